"""pytest_moeperf.host_load: the PSI and /proc/stat parsers on sample texts, readings that fail
(never an exception: the stall is "unknown"), and the meter's sums over measured intervals."""

from __future__ import annotations

import time

import pytest

from pytest_moeperf import host_load
from pytest_moeperf.host_load import Meter, Window, parse_cpu_times, parse_psi_some_total

# /proc/pressure/cpu as Linux 5.13+ writes it (the `full` line is all zeros at the system level),
# and as 4.20-5.12 wrote it (no `full` line).
PSI_TEXT = ("some avg10=0.36 avg60=0.14 avg300=17.19 total=2583929198\n"
            "full avg10=0.00 avg60=0.00 avg300=0.00 total=0\n")
PSI_TEXT_OLD = "some avg10=1.00 avg60=0.50 avg300=0.10 total=12345\n"


@pytest.mark.parametrize("text, total", [(PSI_TEXT, 2583929198), (PSI_TEXT_OLD, 12345),
                                         ("full avg10=0 total=7\nsome total=42 avg10=0\n", 42)])
def test_psi_parser_reads_the_some_lines_total(text, total):
    assert parse_psi_some_total(text) == total


@pytest.mark.parametrize("text, problem", [
    ("", "no `some` line"),
    ("full avg10=0.00 avg60=0.00 avg300=0.00 total=0\n", "no `some` line"),
    ("some avg10=0.36 avg60=0.14 avg300=17.19\n", "no total= field"),
    ("some avg10=0.36 total=12.5\n", "not a whole number"),
    ("some avg10=0.36 total=-3\n", "not a whole number"),
    ("some avg10=0.36 total=\n", "not a whole number"),
])
def test_psi_parser_rejects_malformed_texts_saying_why(text, problem):
    with pytest.raises(ValueError, match=problem):
        parse_psi_some_total(text)


def test_a_missing_unreadable_or_malformed_psi_file_reads_as_unknown(tmp_path, monkeypatch):
    def reading(path):
        monkeypatch.setattr(host_load, "psi_file", lambda: (path, "psi"))
        return host_load.read_counter()

    assert reading(tmp_path / "absent") == (None, f"unknown: no {tmp_path / 'absent'} (not Linux, or a kernel "
                                                  "without PSI)")
    stall, source = reading(tmp_path)  # a folder: reading fails as psi=0's EOPNOTSUPP does
    assert stall is None and source.startswith(f"unknown: {tmp_path} unreadable")
    bad = tmp_path / "cpu"
    bad.write_text("some avg10=0.00\n")
    stall, source = reading(bad)
    assert stall is None and "malformed" in source and "no total= field" in source
    bad.write_text(PSI_TEXT)
    assert reading(bad) == (2583929198, "psi")


@pytest.mark.parametrize("text, path", [
    ("0::/system.slice/ci-runner.service\n", "/system.slice/ci-runner.service"),  # cgroup v2 alone
    ("12:cpu,cpuacct:/docker/abc\n1:name=systemd:/docker/abc\n0::/docker/abc\n", "/docker/abc"),  # hybrid
    ("0::/\n", "/"),  # the root, or a container's own cgroup namespace
    ("4:memory:/job\n2:cpu:/job\n", None),  # cgroup v1 only
    ("", None),
])
def test_cgroup_path_is_the_v2_line_of_proc_self_cgroup(text, path):
    assert host_load.cgroup_v2_path(text) == path


def _cgroup_host(tmp_path, pressure: str | None) -> tuple:
    """A /proc/self/cgroup naming /ci/job, and the v2 hierarchy mounted at tmp_path/unified with
    that cgroup's cpu.pressure holding `pressure` (None: no file)."""
    proc = tmp_path / "cgroup"
    proc.write_text("3:cpu:/ci/job\n0::/ci/job\n")
    folder = tmp_path / "unified" / "ci" / "job"
    folder.mkdir(parents=True)
    if pressure is not None:
        (folder / "cpu.pressure").write_text(pressure)
    return proc, (tmp_path / "v2-not-mounted-here", tmp_path / "unified")


def test_the_own_cgroups_cpu_pressure_is_found_under_either_mount(tmp_path):
    proc, mounts = _cgroup_host(tmp_path, PSI_TEXT)
    assert host_load.own_cgroup_psi(proc, mounts) == tmp_path / "unified" / "ci" / "job" / "cpu.pressure"


@pytest.mark.parametrize("pressure", [None, "some avg10=0.00\n"])
def test_a_cgroup_without_a_readable_cpu_pressure_falls_back_to_the_system(tmp_path, pressure):
    proc, mounts = _cgroup_host(tmp_path, pressure)
    assert host_load.own_cgroup_psi(proc, mounts) is None
    assert host_load.own_cgroup_psi(tmp_path / "no-proc-file", mounts) is None


def test_the_counter_is_read_from_the_cgroups_file_where_there_is_one(tmp_path, monkeypatch):
    proc, mounts = _cgroup_host(tmp_path, PSI_TEXT)
    monkeypatch.setattr(host_load, "PROC_SELF_CGROUP", proc)
    monkeypatch.setattr(host_load, "CGROUP_V2_MOUNTS", mounts)
    monkeypatch.setattr(host_load, "PSI_CPU", tmp_path / "system-psi-absent")
    host_load.psi_file.cache_clear()
    try:
        assert host_load.read_counter() == (2583929198, "psi:cgroup")
        meter = Meter()
        with meter.measuring():
            time.sleep(0.01)
        assert meter.take().source == "psi:cgroup"
        (tmp_path / "unified" / "ci" / "job" / "cpu.pressure").unlink()  # chosen once: not the system's now
        assert host_load.read_counter()[1].startswith(f"unknown: no {tmp_path / 'unified'}")
        monkeypatch.setattr(host_load, "CGROUP_V2_MOUNTS", ())
        host_load.psi_file.cache_clear()
        assert host_load.psi_file() == (tmp_path / "system-psi-absent", "psi")
    finally:
        host_load.psi_file.cache_clear()


def test_cpu_times_parser_counts_steal_as_busy_and_iowait_as_idle():
    text = "cpu  100 5 20 800 30 1 2 40 0 0\ncpu0 50 2 10 400 15 0 1 20 0 0\nintr 1 2\n"
    assert parse_cpu_times(text) == (100 + 5 + 20 + 1 + 2 + 40, 100 + 5 + 20 + 800 + 30 + 1 + 2 + 40)
    assert parse_cpu_times("cpu 1 2 3 4\n") == (6, 10)  # Linux 2.4's four fields
    for bad in ("", "cpu0 1 2 3 4\n", "cpu 1 2 x 4\n", "cpu 1 2\n"):
        with pytest.raises(ValueError):
            parse_cpu_times(bad)


class FakeCounter:
    """A PSI counter growing at `rate` seconds of stall per second of wall time."""

    def __init__(self, rate: float) -> None:
        self.rate, self.origin = rate, time.monotonic()

    def __call__(self):
        return int((time.monotonic() - self.origin) * self.rate * 1e6), "psi"


class FakeCpus:
    """Two CPUs on which other work keeps `other` CPUs busy and this process `own` CPUs
    (/proc/stat's ticks and this process's CPU seconds growing with wall time)."""

    def __init__(self, other: float, own: float) -> None:
        self.other, self.own, self.origin = other, own, time.monotonic()

    def _elapsed(self) -> float:
        return time.monotonic() - self.origin

    def times(self):
        hz = host_load.CLOCK_TICKS_PER_S
        return int(self._elapsed() * hz * (self.other + self.own)), int(self._elapsed() * hz * 2)

    def own_cpu_s(self) -> float:
        return self._elapsed() * self.own


def fake_cpus(monkeypatch, other: float, own: float) -> None:
    cpus = FakeCpus(other, own)
    monkeypatch.setattr(host_load, "read_cpu_times", cpus.times)
    monkeypatch.setattr(host_load, "read_own_cpu_s", cpus.own_cpu_s)


def test_meter_gives_the_share_of_measured_wall_time_that_stalled(monkeypatch):
    monkeypatch.setattr(host_load, "read_counter", FakeCounter(0.6))
    fake_cpus(monkeypatch, other=1.0, own=1.0)  # another job on one of the two CPUs
    meter = Meter()
    assert meter.take() is None  # nothing measured through it
    for _ in range(2):
        with meter.measuring():
            time.sleep(0.05)
    time.sleep(0.1)  # between measurements: not counted
    load = meter.take()
    assert load.source == "psi" and load.stall == pytest.approx(0.6, abs=0.05)
    assert load.wall_s == pytest.approx(0.1, abs=0.05)
    assert load.other == pytest.approx(0.5, abs=0.05)
    assert load.contended(0.05) and not load.contended(0.7) and not load.contended(None)
    assert meter.take() is None  # take starts over


def test_a_stall_of_the_measured_processs_own_making_is_not_contention(monkeypatch):
    """More threads than cores stall the process by itself: the same 60% stall with the CPUs busy
    only with this process's own threads is the code's doing (judged), not the host's."""
    monkeypatch.setattr(host_load, "read_counter", FakeCounter(0.6))
    fake_cpus(monkeypatch, other=0.0, own=2.0)
    meter = Meter()
    with meter.measuring():
        time.sleep(0.1)
    load = meter.take()
    assert load.stall == pytest.approx(0.6, abs=0.05) and load.other == pytest.approx(0.0, abs=0.02)
    assert not load.contended(0.05)
    assert "other work 0% of the CPUs" in load.describe()
    # Negative control: the same stall beside other work is contention.
    fake_cpus(monkeypatch, other=1.0, own=1.0)
    with meter.measuring():
        time.sleep(0.1)
    assert meter.take().contended(0.05)


def test_meter_reports_unknown_when_a_reading_fails_and_a_disabled_meter_measures_nothing(monkeypatch):
    monkeypatch.setattr(host_load, "read_counter", lambda: (None, "unknown: no PSI here"))
    meter = Meter()
    with meter.measuring():
        pass
    load = meter.take()
    assert (load.stall, load.source) == (None, "unknown: no PSI here")
    assert not load.contended(0.05) and load.describe() == "CPU stall unknown: no PSI here"
    off = Meter(enabled=False)
    with off.measuring():
        pass
    assert off.take() is None


def test_a_counter_that_goes_backwards_is_unknown_not_a_negative_stall(monkeypatch):
    readings = iter([(500, "psi"), (100, "psi")])
    monkeypatch.setattr(host_load, "read_counter", lambda: next(readings))
    meter = Meter()
    with meter.measuring():
        pass
    assert meter.take().stall is None


def test_a_window_is_quiet_only_when_the_cpus_are_free_and_nothing_waits():
    # Two busy loops on two cores, this process asleep: nothing waits, yet there is no room.
    assert not Window(busy=1.0, stall=0.0, wall_s=0.5).quiet(0.05)
    assert not Window(busy=0.01, stall=0.3, wall_s=0.5).quiet(0.05)
    assert Window(busy=0.01, stall=0.0, wall_s=0.5).quiet(0.05)
    assert Window(busy=None, stall=None, wall_s=0.5).quiet(0.05)  # nothing to read: do not wait


def test_wait_for_quiet_stops_at_the_first_quiet_window_or_at_its_budget(monkeypatch):
    windows = iter([Window(1.0, 0.0, 0.1), Window(0.0, 0.0, 0.1)])
    monkeypatch.setattr(host_load, "read_window", lambda seconds: next(windows))
    waited, last = host_load.wait_for_quiet(0.05, budget_s=5)
    assert last.busy == 0.0
    monkeypatch.setattr(host_load, "read_window", lambda seconds: (time.sleep(seconds), Window(1.0, 0.0, seconds))[1])
    start = time.monotonic()
    waited, last = host_load.wait_for_quiet(0.05, budget_s=0.3, window_s=0.1)
    assert 0.3 <= time.monotonic() - start < 1.0 and last.busy == 1.0
    assert host_load.wait_for_quiet(0.05, budget_s=0)[1].wall_s == 0.0  # no budget: no wait


def test_the_sampler_meters_its_timed_rounds_unless_told_a_figure_is_only_reported(monkeypatch):
    """What the gate reads: moe_sampler's measurements go through the test's meter (warm-up not
    counted); a figure sampled with metered=False (reported, never gated) adds nothing, so the
    load the gate reads stays the gated measurement's."""
    import torch

    from pytest_moeperf.timing import Sampler
    monkeypatch.setattr(host_load, "read_counter", FakeCounter(0.6))
    fake_cpus(monkeypatch, other=1.0, own=1.0)
    meter = Meter()
    sampler = Sampler(torch.device("cpu"), rounds=3, warmup=1, warmup_s=0.0, meter=meter)

    def work():
        time.sleep(0.01)
    sampler.sample(work, metered=False)
    assert meter.take() is None
    sampler.sample(work)
    load = meter.take()
    assert load is not None and load.wall_s == pytest.approx(0.03, abs=0.02) and load.contended(0.05)
    sampler.interleaved({"a": work, "b": work})
    assert meter.take().wall_s == pytest.approx(0.06, abs=0.03)
