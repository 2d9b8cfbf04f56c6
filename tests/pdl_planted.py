"""Two PDL kernels for the negative control of `writes_before_wait` (tests/test_moe_gpu_compile.py):
one writes only after waiting on every path, one writes on a path that has not waited yet (the
defect the shared-expert programs of the gate_up kernel once had)."""

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
