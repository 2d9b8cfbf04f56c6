"""pytest wiring: options, markers, hooks. The work lives in session, gate, timing and report."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import pytest

from moe_harness.ladder.run import MIN_REQUESTS
from pytest_moeperf.device import parse_device
from pytest_moeperf.fixtures import (  # noqa: F401  (fixtures are registered by import)
    moe_backend, moe_checked_backend, moe_device, moe_gate, moe_host_meter, moe_model, moe_sampler, moe_session)
from pytest_moeperf.host_load import DEFAULT_STALL_THRESHOLD, DEFAULT_WAIT_S
from pytest_moeperf.session import SESSION_KEY, MoePerfSession, Options
from pytest_moeperf.timing import parse_samples
from pytest_moeperf import workers

DEFAULTS = {"moe_device": "auto", "moe_model": "tiny-gsm", "moe_backend": "auto", "moe_head": "bf16",
            "moe_baselines": "baselines", "moe_samples": "10", "moe_trust": "", "moe_plant": "",
            "moe_ladder": "", "moe_workload": "arith", "moe_requests": "", "moe_shots": "", "moe_margin": "1",
            "moe_expect": "", "moe_servers": "", "moe_server_errors": "stop",
            "moe_ab_report": "ab-report", "moe_host_stall": str(DEFAULT_STALL_THRESHOLD),
            "moe_host_wait": str(DEFAULT_WAIT_S)}
# Requests a ladder row serves at most: every request is built and checked before the first is
# served, and more than this is an evaluation to split, not one A/B run (GSM8K's test split is 1,319).
MAX_REQUESTS = 100_000
BENCH_SKIP_REASON = "performance suite: run with --moe-bench to enable it"
MARKERS = (
    "moe_bench: a performance suite, gated against frozen baselines; runs only with --moe-bench",
    "gpu: needs a CUDA device; skipped (with the reason) when there is none",
    "requires_capability(major, minor): needs a CUDA device of at least this compute capability",
)


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("moeperf", "MoE decode correctness and performance (pytest-moeperf)")

    def add(flag, ini, help, **kw):
        group.addoption(flag, dest=ini, default=None, help=f"{help} (ini: {ini})", **kw)
        # argparse formats its help with %: the ini help is printed as it is.
        parser.addini(ini, help.replace("%%", "%"), type="bool" if kw.get("action") == "store_true" else "string",
                      default=DEFAULTS.get(ini, False if kw.get("action") == "store_true" else None))

    add("--moe-bench", "moe_bench", "run the performance suites (marked moe_bench)", action="store_true")
    add("--moe-device", "moe_device", "device under test: auto, cpu, cuda or cuda:N (default: auto)",
        metavar="DEVICE")
    add("--moe-model", "moe_model", "model under test: an embedded checkpoint, a preset name (random weights) "
        "or a checkpoint folder (default: tiny-gsm, the trained tiny model)", metavar="MODEL")
    add("--moe-backend", "moe_backend", "MoE implementation under test, a registered `moe` backend "
        "(default: auto = triton on CUDA, gather on CPU)", metavar="NAME")
    add("--moe-head", "moe_head", "LM head of the model under test: bf16, or fp8 (quantized online at load; "
        "the Triton FP8 GEMV on CUDA, torch's scaled matmul on CPU) (default: bf16)", metavar="HEAD")
    add("--moe-baselines", "moe_baselines", "folder of frozen baselines, relative to rootdir "
        "(default: baselines)", metavar="DIR")
    add("--moe-freeze", "moe_freeze", "write or refresh this device's frozen figures (needs --moe-bench)",
        action="store_true")
    add("--moe-report", "moe_report", "write the gate's results as JSON to PATH (not ending in .md) and Markdown "
        "beside it (PATH with the suffix .md)", metavar="PATH")
    add("--moe-samples", "moe_samples", "timing samples per metric, at least 3 (default: 10)", metavar="N")
    add("--moe-strict", "moe_strict", "fail the run when a gated figure has no baseline, when a figure frozen for "
        "this device and configuration was not measured, when nothing was compared, or when a figure was not judged "
        "for a contended host (nightly CI)",
        action="store_true")
    add("--moe-trust", "moe_trust", "gate-trust run: gate each timed figure N times (its measurement, then N-1 "
        "re-measurements) and record the verdicts instead of acting on them (see scripts/gate_trust.py)",
        metavar="N")
    add("--moe-ladder", "moe_ladder", "A/B rows of the ladder suite, separated by ';': presets (baseline, +kernels, "
        "+fp8-head, +mtp), NAME=SPEC or SPEC with SPEC key=value items (moe, experts, head, head_scales, attention, "
        "projection, spec, accept, temperature, top_k, top_p, seed; see impl/serve/rows.py) "
        "(default: baseline;+kernels;+fp8-head;+mtp "
        "on CUDA, baseline;+fp8-head;+mtp on CPU)", metavar="ROWS")
    add("--moe-servers", "moe_servers", "a TOML file of server rows for the ladder (OpenAI-compatible servers: "
        "a URL, or a command the plugin starts and stops; see moe_harness/ladder/endpoints/servers.py); --moe-ladder may "
        "then name them beside this engine's rows, and without it the ladder is the file's servers", metavar="FILE")
    add("--moe-server-errors", "moe_server_errors", "what a server row's failed request does to the ladder: stop "
        "(default) or continue (kept as failed, the run goes on)", metavar="stop|continue")
    add("--moe-allow-different-models", "moe_allow_different_models", "let ladder rows serve different models "
        "(refused by default: their outputs could not be compared)", action="store_true")
    add("--moe-workload", "moe_workload", "prompts of the ladder suite: arith, gsm8k[:FOLDER|HUB_ID], "
        "synthetic[:IN:OUT] or jsonl:FILE (prompt, optional answer and max_tokens) (default: arith)",
        metavar="WORKLOAD")
    add("--moe-requests", "moe_requests", "requests the ladder suite serves per row, 3 to 100000 (default: 60 on "
        "CPU, 1000 on CUDA, or all of a smaller file or split)", metavar="N")
    add("--moe-shots", "moe_shots", "few-shot examples of the gsm8k workload, which alone takes them (default: 5, "
        "as lm-evaluation-harness)", metavar="K")
    add("--moe-margin", "moe_margin", "equivalence margin of the ladder's accuracy comparison, in percentage "
        "points (default: 1)", metavar="POINTS")
    add("--moe-expect", "moe_expect", "what each ladder row must show against the first, else its test fails: "
        "faster (its decode tokens/s interval above 1) or not-slower (not below 1); without it a first run, "
        "with nothing frozen, passes whatever the verdict", metavar="faster|not-slower")
    add("--moe-ab-report", "moe_ab_report", "folder for the ladder's report (JSON, Markdown, PNG figures), "
        "relative to rootdir (default: ab-report)", metavar="DIR")
    add("--moe-host-stall", "moe_host_stall", "CPU timings: the share of wall time runnable tasks waited for a CPU "
        "(the kernel's PSI: this process's cgroup's cpu.pressure, else /proc/pressure/cpu) above which, with "
        "other processes' work also above it, a measurement is taken as made on a contended host: a regression "
        "it shows is not judged (HOST-CONTENDED) and it is not frozen; off: never "
        f"(default: {DEFAULT_STALL_THRESHOLD})", metavar="FRACTION")
    add("--moe-host-wait", "moe_host_wait", "seconds (0 to 600) to wait for a contended host to quiet before "
        f"measuring once more (default: {DEFAULT_WAIT_S:g})", metavar="SECONDS")
    add("--moe-plant", "moe_plant", "gate-trust run: plant a slowdown, KIND[:NAME]=FRACTION[,...] (e.g. moe=0.1: "
        "every call of the MoE backend under test takes 10%% longer; head:fp8-triton=0.1; decoder:mtp=0.1)",
        metavar="SPEC")


def _option(config: pytest.Config, name: str):
    value = config.getoption(name)
    if value is not None:
        return value
    try:
        return config.getini(name)
    except (ValueError, pytest.UsageError) as e:  # a bool ini key that is not one ("invalid truth value")
        raise ValueError(f"ini key {name}: {e}") from None


def _set_by_ini(config: pytest.Config, name: str) -> bool:
    """Whether option `name`'s value came from its ini key (not the command line, not the default)."""
    return config.getoption(name) is None and config.getini(name) != DEFAULTS.get(name)


def _from_ini(config: pytest.Config, name: str, message: str) -> str:
    """`message` (which names the option's flag) prefixed with the ini key when the value came from
    there: a user who never typed the flag finds the line to fix."""
    return f"ini key {name}: {message}" if _set_by_ini(config, name) else message


def _parsed(config: pytest.Config, name: str, parse, *args):
    """The option's value through `parse`; its error names the ini key when the value came from there."""
    try:
        return parse(_option(config, name), *args)
    except ValueError as e:
        raise ValueError(_from_ini(config, name, str(e))) from None


def parse_model(value: str, rootpath: Path) -> str:
    from impl.model.build import EMBEDDED
    from impl.model.config import PRESETS
    if value in PRESETS or value in EMBEDDED:
        return value
    path = _under_root(value, rootpath)
    if path.is_dir():
        from impl.model.loading import check_checkpoint
        from impl.model.weight_formats import CheckpointError
        try:
            check_checkpoint(path)  # a folder that is no checkpoint fails here, not in every test that builds it
        except CheckpointError as e:
            raise ValueError(f"--moe-model {value!r}: {e}") from None
        return str(path)
    raise ValueError(f"--moe-model {value!r} is neither a preset ({', '.join(sorted(PRESETS))}), an embedded "
                     f"checkpoint ({', '.join(sorted(EMBEDDED))}) nor a folder (looked for {path.resolve()}: a relative "
                     "folder is taken from rootdir)")


def parse_backend(value: str, device: str = "auto") -> str:
    """A registered MoE backend (or `auto`) that runs on the run's device (`device`: a parsed
    --moe-device; `auto` is the GPU where there is one)."""
    if value == "auto":
        return value
    from impl import backends
    try:
        backend = backends.get("moe", value)
    except ValueError as e:
        raise ValueError(f"--moe-backend: {e}") from None
    import torch
    kind = "cuda" if device.startswith("cuda") or (device == "auto" and torch.cuda.is_available()) else "cpu"
    if kind not in backend.devices:
        raise ValueError(f"--moe-backend: the {value!r} MoE backend runs on {list(backend.devices)}, not on this "
                         f"run's device ({kind}: --moe-device {device})")
    return value


def parse_head(value: str) -> str:
    from impl.model.build import HEADS
    if value not in HEADS:
        raise ValueError(f"--moe-head must be one of {', '.join(HEADS)}, got {value!r}")
    return value


def parse_trust(value: str | None) -> int:
    """Evaluations per timed figure of a gate-trust run; 0: not one."""
    return parse_count("--moe-trust", value, 1) or 0


def parse_ladder_option(value: str | None, device: str, servers: tuple = ()) -> str | None:
    """The ladder text as given (None: the device's default, or the servers' file), after checking
    that every row parses for `device` (or names a server of `servers`, or is NAME=http://...): an
    unknown preset, key, backend or a bad combination is a usage error, and so is a single row (the
    suites compare every row with the first: nothing would be compared)."""
    if not value and not servers:
        return None
    from moe_harness.ladder.endpoints.servers import ladder_rows
    try:
        rows = ladder_rows(value or None, servers, device)
    except ValueError as e:
        raise ValueError(f"--moe-ladder: {e}") from None
    if len(rows) < 2:
        raise ValueError(f"--moe-ladder {value or '(the --moe-servers file)'!r}: one row; the ladder compares each "
                         "row with its first, so give at least two (e.g. 'baseline;+fp8-head')")
    return value or None


def parse_servers_option(value: str | None, rootpath: Path):
    """The server rows and schedule of a --moe-servers file (relative: from rootdir), read and
    checked now (endpoints.servers.ServerFile; () without one)."""
    if not value:
        return ()
    from moe_harness.ladder.endpoints.servers import load_servers
    path = _under_root(value, rootpath)
    if not path.is_file():
        raise ValueError(f"--moe-servers {value}: no such file ({path}; a relative path is taken from rootdir)")
    servers = load_servers(path)
    unset = [f"{s.name!r} ({s.api_key_env})" for s in servers if s.api_key_env and not os.environ.get(s.api_key_env)]
    if unset:  # found before any server starts, not at its first request
        raise ValueError(f"--moe-servers {value}: the API key variable of row(s) {', '.join(unset)} is not set")
    return servers


def parse_server_errors(value: str) -> str:
    if value not in ("stop", "continue"):
        raise ValueError(f"--moe-server-errors must be stop or continue, got {value!r}")
    return value


def parse_workload_option(value: str, rootpath: Path):
    """The workload spec, its local source (a prompts file, a GSM8K folder) taken from rootdir when
    relative, as every path option is, and read through once so that a missing file or a malformed
    line is a usage error, not an error in every ladder test. A GSM8K source that names no folder
    there (and does not start with ./ or ../) stays a hub id."""
    from impl.data.workloads import check_source, parse_workload
    source, relative = None, False
    try:
        spec = parse_workload(value)
        source = spec.source
        relative = bool(source) and not Path(source).expanduser().is_absolute() and (
            spec.kind == "jsonl" or source.startswith(("./", "../")) or (rootpath / source).exists())
        if relative:
            spec = dataclasses.replace(spec, source=str(_under_root(source, rootpath)))
        check_source(spec)
        return spec
    except ValueError as e:
        missing = relative and "does not exist" in str(e)
        rule = f" ({source!r} is relative: taken from rootdir {rootpath})" if missing else ""
        raise ValueError(f"--moe-workload: {e}{rule}") from None


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


def _number(value: str) -> float:
    """The value as a float, NaN when it is none (NaN fails every range check below)."""
    try:
        return float(value)
    except ValueError:
        return float("nan")


def parse_margin(value: str) -> float:
    """Percentage points -> a fraction (1 -> 0.01), in (0, 50]."""
    points = _number(value)
    if not 0 < points <= 50:
        raise ValueError(f"--moe-margin must be in (0, 50] percentage points, got {value!r}")
    return points / 100


EXPECTATIONS = ("faster", "not-slower")


def parse_expect(value: str | None) -> str | None:
    """What each ladder row must show against the first (EXPECTATIONS), or None."""
    if not value:
        return None
    if value not in EXPECTATIONS:
        raise ValueError(f"--moe-expect must be one of {', '.join(EXPECTATIONS)}, got {value!r}")
    return value


def parse_host_stall(value: str) -> float | None:
    """A stall fraction in (0, 1), or None for `off`."""
    if value.strip().lower() == "off":
        return None
    fraction = _number(value)
    if not 0 < fraction < 1:
        raise ValueError(f"--moe-host-stall must be a fraction of wall time in (0, 1) or off, got {value!r}")
    return fraction


def parse_host_wait(value: str) -> float:
    """Seconds in [0, 600]: 0 measures again at once; the bound keeps a busy host from stalling a run."""
    seconds = _number(value)
    if not 0 <= seconds <= 600:
        raise ValueError(f"--moe-host-wait must be seconds in [0, 600], got {value!r}")
    return seconds


def parse_report_path(value: str, root: Path) -> Path | None:
    """The JSON report's path (None: no report); the Markdown goes beside it with the suffix .md,
    so a path ending in .md would be overwritten by it."""
    if not value:
        return None
    path = _under_root(value, root)
    if path.suffix == ".md":
        raise ValueError(f"--moe-report {value}: is the JSON report's path, and the Markdown report is written "
                         f"beside it as {path.stem}.md: give a path ending in .json")
    return path


def parse_shots(value: str | None, workload) -> int | None:
    """Few-shot examples, which only the gsm8k workload takes."""
    shots = parse_count("--moe-shots", value, 0)
    if shots is not None and workload.kind != "gsm8k":
        raise ValueError(f"--moe-shots {shots}: only the gsm8k workload takes few-shot examples, and the workload "
                         f"is {workload} (--moe-workload)")
    return shots


def _under_root(value: str, root: Path) -> Path:
    """A path option: relative ones are taken from rootdir, as ini values are (one rule for every
    path option, wherever pytest was started)."""
    path = Path(value)
    return path if path.is_absolute() else root / path


def parse_options(config: pytest.Config) -> Options:
    root = config.rootpath
    device = _parsed(config, "moe_device", parse_device)
    workload = _parsed(config, "moe_workload", parse_workload_option, root)
    options = Options(
        bench=bool(_option(config, "moe_bench")),
        device=device,
        model=_parsed(config, "moe_model", parse_model, root),
        backend=_parsed(config, "moe_backend", parse_backend, device),
        head=_parsed(config, "moe_head", parse_head),
        baselines=_under_root(_option(config, "moe_baselines"), root),
        freeze=bool(_option(config, "moe_freeze")),
        report=_parsed(config, "moe_report", parse_report_path, root),
        samples=_parsed(config, "moe_samples", parse_samples),
        strict=bool(_option(config, "moe_strict")),
        trust=_parsed(config, "moe_trust", parse_trust),
        ladder=_option(config, "moe_ladder") or None,
        workload=workload,
        requests=_parsed(config, "moe_requests", lambda v: parse_count("--moe-requests", v, MIN_REQUESTS, MAX_REQUESTS)),
        shots=_parsed(config, "moe_shots", parse_shots, workload),
        margin=_parsed(config, "moe_margin", parse_margin),
        expect=_parsed(config, "moe_expect", parse_expect),
        ab_report=_under_root(_option(config, "moe_ab_report"), root),
        servers=_parsed(config, "moe_servers", parse_servers_option, root),
        server_errors=_parsed(config, "moe_server_errors", parse_server_errors),
        allow_different_models=bool(_option(config, "moe_allow_different_models")),
        host_stall=_parsed(config, "moe_host_stall", parse_host_stall),
        host_wait=_parsed(config, "moe_host_wait", parse_host_wait),
    )
    options = dataclasses.replace(options, from_ini=frozenset(name for name in DEFAULTS if _set_by_ini(config, name)))
    if options.freeze and not options.bench:
        raise ValueError("--moe-freeze needs --moe-bench: only the performance suites produce figures to freeze")
    for flag, given in (("--moe-trust", options.trust), ("--moe-plant", _option(config, "moe_plant"))):
        if given and not options.bench:
            raise ValueError(f"{flag} needs --moe-bench: gate-trust runs evaluate the performance suites")
        if given and options.freeze:
            raise ValueError(f"{flag} and --moe-freeze exclude each other: freeze first, then evaluate the gate "
                             "against what was frozen")
    if _is_worker(config):
        gpu = config.workerinput.get(workers.WORKER_GPU_KEY)
        if gpu is not None and workers.simulated_gpus():
            options = dataclasses.replace(options, simulated_gpu=workers.simulated_name(gpu))
    elif options.bench and _xdist_workers(config):
        sim = workers.simulated_gpus()
        gpus = workers.parse_worker_gpus(int(config.option.numprocesses), options.device,
                                         workers.visible_gpus(), simulated=bool(sim))
        options = dataclasses.replace(options, worker_gpus=tuple(gpus))
    return options


def _stop_on_sigterm() -> None:
    """A bench run sent SIGTERM (`timeout`, a CI job's cancel) stops as on Ctrl-C: pytest still
    finishes the session, so the figures measured so far are frozen (with --moe-freeze) and
    reported instead of lost. Only where SIGTERM still has its default action."""
    import signal
    import threading
    if threading.current_thread() is not threading.main_thread():
        return
    if signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
        def stop(signum, frame):
            raise KeyboardInterrupt(f"signal {signum} (SIGTERM): stopping, keeping what was measured")
        signal.signal(signal.SIGTERM, stop)
        _restore_on_unconfigure.append(lambda: signal.signal(signal.SIGTERM, signal.SIG_DFL))


_restore_on_unconfigure: list = []  # undone when the session ends (pytester runs many in one process)


def _is_worker(config: pytest.Config) -> bool:
    return hasattr(config, "workerinput")


def _xdist_workers(config: pytest.Config) -> bool:
    """Whether pytest-xdist was asked for worker processes (`-n N` or `-n auto`; 0 runs in process)."""
    n = getattr(config.option, "numprocesses", None)
    return n not in (None, 0, "0") and getattr(config.option, "dist", "no") != "no"


# -- pytest-xdist (optional hooks: absent without the plugin) -----------------------------------
@pytest.hookimpl(optionalhook=True)
def pytest_xdist_auto_num_workers(config: pytest.Config) -> int | None:
    """`-n auto` with --moe-bench: one worker per visible GPU (None: xdist's own rule)."""
    if not _option(config, "moe_bench"):
        return None
    return len(workers.visible_gpus()) or None


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node) -> None:
    """Controller: give a starting worker a GPU no live worker holds (a restarted worker gets the
    one its predecessor freed)."""
    state = node.config.stash.get(SESSION_KEY, None)
    if state is None or not state.options.worker_gpus:
        return
    held = set(state.gpu_of_worker.values())
    gpu = next(g for g in state.options.worker_gpus if g not in held)
    state.gpu_of_worker[node.gateway.id] = gpu
    node.workerinput[workers.WORKER_GPU_KEY] = gpu


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error) -> None:
    """Controller: merge what a finished worker measured; a crashed one is an infrastructure error."""
    state = node.config.stash.get(SESSION_KEY, None)
    if state is None or not state.options.bench:
        return
    gpu = state.gpu_of_worker.pop(node.gateway.id, "?")
    payload = getattr(node, "workeroutput", {}).get(workers.OUTPUT_KEY)
    if payload is not None:
        workers.merge_payload(state, payload, node.gateway.id)
    if error:
        state.worker_errors.append(f"pytest-xdist worker {node.gateway.id} (GPU {gpu}) went down: {error}")


class _ControllerHooks:
    """On the controller of a pytest-xdist run, or a plain run: the tests that failed on their
    own (not one pytest-xdist failed because its worker went down under it), and the figures each
    worker sends with its test reports (_WorkerHooks)."""

    def __init__(self, session: MoePerfSession) -> None:
        self.session = session

    @pytest.hookimpl
    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        if (report.failed and "crashed while running" not in str(report.longrepr)
                and report.nodeid not in self.session.failed_tests):  # once, whichever phases failed
            self.session.failed_tests.append(report.nodeid)
        payload = getattr(report, "moeperf_figures", None)  # a worker's figures, sent with its report
        if payload is not None and self.session.options.bench:
            node = getattr(report, "node", None)  # set by pytest-xdist on the controller
            workers.merge_payload(self.session, payload, node.gateway.id if node else payload["gpu"])


class _WorkerHooks:
    """On a pytest-xdist worker: what each test measured travels with its report, which xdist
    sends to the controller as the test ends."""

    def __init__(self, session: MoePerfSession, gpu: str) -> None:
        self.session, self.gpu = session, gpu

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_makereport(self, item, call):
        outcome = yield
        report = outcome.get_result()
        if self.session.options.bench:  # every phase: xdist holds a worker's last teardown back
            report.moeperf_figures = workers.worker_payload(self.session, self.gpu)


class _BenchmarkHooks:
    """Registered only when pytest-benchmark is installed: puts the fingerprint in its machine info."""

    def __init__(self, session: MoePerfSession) -> None:
        self.session = session

    @pytest.hookimpl
    def pytest_benchmark_update_machine_info(self, config, machine_info) -> None:
        machine_info["moeperf"] = {"fingerprint": self.session.device.fingerprint, "key": self.session.device.key}


def pytest_configure(config: pytest.Config) -> None:
    for marker in MARKERS:
        config.addinivalue_line("markers", marker)
    gpu = config.workerinput.get(workers.WORKER_GPU_KEY) if _is_worker(config) else None
    if gpu is not None:
        workers.pin_worker_gpu(gpu)  # before anything below can initialize CUDA in this worker
    try:
        options = parse_options(config)
    except ValueError as e:
        raise pytest.UsageError(str(e)) from None
    session = MoePerfSession(options)
    session.rootdir = config.rootpath
    plant_spec = _option(config, "moe_plant")
    if plant_spec:
        plant = _plant_module()
        try:
            plants = plant.parse_plants(plant_spec, {"moe": session.moe_backend})
        except ValueError as e:
            raise pytest.UsageError(_from_ini(config, "moe_plant", f"--moe-plant: {e}")) from None
        session.options = dataclasses.replace(options, plants=plants)
        plant.activate(plants, session.device.torch_device)
    config.stash[SESSION_KEY] = session
    if options.bench:
        from pytest_moeperf.baselines import BaselineError, BaselineStore
        from pytest_moeperf.timing import pin_heap_allocations
        pin_heap_allocations()
        problem = _unwritable(options) if not _is_worker(config) else None
        if problem:  # found before anything is measured, not after
            raise pytest.UsageError(problem)
        if options.report is not None and not _is_worker(config):
            from pytest_moeperf import report
            report.write_unfinished(options.report, session.run_header())
        try:
            BaselineStore.validate_folder(options.baselines)
        except BaselineError as e:
            raise pytest.UsageError(f"malformed baseline: {e}") from None
        if options.device != "auto":
            try:
                session.device.torch_device
            except ValueError as e:
                raise pytest.UsageError(str(e)) from None
        try:  # read once here: an unreadable file is a usage error, not an error in every gated test
            session.checkpoint_digest
        except OSError as e:
            raise pytest.UsageError(f"--moe-model {options.model}: cannot read the checkpoint to name what its "
                                    f"figures are frozen under: {e}") from None
        _stop_on_sigterm()
    if options.ladder is not None or options.servers:  # checked with or without --moe-bench: a typo waits for no run
        try:
            parse_ladder_option(options.ladder, session.device.torch_device.type, options.servers)
        except ValueError as e:
            raise pytest.UsageError(_from_ini(config, "moe_ladder", str(e))) from None
    if not _is_worker(config):
        config.pluginmanager.register(_ControllerHooks(session), "moeperf-controller-hooks")
    else:
        config.pluginmanager.register(_WorkerHooks(session, gpu or ""), "moeperf-worker-hooks")
    if config.pluginmanager.hasplugin("benchmark"):
        config.pluginmanager.register(_BenchmarkHooks(session), "moeperf-benchmark-hooks")


def _unwritable(options: Options) -> str | None:
    """Why what this run writes at its end could not be written (None: it can be): the baselines
    folder under --moe-freeze, the --moe-report file."""
    targets = [("--moe-report", options.report)] if options.report is not None else []
    if options.freeze:
        targets.append(("--moe-baselines", options.baselines / "x.json"))
    from pytest_moeperf.files import unwritable_ancestor
    for flag, path in targets:
        if path.is_dir():
            return f"{flag} {path}: is a folder; a file path is needed"
        blocked = unwritable_ancestor(path.parent)
        if blocked is not None:
            return f"{flag} {path.parent}: cannot be written ({blocked} is not a writable folder)"
    return None


def _gpu_skip_reason(session: MoePerfSession, item: pytest.Item) -> str | None:
    if not session.device.is_cuda:
        return f"needs a CUDA device; the device under test is {session.device.torch_device}"
    cap = item.get_closest_marker("requires_capability")
    if cap is not None:
        import torch
        have = torch.cuda.get_device_capability(session.device.torch_device)
        need = tuple(cap.args)
        if have < need:
            return f"needs compute capability >= {need[0]}.{need[1]}, the device has {have[0]}.{have[1]}"
    return None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    session = config.stash[SESSION_KEY]
    if session.options.bench:
        # Timed suites first, in a fresh process: what correctness suites leave behind (heap
        # fragmentation, caches, hypothesis' objects) slowed a CPU MoE layer by up to 35%.
        items.sort(key=lambda item: item.get_closest_marker("moe_bench") is None)
    for item in items:
        if item.get_closest_marker("moe_bench") and not session.options.bench:
            item.add_marker(pytest.mark.skip(reason=BENCH_SKIP_REASON))
        elif item.get_closest_marker("gpu") or item.get_closest_marker("requires_capability"):
            reason = _gpu_skip_reason(session, item)
            if reason:
                item.add_marker(pytest.mark.skip(reason=reason))


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    # A test asking for `moe_backend_name` runs once per backend under test.
    if "moe_backend_name" in metafunc.fixturenames:
        session = metafunc.config.stash[SESSION_KEY]
        metafunc.parametrize("moe_backend_name", session.backends_under_test(), scope="session")


def pytest_report_header(config: pytest.Config) -> list[str] | None:
    session = config.stash.get(SESSION_KEY, None)
    if session is None or not session.options.bench:
        return None
    if session.options.worker_gpus:  # the controller of an xdist run times nothing itself
        gpus = session.options.worker_gpus
        return [f"moeperf: {len(gpus)} pytest-xdist worker(s), one GPU each ({', '.join(gpus)}); "
                f"model {session.options.model}, baselines {session.options.baselines}"
                + (" (freezing)" if session.freeze else "")]
    h = session.header()
    lines = [f"moeperf: {h['device']} [fingerprint {h['fingerprint']}]",
             f"moeperf: model {h['model']}, baselines {h['baselines']}" + (" (freezing)" if session.freeze else "")]
    if session.options.trust or session.options.plants:
        lines.append(f"moeperf: GATE-TRUST RUN: {session.options.trust or 1} evaluation(s) per timed figure, "
                     f"planted slowdown: {h.get('planted', 'none')}")
    return lines


def pytest_sessionfinish(session: pytest.Session) -> None:
    state = session.config.stash.get(SESSION_KEY, None)
    if state is None:
        return
    if _is_worker(session.config) and state.options.bench:
        # The controller merges every worker's figures, freezes and reports once; most came with
        # the test reports (_WorkerHooks), the rest (a session fixture's teardown) come here.
        gpu = session.config.workerinput.get(workers.WORKER_GPU_KEY, "")
        session.config.workeroutput[workers.OUTPUT_KEY] = workers.worker_payload(state, gpu)
        return
    state.finish_lines = state.finish(interrupted=session.exitstatus == pytest.ExitCode.INTERRUPTED)
    if state.worker_errors and not (state.failed_tests or state.run_failures()):
        # Exit 3, not 1: a lost worker says nothing about the code under test. A run that also
        # found a regression or a failed check exits 1, the lost worker named in its summary.
        session.exitstatus = pytest.ExitCode.INTERNAL_ERROR
    elif (state.failed_tests or state.run_failures()) and session.exitstatus in (
            pytest.ExitCode.OK, pytest.ExitCode.NO_TESTS_COLLECTED, pytest.ExitCode.INTERNAL_ERROR):
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_unconfigure(config: pytest.Config) -> None:
    while _restore_on_unconfigure:
        _restore_on_unconfigure.pop()()
    session = config.stash.get(SESSION_KEY, None)
    if session is not None and session.options.plants:
        _plant_module().deactivate()


def _plant_module():
    """impl.plant as sys.modules has it: the module `impl.backends.get` consults (an attribute of
    the impl package can outlive its sys.modules entry, as pytester's in-process runs show)."""
    import importlib
    return importlib.import_module("impl.plant")


def pytest_terminal_summary(terminalreporter, config: pytest.Config) -> None:
    from pytest_moeperf import report
    session = config.stash.get(SESSION_KEY, None)
    if session is None or not (session.results or session.finish_lines):
        return
    terminalreporter.write_sep("=", "moeperf gate")
    if session.results:
        terminalreporter.write_line(report.table(session.results))
        for line in report.legend(session.results):
            terminalreporter.write_line(line)
    if session.options.trust:
        terminalreporter.write_sep("-", "gate-trust evaluations")
        terminalreporter.write_line(report.trust_table(session.results))
    for line in session.finish_lines:
        loud = line.startswith(("HOST-CONTENDED", "the freeze is incomplete", "ERROR:"))
        terminalreporter.write_line(line, yellow=loud, bold=loud)
