"""Repeated timing samples: host clock on CPU, CUDA events on GPU, warm-up first.

`Sampler.sample` goes through pytest-benchmark's fixture (pedantic mode) when it is active, so
its tables, --benchmark-json and compare tooling see the same rounds; otherwise (disabled) it
runs the same loop itself. `Sampler.interleaved` times several callables in
turn (A B A B ...) so that their ratio is measured under the same machine conditions. Given a
`host_load.Meter`, the timed rounds (not the warm-up) are measured through it, so the gate knows
how contended the host's CPUs were while the samples were taken.
"""

from __future__ import annotations

import contextlib
import ctypes
import time
from typing import Callable

from pytest_moeperf.host_load import Meter


class CudaEventClock:
    """A pytest-benchmark-compatible timer reading CUDA events: seconds since construction.

    Each reading records an event and waits for it, so an interval is device time between
    two points of the stream (launch gaps included, host-side Python excluded once queued)."""

    def __init__(self, device) -> None:
        import torch
        self._torch = torch
        self._device = device
        with torch.cuda.device(device):
            self._origin = torch.cuda.Event(enable_timing=True)
            self._origin.record()
            self._origin.synchronize()

    def __call__(self) -> float:
        with self._torch.cuda.device(self._device):
            ev = self._torch.cuda.Event(enable_timing=True)
            ev.record()
            ev.synchronize()
        return self._origin.elapsed_time(ev) / 1e3


def pin_heap_allocations() -> bool:
    """Keep glibc from serving large blocks with mmap/munmap. Above a threshold that starts at
    128 KiB and rises as such blocks are freed, each allocation maps fresh pages, so the same op's
    temporaries cost page faults or not depending on what ran earlier in the process: the tiny
    MoE layer timed 182 us fresh, 223 us after a few speculative generations and 396 us after the
    other suites, and 187-189 us in every case with this. Returns False where there is no glibc."""
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    m_trim_threshold, m_mmap_threshold = -1, -3
    limit = 32 << 20  # glibc's ceiling for the mmap threshold on 64-bit
    return bool(mallopt(m_mmap_threshold, limit)) and bool(mallopt(m_trim_threshold, 2 * limit))


def clock_for(device) -> Callable[[], float]:
    return CudaEventClock(device) if getattr(device, "type", "cpu") == "cuda" else time.perf_counter


# Warm-up lasts at least this long as well as `warmup` rounds: a GPU idle during a build phase
# (seconds of host work between timed tests) starts below its steady clocks, and two rounds of a
# graph of 3 us calls are over in a millisecond.
WARMUP_S = 0.3


class Sampler:
    """Takes `rounds` samples of `inner` calls each; a sample is seconds per call."""

    def __init__(self, device, rounds: int, warmup: int = 2, warmup_s: float = WARMUP_S,
                 benchmark: Callable[[], object] | None = None, meter: Meter | None = None) -> None:
        """`benchmark` returns pytest-benchmark's fixture; it is called at most once, by `sample`.
        `meter` (host_load.Meter) measures the host's CPU contention during the timed rounds."""
        self.device, self.rounds, self.warmup, self.warmup_s = device, rounds, warmup, warmup_s
        self.clock = clock_for(device)
        self.benchmark = benchmark
        self.meter = meter

    def _measuring(self, metered: bool = True):
        return self.meter.measuring() if self.meter is not None and metered else contextlib.nullcontext()

    def _warm_up(self, one_round: Callable[[], object]) -> None:
        """`warmup` rounds, then more until `warmup_s` have passed."""
        start = time.perf_counter()
        done = 0
        while done < self.warmup or time.perf_counter() - start < self.warmup_s:
            one_round()
            done += 1

    def sample(self, fn: Callable[[], object], inner: int = 1, rounds: int | None = None,
               metered: bool = True) -> list[float]:
        """`rounds` samples of `fn`. `metered=False`: a figure only reported, never gated, whose
        host load must not be counted into the gated measurement's (the gate reads everything
        the meter saw since its last figure)."""
        rounds = rounds or self.rounds
        self._warm_up(lambda: self._time(fn, inner))
        if self.benchmark is not None:
            benchmark, self.benchmark = self.benchmark(), None  # the fixture times one thing per test
            benchmark._timer = self.clock  # pytest-benchmark has no public hook for the timer
            with self._measuring(metered):
                benchmark.pedantic(fn, rounds=rounds, iterations=inner, warmup_rounds=0)
            return list(benchmark.stats.stats.data)
        with self._measuring(metered):
            return [self._time(fn, inner) for _ in range(rounds)]

    def interleaved(self, fns: dict[str, Callable[[], object]], inner: int = 1, rounds: int | None = None,
                    setup: dict[str, Callable[[], object]] | None = None) -> dict[str, list[float]]:
        """Samples of each of `fns`, taken in turn; `setup[name]`, if given, runs untimed before
        each sample of `name` (e.g. to restore the state a decode run starts from)."""
        rounds = rounds or self.rounds
        setup = setup or {}
        unknown = sorted(set(setup) - set(fns))
        if unknown:
            raise ValueError(f"setup names {unknown} are not among the timed callables {sorted(fns)}")

        def one(name: str) -> float:
            if name in setup:
                setup[name]()
            return self._time(fns[name], inner)

        self._warm_up(lambda: [one(name) for name in fns])
        out: dict[str, list[float]] = {name: [] for name in fns}
        with self._measuring():
            for _ in range(rounds):
                for name in fns:
                    out[name].append(one(name))
        return out

    def _time(self, fn, inner: int) -> float:
        self.clock()  # drains queued device work before the interval starts
        start = self.clock()
        for _ in range(inner):
            fn()
        return (self.clock() - start) / inner
