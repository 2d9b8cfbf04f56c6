"""The A/B ladder: is each row faster than the first, with the same answers, running what it says?

The model under test serves the workload (`--moe-workload`, default `arith`) once per row of the
ladder (`--moe-ladder`; default baseline, +kernels, +fp8-head, +mtp on CUDA, and on a CPU, where
the kernels exist only interpreted, baseline, +fp8-head, +mtp), rows interleaved request by
request (impl.serve.ladder: A B, then B A), each request timed as a serving loop times it: TTFT
(prefill included), TPOT = (latency - TTFT) / (output tokens - 1), latency, decode tokens/s,
accept length per verify step. Answers are scored per request (impl.data.workloads). The run's
report (JSON, Markdown, PNG figures: moe_harness.ladder.report) goes to `--moe-ab-report`, also
when a test below fails and when the run stops part-way (it holds what completed).

Per row after the first, against the first, paired over the same requests:
* provenance: what ran (MoE kernels, head class and kernel, the draft holding the target's own
  head module, drafts per step) must be what the row's name says, or the row fails naming the part;
* speed: the per-request ratios of decode tokens/s, TPOT and TTFT, gated against the frozen
  figures (portable: both sides measured in the same minutes);
* answers: McNemar's exact test on the discordant pairs must not find them `different`, and the
  fraction of requests both rows score alike is gated; each row's accuracy is gated too.
Speculative rows also gate their mean accept length.

Tolerances: moe_harness.tolerances ("ab_speed", "ab_accuracy", "accept_length").
"""

from __future__ import annotations

import functools
import statistics

import pytest

from impl.data.workloads import AtMost
from impl.serve.defaults import DEFAULT_LADDER, DEFAULT_REQUESTS
from moe_harness.ladder.run import (WARMUP, LadderRun, accuracy_chunks, fail_on_provenance, paired, row_config,
                                   run_suite_ladder, workload_key)
from moe_harness.tolerances import tolerance_for

pytestmark = pytest.mark.moe_bench

CHUNKS = 10  # accuracy figures are gated over this many consecutive chunks of the requests


def _rows(run):
    """The ladder's rows: --moe-ladder's, else a --moe-servers file's ([ladder] rows, or its
    servers), else the device's default rows (moe_harness.ladder.endpoints.servers.ladder_rows)."""
    from moe_harness.ladder.endpoints.servers import ladder_rows
    device, opts = run.core.device.torch_device.type, run.options
    text = opts.ladder or (None if opts.servers else _default_ladder(run, device))
    return ladder_rows(text, opts.servers, device)


@functools.lru_cache(maxsize=None)
def _has_mtp(model: str) -> bool:
    """Whether the model under test has a NEXTN layer (a checkpoint's headers read once a session:
    the rows are asked for by every parametrized test function)."""
    from impl.model.build import model_config
    return model_config(model).num_mtp_layers > 0


def _default_ladder(run, device: str) -> str:
    """The device's default rows, less +mtp for a model without a NEXTN layer to draft with (said
    once in the terminal summary; naming +mtp in --moe-ladder for such a model is a usage error)."""
    rows = DEFAULT_LADDER[device]
    if _has_mtp(run.options.model):
        return rows
    note = (f"A/B: the default ladder leaves out +mtp: model {run.options.model!r} has no MTP (NEXTN) layer "
            "to draft with")
    if note not in run.ab_verdicts:
        run.ab_verdicts.append(note)
    return rows.replace(";+mtp", "")


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "row" in metafunc.fixturenames:
        from moe_harness.state import HARNESS_KEY
        run = metafunc.config.stash[HARNESS_KEY]
        if not run.core.options.bench:  # one placeholder each, skipped by the moe_bench marker saying why
            metafunc.parametrize("row", ["(not run)"])
            return
        names = [r.name for r in _rows(run)]
        metafunc.parametrize("row", names[1:] if metafunc.function.__name__ != "test_row_provenance" else names)


@pytest.fixture(scope="module")
def ladder(moe_run, moe_model) -> LadderRun:
    opts = moe_run.options
    device = moe_model.embed_tokens.weight.device
    # Without --moe-requests, the default count or all of a smaller file or split.
    return run_suite_ladder(moe_run, moe_model, _rows(moe_run), opts.workload,
                            opts.requests or AtMost(DEFAULT_REQUESTS[device.type]), opts.ab_report, warmup=WARMUP)


def test_row_provenance(ladder, row):
    """The row ran what its name says (impl.serve.provenance): else it fails naming the part."""
    fail_on_provenance(ladder, row)


def test_row_as_expected(ladder, row, moe_run):
    """`--moe-expect`: the row is faster than the first (its decode tokens/s interval above 1), or
    not slower (not below 1), and runs what it declares (a speculative row whose drafts do not run
    or are never accepted fails, whatever its speed); without it, skipped (the gate judges against
    frozen figures)."""
    expect = moe_run.options.expect
    if expect is None:
        pytest.skip("no --moe-expect: the row's verdict is in the report and the terminal summary")
    comparison = next(c for c in ladder.summary["comparisons"] if c["row"] == row)
    wanted = "faster than" if expect == "faster" else "not slower than"
    unmet = next(s["unmet_claims"] for s in ladder.summary["rows"] if s["name"] == row)
    if unmet:
        pytest.fail(f"row {row!r} is expected {wanted} {comparison['reference']!r} (--moe-expect {expect}) but does "
                    f"not run what it declares: {'; '.join(unmet)}", pytrace=False)
    allowed = ("faster",) if expect == "faster" else ("faster", "no detectable difference")
    if comparison["speed"] not in allowed:
        r = comparison["ratios"]["decode_tokens_per_s"]
        ratio = "" if r is None else f" (decode tok/s x{r['ratio']:.3f}, 95% CI {r['ci'][0]:.3f}-{r['ci'][1]:.3f})"
        pytest.fail(f"row {row!r} is expected {wanted} {comparison['reference']!r} (--moe-expect {expect}) but reads "
                    f"{comparison['speed']}{ratio}", pytrace=False)


@pytest.mark.parametrize("figure,key,direction", [
    ("ab_tokens_per_s", "decode_tokens_per_s", "higher"),
    ("ab_tpot", "tpot_s", "lower"),
    ("ab_ttft", "ttft_s", "lower"),
])
def test_row_speed(ladder, row, figure, key, direction, moe_gate, moe_device):
    ratios = paired(ladder, row, key)
    if len(ratios) < 3:
        pytest.fail(f"row {row!r}: {len(ratios)} paired requests with a {key}: too few to gate", pytrace=False)
    moe_gate.check(figure, ratios, unit="x", direction=direction,
                   tolerance=tolerance_for("ab_speed", moe_device.torch_device), config=row_config(ladder, row),
                   portable=True, host_load=ladder.host_load)


def test_row_answers(ladder, row, moe_gate, moe_device):
    """Answers: not `different` from the first row's (exact McNemar), and the fraction scored
    alike gated per chunk of requests (as is the row's own accuracy)."""
    comparison = next(c for c in ladder.summary["comparisons"] if c["row"] == row)
    acc = comparison.get("accuracy")
    if acc is None:
        pytest.skip(f"workload {ladder.result.workload['name']!r} has no answers to compare")
    reference = ladder.result.rows[0].name
    if acc["verdict"] == "different":
        pytest.fail(f"row {row!r}: answers differ from {reference!r}: accuracy "
                    f"{acc['accuracy_b']:.1%} vs {acc['accuracy_a']:.1%}, discordant {acc['a_only']} / {acc['b_only']} "
                    f"of {acc['n']}, exact McNemar p = {acc['p_value']:.3g}", pytrace=False)
    mine, ref = ladder.by_row[row], ladder.by_row[reference]
    ids = [i for i in mine if i in ref and mine[i].mark("correct") is not None and ref[i].mark("correct") is not None]
    groups = accuracy_chunks(ids, CHUNKS)
    tol = tolerance_for("ab_accuracy", moe_device.torch_device)
    moe_gate.check("ab_answers_alike", [statistics.fmean(mine[i].mark("correct") == ref[i].mark("correct") for i in c)
                                     for c in groups],
                   unit="fraction", direction="higher", tolerance=tol, config=row_config(ladder, row), portable=True)
    print(f"\nrow {row}: {acc['verdict']} at a {acc['margin']:.0%} margin; accuracy {acc['accuracy_b']:.1%} vs "
          f"{acc['accuracy_a']:.1%}, difference {acc['difference']:+.2%} (95% CI {acc['ci_difference'][0]:+.2%} to "
          f"{acc['ci_difference'][1]:+.2%}), smallest detectable {acc['mdd']:.1%}")


def test_reference_accuracy(ladder, moe_gate, moe_device):
    """The first row's own accuracy, gated per chunk of requests: the workload still scores as
    frozen (a broken model, tokenizer or scorer moves every row at once, which the paired
    comparisons above cannot see)."""
    reference = ladder.result.rows[0]
    served = ladder.by_row[reference.name]
    ids = [i for i, r in served.items() if r.mark("correct") is not None]
    if not ids:
        pytest.skip(f"workload {ladder.result.workload['name']!r} has no answers")
    groups = accuracy_chunks(ids, CHUNKS)
    moe_gate.check("ab_reference_accuracy", [statistics.fmean(served[i].mark("correct") for i in c) for c in groups],
                   unit="fraction", direction="higher", tolerance=tolerance_for("ab_accuracy", moe_device.torch_device),
                   config={"row": reference.config, **workload_key(ladder)}, portable=True)


def test_row_accept_length(ladder, row, moe_gate, moe_device):
    if not ladder.result.row(row).speculative:
        pytest.skip(f"row {row!r} does not speculate")
    per_request = [r.acceptance.accept_length for r in ladder.by_row[row].values()
                   if r.acceptance is not None and r.acceptance.verify_steps]
    if not per_request:
        pytest.fail(f"row {row!r}: no verify steps recorded", pytrace=False)
    moe_gate.check("ab_accept_length", per_request, unit="tokens/step", direction="higher",
                   tolerance=tolerance_for("accept_length", moe_device.torch_device), config=row_config(ladder, row),
                   portable=True)
