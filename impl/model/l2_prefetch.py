"""Ask for a weight's bytes in L2 from a side stream, while the launches ahead of its projection
are bound by latency rather than by memory.

Why: in a decode step MLA's query, attention, combine and output kernels, and KDA's decode
kernels, read a few MB in several microseconds each, so HBM idles while they run; the projection
after them (o_proj, 21 MB at Ling-3.0-flash) then streams its weight alone. A kernel on a second
stream, forked after the input projection and joined before o_proj, issues one
`prefetch.global.L2` per 128-byte line of that weight; o_proj then finds its rows in L2 (50 MB on
an H100/H200). In a captured CUDA graph the fork is a parallel branch: nothing waits on it until
the join. It writes nothing, so it needs no ordering against the launches it runs beside.

`prefetch_async(weight)` launches it and returns a `SideWork` whose `join()` makes the current
stream wait for it; off CUDA, under the interpreter or with `enabled` False it does nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from impl.triton_env import INTERPRET, tl, triton

LINE_BYTES = 128


@dataclass(frozen=True)
class PrefetchLaunch:
    """Programs of the side kernel, 128-byte lines a program asks for per loop step, warps, and
    whether the lines are marked evict_last (kept ahead of the cache rows streaming meanwhile)."""
    programs: int = 16
    lines: int = 256
    num_warps: int = 4
    evict_last: bool = True
    max_bytes: int = 0          # 0: the whole weight
    late_join: bool = False     # join at join_pending() instead of before the projection


LAUNCH = PrefetchLaunch()


@triton.jit
def l2_prefetch_kernel(src_ptr, NBYTES, BYTES_PER_PROGRAM, LINES: tl.constexpr, EVICT_LAST: tl.constexpr):
    """prefetch.global.L2 of bytes [pid * BYTES_PER_PROGRAM, (pid + 1) * BYTES_PER_PROGRAM) of src."""
    pid = tl.program_id(0)
    start = pid.to(tl.int64) * BYTES_PER_PROGRAM
    end = tl.minimum(start + BYTES_PER_PROGRAM, NBYTES)
    base = src_ptr.to(tl.int64)
    for off in range(start, end, 128 * LINES):
        offs_line = tl.minimum(off + tl.arange(0, LINES).to(tl.int64) * 128, end - 1)
        if EVICT_LAST:
            tl.inline_asm_elementwise("prefetch.global.L2::evict_last [$1]; mov.u32 $0, 0;", "=r,l",
                                      [base + offs_line], dtype=tl.int32, is_pure=False, pack=1)
        else:
            tl.inline_asm_elementwise("prefetch.global.L2 [$1]; mov.u32 $0, 0;", "=r,l",
                                      [base + offs_line], dtype=tl.int32, is_pure=False, pack=1)


class SideWork:
    """Work forked onto a side stream; `join()` makes the stream that forked it wait for it."""

    def __init__(self, stream: "torch.cuda.Stream | None" = None, main: "torch.cuda.Stream | None" = None):
        self._stream, self._main = stream, main

    def join(self) -> None:
        if self._stream is not None:
            self._main.wait_stream(self._stream)
            self._stream = None


_SIDE_STREAMS: dict[int, "torch.cuda.Stream"] = {}
enabled = True
# Which layers fork the prefetch of their o_proj weight: "mla", "kda".
TARGETS: set[str] = {"mla", "kda"}


def _side_stream(device: torch.device) -> "torch.cuda.Stream":
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _SIDE_STREAMS:
        _SIDE_STREAMS[index] = torch.cuda.Stream(device=index)
    return _SIDE_STREAMS[index]


def prefetch_async(weight: torch.Tensor, launch: PrefetchLaunch | None = None, target: str | None = None) -> SideWork:
    """Ask for `weight`'s bytes in L2 from the device's side stream, after what the current stream
    has launched so far; the returned SideWork's `join()` orders the current stream after it."""
    if not enabled or (target is not None and target not in TARGETS) or INTERPRET or not weight.is_cuda or not weight.is_contiguous():
        return SideWork()
    launch = launch or LAUNCH
    main = torch.cuda.current_stream(weight.device)
    side = _side_stream(weight.device)
    side.wait_stream(main)
    nbytes = weight.numel() * weight.element_size()
    if launch.max_bytes:
        nbytes = min(nbytes, launch.max_bytes)
    per_program = triton.cdiv(triton.cdiv(nbytes, launch.programs), LINE_BYTES) * LINE_BYTES
    with torch.cuda.stream(side):
        l2_prefetch_kernel[(triton.cdiv(nbytes, per_program),)](
            weight, nbytes, per_program, LINES=launch.lines, EVICT_LAST=launch.evict_last,
            num_warps=launch.num_warps)
    if launch.late_join:
        PENDING.append(SideWork(side, main))
        return SideWork()
    return SideWork(side, main)


PENDING: list[SideWork] = []


def join_pending() -> None:
    while PENDING:
        PENDING.pop().join()


__all__ = ["LAUNCH", "PrefetchLaunch", "SideWork", "l2_prefetch_kernel", "prefetch_async"]
