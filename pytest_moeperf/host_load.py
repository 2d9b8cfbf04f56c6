"""How contended the host's CPUs were while something was measured.

The signal is the kernel's pressure stall information (PSI, Linux 4.20+): the `some` line of a
`cpu.pressure` file has `total=`, the cumulative microseconds during which at least one runnable
task waited for a CPU. The file read is this process's own cgroup's (cgroup v2, found through
/proc/self/cgroup), which counts only its cgroup's tasks, including their waits while a CPU
quota (`cpu.max`) throttles them (Linux 5.7+); in a container, /proc/pressure/cpu would count
every container's waiting and never a quota's. Where the process has no cgroup-v2 PSI file that
reads, it is /proc/pressure/cpu, the whole system's. Its growth over an interval divided by the
interval's wall time is the *stall fraction*: 0 on a host with a CPU free for every runnable
task, towards 1 when something waits all the time. It counts waiting, not CPU use: another job
taking turns on the cores reads a lot, and so does the measured process itself when it runs more
threads than there are cores (torch at 4 threads on 2 cores read 47%, a spinning helper thread
beside 2 torch threads 21%: a regression of the code, which must not pass as the host's). So a
measurement counts as contended only when *other work* also took more than the threshold of all
CPUs' time: /proc/stat's busy ticks over the interval less this process's own CPU time
(`os.times`), over all ticks.

Where PSI is missing (not Linux, a kernel built without it or booted with psi=0, a reading that
fails) the stall is unknown, never guessed, and the gate judges as it would without this module:
the 1-minute load average (`os.getloadavg`) is kept beside it for a reader of the report, but it
lags by a minute and counts the measured process's own threads; CPU time alone says how busy the
cores were, not whether anything waited.
"""

from __future__ import annotations

import functools
import os
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

PSI_CPU = Path("/proc/pressure/cpu")
SOURCE_PSI = "psi"
SOURCE_CGROUP_PSI = "psi:cgroup"
PROC_SELF_CGROUP = Path("/proc/self/cgroup")
# Where a cgroup-v2 hierarchy is mounted: alone, or (hybrid hosts) beside the v1 controllers.
CGROUP_V2_MOUNTS = (Path("/sys/fs/cgroup"), Path("/sys/fs/cgroup/unified"))

# The stall fraction above which a measurement is taken as contended (--moe-host-stall).
# Measured on a 2-core Xeon VM (2026-12-04), per measurement of suites/test_decode_bench.py
# (notes/gate-trust.md): alone, 0.0000-0.0122 in 36 measurements (decode step and MoE layer at 2
# threads 0.0003-0.0122, the MoE/dense ratio at 1 thread 0.0000-0.0004): the measured process's
# own threads cause almost none. Beside two busy loops or a `pytest -n 2` of the tests: 0.94-0.996
# at 2 threads, 0.50-0.57 at 1 thread (one core left to share); beside one busy loop 0.50-0.55 at
# 2 threads, 0.0001-0.14 at 1 thread (a core free). 0.05 is four times the largest quiet reading
# and a tenth of the sustained contention; at 5% of the wall time waiting, a single-threaded
# measurement is slowed by about 5% at most, less than the smallest CPU tolerance (6%).
DEFAULT_STALL_THRESHOLD = 0.05
# How long the gate waits for a contended host to quiet before measuring once more (--moe-host-wait).
DEFAULT_WAIT_S = 5.0


def parse_psi_some_total(text: str) -> int:
    """The `some` line's `total=` (microseconds) of a /proc/pressure/cpu text; ValueError when
    the text has no such line or the field is not a whole number."""
    for line in text.splitlines():
        kind, _, fields = line.strip().partition(" ")
        if kind != "some":
            continue
        for field in fields.split():
            key, _, value = field.partition("=")
            if key == "total":
                if not value.isdigit():
                    raise ValueError(f"PSI `some` total is not a whole number: {value!r}")
                return int(value)
        raise ValueError(f"PSI `some` line has no total= field: {line.strip()!r}")
    raise ValueError("no `some` line in the PSI text")


def cgroup_v2_path(text: str) -> str | None:
    """The cgroup-v2 path (the `0::PATH` line) of a /proc/PID/cgroup text; None without one."""
    for line in text.splitlines():
        hierarchy, _, rest = line.strip().partition(":")
        controllers, _, path = rest.partition(":")
        if hierarchy == "0" and not controllers and path.startswith("/"):
            return path
    return None


def own_cgroup_psi(proc_cgroup: Path | None = None, mounts: tuple[Path, ...] | None = None) -> Path | None:
    """This process's cgroup-v2 cpu.pressure, if it has one that reads as PSI (a cgroup with
    pressure accounting off, `cgroup.pressure` 0, fails its reads); None otherwise."""
    try:
        path = cgroup_v2_path((proc_cgroup or PROC_SELF_CGROUP).read_text())
    except OSError:
        return None
    for mount in (mounts or CGROUP_V2_MOUNTS) if path else ():
        candidate = mount / path.lstrip("/") / "cpu.pressure"
        try:
            parse_psi_some_total(candidate.read_text())
        except (OSError, ValueError):
            continue
        return candidate
    return None


@functools.cache
def psi_file() -> tuple[Path, str]:
    """(the PSI file this process reads, its source tag), chosen once: a process's cgroup does not
    change while it measures, and a counter must be read from one file for its growth to mean anything."""
    own = own_cgroup_psi()
    return (own, SOURCE_CGROUP_PSI) if own is not None else (PSI_CPU, SOURCE_PSI)


def read_counter() -> tuple[int | None, str]:
    """(stall microseconds so far, its source: "psi" or "psi:cgroup"), or (None, why it is
    unknown). Never raises."""
    path, source = psi_file()
    try:
        text = path.read_text()
    except FileNotFoundError:
        return None, f"unknown: no {path} (not Linux, or a kernel without PSI)"
    except OSError as e:  # psi=0 at boot: the file exists and reading it fails (EOPNOTSUPP)
        return None, f"unknown: {path} unreadable ({e.strerror or e})"
    try:
        return parse_psi_some_total(text), source
    except ValueError as e:
        return None, f"unknown: {path} malformed ({e})"


def load_average() -> float | None:
    try:
        return round(os.getloadavg()[0], 2)
    except (OSError, AttributeError):  # no getloadavg on Windows
        return None


@dataclass
class HostLoad:
    """The host's CPU contention over one or more measured intervals."""
    stall: float | None  # share of wall time some runnable task waited for a CPU; None: unknown
    wall_s: float
    source: str  # "psi" (the system's), "psi:cgroup" (this process's cgroup's), or "unknown: why"
    loadavg_1m: float | None = None  # at the end: informational only (see the module docstring)
    other: float | None = None  # share of all CPUs' time other work used; None: unknown

    def contended(self, threshold: float | None) -> bool:
        """Some task waited for a CPU more than `threshold` of the time while other work (not this
        process) used more than `threshold` of the CPUs: a stall of the process's own making (more
        threads than cores) is the code's, and is judged."""
        if threshold is None or self.stall is None or self.stall <= threshold:
            return False
        return self.other is None or self.other > threshold

    def describe(self) -> str:
        if self.stall is None:
            return f"CPU stall {self.source}"
        other = "" if self.other is None else f", other work {self.other:.0%} of the CPUs"
        return f"CPU stall {self.stall:.0%} of {self.wall_s:.3g} s{other} ({self.source})"

    def as_dict(self) -> dict:
        return {"stall": None if self.stall is None else round(self.stall, 4), "wall_s": round(self.wall_s, 4),
                "source": self.source, "loadavg_1m": self.loadavg_1m,
                "other_work": None if self.other is None else round(self.other, 4)}


class Meter:
    """Sums the stall over the intervals measured through it (`with meter.measuring(): ...`);
    `take()` returns what was measured since the previous `take` (None: nothing) and starts over.
    A disabled meter (GPU timings) measures nothing."""

    def __init__(self, enabled: bool = True) -> None:
        self.enabled = enabled
        self._reset()

    def _reset(self) -> None:
        self._stall_us = 0
        self._wall_s = 0.0
        self._unknown: str | None = None
        self._intervals = 0
        self._other_ticks = 0.0
        self._all_ticks: int | None = 0  # None: some interval had no CPU times
        self._source = SOURCE_PSI

    @contextmanager
    def measuring(self):
        if not self.enabled:
            yield
            return
        before, source = read_counter()
        times_before, own_before = read_cpu_times(), read_own_cpu_s()
        if before is not None:
            self._source = source
        start = time.monotonic()
        try:
            yield
        finally:
            wall = time.monotonic() - start
            after, source_after = read_counter() if before is not None else (None, source)
            times_after, own_after = read_cpu_times(), read_own_cpu_s()
            self._intervals += 1
            self._wall_s += wall
            if after is None or before is None:
                self._unknown = self._unknown or (source_after if after is None else source)
            elif after < before:
                self._unknown = self._unknown or "unknown: the PSI counter went backwards"
            else:
                self._stall_us += after - before
            ticks = other_ticks(times_before, times_after, own_after - own_before)
            if ticks is None or self._all_ticks is None:
                self._all_ticks = None
            else:
                self._other_ticks += ticks[0]
                self._all_ticks += ticks[1]

    def take(self) -> HostLoad | None:
        if not self._intervals:
            return None
        other = (min(1.0, self._other_ticks / self._all_ticks) if self._all_ticks else None)
        if self._unknown:
            load = HostLoad(None, self._wall_s, self._unknown, load_average(), other)
        elif self._wall_s <= 0:
            load = HostLoad(None, self._wall_s, "unknown: no time measured", load_average(), other)
        else:
            load = HostLoad(min(1.0, self._stall_us / 1e6 / self._wall_s), self._wall_s, self._source,
                            load_average(), other)
        self._reset()
        return load


PROC_STAT = Path("/proc/stat")


def parse_cpu_times(text: str) -> tuple[int, int]:
    """(busy, total) clock ticks of all CPUs from the `cpu` line of a /proc/stat text: busy is
    user, nice, system, irq, softirq and steal (time a hypervisor gave to someone else); idle
    and iowait are the rest. ValueError when the line is missing or malformed."""
    for line in text.splitlines():
        fields = line.split()
        if fields and fields[0] == "cpu":
            if len(fields) < 5 or not all(f.isdigit() for f in fields[1:]):
                raise ValueError(f"malformed cpu line: {line.strip()!r}")
            ticks = [int(f) for f in fields[1:9]] + [0] * (9 - len(fields))
            user, nice, system, idle, iowait, irq, softirq, steal = ticks[:8]
            busy = user + nice + system + irq + softirq + steal
            return busy, busy + idle + iowait
    raise ValueError("no `cpu` line in the /proc/stat text")


def read_cpu_times() -> tuple[int, int] | None:
    try:
        return parse_cpu_times(PROC_STAT.read_text())
    except (OSError, ValueError):
        return None


# /proc/stat counts clock ticks (USER_HZ, 100 on Linux).
CLOCK_TICKS_PER_S = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100

# Process groups whose CPU time is the measured work, counted as this process's own: servers a
# run started and times (moe_harness.ladder.endpoints.managed), which are no other job's contention.
MEASURED_GROUPS: set[int] = set()


def _group_cpu_s(groups: set[int]) -> float:
    """CPU seconds the live processes of `groups` have used (/proc/PID/stat: utime, stime)."""
    total = 0.0
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue  # gone meanwhile
        # after the command's ")": state ppid pgrp session ... utime (index 11) stime (12)
        if int(fields[2]) in groups:
            total += (int(fields[11]) + int(fields[12])) / CLOCK_TICKS_PER_S
    return total


def read_own_cpu_s() -> float:
    """CPU seconds this process (all its threads) has used, and the MEASURED_GROUPS."""
    t = os.times()
    return t.user + t.system + (_group_cpu_s(MEASURED_GROUPS) if MEASURED_GROUPS else 0.0)


def other_ticks(times_before, times_after, own_cpu_s: float) -> tuple[float, int] | None:
    """(ticks of CPU time other work used, ticks of all CPUs) between two /proc/stat readings,
    this process having used `own_cpu_s` meanwhile; None when a reading is missing or no tick
    passed."""
    if not times_before or not times_after or times_after[1] <= times_before[1]:
        return None
    busy = times_after[0] - times_before[0] - own_cpu_s * CLOCK_TICKS_PER_S
    return max(0.0, busy), times_after[1] - times_before[1]


@dataclass
class Window:
    """A short interval during which the gate's thread slept: how busy the CPUs were with other
    work (this process's own CPU time, from any thread, left out) and the stall. The stall alone
    cannot say whether the host has room for a measurement: two busy loops on two cores wait for
    nothing while this process sleeps (stall 0%, measured) and stall it 98% once it runs; the
    busy share of the CPUs does say so."""
    busy: float | None
    stall: float | None
    wall_s: float

    def quiet(self, threshold: float) -> bool:
        if self.busy is None and self.stall is None:
            return True  # nothing to read: waiting cannot help
        return all(x is None or x <= threshold for x in (self.busy, self.stall))

    def describe(self) -> str:
        busy = "?" if self.busy is None else f"{self.busy:.0%}"
        stall = "?" if self.stall is None else f"{self.stall:.0%}"
        return f"CPUs {busy} busy with other work, stall {stall} over {self.wall_s:.2g} s"


# Windows of this length are read while waiting for the host to quiet: 50 clock ticks of each CPU
# at 100 Hz, so a 5% busy share is a few ticks, not one; short enough to stop soon after it quiets.
QUIET_WINDOW_S = 0.5


def read_window(seconds: float) -> Window:
    """Sleep `seconds` and say how busy the host's CPUs were meanwhile."""
    stall_before, _ = read_counter()
    times_before, own_before = read_cpu_times(), read_own_cpu_s()
    start = time.monotonic()
    time.sleep(seconds)
    wall = time.monotonic() - start
    stall_after, _ = read_counter()
    times_after, own_after = read_cpu_times(), read_own_cpu_s()
    busy = stall = None
    if (ticks := other_ticks(times_before, times_after, own_after - own_before)) is not None:
        busy = min(1.0, ticks[0] / ticks[1])
    if stall_before is not None and stall_after is not None and stall_after >= stall_before and wall > 0:
        stall = min(1.0, (stall_after - stall_before) / 1e6 / wall)
    return Window(busy, stall, wall)


def wait_for_quiet(threshold: float, budget_s: float, window_s: float = QUIET_WINDOW_S) -> tuple[float, Window]:
    """Read windows (this process sleeping) until one is quiet, i.e. the CPUs busy with other
    work and the stall both at most `threshold`, or `budget_s` has passed; returns (seconds
    waited, the last window). The measurement after it is judged by its own stall either way."""
    start = time.monotonic()
    last = Window(None, None, 0.0)
    while True:
        left = budget_s - (time.monotonic() - start)
        if left <= 0:
            break
        last = read_window(min(window_s, left))
        if last.quiet(threshold):
            break
    return time.monotonic() - start, last
