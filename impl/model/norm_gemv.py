"""The residual add, the RMS norm after it and the projection that reads the normed row, as one
GEMV: `(rms_norm(residual + delta) @ w.T, residual + delta)` for one token.

Why: a decode token's attention layer starts with two dependent launches, the add + norm
(impl/model/add_rms_norm.py, one program) and the input projection's GEMV (impl/model/gemv.py),
and each hop of a chain of short launches costs its wait and its memory flush. Here every GEMV
program loads its first weight tile before its PDL wait, as gemv_kernel does, then reads the whole
5 KB row pair (L2-resident: the launch before just wrote delta), takes the norm's statistics
itself and normalizes each K tile as it multiplies it; program 0 alone stores the sum, the
residual stream the layer's next add reads. The normed row is never stored: in KDA and MLA layers
the fused input projection is its only reader.

Numerics are the two launches': the sum rounded to the stream's dtype, fp32 statistics over it,
the norm weight taken in the activations' dtype, the normed value rounded to that dtype before the
fp32 products. The statistics' sum runs in another order than add_rms_norm_kernel's (another
layout), so a normed value may land on the other neighbour of its rounding.

`norm_gemv_reference` is the two steps in torch (add_rms_norm_reference, then the fp32 product);
the kernel runs on CUDA tensors and under Triton's interpreter in the tests.
"""

from __future__ import annotations

import torch

from impl.model.add_rms_norm import add_rms_norm_reference
from impl.model.gemv import DTYPES, GemvLaunch, gemv_applies, gemv_reference, launch_for, row_sums, weight_rows
from impl.moe.triton_pdl import pdl_release, pdl_supported, pdl_wait
from impl.triton_env import tl, triton


@triton.jit
def norm_gemv_kernel(delta_ptr, residual_ptr, norm_w_ptr, w_ptr, out_ptr, sum_ptr, N, K, stride_wn, eps,
                     BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_H: tl.constexpr, PDL: tl.constexpr):
    """out[n] = sum_k norm(residual + delta)[k] * w[n, k] for this program's BLOCK_N rows; program 0
    also stores sum = round(residual + delta). BLOCK_H: K rounded up to a power of two (the row the
    statistics are taken over at once)."""
    rows, offs_n, n_ok, offs_k, w = weight_rows(w_ptr, stride_wn, N, K, BLOCK_N, BLOCK_K)
    pdl_wait(PDL)  # delta comes from the launch before this one
    pdl_release(PDL)
    offs_h = tl.arange(0, BLOCK_H)
    h_ok = offs_h < K
    s = (tl.load(residual_ptr + offs_h, mask=h_ok, other=0.0).to(tl.float32)
         + tl.load(delta_ptr + offs_h, mask=h_ok, other=0.0).to(tl.float32)).to(sum_ptr.dtype.element_ty)
    if tl.program_id(0) == 0:  # the residual stream, stored once
        tl.store(sum_ptr + offs_h, s, mask=h_ok)
    sf = s.to(tl.float32)
    inv = tl.rsqrt(tl.sum(sf * sf, axis=0) / K + eps)
    acc = row_sums(rows, n_ok, offs_k, w, delta_ptr, K, residual_ptr, norm_w_ptr, inv, BLOCK_K, True)
    tl.store(out_ptr + offs_n[None, :], acc[None, :].to(out_ptr.dtype.element_ty), mask=n_ok[None, :])


def norm_gemv_reference(delta: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                        w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(residual + delta) @ w.T, residual + delta) in torch: the add and norm, then the
    fp32 product rounded to the activations' dtype."""
    h, total = add_rms_norm_reference(delta, residual, norm_weight, eps)
    return gemv_reference(h, w), total


def _check(delta: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor, w: torch.Tensor) -> None:
    if w.dim() != 2 or w.stride(1) != 1:
        raise ValueError(f"norm_gemv: w must be 2-d with contiguous rows, got {tuple(w.shape)} strides {w.stride()}")
    k = w.shape[1]
    if delta.shape != residual.shape:
        raise ValueError(f"norm_gemv: delta {tuple(delta.shape)} and residual {tuple(residual.shape)} differ")
    if residual.shape[-1] != k or residual.numel() != k:
        raise ValueError(f"norm_gemv: residual {tuple(residual.shape)} must hold one row of w's {k} inputs "
                         f"(w {tuple(w.shape)})")
    if norm_weight.shape != (k,):
        raise ValueError(f"norm_gemv: norm weight {tuple(norm_weight.shape)} does not match the hidden size {k}")
    if not delta.dtype == residual.dtype == w.dtype or w.dtype not in DTYPES + (torch.float32,):
        raise TypeError(f"norm_gemv: delta {delta.dtype}, residual {residual.dtype} and w {w.dtype} must be one "
                        "float dtype")
    devices = {delta.device, residual.device, norm_weight.device, w.device}
    if len(devices) != 1:
        raise ValueError(f"norm_gemv: tensors on {sorted(map(str, devices))}")


def norm_gemv(delta: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor, eps: float,
              w: torch.Tensor, launch: GemvLaunch | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """`norm_gemv_reference` in one launch of `norm_gemv_kernel` (launch: the GEMV's tile, by
    default impl.model.gemv's for w's shape). Returns (out [..., N], sum shaped as residual)."""
    _check(delta, residual, norm_weight, w)
    n, k = w.shape
    launch = launch or launch_for(n, k)
    d, r = delta.reshape(k), residual.reshape(k)
    d = d if d.stride(0) == 1 else d.contiguous()
    r = r if r.stride(0) == 1 else r.contiguous()
    out = torch.empty(residual.shape[:-1] + (n,), dtype=w.dtype, device=w.device)
    total = torch.empty_like(r)
    pdl = launch.pdl and pdl_supported(w.device)
    norm_gemv_kernel[(triton.cdiv(n, launch.block_n),)](
        d, r, norm_weight, w, out, total, n, k, w.stride(0), float(eps), BLOCK_N=launch.block_n,
        BLOCK_K=launch.block_k, BLOCK_H=triton.next_power_of_2(k), PDL=pdl, launch_pdl=pdl,
        num_warps=launch.num_warps)
    return out, total.view(residual.shape)


def norm_gemv_applies(delta: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether `norm_gemv` takes this call in a model: whatever the plain GEMV takes
    (impl.model.gemv's `gemv_applies`: one row of 16-bit activations on a GPU, ...)."""
    return gemv_applies(delta, w, None)


__all__ = ["norm_gemv", "norm_gemv_applies", "norm_gemv_kernel", "norm_gemv_reference"]
