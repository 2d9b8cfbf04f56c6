"""The reference result's table at its own shape: the Ling-3.0-flash ladder at full depth, each row
explained by the bytes it reads.

Opt-in by model name: it runs with `--moe-bench --moe-model ling-3.0-flash` (random weights, routed
experts in MXFP4 as the checkpoint ships them: about 70 GB of device memory, twice the experts with
Humming's copy for row 1) and is skipped otherwise. Rows (`LING_LADDER`, or `--moe-ladder`), batch 1,
decode and verify steps replayed from CUDA graphs, interleaved request by request:

1. `humming`: Humming's MoE GEMMs + bf16 head (the reference result's second row),
2. `kernels`: this project's MoE kernels + bf16 head,
3. `+fp8-head`: + the FP8 head,
4. `+mtp`: + MTP, k = 3 (the reference setup's 3 steps, 4 draft tokens), **acceptance assumed**:
   random weights never accept a draft, so the drafts are forced to the target's choices with a
   constant per-position profile of mean accept length 3.90 (the reference result's). Its verify
   and commit steps run for real; its speed follows from the assumed acceptance, and every
   output labels it (impl.speculative.assumed).

Workloads (`LING_WORKLOADS`): synthetic prompts at 1k and 8k context with 256 output tokens, and
the reference result's 32k in / 2k out. Per workload, gated against the frozen figures:
- each row's provenance (what ran is what the name says);
- each row after the first against the first, and against the row before it (what that rung
  adds): paired per-request ratios of decode tokens/s, TPOT and TTFT;
- the speculative row's cost: its time per verify step over the plain row's TPOT
  (`test_verify_cost`), which its accept length has to beat;
- each row's TPOT against its byte floor (`test_row_floor`): per request, the bytes the row reads
  a decode token (its head's format; a speculative row's step over the tokens it commits) at the
  request's decode positions, at the copy bandwidth measured in the same run
  (`rows-CONTEXT.json` / `.md` beside the A/B report);
- the roofline (`test_roofline`): the plain greedy step of row 3 captured whole and with each
  component left out (impl.model.components), replayed interleaved; each component's time
  against its bytes (impl.model.roofline) at the copy bandwidth measured in the same process,
  and the step's TPOT over its byte floor. The table goes beside the A/B report
  (`roofline-CONTEXT.json` / `.md`).

What it does not show: trained weights (acceptance is assumed, answers are not scored), other
devices, batch > 1.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import pytest

from impl.data.workloads import AtMost
from impl.model.roofline import Formats
from moe_harness.ladder.run import fail_on_provenance, paired, row_config, run_suite_ladder
from pytest_moeperf.baselines import atomic_write_text
from moe_harness.tolerances import tolerance_for

pytestmark = pytest.mark.moe_bench

LING_MODEL = "ling-3.0-flash"
ASSUMED_ACCEPT = 3.90  # the reference result's mean accept length (k = 3)
ROW3 = "+fp8-head=moe=triton,head=fp8"  # the row the roofline test times
ROW3_FORMATS = Formats(experts="mxfp4", projections="bf16", head="fp8")  # its weights, as the byte floor counts them
LING_LADDER = (f"humming=moe=humming,head=bf16;kernels=moe=triton,head=bf16;{ROW3};"
               f"+mtp=moe=triton,head=fp8,spec=mtp:3,accept={ASSUMED_ACCEPT}")
# name -> (workload, requests per row, with the humming row). Requests are few at 32k: each takes
# about 20 s per row. At 32k Humming's copy of the experts (60 GiB beside this project's 64) leaves
# too little of the card for the prompt pass, so that ladder starts at `kernels` and the copy is
# released before it; elsewhere the row is dropped, with the reason, where free memory says so.
LING_WORKLOADS = {"1k": ("synthetic:1024:256", 6, True), "8k": ("synthetic:8192:256", 4, True),
                  "32k": ("synthetic:32768:2048", 3, False)}
WARMUP = 1  # one request per row: its graphs captured, the prompt length's kernels compiled
FIGURES = (("ab_tokens_per_s", "decode_tokens_per_s", "higher"), ("ab_tpot", "tpot_s", "lower"),
           ("ab_ttft", "ttft_s", "lower"))


def _rows(run):
    from impl import backends
    from impl.serve.rows import parse_ladder
    if not run.options.ladder and "humming" not in backends.available("moe"):
        raise pytest.UsageError("the Ling ladder's first row runs Humming's MoE: install humming-kernels, or give "
                                "the rows with --moe-ladder (e.g. without the humming row)")
    return parse_ladder(run.options.ladder or LING_LADDER, run.core.device.torch_device.type)


def _opted_in(run) -> bool:
    return run.core.options.bench and run.options.model == LING_MODEL


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    from moe_harness.state import HARNESS_KEY
    run = metafunc.config.stash[HARNESS_KEY]
    if "context" in metafunc.fixturenames:
        metafunc.parametrize("context", list(LING_WORKLOADS), scope="module")
    if "row" in metafunc.fixturenames:
        if not _opted_in(run):  # one placeholder each, skipped saying why
            metafunc.parametrize("row", ["(not run)"])
            return
        names = [r.name for r in _rows(run)]
        first = {"test_row_provenance": 0, "test_row_floor": 0, "test_rung_speed": 2}.get(metafunc.function.__name__, 1)
        metafunc.parametrize("row", names[first:])


@pytest.fixture(scope="module")
def ling_run(moe_run):
    if not _opted_in(moe_run):
        pytest.skip(f"opt-in: the full-depth ladder runs with --moe-model {LING_MODEL} (about 70 GB of device "
                    "memory)")
    if moe_run.core.device.torch_device.type != "cuda":
        pytest.skip("the full-depth ladder times CUDA graphs: it needs a CUDA device")
    return moe_run


_ladders: dict[str, object] = {}  # context -> its LadderRun, or the exception it raised


@pytest.fixture(scope="module")
def ling_ladder(ling_run, moe_model, context):
    """The context's ladder, run once a session: pytest sets a module-scoped parametrized fixture
    up again when its tests' order returns to a parameter (the 1k ladder ran twice in one H200
    session, the second time without the room for its humming row), and retries a failed one for
    every test that asks; at full depth each costs minutes. The outcome is kept per context."""
    if context not in _ladders:
        try:
            _ladders[context] = _run_ladder(ling_run, moe_model, context)
        except Exception as e:
            _ladders[context] = e
    if isinstance(_ladders[context], Exception):
        raise _ladders[context]
    return _ladders[context]


# Device memory a ladder needs past the weights before the humming row is tried at all; whether
# it really fits is then measured: a row whose warm-up runs out of memory is dropped with the
# reason (run_suite_ladder's `optional` rows) and the other rows run. The first full-depth attempt
# ran out with 138.3 of 139.8 GiB allocated, 6.4 GiB of it graph pools.
LADDER_HEADROOM_GIB = 4.0
_dropped: dict[str, str] = {}  # context -> why its ladder runs without the humming row


def _humming_fits(model) -> tuple[bool, str]:
    """Whether Humming's copy of the routed experts (as large as ours) fits beside the ladder."""
    import torch
    from impl.model.roofline import MXFP4_BYTES
    need = model.config.expert_parameters() * MXFP4_BYTES / 2**30
    free = torch.cuda.mem_get_info(model.embed_tokens.weight.device)[0] / 2**30
    return free >= need + LADDER_HEADROOM_GIB, (f"Humming's copy of the experts ({need:.1f} GiB) and the ladder's "
                                                f"{LADDER_HEADROOM_GIB:g} GiB do not fit the {free:.1f} GiB free")


def _run_ladder(ling_run, moe_model, context):
    from impl.moe.humming import release
    workload, n, with_humming = LING_WORKLOADS[context]
    opts = ling_run.options
    rows = _rows(ling_run)
    if any(r.config.moe == "humming" for r in rows):
        release()  # a ladder converts again what it runs; the last one's copy would only take room
        fits, why = _humming_fits(moe_model)
        if not with_humming or not fits:
            _dropped[context] = ("the 32k prompt pass needs the room" if not with_humming else why)
            rows = [r for r in rows if r.config.moe != "humming"]
    ladder = run_suite_ladder(ling_run, moe_model, rows, workload, opts.requests or AtMost(n),
                              Path(opts.ab_report) / f"ling-{context}", warmup=WARMUP,
                              optional=tuple(r.name for r in rows if r.config.moe == "humming"))
    if ladder.result.dropped:  # the runner has released what a dropped row converted
        _dropped[context] = "; ".join(f"{k}: {v}" for k, v in ladder.result.dropped.items())
    return ladder


def _names(ladder) -> list[str]:
    return [r.name for r in ladder.result.rows]


def _served(ladder, row, context, first: int = 0) -> None:
    """Skip a row this context's ladder does not run (or runs as its reference), saying why."""
    names = _names(ladder)
    if row not in names[first:]:
        why = f" (the humming row was dropped: {_dropped[context]})" if context in _dropped else ""
        pytest.skip(f"row {row!r} is not compared at {context}: that ladder is {names}{why}")


def test_row_provenance(ling_ladder, row, context):
    _served(ling_ladder, row, context)
    fail_on_provenance(ling_ladder, row)


@pytest.mark.parametrize("figure,key,direction", FIGURES)
def test_row_speed(ling_ladder, row, context, figure, key, direction, moe_gate, moe_device):
    """The row against the first row (humming; kernels at 32k), paired per request."""
    _served(ling_ladder, row, context, first=1)
    _gate_ratio(ling_ladder, row, None, figure, key, direction, moe_gate, moe_device)


@pytest.mark.parametrize("figure,key,direction", FIGURES[:2])
def test_rung_speed(ling_ladder, row, context, figure, key, direction, moe_gate, moe_device):
    """The row against the row before it: what this rung of the ladder adds (from the third row;
    the second's rung is its comparison with the first)."""
    _served(ling_ladder, row, context, first=2)
    names = _names(ling_ladder)
    previous = names[names.index(row) - 1]
    _gate_ratio(ling_ladder, row, previous, f"{figure}_rung", key, direction, moe_gate, moe_device)


def test_verify_cost(ling_ladder, moe_model, context, moe_gate, moe_device):
    """What speculation costs: per request, the speculative row's time per verify step (k drafts,
    the verify pass, the commit) over the TPOT of the row before it (the same model without MTP),
    paired. The row is faster only where its accept length beats this."""
    from moe_harness.ladder.summary import verify_step_s
    names = _names(ling_ladder)
    spec = [r for r in ling_ladder.result.rows if r.speculative]
    if not spec or names.index(spec[0].name) == 0:
        pytest.skip(f"no speculative row after a plain one in {names}")
    row, plain = spec[0].name, names[names.index(spec[0].name) - 1]
    k = spec[0].provenance["drafts_per_step"]
    mine, ref = ling_ladder.by_row[row], ling_ladder.by_row[plain]
    costs = [verify_step_s(mine[i]) / ref[i].tpot_s for i in mine
             if i in ref and verify_step_s(mine[i]) and ref[i].tpot_s]
    if len(costs) < 3:
        pytest.fail(f"row {row!r}: {len(costs)} paired requests with verify steps: too few to gate", pytrace=False)
    accept = next(s["accept_length"]["mean"] for s in ling_ladder.summary["rows"] if s["name"] == row)
    cost = statistics.median(costs)
    print(f"\n{context}: a verify step of {row!r} costs {cost:.2f} plain steps of {plain!r} (median); at its "
          f"accept length {accept:.2f} that is x{accept / cost:.2f}; {_spec_bytes_line(moe_model.config, k, context)}")
    moe_gate.check("ab_verify_cost", costs, unit="plain steps", direction="lower",
                   tolerance=tolerance_for("ab_speed", moe_device.torch_device),
                   config=row_config(ling_ladder, row, plain), portable=True)


_bandwidth: list[float] = []  # the copy bandwidth, measured once a session on the ladder's device
_row_floors: dict[str, dict] = {}  # context -> its rows-CONTEXT table, written again after each row


def test_row_floor(ling_run, ling_ladder, moe_model, row, context, moe_gate, moe_device):
    """The row's TPOT over its byte floor, per request (impl.model.roofline.tpot_floor_s): the
    weights in the formats the row holds them (experts as its provenance says, bf16 projections,
    its head's format), the caches at the request's decode positions, and for a speculative row a
    step's bytes over the decoded tokens a step (output_tokens - 1 over its verify steps, the
    tokens TPOT is taken over: a last step cut short by the length limit counts what it kept);
    at the copy bandwidth measured in this run. What explains a row's speed beside its ratios:
    how far it is from its bytes."""
    from impl.gpu_timing import copy_bandwidth
    from impl.model.roofline import Formats, meta_model, tpot_floor_s
    _served(ling_ladder, row, context)
    config = {r.name: r.config for r in _rows(ling_run)}[row]
    if not _bandwidth:
        _bandwidth.append(copy_bandwidth(moe_model.embed_tokens.weight.device, nbytes=1 << 30))
    formats = Formats(experts=ling_ladder.result.row(row).provenance["expert_format"],
                      projections=ROW3_FORMATS.projections, head=config.head)
    shapes = meta_model(moe_model.config)
    floors, ratios = [], []
    for rec in ling_ladder.by_row[row].values():
        steps = rec.acceptance.verify_steps if rec.acceptance is not None else 0
        if not rec.tpot_s or rec.output_tokens < 2 or (config.k and not steps):
            continue
        committed = (rec.output_tokens - 1) / steps if config.k else 1.0
        floors.append(tpot_floor_s(moe_model.config, rec.prompt_tokens, rec.output_tokens, formats,
                                   _bandwidth[0], drafts=config.k, committed_per_step=committed, model=shapes))
        ratios.append(rec.tpot_s / floors[-1])
    if len(ratios) < 3:
        pytest.fail(f"row {row!r}: {len(ratios)} requests with a TPOT: too few to gate", pytrace=False)
    table = _row_floors.setdefault(context, {"workload": LING_WORKLOADS[context][0], "rows": {}})
    table["bandwidth_tb_s"] = _bandwidth[0] / 1e12
    tpots = [ratio * floor for ratio, floor in zip(ratios, floors)]  # the requests gated
    table["rows"][row] = {"config": config.spec_text(), "formats": vars(formats), "tpot_ms": statistics.median(tpots) * 1e3,
                          "floor_ms": statistics.median(floors) * 1e3, "over_floor": statistics.median(ratios),
                          "assumed_accept": config.assumed_accept}
    _write_row_floors(Path(ling_run.options.ab_report) / f"rows-{context}", table)
    moe_gate.check("row_tpot_over_floor", ratios, unit="x", direction="lower",
                   tolerance=tolerance_for("ab_speed", moe_device.torch_device),
                   config=row_config(ling_ladder, row, None), portable=True)


def _write_row_floors(stem: Path, table: dict) -> None:
    """JSON and Markdown of the rows' TPOT against their byte floors, each written whole or not at all."""
    lines = [f"# Each row against its bytes: {table['workload']} ({table['bandwidth_tb_s']:.2f} TB/s copy bandwidth)", "",
             "| row | formats (experts / projections / head) | TPOT p50 | byte floor | TPOT / floor |", "|---|---|---|---|---|"]
    for name, r in table["rows"].items():
        f = r["formats"]
        label = name + (f" (acceptance assumed at {r['assumed_accept']:g})" if r["assumed_accept"] else "")
        lines.append(f"| {label} | {f['experts']} / {f['projections']} / {f['head']} | {r['tpot_ms']:.3f} ms | "
                     f"{r['floor_ms']:.3f} ms | x{r['over_floor']:.2f} |")
    lines += ["", "Medians over requests. The floor is the bytes a decode token reads (a speculative row: a step's "
              "bytes over the tokens it commits) at the request's decode positions, at the copy bandwidth measured "
              "in the same run (impl.model.roofline.tpot_floor_s)."]
    atomic_write_text(stem.with_suffix(".json"), json.dumps(table, indent=2) + "\n")
    atomic_write_text(stem.with_suffix(".md"), "\n".join(lines) + "\n")
    print("\n" + "\n".join(lines))


def _spec_bytes_line(config, k: int, context: str) -> str:
    """What a speculative step of k drafts reads next to a plain token (impl.model.roofline), at
    the workload's context and the routing of random weights (independent, uniform)."""
    from impl.data.workloads import parse_workload
    from impl.model.roofline import expected_distinct_experts, meta_model, spec_step_bytes, token_bytes
    length = parse_workload(LING_WORKLOADS[context][0]).input_len.tokens
    shapes = meta_model(config)
    spec = sum(spec_step_bytes(config, length, k, ROW3_FORMATS, shapes).values())
    plain = sum(token_bytes(config, length, ROW3_FORMATS, shapes).values())
    return (f"it reads {spec / 1e9:.2f} GB, {spec / plain:.2f} plain tokens' bytes "
            f"({expected_distinct_experts(config, k + 1):.1f} distinct experts a MoE layer)")


def _gate_ratio(ladder, row, reference, figure, key, direction, moe_gate, moe_device):
    ratios = paired(ladder, row, key, reference)
    if len(ratios) < 3:
        pytest.fail(f"row {row!r}: {len(ratios)} paired requests with a {key}: too few to gate", pytrace=False)
    moe_gate.check(figure, ratios, unit="x", direction=direction,
                   tolerance=tolerance_for("ab_speed", moe_device.torch_device),
                   config=row_config(ladder, row, reference), portable=True)


def test_roofline(ling_run, moe_model, context, moe_gate, moe_device):
    """Row 3's plain greedy step at the workload's context: measured / byte floor for the whole
    step and per component, at the copy bandwidth measured here; the step's ratio is gated."""
    import torch

    from impl.decode_runner import PlainRunner
    from impl.gpu_timing import copy_bandwidth
    from impl.model.components import component_bytes, component_times
    from impl.model.roofline import token_bytes
    from impl.data.text import tokenizer_for
    from impl.data.workloads import parse_workload
    from impl.serve import build_row
    from impl.serve.rows import parse_row
    length = parse_workload(LING_WORKLOADS[context][0]).input_len.tokens
    row = parse_row(ROW3, "cuda")
    built = build_row(moe_model, row.config, tokenizer=tokenizer_for(ling_run.options.model,
                                                                   moe_model.config.vocab_size), name=row.name)
    restore = (moe_model.moe_backend, moe_model.lm_head)
    dev = moe_model.embed_tokens.weight.device
    try:
        built.activate()
        step = PlainRunner(moe_model).held_step(length)
        with torch.inference_mode():
            times = component_times(moe_model, step)
        bandwidth = copy_bandwidth(dev, nbytes=1 << 30)  # 2 GiB in all: the card is nearly full
    finally:
        moe_model.set_moe_backend(restore[0])
        moe_model.set_head(restore[1])
    parts = component_bytes(token_bytes(moe_model.config, length, ROW3_FORMATS))
    floor_us = {c: b / bandwidth * 1e6 for c, b in parts.items()}
    step_floor = sum(floor_us.values())
    timed = [c for c in parts if c in times]  # "other" (norms, the embedding row) is never left out
    table = {"context": length, "bandwidth_tb_s": bandwidth / 1e12, "step_us": times["step"]["us"],
             "step_floor_us": step_floor, "step_over_floor": times["step"]["us"] / step_floor,
             "components": {c: {"us": times[c]["us"], "bytes": parts[c], "floor_us": floor_us[c],
                                "over_floor": times[c]["us"] / floor_us[c]} for c in timed}}
    table["components"]["rest (norms, residuals, embedding, gaps)"] = {
        "us": times["step"]["us"] - sum(times[c]["us"] for c in timed), "bytes": parts.get("other", 0.0),
        "floor_us": floor_us.get("other", 0.0), "over_floor": None}
    _write_roofline(Path(ling_run.options.ab_report) / f"roofline-{context}", table)
    moe_gate.check("roofline_step_over_floor", [t / step_floor for t in times["step"]["samples"]], unit="x",
                   direction="lower", tolerance=tolerance_for("ab_speed", moe_device.torch_device),
                   config={"context": length, "row": row.config.spec_text()}, portable=True)


def _write_roofline(stem: Path, table: dict) -> None:
    """JSON and Markdown of the roofline table, each written whole or not at all."""
    lines = [f"# Roofline at context {table['context']} ({table['bandwidth_tb_s']:.2f} TB/s copy bandwidth)", "",
             f"Step {table['step_us']:.1f} us against a byte floor of {table['step_floor_us']:.1f} us: "
             f"x{table['step_over_floor']:.2f}.", "",
             "| component | measured us (left out) | bytes a token (MB) | floor us | measured / floor |",
             "|---|---|---|---|---|"]
    for name, c in table["components"].items():
        us = "-" if c["us"] is None else f"{c['us']:.1f}"
        ratio = "-" if c["over_floor"] is None else f"x{c['over_floor']:.2f}"
        lines.append(f"| {name} | {us} | {c['bytes'] / 1e6:.1f} | {c['floor_us']:.1f} | {ratio} |")
    atomic_write_text(stem.with_suffix(".json"), json.dumps(table, indent=2) + "\n")
    atomic_write_text(stem.with_suffix(".md"), "\n".join(lines) + "\n")
    print("\n" + "\n".join(lines))
