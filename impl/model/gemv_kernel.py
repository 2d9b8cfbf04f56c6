"""The Triton kernels of impl.model.gemv (the split-K GEMV of one decode token), and `gemv`."""

from __future__ import annotations

import torch

from impl.model.gemv import GemvConfig
from impl.triton_env import tl, triton

@triton.jit
def gemv_split_kernel(x_ptr, w_ptr, partial_ptr, N, K, stride_wn, K_PER_SPLIT,
                      BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_n = tl.program_id(0)
    split = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    rows = tl.minimum(offs_n, N - 1).to(tl.int64)  # clamped: loads stay in bounds, never stored
    acc = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
    k_start = split * K_PER_SPLIT
    k_end = tl.minimum(k_start + K_PER_SPLIT, K)
    for k0 in range(k_start, k_end, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_ok = offs_k < k_end
        x = tl.load(x_ptr + offs_k, mask=k_ok, other=0.0).to(tl.float32)
        w = tl.load(w_ptr + rows[:, None] * stride_wn + offs_k[None, :], mask=k_ok[None, :], other=0.0)
        acc += w.to(tl.float32) * x[None, :]
    tl.store(partial_ptr + split * N + offs_n, tl.sum(acc, axis=1), mask=n_ok)


@triton.jit
def gemv_reduce_kernel(partial_ptr, out_ptr, N, SPLIT_K: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < N
    acc = tl.zeros([BLOCK], tl.float32)
    for s in tl.static_range(SPLIT_K):
        acc += tl.load(partial_ptr + s * N + offs, mask=ok, other=0.0)
    tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=ok)


REDUCE_BLOCK = 1024


def gemv(x: torch.Tensor, w: torch.Tensor, config: GemvConfig) -> torch.Tensor:
    """x [..., K] with one row in all (a decode token), w [N, K] (last dim contiguous) -> [..., N]
    in x's dtype, accumulated in fp32, with launch config `config`."""
    n, k = w.shape
    if x.shape[-1] != k or x.numel() != k:
        raise ValueError(f"gemv: x {tuple(x.shape)} must hold one row of K={k} (the weight is {tuple(w.shape)})")
    if w.stride(-1) != 1:
        raise ValueError(f"gemv: the weight must be contiguous in K, got strides {w.stride()}")
    if x.device != w.device:
        raise ValueError(f"gemv: x is on {x.device}, the weight on {w.device}")
    xv = x.reshape(k).contiguous()
    per_split = triton.cdiv(triton.cdiv(k, config.split_k), config.block_k) * config.block_k
    splits = triton.cdiv(k, per_split)
    partial = torch.empty(splits, n, dtype=torch.float32, device=x.device)
    gemv_split_kernel[(triton.cdiv(n, config.block_n), splits)](
        xv, w, partial, n, k, w.stride(0), per_split, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
        num_warps=config.num_warps, num_stages=config.num_stages)
    out = torch.empty(n, dtype=x.dtype, device=x.device)
    gemv_reduce_kernel[(triton.cdiv(n, REDUCE_BLOCK),)](partial, out, n, SPLIT_K=splits, BLOCK=REDUCE_BLOCK)
    return out.view(*x.shape[:-1], n)
