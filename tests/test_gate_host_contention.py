"""The gate on a contended host, through pytester: a planted slowdown measured while the host's
CPUs were contended is HOST-CONTENDED (the run passes), the same slowdown on a quiet host is a
REGRESSION (the negative control), a host that quiets while the gate waits gets the figure judged,
and a freeze never stores a figure measured on a contended host.

No CPU is burnt: the suite's measurements go through the test's host meter (as moe_sampler's
timed rounds do) and the host's PSI counter and CPU times are simulated: contended until a given
moment and quiet after it (FakeHost), or contended during the measurements the suite's
PLANTED_CONTENTION marks (ScriptedHost).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

from pytest_moeperf import host_load
from tests.pytester_runs import ONE_THREAD_CONFTEST, gate_suite, run_inner, this_device_store

# Synthetic latencies (1% spread) scaled per measurement by the next entry of PLANTED_FACTORS; each
# measurement is metered like moe_sampler's timed rounds, and before it starts sets the switch a
# ScriptedHost reads, SIMULATED_HOST_CONTENDED, to the next entry of PLANTED_CONTENTION ("1": contended).
SUITE = gate_suite("""
def test_latency(moe_gate, moe_host_meter):
    factors = iter(float(f) for f in os.environ.get("PLANTED_FACTORS", "1,1,1,1").split(","))
    contention = iter(os.environ.get("PLANTED_CONTENTION", "").split(","))

    def measure():
        f = next(factors)
        os.environ["SIMULATED_HOST_CONTENDED"] = next(contention, "0")
        with moe_host_meter.measuring():
            time.sleep(0.02)
        return [100 * s * f for s in SPREAD]

    moe_gate.check("latency_us", measure(), unit="us", direction="lower", tolerance=0.10, remeasure=measure)
""", imports=("import time",))

SLOW = "1.3,1.3,1.3,1.3"  # a real regression: every measurement 30% slower


class FakeHost:
    """Contended (90% stall while measured, all CPUs busy with other work) until `quiet_after`
    seconds after its first reading (the inner run's start-up, seconds on a loaded CI host, must
    not use up the contended spell), quiet afterwards; None: contended throughout; 0: quiet throughout."""

    def __init__(self, quiet_after: float | None) -> None:
        self._origin: float | None = None
        self.quiet_after = float("inf") if quiet_after is None else quiet_after

    @property
    def origin(self) -> float:
        if self._origin is None:
            self._origin = time.monotonic()
        return self._origin

    def _contended_s(self) -> float:
        return min(time.monotonic() - self.origin, self.quiet_after)

    def read_counter(self):
        return int(self._contended_s() * 0.9 * 1e6), "psi"

    def read_cpu_times(self):
        ticks = 100 * 2  # two CPUs at 100 Hz
        return int(self._contended_s() * ticks), int((time.monotonic() - self.origin) * ticks)


class ScriptedHost(FakeHost):
    """Contended (as FakeHost is) while SIMULATED_HOST_CONTENDED is "1": the suite sets it per
    measurement from PLANTED_CONTENTION, and it stays so until the next measurement (through the
    gate's wait for a quiet host, for one)."""

    def __init__(self) -> None:
        super().__init__(0)
        self.last, self.contended, self.total = time.monotonic(), 0.0, 0.0

    def _contended_s(self) -> float:
        now = time.monotonic()
        if os.environ.get("SIMULATED_HOST_CONTENDED") == "1":
            self.contended += now - self.last
        self.last = now
        return self.contended


@pytest.fixture
def host(monkeypatch):
    """host(quiet_after): a FakeHost; host("scripted"): a ScriptedHost."""
    monkeypatch.setenv("SIMULATED_HOST_CONTENDED", "0")  # the suite sets it; restored after the test

    def simulate(quiet_after: float | None | str) -> FakeHost:
        fake = ScriptedHost() if quiet_after == "scripted" else FakeHost(quiet_after)
        monkeypatch.setattr(host_load, "read_counter", fake.read_counter)
        monkeypatch.setattr(host_load, "read_cpu_times", fake.read_cpu_times)
        return fake
    return simulate


@pytest.fixture
def frozen_suite(pytester, monkeypatch, host):
    """The suite, frozen at factor 1 on a quiet host."""
    pytester.makepyfile(test_suite=SUITE)
    host(0)
    run(pytester, monkeypatch, "--moe-freeze").assert_outcomes(passed=1)
    return pytester


def run(pytester, monkeypatch, *args, factors: str = "1,1,1,1", contention: str = ""):
    monkeypatch.setenv("PLANTED_FACTORS", factors)
    monkeypatch.setenv("PLANTED_CONTENTION", contention)
    return run_inner(pytester, "--moe-bench", "--moe-report", "report.json", *args, monkeypatch=monkeypatch)


def _metric(pytester) -> dict:
    (metric,) = json.loads((pytester.path / "report.json").read_text())["metrics"]
    return metric


def test_planted_slowdown_on_a_contended_host_is_host_contended_and_passes(frozen_suite, monkeypatch, host):
    host(None)
    result = run(frozen_suite, monkeypatch, "--moe-host-wait", "0.3", factors=SLOW)
    assert result.ret == pytest.ExitCode.OK
    result.assert_outcomes(passed=1, warnings=1)
    result.stdout.fnmatch_lines([
        "*HostContendedWarning: latency_us: NOT JUDGED, HOST CONTENDED*",
        "*latency_us*130 us*100 us*0.769*HOST-CONTENDED**%*",
        "*1 figure(s) compared*1 NOT JUDGED (host contended)*",
        "HOST-CONTENDED: latency_us: NOT JUDGED, HOST CONTENDED: it read as a regression while the host's CPUs "
        "were contended (CPU stall *% of *, other work *% of the CPUs (psi), threshold 5%)*waited 0.3 s for the "
        "host to quiet (last window: CPUs *% busy with other work*"])
    metric = _metric(frozen_suite)
    assert metric["verdict"] == "host-contended"
    assert 0.8 < metric["host_load"]["stall"] <= 1.0 and metric["host_load"]["source"] == "psi"
    # the first measurement, its confirmation, and the one after the wait
    assert len(metric["host_loads"]) == 3 and all(load["stall"] > 0.8 for load in metric["host_loads"])


def test_planted_slowdown_on_a_quiet_host_still_fails_as_a_regression(frozen_suite, monkeypatch, host):
    """The negative control: same slowdown, same code path, a quiet host."""
    host(0)
    result = run(frozen_suite, monkeypatch, factors=SLOW)
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*latency_us: 130 us vs frozen 100 us*-> regression (re-measured after: *",
                                 "*latency_us*REGRESSION*0.0%*"])
    result.stdout.no_fnmatch_line("*HOST-CONTENDED*")
    assert _metric(frozen_suite)["verdict"] == "regression"


def test_a_stall_the_measured_code_makes_itself_is_judged_as_a_regression(frozen_suite, monkeypatch, host):
    """A stall with no other work on the CPUs (the code ran more threads than cores) is the code's:
    the slowdown fails as a REGRESSION, without waiting for the host."""
    host(None)  # PSI reads a 90% stall throughout
    monkeypatch.setattr(host_load, "read_cpu_times", lambda: (0, int(time.monotonic() * 200)))  # no other work
    result = run(frozen_suite, monkeypatch, "--moe-host-wait", "5", factors=SLOW)
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    result.assert_outcomes(failed=1)
    result.stdout.no_fnmatch_line("*HOST-CONTENDED*")
    result.stdout.no_fnmatch_line("*waited * s for the host to quiet*")
    metric = _metric(frozen_suite)
    assert metric["verdict"] == "regression" and metric["host_load"]["stall"] > 0.8
    assert metric["host_load"]["other_work"] == 0.0


@pytest.mark.parametrize("simulated, wait, contention, contended", [
    (0.5, "5", "", [True, True, False]),  # contended through the first two measurements, quiet within the wait
    ("scripted", "0.3", "0,1,0", [False, True, False]),  # a quiet first reading, a contended confirmation
])
def test_a_regression_is_judged_on_the_measurement_after_the_host_quiets(frozen_suite, monkeypatch, host, simulated,
                                                                        wait, contention, contended):
    """When the confirmation ran contended, the gate waits and measures again; on a quiet host
    that third measurement decides."""
    host(simulated)
    result = run(frozen_suite, monkeypatch, "--moe-host-wait", wait, factors=SLOW, contention=contention)
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*latency_us: 130 us vs frozen 100 us*-> regression (waited * s for the host to "
                                 "quiet (last window: *re-measured at CPU stall 0%*"])
    metric = _metric(frozen_suite)
    assert metric["verdict"] == "regression" and metric["host_load"]["stall"] < 0.05
    assert [load["stall"] > 0.8 for load in metric["host_loads"]] == contended


def test_a_slowdown_that_goes_with_the_contention_passes_once_the_host_quiets(frozen_suite, monkeypatch, host):
    host(0.5)
    result = run(frozen_suite, monkeypatch, "--moe-host-wait", "5", factors="1.3,1.3,1.0")
    result.assert_outcomes(passed=1)
    assert _metric(frozen_suite)["verdict"] == "pass"


def test_a_transient_on_a_contended_host_still_clears_on_its_confirmation(frozen_suite, monkeypatch, host):
    """A contended measurement that passes is a pass; only a regression needs a quiet host."""
    host(None)
    result = run(frozen_suite, monkeypatch, "--moe-host-wait", "0.3", factors="1.3,1.0")
    result.assert_outcomes(passed=1)
    assert _metric(frozen_suite)["verdict"] == "pass"


def test_a_regression_measured_quiet_but_confirmed_only_on_a_contended_host_is_not_judged(
        frozen_suite, monkeypatch, host):
    """The confirmation decides a regression; when it ran on a contended host, a quiet first
    reading alone does not fail the run, and the gate waits and measures a third time."""
    host("scripted")
    result = run(frozen_suite, monkeypatch, "--moe-host-wait", "0.3", factors=SLOW, contention="0,1,1")
    assert result.ret == pytest.ExitCode.OK
    result.assert_outcomes(passed=1, warnings=1)
    result.stdout.fnmatch_lines(["*latency_us: NOT JUDGED, HOST CONTENDED*(re-measured after: latency_us: 130 us*"])
    metric = _metric(frozen_suite)
    assert metric["verdict"] == "host-contended"
    assert [load["stall"] > 0.8 for load in metric["host_loads"]] == [False, True, True]


def test_a_quiet_reading_cleared_by_a_contended_confirmation_passes(frozen_suite, monkeypatch, host):
    """A slow quiet reading that the confirmation does not repeat was a transient: contention only
    slows a timing, so a contended confirmation within tolerance clears it."""
    host("scripted")
    result = run(frozen_suite, monkeypatch, "--moe-host-wait", "0.3", factors="1.3,1.0", contention="0,1")
    result.assert_outcomes(passed=1)
    metric = _metric(frozen_suite)
    assert metric["verdict"] == "pass"
    assert [load["stall"] > 0.8 for load in metric["host_loads"]] == [False, True]


def test_strict_fails_the_run_when_a_figure_was_not_judged_for_the_host(frozen_suite, monkeypatch, host):
    host(None)
    result = run(frozen_suite, monkeypatch, "--moe-strict", "--moe-host-wait", "0", factors=SLOW)
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    result.assert_outcomes(passed=1, warnings=1)  # the test is not failed: the code was not judged
    result.stdout.fnmatch_lines(["*--moe-strict fails this run: 1 figure(s) not judged: the host's CPUs were "
                                 "contended*"])


def test_unknown_stall_and_the_check_turned_off_judge_as_before(frozen_suite, monkeypatch, host):
    monkeypatch.setattr(host_load, "read_counter", lambda: (None, "unknown: no /proc/pressure/cpu"))
    result = run(frozen_suite, monkeypatch, factors=SLOW)
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*latency_us*REGRESSION*?*"])
    assert _metric(frozen_suite)["host_load"]["source"] == "unknown: no /proc/pressure/cpu"
    host(None)
    off = run(frozen_suite, monkeypatch, "--moe-host-stall", "off", factors=SLOW)
    off.assert_outcomes(failed=1)
    off.stdout.fnmatch_lines(["*latency_us*REGRESSION**%*"])


def test_a_freeze_on_a_contended_host_stores_nothing_and_fails_saying_so(frozen_suite, monkeypatch, host):
    before = this_device_store(frozen_suite).metrics["test_suite.py::test_latency::latency_us"]
    host(None)
    result = run(frozen_suite, monkeypatch, "--moe-freeze", "--moe-host-wait", "0.3", factors="2,2,2,2")
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    result.stdout.fnmatch_lines([
        "*latency_us*200 us*HOST-CONTENDED**%*",
        "HOST-CONTENDED: latency_us: NOT FROZEN: the host's CPUs were contended while it was measured*the figure "
        "frozen before, if any, is kept: freeze again on a quiet host",
        "the freeze is incomplete: 1 figure(s) measured on a contended host were not frozen; this run fails"])
    after = this_device_store(frozen_suite).metrics["test_suite.py::test_latency::latency_us"]
    assert after.value == before.value == pytest.approx(100, rel=0.01)
    # The report a nightly job publishes says why the run failed, as the terminal does.
    failures = json.loads((frozen_suite.path / "report.json").read_text())["run_failures"]
    assert failures == ["1 figure(s) not frozen: the host's CPUs were contended"]


def test_a_freeze_whose_host_quiets_while_it_waits_freezes_the_quiet_measurement(frozen_suite, monkeypatch, host):
    host(0.3)
    result = run(frozen_suite, monkeypatch, "--moe-freeze", "--moe-host-wait", "5", factors="2,1.1")
    assert result.ret == pytest.ExitCode.OK
    result.stdout.fnmatch_lines(["*latency_us*110 us*FROZEN*0.0%*"])
    assert this_device_store(frozen_suite).metrics["test_suite.py::test_latency::latency_us"].value == \
        pytest.approx(110, rel=0.01)


@pytest.mark.parametrize("args, message", [
    (["--moe-host-stall", "1.5"], "--moe-host-stall must be a fraction of wall time in (0, 1) or off, got '1.5'"),
    (["--moe-host-stall", "0"], "--moe-host-stall must be a fraction of wall time in (0, 1) or off, got '0'"),
    (["--moe-host-stall", "5%"], "--moe-host-stall must be a fraction of wall time in (0, 1) or off, got '5%'"),
    (["--moe-host-wait", "-1"], "--moe-host-wait must be seconds in [0, 600], got '-1'"),
    (["--moe-host-wait", "soon"], "--moe-host-wait must be seconds in [0, 600], got 'soon'"),
])
def test_bad_host_options_are_usage_errors(pytester, monkeypatch, args, message):
    pytester.makepyfile(test_suite=SUITE)
    result = run(pytester, monkeypatch, *args)
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    assert message in result.stderr.str()


def test_host_options_fall_back_to_ini_keys(pytester, monkeypatch):
    pytester.makepyfile(test_suite=SUITE)
    pytester.makeini("[pytest]\nmoe_host_wait = forever\n")
    result = run(pytester, monkeypatch)
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    assert "--moe-host-wait must be seconds in [0, 600], got 'forever'" in result.stderr.str()


def test_gate_trust_runs_count_host_contended_evaluations_apart_from_regressions(frozen_suite, monkeypatch, host):
    host(None)
    result = run(frozen_suite, monkeypatch, "--moe-trust", "2", "--moe-host-wait", "0", factors="1.3," * 7 + "1.3")
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines(["*evaluations*regression*refreeze*host-contended*",
                                 "*latency_us*2*0*0*2*0.769*"])
    assert [e["verdict"] for e in _metric(frozen_suite)["evaluations"]] == ["host-contended"] * 2


@pytest.mark.parametrize("contended", [True, False], ids=["contended", "quiet (negative control)"])
def test_the_ladders_speed_figures_are_not_frozen_on_a_contended_host(pytester, monkeypatch, host, contended):
    """The ladder serves its rows in one run shared by its tests, outside any test's meter: the
    run is metered itself and its speed figures judged by that reading."""
    suite = Path(__file__).resolve().parents[1] / "suites" / "test_ab_ladder.py"
    # Another module name than the suite's: an in-process run beside the suites (CI) has that one imported.
    pytester.makepyfile(test_ladder_on_a_busy_host=suite.read_text())
    # One thread: the simulated host's CPUs are all busy, half of them (not the run's own) with other work.
    pytester.makeconftest(ONE_THREAD_CONFTEST)
    host(None if contended else 0)
    result = run_inner(pytester, "--moe-bench", "--moe-freeze", "--moe-model", "tiny", "--moe-workload",
                       "synthetic:8:4", "--moe-requests", "3", "--moe-ladder", "baseline;+fp8-head",
                       "--moe-ab-report", str(pytester.path / "ab"), "-k", "speed", monkeypatch=monkeypatch)
    if contended:
        assert result.ret == pytest.ExitCode.TESTS_FAILED
        result.stdout.fnmatch_lines(["HOST-CONTENDED: ab_tokens_per_s: NOT FROZEN: the host's CPUs were contended*"])
        assert not (pytester.path / "baselines").is_dir() or not this_device_store(pytester).metrics
    else:
        assert result.ret == 0, result.stdout.str()[-2000:]
        assert len(this_device_store(pytester).metrics) == 3
