"""Figures a device's gate shows but never judges (`Reported` in place of a tolerance), and the
CPU's MoE/dense ratio as one: measured on a second machine of the committed fingerprint it moved
9% (5.61x and 5.584x against a frozen 5.136x) and failed a newcomer's first main job; now it is
reported there, with its reason, and the MoE layer is gated on a CPU by moe_over_plain_torch."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from pytest_moeperf import device
from pytest_moeperf.baselines import BaselineStore
from tests.pytester_runs import LATENCY_TEST, frozen, gate_suite, run_inner, this_device_store

ROOT = Path(__file__).resolve().parents[1]
CPU_BASELINES = ROOT / "baselines" / "cpu-amd-epyc-2c.json"

SUITE = gate_suite("""
def test_moe_over_dense(moe_gate):
    level = float(os.environ.get("MOE_OVER_DENSE", "5.136"))
    moe_gate.check_ratio("moe_over_dense_equivalent", lambda: ([level * s for s in SPREAD], [1.0] * len(SPREAD)),
                         direction="lower", tolerance=tolerance_for("moe_over_dense", "cpu"))
""", LATENCY_TEST, imports=("from moe_harness.tolerances import tolerance_for",))
REPORTED = "test_suite.py::test_moe_over_dense::moe_over_dense_equivalent"


@pytest.fixture
def suite(pytester, monkeypatch):
    """The suite above in pytester's folder; `suite.run_suite(*args)` runs it in process."""
    pytester.makepyfile(test_suite=SUITE)
    pytester.run_suite = lambda *args: run_inner(pytester, *args, monkeypatch=monkeypatch)
    return pytester


def test_a_reported_figure_is_shown_with_its_reason_and_is_never_judged(suite, monkeypatch):
    store = this_device_store(suite)
    # Even a frozen figure it would fail against is not looked up.
    store.freeze({REPORTED: frozen(2.0, unit="x", config={"model": "tiny-gsm", "dtype": "float32",
                                                           "moe_backend": "gather"})})
    monkeypatch.setenv("MOE_OVER_DENSE", "9.0")
    result = suite.run_suite("--moe-bench", "--moe-baselines", str(store.folder))
    result.assert_outcomes(passed=1, skipped=1)
    result.stdout.fnmatch_lines([f"*{REPORTED}*9 x*-*-*-*-*REPORTED*",
                                 "REPORTED, not gated: moe_over_dense_equivalent: not gated on a CPU: *moe_over_plain_torch*",
                                 "*0 figure(s) compared*1 without a baseline, 1 reported, not gated (see below)*"])


def test_a_freeze_writes_no_reported_figure_and_strict_does_not_count_it_as_compared(suite):
    store = this_device_store(suite)
    suite.run_suite("--moe-bench", "--moe-freeze").assert_outcomes(passed=2)
    assert set(store.__class__(store.folder, store.fingerprint, store.path.stem).metrics) == {
        "test_suite.py::test_latency::latency_us"}
    suite.run_suite("--moe-bench", "--moe-strict").assert_outcomes(passed=2)  # latency compared; MoE/dense shown
    alone = suite.run_suite("--moe-bench", "--moe-strict", "-k", "moe_over_dense")
    assert alone.ret == 1  # nothing was compared: a reported figure is not a comparison
    alone.stdout.fnmatch_lines(["*--moe-strict fails this run: *no figure was compared with a frozen one*"])


def test_the_committed_cpu_entries_have_no_moe_over_dense_figure_and_another_machine_of_their_fingerprint_passes(
        suite, monkeypatch):
    """The measurements of a second machine of the committed AVX512 fingerprint (5.61x and 5.584x),
    replayed as samples on that fingerprint with the committed baselines: shown, not failed."""
    entries = json.loads(CPU_BASELINES.read_text())["entries"]
    assert entries and not [mid for e in entries for mid in e["metrics"] if mid.endswith("::moe_over_dense_equivalent")]
    fingerprint = next(e["fingerprint"] for e in entries if e["fingerprint"].get("isa") == "AVX512")
    monkeypatch.setattr(device, "cpu_fingerprint", lambda: dict(fingerprint))
    folder = suite.path / "committed"
    shutil.copytree(ROOT / "baselines", folder)
    for level in ("5.61", "5.584"):
        monkeypatch.setenv("MOE_OVER_DENSE", level)
        result = suite.run_suite("--moe-bench", "--moe-baselines", str(folder), "-k", "moe_over_dense")
        result.assert_outcomes(passed=1)
        result.stdout.fnmatch_lines([f"*{REPORTED}*{level} x*REPORTED*"])
    assert BaselineStore(folder, fingerprint, CPU_BASELINES.stem).metrics  # the fingerprint was the committed one
