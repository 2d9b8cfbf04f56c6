"""Overlap helpers for the MoE layer's kernels: L2 prefetch of a program's whole weight slab, and
programmatic dependent launch (PDL), so that a decode layer's weights stream while its small
kernels wait on each other.

Why: at batch 1 each program of the expert kernels reads a few tens of KB and has few loads in
flight at a time, so memory sits idle between its K steps and between kernels (routing is ~8 us of
latency with ~1 us of bytes; notes/moe-h200.md). A bulk prefetch (`cp.async.bulk.prefetch.L2`,
sm_90) asks the memory system for a program's whole slab at once, without registers, so its later
loads hit L2. With PDL a kernel's programs start while the kernel before it finishes: they
prefetch what does not depend on it, then wait (`gdc_wait`) for its results.

Rules every PDL kernel here follows (what makes the early start safe):
- before its `gdc_wait` a program only reads data written two or more launches earlier (weights,
  x) and writes nothing the launch just before it reads;
- it calls `gdc_launch_dependents` only after its `gdc_wait`, so the launch after it starts only
  once everything before this launch has completed.
Under the interpreter both are no-ops (the kernels run one after another anyway).
"""

from __future__ import annotations

from impl.triton_env import tl, triton


@triton.jit
def prefetch_l2(start_ptr, end_ptr, ASM: tl.constexpr):
    """Ask for the bytes [start_ptr, end_ptr) in L2: one thread issues one bulk prefetch, the range
    widened to 16-byte bounds as the instruction requires. A hint: nothing waits for it."""
    if ASM:
        lo = start_ptr.to(tl.int64) & -16
        size = ((end_ptr.to(tl.int64) + 15) & -16) - lo
        tl.inline_asm_elementwise(
            "{ .reg .pred p; .reg .b32 t; mov.u32 t, %tid.x; setp.eq.u32 p, t, 0;"
            " @p cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }",
            "=r,l,r", [lo, size.to(tl.int32)], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def pdl_wait(PDL: tl.constexpr):
    """Wait until the previous launch has completed and its writes are visible."""
    if PDL:
        tl.extra.cuda.gdc_wait()


@triton.jit
def pdl_release(PDL: tl.constexpr):
    """Let the next launch start (call after `pdl_wait`)."""
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
