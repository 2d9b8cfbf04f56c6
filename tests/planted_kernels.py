"""Planted kernels for the negative controls of tests/test_moe_gpu_compile.py's static checks.

`writes_before_wait`: one PDL kernel writes only after waiting on every path, one writes on a
path that has not waited yet (the defect the shared-expert programs of the gate_up kernel once had).
`loop_barriers`: one K loop accumulates elementwise and reduces after the loop, one reduces across
the tile every step (what the register paths did before: a barrier or two a step).
`loop_load_copies`: the loop that reduces after it uses its loads in place; one that carries the
next step's tile in one rotating set gets it copied in the step that loaded it (what the shared
expert's K loop did on the H200: one memory round trip a step)."""

from impl.moe.triton_pdl import pdl_wait
from impl.triton_env import tl, triton


@triton.jit
def writes_after_waiting(out_ptr, flag, PDL: tl.constexpr):
    offs = tl.arange(0, 128)
    v = tl.load(out_ptr + offs) * 2.0  # reading early is allowed
    if flag > 0:
        pdl_wait(PDL)
        tl.store(out_ptr + offs, v)
    else:
        pdl_wait(PDL)
        tl.atomic_add(out_ptr + offs, v)


@triton.jit
def writes_before_waiting(out_ptr, flag, PDL: tl.constexpr):
    offs = tl.arange(0, 128)
    v = tl.load(out_ptr + offs) * 2.0
    if flag > 0:
        pdl_wait(PDL)
        tl.store(out_ptr + offs, v)
    else:
        tl.store(out_ptr + offs, v)  # planted: this branch writes without waiting
        pdl_wait(PDL)


@triton.jit
def reduces_after_the_loop(w_ptr, out_ptr, K):
    offs_n = tl.arange(0, 32)
    acc = tl.zeros((32, 128), dtype=tl.float32)
    for k0 in range(0, K, 128):
        acc += tl.load(w_ptr + offs_n[:, None] * K + k0 + tl.arange(0, 128)[None, :])
    tl.store(out_ptr + offs_n, tl.sum(acc, axis=1))


@triton.jit
def reduces_every_step(w_ptr, out_ptr, K):
    offs_n = tl.arange(0, 32)
    acc = tl.zeros((32,), dtype=tl.float32)
    for k0 in range(0, K, 128):  # planted: a cross-thread reduction inside the loop
        acc += tl.sum(tl.load(w_ptr + offs_n[:, None] * K + k0 + tl.arange(0, 128)[None, :]), axis=1)
    tl.store(out_ptr + offs_n, acc)


@triton.jit
def loads_ahead_in_one_rotating_set(w_ptr, out_ptr, K):
    offs = tl.arange(0, 1024)
    acc = tl.zeros((1024,), dtype=tl.float32)
    ahead = tl.load(w_ptr + offs, mask=offs < K, other=0.0)
    for k0 in range(0, K, 1024):  # planted: the next step's load, copied into the carried set
        w = ahead
        ahead = tl.load(w_ptr + k0 + 1024 + offs, mask=k0 + 1024 + offs < K, other=0.0)
        acc += w.to(tl.float32) * 3.0
    tl.store(out_ptr + offs, acc)
