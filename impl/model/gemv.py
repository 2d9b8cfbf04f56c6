"""One token's bf16 projection, `x @ w.T` for x [1, K] and w [N, K], as a Triton GEMV that starts
streaming its weight before the kernel ahead of it has finished.

Why: a decode step is a chain of short dependent launches, and a projection's weight (the bytes
that matter) does not depend on the launch before it; only x does. Launched with programmatic
dependent launch (PDL; impl/moe/triton_pdl.py's rules) each program asks for its weight rows in
L2 and loads its first K tile into registers, then waits for x. cuBLAS cannot start before its
input is ready, and at Ling-3.0-flash's shapes it reads o_proj's 21 MB at 40% of the copy
bandwidth (notes/ling-ladder.md).

Each program owns BLOCK_N weight rows and walks K in BLOCK_K steps, fp32 products summed per row
at the end. `gemv_reference` is the fp32 product rounded to the output dtype.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from impl.moe.triton_pdl import pdl_release, pdl_wait, prefetch_l2, use_pdl
from impl.triton_env import ASM, tl, triton


@dataclass(frozen=True)
class GemvLaunch:
    """A launch configuration: weight rows a program, hidden elements a loop step, warps; `pdl`
    (start early, wait for x) and `prefetch` (ask for the program's rows in L2 before the wait)."""
    block_n: int = 8
    block_k: int = 512
    num_warps: int = 4
    pdl: bool = True
    prefetch: bool = True

    def __post_init__(self) -> None:
        for name in ("block_n", "block_k"):
            v = getattr(self, name)
            if v < 1 or v & (v - 1):
                raise ValueError(f"GemvLaunch.{name} must be a power of two, got {v}")
        if self.num_warps not in (1, 2, 4, 8, 16):
            raise ValueError(f"GemvLaunch.num_warps must be 1, 2, 4, 8 or 16, got {self.num_warps}")
        if self.prefetch and not self.pdl:
            raise ValueError("GemvLaunch.prefetch needs pdl (it fills the time spent waiting)")


@triton.jit
def gemv_kernel(x_ptr, w_ptr, out_ptr, N, K, stride_wn, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                PDL: tl.constexpr, PREFETCH: tl.constexpr, ASM: tl.constexpr):
    """out[n] = sum_k x[k] * w[n, k] for this program's BLOCK_N rows."""
    pid = tl.program_id(0)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    n_ok = offs_n < N
    rows = w_ptr + offs_n.to(tl.int64)[:, None] * stride_wn
    if PREFETCH:  # rows are contiguous: one range from the first row to past the last
        last = tl.minimum(pid * BLOCK_N + BLOCK_N, N)
        prefetch_l2(w_ptr + pid.to(tl.int64) * BLOCK_N * stride_wn, w_ptr + last.to(tl.int64) * stride_wn, ASM)
    # The first tile is read before the wait: weights were written long before this launch.
    w = tl.load(rows + offs_k[None, :], mask=n_ok[:, None] & (offs_k < K)[None, :], other=0.0,
                eviction_policy="evict_first")
    pdl_wait(PDL)  # x comes from the launch before this one
    pdl_release(PDL)
    x = tl.load(x_ptr + offs_k, mask=offs_k < K, other=0.0)
    acc = w.to(tl.float32) * x.to(tl.float32)[None, :]
    for k0 in range(BLOCK_K, K, BLOCK_K):
        k_ok = (k0 + offs_k) < K
        w = tl.load(rows + (k0 + offs_k)[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0,
                    eviction_policy="evict_first")
        x = tl.load(x_ptr + k0 + offs_k, mask=k_ok, other=0.0)
        acc += w.to(tl.float32) * x.to(tl.float32)[None, :]
    tl.store(out_ptr + offs_n, tl.sum(acc, axis=1).to(out_ptr.dtype.element_ty), mask=n_ok)


def gemv_reference(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x @ w.T in fp32, rounded to x's dtype."""
    return (x.float() @ w.float().t()).to(x.dtype)


def _check(x: torch.Tensor, w: torch.Tensor) -> None:
    if w.dim() != 2 or x.shape[-1] != w.shape[1] or x.numel() != w.shape[1]:
        raise ValueError(f"gemv: x {tuple(x.shape)} must hold one row of w's {w.shape[1] if w.dim() == 2 else '?'} "
                         f"inputs (w {tuple(w.shape)})")
    if x.dtype != w.dtype:
        raise TypeError(f"gemv: x is {x.dtype}, w is {w.dtype}")
    if x.device != w.device:
        raise ValueError(f"gemv: x on {x.device}, w on {w.device}")
    if w.stride(1) != 1:
        raise ValueError(f"gemv: w's rows must be contiguous, strides {w.stride()}")


def gemv(x: torch.Tensor, w: torch.Tensor, launch: GemvLaunch = GemvLaunch(),
         out: torch.Tensor | None = None) -> torch.Tensor:
    """x @ w.T for one row x (shape [..., K] with one row in all) in one launch of `gemv_kernel`."""
    _check(x, w)
    n, k = w.shape
    xc = x.reshape(k)
    if xc.stride(0) != 1:
        xc = xc.contiguous()
    if out is None:
        out = torch.empty(x.shape[:-1] + (n,), dtype=x.dtype, device=x.device)
    pdl = use_pdl(launch.pdl, x.device) if x.is_cuda else False
    gemv_kernel[(triton.cdiv(n, launch.block_n),)](
        xc, w, out, n, k, w.stride(0), BLOCK_N=launch.block_n, BLOCK_K=launch.block_k, PDL=pdl,
        PREFETCH=pdl and launch.prefetch, ASM=ASM, launch_pdl=pdl, num_warps=launch.num_warps)
    return out


__all__ = ["GemvLaunch", "gemv", "gemv_kernel", "gemv_reference"]
