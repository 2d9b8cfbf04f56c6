"""Programmatic dependent launch (PDL) for the MoE layer's kernels: each kernel's programs start
while the kernel before it finishes, do what does not depend on it, then wait for its results.

Why: at batch 1 a layer is four short kernels (router logits, router top-k, gate_up, down), and
each launch waits for the one before it to drain; with PDL the next one is already resident. The
gate_up kernel's shared-expert programs, which need only x, run during the router's top-k.

Rules every PDL kernel here follows (what makes the early start safe):
- before its `pdl_wait` a program only reads data written two or more launches earlier (weights,
  x, the slots in the down kernel) and writes nothing at all: a buffer this launch writes may be
  memory the caching allocator took back from one the launch before still reads (the router's
  logits, freed when `route_triton` returns);
- each launch has programs that wait before they release (`pdl_release`), so the launch after it
  starts only once everything before this one has completed: "two launches earlier" is done.
  A kernel may release before it waits only where the launch after it reads nothing but weights
  before its wait (KDA's output kernel for a decode token, MLA's combine and output kernels,
  followed by MLA's output kernel and the o_proj GEMV; the residual add + RMS norm, followed by a
  projection's GEMV or the MoE router): that launch then becomes resident while
  the one before still runs. Its writes stay safe: each wait returns once the launch before has
  completed, which it did only after its own wait returned, so every launch before has completed.
Launched without PDL (and under the interpreter, where launches run one after another) both are
skipped at compile time.

While it waits, a program can ask for its weights in L2 (`prefetch_l2`, the config's
`l2_prefetch`): the down kernel's weights then stream while the gate_up kernel, bound by its
instructions more than by memory, still runs; the router's while the previous layer finishes.
"""

from __future__ import annotations

import functools

import torch

from impl.triton_env import INTERPRET, tl, triton

PREFETCH_LINES = tl.constexpr(128)  # 128-byte lines a program asks for per step of `prefetch_l2`


@functools.lru_cache(maxsize=None)
def _capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def use_pdl(requested: bool, device: torch.device) -> bool:
    """Whether kernels on `device` launch with PDL: as requested on a GPU, which must be sm_90 or
    newer (a clear error otherwise); never under the interpreter (launches run in order there)."""
    if not requested or INTERPRET:
        return False
    if not pdl_supported(device):
        name = torch.cuda.get_device_name(device) if device.type == "cuda" else device
        raise ValueError(f"pdl needs an sm_90 or newer GPU (programmatic dependent launch), got {name}")
    return True


def pdl_supported(device: torch.device) -> bool:
    """Whether kernels on `device` can launch with PDL (an sm_90 or newer GPU, not the interpreter):
    for kernels that take it where it is there and run plainly elsewhere."""
    if INTERPRET or device.type != "cuda":
        return False
    return _capability(device.index if device.index is not None else torch.cuda.current_device()) >= (9, 0)


@triton.jit
def pdl_wait(PDL: tl.constexpr):
    """Wait until the previous launch has completed and its writes are visible."""
    if PDL:
        tl.extra.cuda.gdc_wait()


@triton.jit
def prefetch_l2(start_ptr, end_ptr, ASM: tl.constexpr):
    """Ask for the bytes [start_ptr, end_ptr) in L2, one `prefetch.global.L2` per 128-byte line
    spread over the program's threads (a hint: nothing waits for it; a no-op when not ASM)."""
    if ASM:
        start = start_ptr.to(tl.int64)
        nbytes = (end_ptr.to(tl.int64) - start).to(tl.int32)
        for off in range(0, nbytes, 128 * PREFETCH_LINES):
            line = tl.minimum(off + tl.arange(0, PREFETCH_LINES) * 128, nbytes - 1)
            tl.inline_asm_elementwise("prefetch.global.L2 [$1]; mov.u32 $0, 0;", "=r,l", [start + line],
                                      dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def pdl_release(PDL: tl.constexpr):
    """Let the next launch start."""
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
