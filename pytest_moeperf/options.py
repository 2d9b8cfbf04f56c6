"""The gate core's options: their declarations, the parsed `Options`, and the `parse_*` functions
that validate them; plus the reader both plugins use (a value from the command line, else its
ini key, an error naming the ini key when the value came from there)."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import pytest

from pytest_moeperf.host_load import DEFAULT_STALL_THRESHOLD, DEFAULT_WAIT_S

# Every declared option's ini default, filled by `declare` (the core's and a harness's): a value
# equal to it did not come from an ini file.
DEFAULTS: dict[str, object] = {}


def declare(parser: pytest.Parser, flag: str, ini: str, help: str, default=None, **kw) -> None:
    """An option `flag` of the moeperf group and its ini key `ini` (same help, same default)."""
    group = parser.getgroup("moeperf", "MoE decode correctness and performance (pytest-moeperf)")
    group.addoption(flag, dest=ini, default=None, help=f"{help} (ini: {ini})", **kw)
    is_flag = kw.get("action") == "store_true"
    DEFAULTS[ini] = default if default is not None else (False if is_flag else None)
    # argparse formats its help with %: the ini help is printed as it is.
    parser.addini(ini, help.replace("%%", "%"), type="bool" if is_flag else "string", default=DEFAULTS[ini])


def option(config: pytest.Config, name: str):
    """Option `name`'s value: the command line's, else its ini key's (or the default)."""
    value = config.getoption(name)
    if value is not None:
        return value
    try:
        return config.getini(name)
    except (ValueError, pytest.UsageError) as e:  # a bool ini key that is not one ("invalid truth value")
        raise ValueError(f"ini key {name}: {e}") from None


def set_by_ini(config: pytest.Config, name: str) -> bool:
    """Whether option `name`'s value came from its ini key (not the command line, not the default)."""
    return config.getoption(name) is None and config.getini(name) != DEFAULTS.get(name)


def from_ini(config: pytest.Config, name: str, message: str) -> str:
    """`message` (which names the option's flag) prefixed with the ini key when the value came from
    there: a user who never typed the flag finds the line to fix."""
    return f"ini key {name}: {message}" if set_by_ini(config, name) else message


def parsed(config: pytest.Config, name: str, parse, *args):
    """The option's value through `parse`; its error names the ini key when the value came from there."""
    try:
        return parse(option(config, name), *args)
    except ValueError as e:
        raise ValueError(from_ini(config, name, str(e))) from None


def ini_names(config: pytest.Config, names) -> frozenset:
    """Which of the options `names` took their value from an ini key."""
    return frozenset(name for name in names if set_by_ini(config, name))


def named(name: str, ini: frozenset) -> str:
    """How a message names option `name` (e.g. moe_workload): its flag, or its ini key and flag
    when its value came from there (`ini`: such names), where the user has to look."""
    flag = "--" + name.replace("_", "-")
    return f"ini key {name} ({flag})" if name in ini else flag


def under_root(value: str, root: Path) -> Path:
    """A path option: relative ones are taken from rootdir, as ini values are (one rule for every
    path option, wherever pytest was started)."""
    path = Path(value)
    return path if path.is_absolute() else root / path


def number(value: str) -> float:
    """The value as a float, NaN when it is none (NaN fails every range check)."""
    try:
        return float(value)
    except ValueError:
        return float("nan")


def parse_count(flag: str, value: str | None, minimum: int, maximum: int | None = None) -> int | None:
    """A whole number in [minimum, maximum], or None when not given; `flag` names where it was
    given (an option, an environment variable)."""
    if value in (None, ""):
        return None
    try:
        n = int(value)
    except ValueError:
        n = minimum - 1
    if n < minimum or (maximum is not None and n > maximum):
        bound = f">= {minimum}" if maximum is None else f"in [{minimum}, {maximum}]"
        raise ValueError(f"{flag} must be a whole number {bound}, got {value!r}")
    return n


def parse_device(value: str) -> str:
    """`auto`, `cpu`, `cuda` or `cuda:N` (validated here; whether it exists is checked on use)."""
    value = value.strip().lower()
    if value in ("auto", "cpu", "cuda") or re.fullmatch(r"cuda:\d+", value):
        return value
    raise ValueError(f"--moe-device must be auto, cpu, cuda or cuda:N, got {value!r}")


def parse_samples(value: str) -> int:
    try:
        n = int(value)
    except (TypeError, ValueError):
        raise ValueError(f"--moe-samples must be a whole number >= 3, got {value!r}") from None
    if n < 3:
        raise ValueError(f"--moe-samples must be at least 3 (a median and an interval need them), got {n}")
    return n


def parse_trust(value: str | None) -> int:
    """Evaluations per timed figure of a gate-trust run; 0: not one."""
    return parse_count("--moe-trust", value, 1) or 0


def parse_host_stall(value: str) -> float | None:
    """A stall fraction in (0, 1), or None for `off`."""
    if value.strip().lower() == "off":
        return None
    fraction = number(value)
    if not 0 < fraction < 1:
        raise ValueError(f"--moe-host-stall must be a fraction of wall time in (0, 1) or off, got {value!r}")
    return fraction


def parse_host_wait(value: str) -> float:
    """Seconds in [0, 600]: 0 measures again at once; the bound keeps a busy host from stalling a run."""
    seconds = number(value)
    if not 0 <= seconds <= 600:
        raise ValueError(f"--moe-host-wait must be seconds in [0, 600], got {value!r}")
    return seconds


def parse_report_path(value: str, root: Path) -> Path | None:
    """The JSON report's path (None: no report); the Markdown goes beside it with the suffix .md,
    so a path ending in .md would be overwritten by it."""
    if not value:
        return None
    path = under_root(value, root)
    if path.suffix == ".md":
        raise ValueError(f"--moe-report {value}: is the JSON report's path, and the Markdown report is written "
                         f"beside it as {path.stem}.md: give a path ending in .json")
    return path


@dataclass(frozen=True)
class Options:
    """The gate core's options, parsed."""

    bench: bool
    device: str
    baselines: Path
    freeze: bool
    report: Path | None
    samples: int
    strict: bool = False
    trust: int = 0  # evaluations per timed figure in a gate-trust run (0: an ordinary run)
    # A CPU timing measured while the host's CPU stall (host_load) exceeded host_stall (None: off)
    # is not judged a regression, nor frozen; the gate first waits up to host_wait s for quiet.
    host_stall: float | None = DEFAULT_STALL_THRESHOLD
    host_wait: float = DEFAULT_WAIT_S
    # pytest-xdist (pytest_moeperf.workers): on the controller, the GPU of each worker; on a worker
    # of a simulated run, the name of the GPU it stands for (put in its fingerprint).
    worker_gpus: tuple[str, ...] = ()
    simulated_gpu: str | None = None
    # Options whose value came from their ini key: an error found during the run names the key.
    from_ini: frozenset = frozenset()

    def named(self, name: str) -> str:
        return named(name, self.from_ini)


def add_options(parser: pytest.Parser) -> None:
    """The gate core's options."""
    declare(parser, "--moe-bench", "moe_bench", "run the performance suites (marked moe_bench)", action="store_true")
    declare(parser, "--moe-device", "moe_device", "device under test: auto, cpu, cuda or cuda:N (default: auto)",
            "auto", metavar="DEVICE")
    declare(parser, "--moe-baselines", "moe_baselines", "folder of frozen baselines, relative to rootdir "
            "(default: baselines)", "baselines", metavar="DIR")
    declare(parser, "--moe-freeze", "moe_freeze", "write or refresh this device's frozen figures (needs --moe-bench)",
            action="store_true")
    declare(parser, "--moe-report", "moe_report", "write the gate's results as JSON to PATH (not ending in .md) and "
            "Markdown beside it (PATH with the suffix .md)", metavar="PATH")
    declare(parser, "--moe-samples", "moe_samples", "timing samples per metric, at least 3 (default: 10)", "10",
            metavar="N")
    declare(parser, "--moe-strict", "moe_strict", "fail the run when a gated figure has no baseline, when a figure "
            "frozen for this device and configuration was not measured, when nothing was compared, or when a figure "
            "was not judged for a contended host (nightly CI)", action="store_true")
    declare(parser, "--moe-trust", "moe_trust", "gate-trust run: gate each timed figure N times (its measurement, "
            "then N-1 re-measurements) and record the verdicts instead of acting on them (see scripts/gate_trust.py)",
            "", metavar="N")
    declare(parser, "--moe-host-stall", "moe_host_stall", "CPU timings: the share of wall time runnable tasks waited "
            "for a CPU (the kernel's PSI: this process's cgroup's cpu.pressure, else /proc/pressure/cpu) above which, "
            "with other processes' work also above it, a measurement is taken as made on a contended host: a "
            "regression it shows is not judged (HOST-CONTENDED) and it is not frozen; off: never "
            f"(default: {DEFAULT_STALL_THRESHOLD})", str(DEFAULT_STALL_THRESHOLD), metavar="FRACTION")
    declare(parser, "--moe-host-wait", "moe_host_wait", "seconds (0 to 600) to wait for a contended host to quiet "
            f"before measuring once more (default: {DEFAULT_WAIT_S:g})", str(DEFAULT_WAIT_S), metavar="SECONDS")


CORE_NAMES = ("moe_bench", "moe_device", "moe_baselines", "moe_freeze", "moe_report", "moe_samples", "moe_strict",
              "moe_trust", "moe_host_stall", "moe_host_wait")


def parse_options(config: pytest.Config) -> Options:
    """The core's options of this run; ValueError names a bad one (its ini key where it came from there)."""
    root = config.rootpath
    options = Options(
        bench=bool(option(config, "moe_bench")),
        device=parsed(config, "moe_device", parse_device),
        baselines=under_root(option(config, "moe_baselines"), root),
        freeze=bool(option(config, "moe_freeze")),
        report=parsed(config, "moe_report", parse_report_path, root),
        samples=parsed(config, "moe_samples", parse_samples),
        strict=bool(option(config, "moe_strict")),
        trust=parsed(config, "moe_trust", parse_trust),
        host_stall=parsed(config, "moe_host_stall", parse_host_stall),
        host_wait=parsed(config, "moe_host_wait", parse_host_wait),
        from_ini=ini_names(config, CORE_NAMES),
    )
    if options.freeze and not options.bench:
        raise ValueError("--moe-freeze needs --moe-bench: only the performance suites produce figures to freeze")
    check_trust_run("--moe-trust", options.trust, options)
    return options


def check_trust_run(flag: str, given, options: Options) -> None:
    """A gate-trust option (`flag`, given as `given`) needs --moe-bench and excludes --moe-freeze."""
    if given and not options.bench:
        raise ValueError(f"{flag} needs --moe-bench: gate-trust runs evaluate the performance suites")
    if given and options.freeze:
        raise ValueError(f"{flag} and --moe-freeze exclude each other: freeze first, then evaluate the gate "
                         "against what was frozen")
