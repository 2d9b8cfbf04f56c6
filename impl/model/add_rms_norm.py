"""A residual add and the RMS norm after it as one kernel: `residual + delta`, and that sum normed.

A pre-norm decoder layer adds each branch's output to the residual stream and norms the sum for
the next branch. Spelled out, that is two kernels per branch (the add, then F.rms_norm); at batch
1 each is a few microseconds of launch and latency for 5 KB of data, and a 42-layer decode step
holds 84 of each. Here the residual stream is kept apart from the branch outputs (vLLM's layout),
so one launch adds, rounds the sum to the stream's dtype (exactly as the spelled-out add does)
and norms that rounded sum with fp32 statistics, storing both.

`add_rms_norm_reference` is the torch form and the CPU path; the kernel runs on CUDA tensors
(and under Triton's interpreter in the tests).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from impl.moe.triton_pdl import pdl_release, pdl_supported, pdl_wait, use_pdl
from impl.triton_env import tl, triton

# Warps for one row: 2560 values of Ling-3.0-flash fit one program of 4 warps, 8 elements a thread.
NUM_WARPS = 4


@triton.jit
def add_rms_norm_kernel(delta_ptr, residual_ptr, weight_ptr, out_ptr, sum_ptr, H, eps,
                        stride_delta, stride_residual, stride_out, stride_sum, BLOCK_H: tl.constexpr,
                        PDL: tl.constexpr = False):
    """One program a row: sum = round(residual + delta); out = sum * rsqrt(mean(sum^2) + eps) * w."""
    # Released before the wait: the PDL launches that follow a norm (a projection's GEMV, the MoE
    # router) read only weights before their own wait, so they load them while the launch before
    # this one still runs (impl/moe/triton_pdl.py's rules). H200, row 3's step: 0.997x / 0.995x at
    # 1k / 32k, logits equal bit for bit (notes/ling.md).
    pdl_release(PDL)
    pdl_wait(PDL)  # delta comes from the launch before this one
    row = tl.program_id(0).to(tl.int64)
    offs_h = tl.arange(0, BLOCK_H)
    ok = offs_h < H
    r = tl.load(residual_ptr + row * stride_residual + offs_h, mask=ok, other=0.0).to(tl.float32)
    d = tl.load(delta_ptr + row * stride_delta + offs_h, mask=ok, other=0.0).to(tl.float32)
    s = (r + d).to(sum_ptr.dtype.element_ty)
    tl.store(sum_ptr + row * stride_sum + offs_h, s, mask=ok)
    x = s.to(tl.float32)
    inv = tl.rsqrt(tl.sum(x * x, axis=0) / H + eps)
    # The weight in the activations' dtype first, as the module's F.rms_norm takes it.
    w = tl.load(weight_ptr + offs_h, mask=ok, other=0.0).to(out_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + row * stride_out + offs_h, (x * inv * w).to(out_ptr.dtype.element_ty), mask=ok)


def add_rms_norm_reference(delta: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                           eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(residual + delta), residual + delta) in torch ops."""
    total = residual + delta
    return F.rms_norm(total, (total.shape[-1],), weight.to(total.dtype), eps), total


def _check(delta: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor) -> None:
    if delta.shape != residual.shape:
        raise ValueError(f"add_rms_norm: delta {tuple(delta.shape)} and residual {tuple(residual.shape)} differ")
    if weight.shape != residual.shape[-1:]:
        raise ValueError(f"add_rms_norm: weight {tuple(weight.shape)} does not match the hidden size "
                         f"{residual.shape[-1]}")
    if delta.dtype != residual.dtype:
        raise TypeError(f"add_rms_norm: delta is {delta.dtype}, the residual stream {residual.dtype}")
    if len({delta.device, residual.device, weight.device}) != 1:
        raise ValueError(f"add_rms_norm: tensors on {delta.device}, {residual.device} and {weight.device}")


def add_rms_norm_triton(delta: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                        eps: float, pdl: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """`add_rms_norm_reference` in one launch of `add_rms_norm_kernel` (`pdl`: launched to start
    while the kernel before it finishes, and letting the next one start early)."""
    _check(delta, residual, weight)
    pdl = use_pdl(pdl, residual.device)
    h = residual.shape[-1]
    d, r = delta.reshape(-1, h), residual.reshape(-1, h)
    if d.stride(-1) != 1:
        d = d.contiguous()
    if r.stride(-1) != 1:
        r = r.contiguous()
    out = torch.empty(r.shape, dtype=r.dtype, device=r.device)
    total = torch.empty_like(out)
    add_rms_norm_kernel[(r.shape[0],)](d, r, weight, out, total, h, eps, d.stride(0), r.stride(0), out.stride(0),
                                       total.stride(0), BLOCK_H=triton.next_power_of_2(h), PDL=pdl, launch_pdl=pdl,
                                       num_warps=NUM_WARPS)
    return out.view(residual.shape), total.view(residual.shape)


def add_rms_norm(delta: torch.Tensor | None, residual: torch.Tensor, norm) -> tuple[torch.Tensor, torch.Tensor]:
    """(norm(residual + delta), residual + delta) for an RMSNorm module `norm`; with `delta` None,
    (norm(residual), residual). One Triton launch on CUDA, torch elsewhere."""
    if delta is None:
        return norm(residual), residual
    if residual.is_cuda:  # launched with PDL where there is PDL: the projection after it starts early
        return add_rms_norm_triton(delta, residual, norm.weight, norm.eps, pdl=pdl_supported(residual.device))
    _check(delta, residual, norm.weight)
    return add_rms_norm_reference(delta, residual, norm.weight, norm.eps)


__all__ = ["add_rms_norm", "add_rms_norm_kernel", "add_rms_norm_reference", "add_rms_norm_triton"]
