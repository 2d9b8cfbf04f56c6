"""The MoE harness's options (model, MoE backend, LM head, the A/B ladder and its workload, server
rows, planted slowdowns): their declarations, the parsed `MoeOptions`, and the `parse_*`
functions that validate them. impl is imported inside the functions that need it, so that
`pytest --help` stays fast."""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from pathlib import Path

import pytest

from pytest_moeperf.options import (Options, check_trust_run, declare, ini_names, named, number, option, parse_count,
                                    parsed, under_root)
from impl.serve.defaults import DEFAULT_LADDER, DEFAULT_REQUESTS
from moe_harness.ladder.run import MIN_REQUESTS

# Requests a ladder row serves at most: every request is built and checked before the first is
# served, and more than this is an evaluation to split, not one A/B run (GSM8K's test split is 1,319).
MAX_REQUESTS = 100_000
EXPECTATIONS = ("faster", "not-slower")


@dataclass(frozen=True)
class MoeOptions:
    """The harness's options, parsed."""

    model: str
    backend: str
    head: str
    plants: tuple = ()  # impl.plant.Plant: planted slowdowns of a gate-trust run
    # The A/B ladder suite (suites/test_ab_ladder.py): rows (None: the device's default), the
    # workload (impl.data.workloads.WorkloadSpec), requests per row and shots (None: defaults),
    # the accuracy equivalence margin (a fraction) and the report folder.
    ladder: str | None = None
    workload: object = None
    requests: int | None = None
    shots: int | None = None
    margin: float = 0.01
    # What each row after the first must show against it, else its test fails (None: no demand;
    # the gate then judges only against frozen figures): "faster", "not-slower" (EXPECTATIONS).
    expect: str | None = None
    ab_report: Path | None = None
    # Server rows (moe_harness.ladder.endpoints.servers.ServerDef) the ladder may name, from
    # --moe-servers; whether a server's failed request stops the ladder ("stop") or is kept as
    # failed while it goes on ("continue"); whether rows may serve different models.
    servers: tuple = ()
    server_errors: str = "stop"
    allow_different_models: bool = False
    from_ini: frozenset = frozenset()

    def named(self, name: str) -> str:
        return named(name, self.from_ini)


# The harness's options: flag -> (default, metavar, help); metavar None for an on/off flag. Each
# also has an ini key: the flag without its dashes, with underscores (--moe-model: moe_model).
OPTIONS = {
    "--moe-model": ("tiny-gsm", "MODEL", "model under test: an embedded checkpoint, a preset name (random weights) "
                    "or a checkpoint folder (default: tiny-gsm, the trained tiny model)"),
    "--moe-backend": ("auto", "NAME", "MoE implementation under test, a registered `moe` backend (default: auto = "
                      "triton on CUDA, gather on CPU)"),
    "--moe-head": ("bf16", "HEAD", "LM head of the model under test: bf16, or fp8 (quantized online at load; the "
                   "Triton FP8 GEMV on CUDA, torch's scaled matmul on CPU) (default: bf16)"),
    "--moe-ladder": ("", "ROWS", "A/B rows of the ladder suite, separated by ';': presets (baseline, +kernels, "
                     "+fp8-head, +mtp), NAME=SPEC or SPEC with SPEC key=value items (moe, experts, head, head_scales, "
                     "attention, projection, spec, accept, temperature, top_k, top_p, seed; see impl/serve/rows.py) "
                     f"(default: {DEFAULT_LADDER['cuda']} on CUDA, {DEFAULT_LADDER['cpu']} on CPU)"),
    "--moe-servers": ("", "FILE", "a TOML file of server rows for the ladder (OpenAI-compatible servers: a URL, or "
                      "a command the plugin starts and stops; see moe_harness/ladder/endpoints/servers.py); "
                      "--moe-ladder may then name them beside this engine's rows, and without it the ladder is the "
                      "file's servers"),
    "--moe-server-errors": ("stop", "stop|continue", "what a server row's failed request does to the ladder: stop "
                            "(default) or continue (kept as failed, the run goes on)"),
    "--moe-allow-different-models": (False, None, "let ladder rows serve different models (refused by default: "
                                     "their outputs could not be compared)"),
    "--moe-workload": ("arith", "WORKLOAD", "prompts of the ladder suite: arith, gsm8k[:FOLDER|HUB_ID], "
                       "synthetic[:IN:OUT] or jsonl:FILE (prompt, optional answer and max_tokens) (default: arith)"),
    "--moe-requests": ("", "N", "requests the ladder suite serves per row, 3 to 100000 (default: "
                       f"{DEFAULT_REQUESTS['cpu']} on CPU, {DEFAULT_REQUESTS['cuda']} on CUDA, or all of a smaller "
                       "file or split)"),
    "--moe-shots": ("", "K", "few-shot examples of the gsm8k workload, which alone takes them (default: 5, as "
                    "lm-evaluation-harness)"),
    "--moe-margin": ("1", "POINTS", "equivalence margin of the ladder's accuracy comparison, in percentage points "
                     "(default: 1)"),
    "--moe-expect": ("", "faster|not-slower", "what each ladder row must show against the first, else its test "
                     "fails: faster (its decode tokens/s interval above 1) or not-slower (not below 1); without it "
                     "a first run, with nothing frozen, passes whatever the verdict"),
    "--moe-ab-report": ("ab-report", "DIR", "folder for the ladder's report (JSON, Markdown, PNG figures), relative "
                        "to rootdir (default: ab-report)"),
    "--moe-plant": ("", "SPEC", "gate-trust run: plant a slowdown, KIND[:NAME]=FRACTION[,...] (e.g. moe=0.1: every "
                    "call of the MoE backend under test takes 10%% longer; head:fp8-triton=0.1; decoder:mtp=0.1)"),
}


def add_options(parser: pytest.Parser) -> None:
    for flag, (default, metavar, help) in OPTIONS.items():
        ini = flag.removeprefix("--").replace("-", "_")
        if metavar is None:
            declare(parser, flag, ini, help, action="store_true")
        else:
            declare(parser, flag, ini, help, default, metavar=metavar)

NAMES = tuple(flag.removeprefix("--").replace("-", "_") for flag in OPTIONS)


def parse_options(config: pytest.Config, core: Options) -> MoeOptions:
    """The harness's options of this run (`core`: the gate core's, parsed); ValueError names a bad
    one (its ini key where it came from there). Planted slowdowns are parsed by the plugin, which
    knows the backend under test."""
    root = config.rootpath
    workload = parsed(config, "moe_workload", parse_workload_option, root)
    check_trust_run("--moe-plant", option(config, "moe_plant"), core)
    return MoeOptions(
        model=parsed(config, "moe_model", parse_model, root),
        backend=parsed(config, "moe_backend", parse_backend, core.device),
        head=parsed(config, "moe_head", parse_head),
        ladder=option(config, "moe_ladder") or None,
        workload=workload,
        requests=parsed(config, "moe_requests", parse_requests),
        shots=parsed(config, "moe_shots", parse_shots, workload),
        margin=parsed(config, "moe_margin", parse_margin),
        expect=parsed(config, "moe_expect", parse_expect),
        ab_report=under_root(option(config, "moe_ab_report"), root),
        servers=parsed(config, "moe_servers", parse_servers_option, root),
        server_errors=parsed(config, "moe_server_errors", parse_server_errors),
        allow_different_models=bool(option(config, "moe_allow_different_models")),
        from_ini=ini_names(config, NAMES),
    )


def parse_model(value: str, rootpath: Path) -> str:
    from impl.model.config import EMBEDDED
    from impl.model.config import PRESETS
    if value in PRESETS or value in EMBEDDED:
        return value
    path = under_root(value, rootpath)
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
    from impl.model.config import HEADS
    if value not in HEADS:
        raise ValueError(f"--moe-head must be one of {', '.join(HEADS)}, got {value!r}")
    return value


def parse_requests(value: str | None) -> int | None:
    return parse_count("--moe-requests", value, MIN_REQUESTS, MAX_REQUESTS)


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
    path = under_root(value, rootpath)
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
            spec = dataclasses.replace(spec, source=str(under_root(source, rootpath)))
        check_source(spec)
        return spec
    except ValueError as e:
        missing = relative and "does not exist" in str(e)
        rule = f" ({source!r} is relative: taken from rootdir {rootpath})" if missing else ""
        raise ValueError(f"--moe-workload: {e}{rule}") from None


def parse_margin(value: str) -> float:
    """Percentage points -> a fraction (1 -> 0.01), in (0, 50]."""
    points = number(value)
    if not 0 < points <= 50:
        raise ValueError(f"--moe-margin must be in (0, 50] percentage points, got {value!r}")
    return points / 100


def parse_expect(value: str | None) -> str | None:
    """What each ladder row must show against the first (EXPECTATIONS), or None."""
    if not value:
        return None
    if value not in EXPECTATIONS:
        raise ValueError(f"--moe-expect must be one of {', '.join(EXPECTATIONS)}, got {value!r}")
    return value


def parse_shots(value: str | None, workload) -> int | None:
    """Few-shot examples, which only the gsm8k workload takes."""
    shots = parse_count("--moe-shots", value, 0)
    if shots is not None and workload.kind != "gsm8k":
        raise ValueError(f"--moe-shots {shots}: only the gsm8k workload takes few-shot examples, and the workload "
                         f"is {workload} (--moe-workload)")
    return shots
