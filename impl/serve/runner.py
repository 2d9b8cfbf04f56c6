"""The interleaved A/B runner: every arm serves every request, arms alternating request by request.

Order: request i is served by every arm in turn, in the given order for even i and in reverse
for odd i (A B, then B A, ...). Slow drift of the machine (clocks, heat, a noisy neighbour) then
falls on every arm alike: each arm's mean position within a request's slot is the same, and a
paired per-request comparison sees the same machine state on both sides.

Before the first recorded request each arm serves `warmup` warm-up requests (the first ones of
the list; not recorded): they capture the arm's CUDA graph, compile kernels and fill caches.
Triton kernels compile again for prefill shapes they have not seen (on the H200 a prompt length
new to the MTP row cost it ~0.45 s of TTFT), so where TTFT matters warm up with requests of the
prompt lengths the run will see. With `check`,
each arm's provenance after its warm-up must match its name and configuration
(impl.serve.provenance.check_provenance), so a row that is not what it says fails before the
long run rather than after it.

Records come out one at a time (`iter_ladder` yields them; `run_ladder` appends each to its list
the moment it exists and calls `on_record`), so a run stopped part-way, by KeyboardInterrupt or by
an error in a later request, keeps every completed record: pass your own `records` list to keep
it when the exception propagates.

A row may need more device memory than is left beside the others (at full depth Humming's copy of
the experts is as large as the model's own). Rows named in `optional` are warmed up after the
others, and one whose warm-up runs out of device memory is dropped instead of ending the run: its
graphs and buffers are let go, its MoE backend's converted weights released (`Backend.release`),
the reason kept under its name in `dropped` (a dict of the caller's), and the other rows go on.
Any other row's error propagates as usual.
"""

from __future__ import annotations

import contextlib
import time
from typing import Callable, Collection, Iterable, Iterator

import torch

from impl import backends
from impl.serve.arm import ArmError
from impl.serve.engine import prepare, run_request
from impl.serve.provenance import check_provenance


def where_failed(error: BaseException) -> tuple[str, object] | None:
    """(row, request id; None while the row prepared its steps) of an error raised while a row
    served, as the runner marks it; None for an error from elsewhere."""
    return getattr(error, "_ladder_where", None)


@contextlib.contextmanager
def _refusals(arm, what: str, request_id=None) -> Iterator[None]:
    """A backend's refusal of its input (impl.backends.Unsupported) raised as the ArmError of the
    row that names that backend: the row cannot run on this model or workload. Every error raised
    here is marked with the row and request it happened in (`where_failed`), keeping its type."""
    try:
        try:
            yield
        except backends.Unsupported as e:
            raise ArmError(f"row {arm.name!r} ({arm.config.spec_text()}): a backend it names does not cover "
                           f"{what}: {e}") from e
    except Exception as e:
        if where_failed(e) is None:
            e._ladder_where = (arm.name, request_id)
        raise


def _served(arm, request) -> dict:
    with _refusals(arm, f"request {request.request_id!r}", request.request_id):
        return run_request(arm, request)

__all__ = ["interleaved_order", "iter_ladder", "run_ladder", "where_failed"]


def interleaved_order(arms: list, i: int) -> list:
    """The arms in the order they serve request `i`: forward for even i, reversed for odd i."""
    return list(arms) if i % 2 == 0 else list(reversed(arms))


def _duration(seconds: float) -> str:
    seconds = int(round(seconds))
    h, rest = divmod(seconds, 3600)
    m, s = divmod(rest, 60)
    return f"{h}h{m:02d}m{s:02d}s" if h else f"{m}m{s:02d}s"


class _Progress:
    def __init__(self, total: int, sink: Callable[[str], None] | None, interval_s: float) -> None:
        self.total, self.sink, self.interval = total, sink, interval_s
        self.start = time.perf_counter()
        self.last = None

    def __call__(self, done: int, record: dict, final: bool = False) -> None:
        if self.sink is None:
            return
        now = time.perf_counter()
        if not final and done != self.total and self.last is not None and now - self.last < self.interval:
            return
        self.last = now
        elapsed = now - self.start
        rate = done / elapsed if elapsed > 0 else float("inf")
        eta = (self.total - done) / rate if 0 < rate < float("inf") else 0.0
        where = f"; last {record['arm']} request {record['request_id']!r}" if record else ""
        self.sink(f"{done}/{self.total} records, {rate:.2f}/s, elapsed {_duration(elapsed)}, "
                  f"ETA {_duration(eta)}{where}")


def iter_ladder(arms: list, requests: Iterable, progress: Callable[[str], None] | None = None,
                warmup: int = 1, check: bool = True, progress_interval_s: float = 10.0,
                optional: Collection[str] = (), dropped: dict[str, str] | None = None) -> Iterator[dict]:
    """Yield one record per (request, arm), interleaved (module docstring)."""
    if not isinstance(warmup, int) or warmup < 0:
        raise ValueError(f"warmup must be a number of requests >= 0, got {warmup!r}")
    arms = list(arms)
    if not arms:
        raise ValueError("no arms to run")
    names = [a.name for a in arms]
    if len(set(names)) != len(names):
        raise ValueError(f"arm names must differ, got {names}")
    requests = list(requests) if not isinstance(requests, (list, tuple)) else requests
    if not requests:
        return
    unknown = set(optional) - set(names)
    if unknown:
        raise ValueError(f"optional rows {sorted(unknown)} are not among the arms {names}")
    dropped = {} if dropped is None else dropped
    if warmup:
        for arm in sorted(arms, key=lambda a: a.name in optional):  # stable: the optional ones last
            try:
                with _refusals(arm, "the model's steps"):
                    prepare(arm)
                for request in requests[:warmup]:
                    _served(arm, request)
            except torch.cuda.OutOfMemoryError as e:
                if arm.name not in optional:
                    raise
                dropped[arm.name] = _drop(arm, e)
                arms.remove(arm)
                if progress is not None:
                    progress(f"row {arm.name!r} dropped: {dropped[arm.name]}")
                continue
            if check:
                check_provenance(arm.name, arm.config, arm.provenance)
        if not arms:
            raise RuntimeError(f"every row ran out of device memory in its warm-up: {dropped}")
    tick = _Progress(len(arms) * len(requests), progress, progress_interval_s)
    done = 0
    for i, request in enumerate(requests):
        for arm in interleaved_order(arms, i):
            record = _served(arm, request)
            done += 1
            tick(done, record)
            yield record


def _drop(arm, error: BaseException) -> str:
    """Let go of what `arm` holds on the device after running out of memory; the reason, in words."""
    import gc

    from impl import backends
    arm.loop = arm.provenance = None
    release = backends.get("moe", arm.config.moe).release
    if release is not None:
        release()
    gc.collect()
    torch.cuda.empty_cache()
    return f"out of device memory in its warm-up ({str(error).splitlines()[0][:200]})"


def run_ladder(arms: list, requests: Iterable, on_record: Callable[[dict], None] | None = None,
               progress: Callable[[str], None] | None = None, *, records: list | None = None,
               warmup: int = 1, check: bool = True, progress_interval_s: float = 10.0,
               optional: Collection[str] = (), dropped: dict[str, str] | None = None) -> list[dict]:
    """Every record of the interleaved run, in the order served. Each record is in `records` (a
    list of yours, or a new one) and passed to `on_record` as soon as it exists; on an exception
    (KeyboardInterrupt included) the completed records stay in `records`, the exception
    propagates, and `progress` is told how many completed."""
    records = [] if records is None else records
    try:
        for record in iter_ladder(arms, requests, progress, warmup, check, progress_interval_s, optional,
                                  dropped):
            records.append(record)
            if on_record is not None:
                on_record(record)
    except BaseException as e:
        if progress is not None:
            progress(f"stopped after {len(records)} record(s): {type(e).__name__}: {e}")
        raise
    return records
