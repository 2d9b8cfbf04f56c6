"""The interleaved A/B runner: every row serves every request, rows alternating request by request.

Order: request i is served by every row in turn, in the given order for even i and in reverse
for odd i (A B, then B A, ...). Slow drift of the machine (clocks, heat, a noisy neighbour) then
falls on every row alike: each row's mean position within a request's slot is the same, and a
paired per-request comparison sees the same machine state on both sides.

A row is anything with a `name` and `prepare()`, `serve(request) -> ServedRequest`, `check()`
(raise unless what ran is what its name says), `release()`, `suspend()` / `resume()` (take down and
bring back what it holds: a server) and `entry() -> RowEntry`: this engine's rows
(impl.serve.engine.EngineRow) and server rows alike.

Where rows cannot be up together (two servers that each fill one GPU's memory), `block` serves
the requests in blocks of that many: each row serves a whole block in turn, the order alternating
from block to block (A B, then B A, ...), and with `one_at_a_time` each row is resumed before its
block and suspended after it (a server restarted each time), warm-up included. `schedule`
describes what was done, for the report.

Before the first recorded request each row serves `warmup` warm-up requests (the first ones of
the list; not recorded): they capture the row's CUDA graph, compile kernels and fill caches.
Triton kernels compile again for prefill shapes they have not seen (on the H200 a prompt length
new to the MTP row cost it ~0.45 s of TTFT), so where TTFT matters warm up with requests of the
prompt lengths the run will see. With `check`, each row's provenance after its warm-up must match
its name, so a row that is not what it says fails before the long run rather than after it.

What completed is the `Ladder`'s own state (`served`, `dropped`), whatever stops the run: a row's
error stops it as `LadderStopped` (impl.serve.result), which carries it too and where it stopped;
KeyboardInterrupt propagates as it is, the ladder keeping what completed. A request a row served
with an `error` (a server's HTTP error or cut stream) is kept as failed, and with `stop_on_error`
stops the run there too; without, the run goes on.

A row may need more device memory than is left beside the others (at full depth Humming's copy of
the experts is as large as the model's own). Rows named in `optional` are warmed up after the
others, and one whose warm-up runs out of device memory is dropped instead of ending the run: it
lets go of what it holds (`release`), the reason is kept under its name in `dropped`, and the
other rows go on. Any other row's error stops the run.
"""

from __future__ import annotations

import gc
import time
from typing import Callable, Collection, Iterable, Iterator

import torch

from impl import backends
from impl.serve.built_row import RowError
from impl.serve.result import Failure, LadderStopped, ServedRequest

__all__ = ["Ladder", "interleaved_order"]


def interleaved_order(rows: list, i: int) -> list:
    """The rows in the order they serve request `i`: forward for even i, reversed for odd i."""
    return list(rows) if i % 2 == 0 else list(reversed(rows))


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

    def __call__(self, done: int, served: ServedRequest | None, final: bool = False) -> None:
        if self.sink is None:
            return
        now = time.perf_counter()
        if not final and done != self.total and self.last is not None and now - self.last < self.interval:
            return
        self.last = now
        elapsed = now - self.start
        rate = done / elapsed if elapsed > 0 else float("inf")
        eta = (self.total - done) / rate if 0 < rate < float("inf") else 0.0
        where = f"; last {served.row} request {served.request_id!r}" if served else ""
        self.sink(f"{done}/{self.total} records, {rate:.2f}/s, elapsed {_duration(elapsed)}, "
                  f"ETA {_duration(eta)}{where}")


class Ladder:
    """One interleaved run of `rows` over `requests` (module docstring). `run()` (or iterating)
    serves them; `served` holds every completed request in the order served, `dropped` the rows
    left out ({name: why}), also after the run stopped."""

    def __init__(self, rows: list, requests: Iterable, *, warmup: int = 1, check: bool = True,
                 optional: Collection[str] = (), progress: Callable[[str], None] | None = None,
                 progress_interval_s: float = 10.0, stop_on_error: bool = True, block: int | None = None,
                 one_at_a_time: bool = False) -> None:
        if not isinstance(warmup, int) or warmup < 0:
            raise ValueError(f"warmup must be a number of requests >= 0, got {warmup!r}")
        self.rows = list(rows)
        if not self.rows:
            raise ValueError("no rows to run")
        names = [r.name for r in self.rows]
        if len(set(names)) != len(names):
            raise ValueError(f"row names must differ, got {names}")
        unknown = set(optional) - set(names)
        if unknown:
            raise ValueError(f"optional rows {sorted(unknown)} are not among the rows {names}")
        self.requests = list(requests)
        self.warmup, self.check, self.optional = warmup, check, set(optional)
        self.progress, self.progress_interval_s = progress, progress_interval_s
        self.stop_on_error = stop_on_error
        if block is not None and (not isinstance(block, int) or block < 1):
            raise ValueError(f"block must be a number of requests >= 1, got {block!r}")
        if one_at_a_time and block is None:
            raise ValueError("one row at a time needs blocks of requests (block=N): request by request, every "
                             "row would restart for every request")
        self.block, self.one_at_a_time = block, one_at_a_time
        self.served: list[ServedRequest] = []
        self.dropped: dict[str, str] = {}
        self._stop_said = False

    def _stop(self, row, request, error: Exception) -> LadderStopped:
        refused = isinstance(error, (backends.Unsupported, RowError))
        what = "the model's steps" if request is None else f"request {request.request_id!r}"
        why = (f"a backend it names does not cover {what}: " if isinstance(error, backends.Unsupported) else "")
        failure = Failure(row.name, None if request is None else request.request_id,
                          "refused" if refused else "failed", f"{why}{type(error).__name__}: {error}")
        return LadderStopped(failure, tuple(self.served), self.dropped)

    @property
    def schedule(self) -> str:
        """What order the rows served in, in words."""
        if self.block is None:
            return "interleaved request by request (A B, then B A)"
        alone = ("; one row up at a time, each resumed (a server restarted) before its block and suspended after"
                 if self.one_at_a_time else "")
        return f"blocks of {self.block} requests, each row a whole block in turn (A B, then B A){alone}"

    def _order(self, rows: list) -> Iterator[tuple]:
        """(row, request) in serving order; with one_at_a_time a row is resumed before and suspended
        after each of its blocks."""
        if self.block is None:
            for i, request in enumerate(self.requests):
                for row in interleaved_order(rows, i):
                    yield row, request
            return
        for b, start in enumerate(range(0, len(self.requests), self.block)):
            for row in interleaved_order(rows, b):
                if self.one_at_a_time:
                    row.resume()
                for request in self.requests[start:start + self.block]:
                    yield row, request
                if self.one_at_a_time:
                    row.suspend()

    def _warm_up(self) -> list:
        rows = list(self.rows)
        for row in sorted(rows, key=lambda r: r.name in self.optional):  # stable: the optional ones last
            request = None
            try:
                if self.one_at_a_time:
                    row.resume()
                row.prepare()
                for request in self.requests[:self.warmup]:
                    served = row.serve(request)
                    if served.error is not None:  # a server that cannot serve its warm-up cannot serve the run
                        raise LadderStopped(Failure(row.name, request.request_id, "failed", served.error),
                                            tuple(self.served), self.dropped)
            except torch.cuda.OutOfMemoryError as e:
                if row.name not in self.optional:
                    raise self._stop(row, request, e) from e
                self.dropped[row.name] = self._drop(row, e)
                rows.remove(row)
                if self.progress is not None:
                    self.progress(f"row {row.name!r} dropped: {self.dropped[row.name]}")
                continue
            except LadderStopped:
                raise
            except Exception as e:
                raise self._stop(row, request, e) from e
            if self.check:
                row.check()
            if self.one_at_a_time:
                row.suspend()
        if not rows:
            raise RuntimeError(f"every row ran out of device memory in its warm-up: {self.dropped}")
        return rows

    @staticmethod
    def _drop(row, error: BaseException) -> str:
        """Let go of what `row` holds on the device after running out of memory; the reason, in words."""
        row.release()
        gc.collect()
        torch.cuda.empty_cache()
        return f"out of device memory in its warm-up ({str(error).splitlines()[0][:200]})"

    def __iter__(self) -> Iterator[ServedRequest]:
        """Each request as soon as a row served it (also recorded in `served`)."""
        if not self.requests:
            return
        rows = self._warm_up() if self.warmup else self.rows
        tick = _Progress(len(rows) * len(self.requests), self.progress, self.progress_interval_s)
        try:
            for row, request in self._order(rows):
                try:
                    served = row.serve(request)
                except Exception as e:
                    raise self._stop(row, request, e) from e
                self.served.append(served)
                tick(len(self.served), served)
                yield served
                if served.error is not None and self.stop_on_error:
                    raise LadderStopped(Failure(row.name, request.request_id, "failed", served.error),
                                        tuple(self.served), self.dropped)
        except GeneratorExit:  # the caller stopped iterating
            raise
        except BaseException as e:
            self._say_stopped(e)
            raise

    def _say_stopped(self, error: BaseException) -> None:
        if self.progress is not None and not self._stop_said:
            self._stop_said = True
            self.progress(f"stopped after {len(self.served)} record(s): {type(error).__name__}: {error}")

    def run(self, on_request: Callable[[ServedRequest], ServedRequest | None] | None = None) -> list[ServedRequest]:
        """Serve every request on every row; `on_request(served)` may return a replacement (the
        same request with its scores), which is what `served` keeps."""
        try:
            for served in self:
                if on_request is not None:
                    replaced = on_request(served)
                    if replaced is not None:
                        self.served[-1] = replaced
        except BaseException as e:  # Ctrl-C in the caller's hands too: said once
            self._say_stopped(e)
            raise
        return self.served
