"""Negative controls of the A/B ladder suite (suites/test_ab_ladder.py), each run through pytester
on the trained checkpoint (checkpoints/tiny-gsm, CPU, one torch thread, the arith workload):

- `trap`: the reference result's silent failure. A `+mtp` row whose draft holds only the FP8
  head's weight tensor (its e4m3 data read as values, scales dropped) instead of the target's head
  module, the decoder's own check switched off: the row's provenance test fails naming the head
  sharing, and the report marks the row.
- `noisy head`: an FP8 head backend that adds noise to the logits (std NOISE, enough to flip the
  greedy answer of about a third of the problems): the row's answers test fails, McNemar's exact
  test finding the answers `different`.
- `A/A`: the baseline twice: nothing fails, the answers come out `equivalent` (margin 5 points:
  at 60 requests a 1-point equivalence is out of reach, the smallest interval half-width with no
  discordant pair being z^2 / (n + z^2) = 4.3 points) and each speed ratio's interval contains
  1 (at 99.75% each, so that the four together miss 1 by chance in 1% of runs).

No baselines are frozen for these runs (an empty folder): the gated figures skip as
NO-BASELINE, the provenance and answer checks, which need no baseline, decide.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from pytest_moeperf.stats import paired_ratio

ROOT = Path(__file__).resolve().parents[1]
SUITE = ROOT / "suites" / "test_ab_ladder.py"
CHECKPOINT = ROOT / "checkpoints" / "tiny-gsm"
NOISE = 8.0  # logit noise std of the planted head (the checkpoint's top logit leads by ~10-20)

pytestmark = pytest.mark.skipif(not (CHECKPOINT / "model.safetensors").is_file(),
                                reason=f"no trained checkpoint at {CHECKPOINT}")

ONE_THREAD = '''
import pytest
import torch


@pytest.fixture(scope="session", autouse=True)
def _one_thread():
    torch.set_num_threads(1)
'''

TRAP = ONE_THREAD + '''
import impl.serve
from impl.serve import unshared_head_arm

_build = impl.serve.build_arms


def _planted(model, rows, *, tokenizer):
    return [unshared_head_arm(a, "weight") if a.name == "+mtp" else a for a in _build(model, rows, tokenizer=tokenizer)]


impl.serve.build_arms = _planted
'''

NOISY = ONE_THREAD + f'''
from impl import backends

_base = backends.get("head", "fp8-dequant")


def _noisy(x, weight, out_dtype):
    logits = _base.fn(x, weight, out_dtype)
    g = torch.Generator(device=logits.device).manual_seed(int(x.abs().sum().item() * 1e3) % 2**31)
    return logits + {NOISE} * torch.randn(logits.shape, generator=g, device=logits.device, dtype=logits.dtype)


backends.register(backends.Backend("head", "fp8-noisy", _noisy, "planted: the FP8 head plus noise"), replace=True)
'''


def run_ladder(pytester, conftest: str, ladder: str, requests: int, *extra: str):
    """(test id -> outcome, output, the report's JSON) of the ladder suite under `conftest`."""
    pytester.makeconftest(conftest)
    pytester.makepyfile(test_ab_ladder=SUITE.read_text())
    report = pytester.path / "ab"
    result = pytester.runpytest_subprocess(
        "-p", "no:cacheprovider", "--moe-bench", "--moe-model", str(CHECKPOINT), "--moe-baselines",
        str(pytester.mkdir("no-baselines")), "--moe-ladder", ladder, "--moe-requests", str(requests),
        "--moe-ab-report", str(report), "-rA", *extra, "test_ab_ladder.py", timeout=600)
    text = result.stdout.str()
    assert result.ret in (0, 1), text[-4000:] + result.stderr.str()[-4000:]
    outcomes = dict((name, outcome) for outcome, name in
                    re.findall(r"^(PASSED|FAILED|ERROR|SKIPPED) \S*::(test_\w+(?:\[[^\]]*\])?)", text, re.MULTILINE))
    return outcomes, text, json.loads((report / "ab-report.json").read_text())


def test_an_mtp_row_whose_draft_holds_only_the_fp8_weight_fails_its_provenance(pytester):
    outcomes, text, report = run_ladder(pytester, TRAP, "baseline;+mtp", 6, "-k", "provenance")
    assert outcomes.get("test_row_provenance[+mtp]") == "FAILED", text[-3000:]
    assert outcomes.get("test_row_provenance[baseline]") == "PASSED", text[-3000:]
    assert re.search(r"row '\+mtp': .*head", text), text[-3000:]
    flagged = report["summary"]["flagged"]
    assert "+mtp" in flagged and flagged["+mtp"], flagged


def test_a_head_that_perturbs_logits_gives_different_answers(pytester):
    outcomes, text, report = run_ladder(pytester, NOISY, "baseline;noisy=head=fp8:fp8-noisy", 60, "-k", "answers")
    assert outcomes.get("test_row_answers[noisy]") == "FAILED", text[-3000:]
    assert "answers differ from 'baseline'" in text and "exact McNemar" in text
    (comparison,) = report["summary"]["comparisons"]
    assert comparison["accuracy"]["verdict"] == "different", comparison["accuracy"]


def test_the_baseline_against_itself_is_equivalent_and_no_faster(pytester):
    outcomes, text, report = run_ladder(pytester, ONE_THREAD, "a=baseline;b=baseline", 60, "--moe-margin", "5")
    assert "FAILED" not in outcomes.values() and "ERROR" not in outcomes.values(), text[-3000:]
    (comparison,) = report["summary"]["comparisons"]
    assert comparison["accuracy"]["verdict"] == "equivalent", comparison["accuracy"]
    # Each speed ratio's interval contains 1, at 99.75% each: the report's 95% intervals of four
    # figures would miss 1 in about one A/A run in five by chance alone (Bonferroni: a 1% chance
    # that any of the four misses).
    by_arm = {arm: {r["request_id"]: r for r in report["requests"] if r["arm"] == arm} for arm in ("a", "b")}
    for key in ("decode_tokens_per_s", "tpot_s", "ttft_s", "latency_s"):
        ids = [i for i in by_arm["a"] if by_arm["a"][i][key] and by_arm["b"].get(i, {}).get(key)]
        ratio, lo, hi = paired_ratio([by_arm["a"][i][key] for i in ids], [by_arm["b"][i][key] for i in ids], 0.9975)
        assert lo <= 1 <= hi, (key, ratio, lo, hi)
