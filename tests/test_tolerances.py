"""moe_harness.tolerances: one rule for the shipped suites' tolerances, and the committed
baselines froze exactly what it gives (the gate compares against the frozen tolerance, so a number
changed in the rule without a refreeze would not gate)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from pytest_moeperf.gate import Reported
from moe_harness.tolerances import FIGURES, GPU_TIMING, tolerance_for

BASELINES = Path(__file__).resolve().parents[1] / "baselines"
# The figure kind of each gated metric of the shipped suites, by the start of its metric name.
FIGURE_OF = {"decode_tokens_per_s": "timing", "moe_layer_us": "timing", "fp8_head_us": "timing",
             "moe_over_dense_equivalent": "moe_over_dense", "moe_over_plain_torch": "moe_over_plain_torch",
             "mtp_speedup": "mtp_over_plain",
             "fp8_over_bf16_head": "ratio", "moe_layer_over_humming": "ratio",
             "mtp_accept_length": "accept_length", "mtp_acceptance": "accept_length",
             "mtp_greedy_agreement": "agreement", "ab_tokens_per_s": "ab_speed", "ab_tpot": "ab_speed",
             "ab_ttft": "ab_speed", "ab_answers_alike": "ab_accuracy", "ab_reference_accuracy": "ab_accuracy",
             "ab_accept_length": "accept_length", "ab_verify_cost": "ab_speed",
             "roofline_step_over_floor": "ab_speed", "row_tpot_over_floor": "ab_speed"}


def _figure(metric_id: str) -> str:
    metric = metric_id.rsplit("::", 1)[1]
    matches = [figure for start, figure in FIGURE_OF.items() if metric.startswith(start)]
    assert len(matches) == 1, f"{metric_id}: add its metric name to FIGURE_OF"
    return matches[0]


def test_every_timing_on_a_gpu_has_one_tolerance():
    timings = ("timing", "ratio", "moe_over_dense", "mtp_over_plain", "ab_speed")
    assert {tolerance_for(f, torch.device("cuda", 0)) for f in timings} == {GPU_TIMING}


def test_a_device_is_given_as_a_torch_device_or_its_type():
    assert tolerance_for("timing", torch.device("cpu")) == tolerance_for("timing", "cpu")


def test_an_unknown_figure_is_refused_naming_the_known_ones():
    with pytest.raises(ValueError, match="one of timing, ratio"):
        tolerance_for("latency", "cpu")


def test_a_figure_never_measured_on_the_device_is_refused():
    with pytest.raises(ValueError, match="'ratio' measured on 'cpu': it was measured only on cuda"):
        tolerance_for("ratio", "cpu")


def test_a_figure_that_a_cpu_cannot_trust_is_reported_there_and_another_gates_the_moe_layer():
    assert isinstance(tolerance_for("moe_over_dense", "cpu"), Reported)
    assert "moe_over_plain_torch" in tolerance_for("moe_over_dense", "cpu").reason
    assert isinstance(tolerance_for("moe_over_plain_torch", "cpu"), float)
    assert tolerance_for("moe_over_dense", "cuda") == GPU_TIMING


def test_a_reported_figure_needs_a_reason():
    with pytest.raises(ValueError, match="needs a reason"):
        Reported(" ")


@pytest.mark.parametrize("path", sorted(BASELINES.glob("*.json")), ids=lambda p: p.name)
def test_the_committed_baselines_froze_the_rules_tolerances(path):
    entries = json.loads(path.read_text())["entries"]
    frozen = [(mid, m["tolerance"], e["fingerprint"]["kind"]) for e in entries for mid, m in e["metrics"].items()]
    assert frozen
    assert set(FIGURE_OF.values()) <= set(FIGURES)
    wrong = [(mid, tol, tolerance_for(_figure(mid), kind)) for mid, tol, kind in frozen
             if tol != tolerance_for(_figure(mid), kind)]
    assert not wrong, (f"frozen tolerance differs from moe_harness.tolerances (refreeze?; a figure now "
                       f"Reported on that device is never read there: delete it): {wrong}")
