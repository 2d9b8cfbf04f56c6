"""Which frozen figure gates a measurement (exact fingerprint, class, schema 1), strict mode, and
gate-trust runs, through pytester and on the fingerprint functions themselves."""

from __future__ import annotations

import json

import pytest

from pytest_moeperf import device
from pytest_moeperf.baselines import BaselineStore
from pytest_moeperf.device import DeviceInfo, class_of, cpu_fingerprint, schema1_match
from pytester_runs import PLANTED_SUITE, REMEASURE_SUITE, frozen, quiet_host, run_inner, this_device_store

SUITE = """
import os
import pytest

pytestmark = pytest.mark.moe_bench
SPREAD = [1.0, 1.004, 0.996, 1.01, 0.99, 1.002, 0.998, 1.006, 0.994, 1.0]

def test_latency(moe_gate):
    factor = float(os.environ.get("PLANTED_FACTOR", "1"))
    moe_gate.check("latency_us", [100 * s * factor for s in SPREAD], unit="us", direction="lower", tolerance=0.10)

def test_ratio(moe_gate):
    factor = float(os.environ.get("PLANTED_FACTOR", "1"))
    moe_gate.check_ratio("new_over_old", lambda: ([2 * s * factor for s in SPREAD], SPREAD), direction="lower",
                         tolerance=0.10)
"""
LATENCY, RATIO = "test_suite.py::test_latency::latency_us", "test_suite.py::test_ratio::new_over_old"
RUN_CONFIG = {"model": "tiny-gsm", "dtype": "float32", "moe_backend": "gather"}

# /proc/cpuinfo of the two 2-core "AMD EPYC" VMs whose decode speed differs 3.5x.
MILAN = {"vendor_id": "AuthenticAMD", "model name": "AMD EPYC", "cpu family": "25", "model": "1", "stepping": "1"}
GENOA = {**MILAN, "model": "17"}


@pytest.fixture
def suite(pytester):
    pytester.makepyfile(test_suite=SUITE)
    return pytester


@pytest.fixture
def run(suite, monkeypatch):
    return lambda *args, factor=1.0: run_inner(suite, *args, factor=factor, monkeypatch=monkeypatch)


def _fingerprint_with(monkeypatch, cpuinfo: dict, isa: str) -> dict:
    import torch
    monkeypatch.setattr(device, "_cpuinfo", lambda: cpuinfo)
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: isa)
    return cpu_fingerprint()


def test_two_epyc_vms_of_one_name_get_different_fingerprints_and_classes(monkeypatch):
    milan, genoa = _fingerprint_with(monkeypatch, MILAN, "AVX2"), _fingerprint_with(monkeypatch, GENOA, "AVX512")
    assert (milan["name"], milan["cores"]) == (genoa["name"], genoa["cores"])  # all that schema 1 compared
    assert milan != genoa and (milan["model"], milan["isa"]) == (1, "AVX2") and genoa["model"] == 17
    assert class_of(milan) != class_of(genoa)
    assert class_of({**genoa, "stepping": 2, "l3_kib": 1}) == class_of(genoa)  # same class, another machine


def test_an_intel_and_an_amd_cpu_of_one_isa_and_core_count_are_not_one_class(monkeypatch):
    """Side-by-side ratios of configurations running different kernels differ between them (the
    ladder's +mtp over baseline 1.148-1.205x on an AVX512 Xeon, 1.302x on an AVX512 EPYC)."""
    xeon = {"vendor_id": "GenuineIntel", "model name": "Intel(R) Xeon(R) Processor", "cpu family": "6",
            "model": "167", "stepping": "1"}
    genoa, intel = _fingerprint_with(monkeypatch, GENOA, "AVX512"), _fingerprint_with(monkeypatch, xeon, "AVX512")
    assert (genoa["isa"], genoa["cores"]) == (intel["isa"], intel["cores"])
    assert class_of(genoa) != class_of(intel)


def test_a_schema1_fingerprint_matches_only_on_cuda_and_only_field_by_field():
    gpu = {"schema": 2, "kind": "cuda", "name": "NVIDIA H200", "capability": "9.0", "sms": 132, "memory_gib": 140,
           "cuda": "13.0", "driver": "580.159.04", "torch": "2.11.0+cu130", "triton": "3.6.0"}
    old = {k: gpu[k] for k in device.SCHEMA1_FIELDS["cuda"]}
    assert schema1_match(old, gpu)
    assert not schema1_match({**old, "driver": "570.0"}, gpu)
    assert not schema1_match({**old, "extra": 1}, gpu)
    cpu = DeviceInfo("cpu").fingerprint
    assert not schema1_match({k: cpu[k] for k in device.SCHEMA1_FIELDS["cpu"]}, cpu)
    assert class_of({k: cpu[k] for k in device.SCHEMA1_FIELDS["cpu"]}) is None  # no ISA level: no class


def _freeze_elsewhere(pytester, **changes) -> dict:
    store = this_device_store(pytester)
    other = {**store.fingerprint, **changes}
    BaselineStore(store.folder, other, store.path.stem).freeze({
        LATENCY: frozen(100.0, config=RUN_CONFIG), RATIO: frozen(2.0, unit="x", config=RUN_CONFIG)})
    return other


def test_a_ratio_frozen_on_another_machine_of_the_class_gates_under_the_class_key(run, suite):
    _freeze_elsewhere(suite, stepping=99, l3_kib=1)
    result = run("--moe-bench")
    result.assert_outcomes(passed=1, skipped=1)
    result.stdout.fnmatch_lines([f"*{RATIO}*2 x*2 x*1.000*class*PASS*",
                                 "*1 figure(s) compared (0 against this device's fingerprint, 1 against its class), "
                                 "1 without a baseline*",
                                 "*latency_us: frozen only on 1 other machine(s) of this device's class*exact "
                                 "fingerprint*--moe-freeze*"])
    slower = run("--moe-bench", factor=1.3)  # the class baseline gates: a 30% worse ratio fails
    slower.assert_outcomes(failed=1, skipped=1)


def test_the_exact_entry_wins_over_the_class(run, suite):
    _freeze_elsewhere(suite, stepping=99)
    run("--moe-bench", "--moe-freeze").assert_outcomes(passed=2)
    result = run("--moe-bench")
    result.assert_outcomes(passed=2)
    result.stdout.fnmatch_lines([f"*{RATIO}*exact*PASS*"])


def test_a_ratio_from_another_class_is_never_used(run, suite):
    _freeze_elsewhere(suite, isa="NO-SUCH-ISA")
    result = run("--moe-bench", factor=1.5)
    result.assert_outcomes(skipped=2)
    result.stdout.fnmatch_lines(["*new_over_old: no frozen figure for this device*1 figure(s) frozen on other devices*"])


def test_figures_under_a_schema1_cpu_fingerprint_are_never_used_and_say_why(run, suite):
    store = this_device_store(suite)
    old = {k: store.fingerprint[k] for k in device.SCHEMA1_FIELDS["cpu"]}  # what this machine had in schema 1
    BaselineStore(store.folder, old, store.path.stem).freeze({RATIO: frozen(2.0, unit="x", config=RUN_CONFIG)})
    result = run("--moe-bench", "-k", "ratio", factor=1.5)
    result.assert_outcomes(skipped=1)
    result.stdout.fnmatch_lines(["*frozen only under a schema-1 CPU fingerprint*cannot tell machines apart*"])


@pytest.mark.parametrize("how", [["--moe-strict"], ["-o", "moe_strict=true"]])
def test_strict_fails_a_run_that_compared_nothing(run, how):
    relaxed = run("--moe-bench")
    relaxed.assert_outcomes(skipped=2)
    assert relaxed.ret == pytest.ExitCode.OK
    relaxed.stdout.fnmatch_lines(["*0 figure(s) compared*2 without a baseline*"])
    strict = run("--moe-bench", *how)
    strict.assert_outcomes(failed=2)
    strict.stdout.fnmatch_lines(["*--moe-strict: latency_us: no frozen figure*",
                                 "*--moe-strict fails this run: no figure was compared with a frozen one*"])


def test_strict_fails_a_run_that_left_a_frozen_figure_unmeasured(run):
    run("--moe-bench", "--moe-freeze").assert_outcomes(passed=2)
    relaxed = run("--moe-bench", "-k", "latency")  # as if test_ratio had been renamed or deleted
    assert relaxed.ret == pytest.ExitCode.OK
    relaxed.stdout.fnmatch_lines([f"*1 figure(s) frozen for this device and configuration were not measured: {RATIO}*"])
    strict = run("--moe-bench", "--moe-strict", "-k", "latency")
    strict.assert_outcomes(passed=1)
    assert strict.ret == pytest.ExitCode.TESTS_FAILED
    strict.stdout.fnmatch_lines(["*--moe-strict fails this run: 1 frozen figure(s) not measured*"])




def test_a_trust_run_gates_each_figure_n_times_and_fails_nothing(pytester, monkeypatch):
    pytester.makepyfile(test_suite=REMEASURE_SUITE)
    run_inner(pytester, "--moe-bench", "--moe-freeze", "-k", "latency",
              monkeypatch=monkeypatch).assert_outcomes(passed=1)
    # Evaluation 1 passes; 2 regresses and its confirmation (1.25) agrees; 3 is 30% better.
    monkeypatch.setenv("PLANTED_FACTORS", "1,1.3,1.25,0.7")
    result = run_inner(pytester, "--moe-bench", "--moe-trust", "3", "--moe-report", "r.json", "-k", "latency",
                       monkeypatch=monkeypatch)
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines(["*gate-trust evaluations*", "*latency_us*3*1*1*"])
    (m,) = json.loads((pytester.path / "r.json").read_text())["metrics"]
    assert [e["verdict"] for e in m["evaluations"]] == ["pass", "regression", "refreeze"]
    assert [e["remeasured"] for e in m["evaluations"]] == [False, True, False]


@pytest.mark.parametrize("args, message", [
    (["--moe-trust", "3"], "--moe-trust needs --moe-bench"),
    (["--moe-bench", "--moe-trust", "0"], "--moe-trust must be a whole number >= 1, got '0'"),
    (["--moe-bench", "--moe-freeze", "--moe-plant", "moe=0.1"], "--moe-plant and --moe-freeze exclude each other"),
    (["--moe-bench", "--moe-plant", "moe"], "--moe-plant: 'moe' is not KIND*NAME*=FRACTION"),
    (["--moe-bench", "--moe-plant", "moe:nope=0.1"], "--moe-plant: unknown moe backend 'nope'; available:"),
    (["--moe-bench", "--moe-plant", "gpu=0.1"], "--moe-plant: unknown backend kind 'gpu'"),
    (["--moe-bench", "--moe-plant", "decoder=0.1"], "--moe-plant: 'decoder=0.1' needs a backend name"),
    (["--moe-bench", "--moe-plant", "moe=11"], "the slowdown fraction in 'moe=11' must be in (0, 10]"),
])
def test_bad_trust_and_plant_options_are_usage_errors(run, args, message):
    result = run(*args)
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines([f"*{message}*"])


def test_a_slowdown_planted_in_a_backend_is_caught_and_named_in_the_header(pytester, monkeypatch):
    pytester.makepyfile(test_planted=PLANTED_SUITE)
    quiet_host(monkeypatch)  # what the plant does, not whether the host was contended
    samples = ("--moe-samples", "15")
    run_inner(pytester, "--moe-bench", "--moe-freeze", *samples, monkeypatch=monkeypatch).assert_outcomes(passed=1)
    run_inner(pytester, "--moe-bench", *samples, monkeypatch=monkeypatch).assert_outcomes(passed=1)
    # A 5x plant: on a loaded 2-core CI machine single rounds of this ~1 ms ratio were seen 2x off
    # (a 2x plant once passed with its interval reaching 1.08). Beside two busy loops even 5x read
    # as a pass once in five runs. The host can spoil the freeze as well as the planted run (in
    # CI a freeze read 5.6x where the unplanted gate run read 1.1x, and three planted runs at
    # 5.8-7.5x then passed against it), so each retry freezes afresh: at most three attempts.
    for attempt in range(3):
        if attempt:
            run_inner(pytester, "--moe-bench", "--moe-freeze", *samples, monkeypatch=monkeypatch)
        planted = run_inner(pytester, "--moe-bench", *samples, "--moe-plant", "head:bf16=4.0", monkeypatch=monkeypatch)
        if planted.parseoutcomes().get("failed") == 1:
            break
    planted.assert_outcomes(failed=1)
    planted.stdout.fnmatch_lines(["*GATE-TRUST RUN*planted slowdown: head:bf16+400%*",
                                  "*head_over_linear*-> regression*"])
