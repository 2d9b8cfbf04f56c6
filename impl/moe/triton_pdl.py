"""Programmatic dependent launch (PDL) for the MoE layer's kernels: each kernel's programs start
while the kernel before it finishes, do what does not depend on it, then wait for its results.

Why: at batch 1 a layer is four short kernels (router logits, router top-k, gate_up, down), and
each launch waits for the one before it to drain; with PDL the next one is already resident. The
gate_up kernel's shared-expert programs, which need only x, run during the router's top-k.

Rules every PDL kernel here follows (what makes the early start safe):
- before its `pdl_wait` a program only reads data written two or more launches earlier (weights,
  x) and writes nothing the launch just before it reads;
- it calls `pdl_release` only after its `pdl_wait` (or, never waiting, reads nothing newer than
  two launches), so the launch after it starts only once everything before this one completed.
Launched without PDL (and under the interpreter, where launches run one after another) both are
skipped at compile time.
"""

from __future__ import annotations

from impl.triton_env import tl, triton


@triton.jit
def pdl_wait(PDL: tl.constexpr):
    """Wait until the previous launch has completed and its writes are visible."""
    if PDL:
        tl.extra.cuda.gdc_wait()


@triton.jit
def pdl_release(PDL: tl.constexpr):
    """Let the next launch start."""
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
