"""The A/B ladder: is each row faster than the first, with the same answers, running what it says?

The model under test serves the workload (`--moe-workload`, default `arith`) once per row of the
ladder (`--moe-ladder`; default baseline, +kernels, +fp8-head, +mtp on CUDA, and on a CPU, where
the kernels exist only interpreted, baseline, +fp8-head, +mtp), rows interleaved request by
request (impl.serve.runner: A B, then B A), each request timed as a serving loop times it: TTFT
(prefill included), TPOT = (latency - TTFT) / (output tokens - 1), latency, decode tokens/s,
accept length per verify step. Answers are scored per request (impl.data.workloads). The run's
report (JSON, Markdown, PNG figures: pytest_moeperf.ab_report) goes to `--moe-ab-report`, also
when a test below fails and when the run stops part-way (it holds what completed).

Per row after the first, against the first, paired over the same requests:
* provenance: what ran (MoE kernels, head class and kernel, the draft holding the target's own
  head module, drafts per step) must be what the row's name says, or the row fails naming the part;
* speed: the per-request ratios of decode tokens/s, TPOT and TTFT, gated against the frozen
  figures (portable: both sides measured in the same minutes);
* answers: McNemar's exact test on the discordant pairs must not find them `different`, and the
  fraction of requests both rows score alike is gated; each row's accuracy is gated too.
Speculative rows also gate their mean accept length.

Tolerances: pytest_moeperf.tolerances ("ab_speed", "ab_accuracy", "accept_length").
"""

from __future__ import annotations

import math
import statistics
import sys
from dataclasses import dataclass

import pytest

from pytest_moeperf.tolerances import tolerance_for

pytestmark = pytest.mark.moe_bench

DEFAULT_LADDER = {"cuda": "baseline;+kernels;+fp8-head;+mtp", "cpu": "baseline;+fp8-head;+mtp"}
DEFAULT_REQUESTS = {"cuda": 1000, "cpu": 60}
WARMUP = 2  # requests per row before timing: graphs captured, every compile of a first shape done
CHUNKS = 10  # accuracy figures are gated over this many consecutive chunks of the requests


def _rows(session):
    from impl.serve.configs import parse_ladder
    device = session.device.torch_device.type
    return parse_ladder(session.options.ladder or DEFAULT_LADDER[device], device)


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "row" in metafunc.fixturenames:
        from pytest_moeperf.session import SESSION_KEY
        session = metafunc.config.stash[SESSION_KEY]
        names = [r.name for r in _rows(session)] if session.options.bench else ["(not run)"]
        metafunc.parametrize("row", names[1:] if metafunc.function.__name__ != "test_row_provenance" else names)


@dataclass
class LadderRun:
    result: dict  # pytest_moeperf.ab_report's input
    summary: dict  # ab_summary.summarize_ab(result)
    report: dict  # what write_ab_report wrote
    records: dict  # arm name -> {request id: record}


def _progress(line: str) -> None:
    print(f"\nmoeperf ladder: {line}", file=sys.stderr, end="")


@pytest.fixture(scope="module")
def ladder(moe_session, moe_model) -> LadderRun:
    from impl.data.text import tokenizer_for
    from impl.data.workloads import ContextError, load_workload
    from impl.serve import build_arms, provenance_problems, run_ladder
    from pytest_moeperf.ab_report import write_ab_report
    from pytest_moeperf.ab_summary import summarize_ab
    opts = moe_session.options
    device = moe_model.embed_tokens.weight.device
    rows = _rows(moe_session)
    tokenizer = tokenizer_for(opts.model, moe_model.config.vocab_size)
    reserve = max((r.config.k for r in rows if r.config.speculative), default=0)
    try:
        workload = load_workload(opts.workload, tokenizer, moe_model.config.max_seq_len - reserve,
                                 n=opts.requests or DEFAULT_REQUESTS[device.type], shots=opts.shots)
        workload.check()
    except ContextError as e:
        hint = " (fewer with --moe-shots)" if e.shots else ""
        raise pytest.UsageError(f"--moe-workload {opts.workload}: {e}{hint}") from None
    requests = list(workload)
    by_id = {r.request_id: r for r in requests}
    restore = (moe_model.moe_backend, moe_model.lm_head)
    arms = build_arms(moe_model, rows, tokenizer=tokenizer)
    records: list[dict] = []

    def scored(record: dict) -> None:
        request = by_id[record["request_id"]]
        record.update({k: v for k, v in workload.score(request, record["text"]).items()
                       if k in ("correct", "strict_correct", "flexible_correct")})

    complete = False
    try:
        run_ladder(arms, requests, on_record=scored, progress=_progress, records=records, warmup=WARMUP, check=False)
        complete = True
    finally:
        moe_model.set_moe_backend(restore[0])
        moe_model.set_head(restore[1])
        result = {
            "workload": {"name": str(opts.workload), "n_requests": len(requests), "shots": workload.shots or 0,
                         "details": {"description": workload.description}},
            "device": moe_session.device.describe(),
            "arms": [_arm_entry(a, provenance_problems) for a in arms],
            "requests": records,
            "complete": complete,
        }
        report = write_ab_report(result, opts.ab_report, margin=opts.margin)
        print(f"\nmoeperf ladder: report in {report['markdown']}", file=sys.stderr)
    arm_records = {a.name: {r["request_id"]: r for r in records if r["arm"] == a.name} for a in arms}
    return LadderRun(result, summarize_ab(result, margin=opts.margin), report, arm_records)


def _arm_entry(arm, provenance_problems) -> dict:
    """A row as the report takes it: its spec, what ran, and what of it contradicts the name."""
    prov = arm.provenance
    if prov is None:
        return {"name": arm.name, "config": arm.config.spec_text(), "provenance": {}, "speculative":
                arm.config.speculative, "provenance_error": "the row served no request"}
    shown = prov.as_dict()
    shown["draft_shares_head"] = all(prov.draft_head_is_target_head) if prov.speculative else None
    shown["drafts_per_step"] = max(prov.drafts_per_step, default=0)
    problems = provenance_problems(arm.name, arm.config, prov)
    return {"name": arm.name, "config": arm.config.spec_text(), "provenance": shown,
            "provenance_error": "; ".join(problems) or None, "speculative": arm.config.speculative}


def _arm(ladder: LadderRun, name: str) -> dict:
    return next(a for a in ladder.result["arms"] if a["name"] == name)


def _config(ladder: LadderRun, row: str) -> dict:
    """What each gated figure of a row depends on: both rows' specs, the workload, its size."""
    first = ladder.result["arms"][0]
    return {"row": _arm(ladder, row)["config"], "reference": first["config"],
            "workload": ladder.result["workload"]["name"], "requests": ladder.result["workload"]["n_requests"]}


def _paired(ladder: LadderRun, row: str, key: str) -> list[float]:
    """Per request, the row's `key` over the first row's, on the requests both have it for."""
    mine, ref = ladder.records[row], ladder.records[ladder.result["arms"][0]["name"]]
    return [mine[i][key] / ref[i][key] for i in mine if i in ref
            and mine[i][key] is not None and ref[i][key] is not None and ref[i][key] > 0 and mine[i][key] > 0]


def _chunks(ids: list) -> list[list]:
    """`ids` in CHUNKS consecutive runs (the last may be shorter): the samples of a fraction gated."""
    size = max(1, math.ceil(len(ids) / CHUNKS))
    return [ids[j:j + size] for j in range(0, len(ids), size)]


def test_row_provenance(ladder, row):
    """The row ran what its name says (impl.serve.provenance): else it fails naming the part."""
    error = _arm(ladder, row)["provenance_error"]
    if error:
        pytest.fail(f"row {row!r}: {error} (report: {ladder.report['markdown']})", pytrace=False)


@pytest.mark.parametrize("figure,key,direction", [
    ("ab_tokens_per_s", "decode_tokens_per_s", "higher"),
    ("ab_tpot", "tpot_s", "lower"),
    ("ab_ttft", "ttft_s", "lower"),
])
def test_row_speed(ladder, row, figure, key, direction, moe_gate, moe_device):
    ratios = _paired(ladder, row, key)
    if len(ratios) < 3:
        pytest.fail(f"row {row!r}: {len(ratios)} paired requests with a {key}: too few to gate", pytrace=False)
    moe_gate.check(figure, ratios, unit="x", direction=direction,
                   tolerance=tolerance_for("ab_speed", moe_device.torch_device), config=_config(ladder, row),
                   portable=True)


def test_row_answers(ladder, row, moe_gate, moe_device):
    """Answers: not `different` from the first row's (exact McNemar), and the fraction scored
    alike gated per chunk of requests (as is the row's own accuracy)."""
    comparison = next(c for c in ladder.summary["comparisons"] if c["arm"] == row)
    acc = comparison.get("accuracy")
    if acc is None:
        pytest.skip(f"workload {ladder.result['workload']['name']!r} has no answers to compare")
    if acc["verdict"] == "different":
        pytest.fail(f"row {row!r}: answers differ from {ladder.result['arms'][0]['name']!r}: accuracy "
                    f"{acc['accuracy_b']:.1%} vs {acc['accuracy_a']:.1%}, discordant {acc['a_only']} / {acc['b_only']} "
                    f"of {acc['n']}, exact McNemar p = {acc['p_value']:.3g}", pytrace=False)
    mine, ref = ladder.records[row], ladder.records[ladder.result["arms"][0]["name"]]
    ids = [i for i in mine if i in ref and mine[i].get("correct") is not None]
    chunks = _chunks(ids)
    tol = tolerance_for("ab_accuracy", moe_device.torch_device)
    moe_gate.check("ab_answers_alike", [statistics.fmean(mine[i]["correct"] == ref[i]["correct"] for i in c)
                                     for c in chunks],
                   unit="fraction", direction="higher", tolerance=tol, config=_config(ladder, row), portable=True)
    print(f"\nrow {row}: {acc['verdict']} at a {acc['margin']:.0%} margin; accuracy {acc['accuracy_b']:.1%} vs "
          f"{acc['accuracy_a']:.1%}, difference {acc['difference']:+.2%} (95% CI {acc['ci_difference'][0]:+.2%} to "
          f"{acc['ci_difference'][1]:+.2%}), smallest detectable {acc['mdd']:.1%}")


def test_reference_accuracy(ladder, moe_gate, moe_device):
    """The first row's own accuracy, gated per chunk of requests: the workload still scores as
    frozen (a broken model, tokenizer or scorer moves every row at once, which the paired
    comparisons above cannot see)."""
    name = ladder.result["arms"][0]["name"]
    ids = [i for i, r in ladder.records[name].items() if r.get("correct") is not None]
    if not ids:
        pytest.skip(f"workload {ladder.result['workload']['name']!r} has no answers")
    chunks = _chunks(ids)
    moe_gate.check("ab_reference_accuracy", [statistics.fmean(ladder.records[name][i]["correct"] for i in c)
                                          for c in chunks],
                   unit="fraction", direction="higher", tolerance=tolerance_for("ab_accuracy", moe_device.torch_device),
                   config={"row": _arm(ladder, name)["config"], "workload": ladder.result["workload"]["name"],
                           "requests": ladder.result["workload"]["n_requests"]}, portable=True)


def test_row_accept_length(ladder, row, moe_gate, moe_device):
    arm = _arm(ladder, row)
    if not arm["speculative"]:
        pytest.skip(f"row {row!r} does not speculate")
    per_request = [statistics.fmean(r["accept_lengths"]) for r in ladder.records[row].values() if r["accept_lengths"]]
    if not per_request:
        pytest.fail(f"row {row!r}: no verify steps recorded", pytrace=False)
    moe_gate.check("ab_accept_length", per_request, unit="tokens/step", direction="higher",
                   tolerance=tolerance_for("accept_length", moe_device.torch_device), config=_config(ladder, row),
                   portable=True)
