"""A decode step's bf16 projections, `x @ w.T` for x [M, K] (M <= 4: one token, or an MTP verify
step's tokens) and w [N, K], as a Triton GEMV that starts streaming its weight before the kernel
ahead of it has finished.

Why: a decode step is a chain of short dependent launches, and a projection's weight (the bytes
that matter) does not depend on the launch before it; only x does. Launched with programmatic
dependent launch (PDL; impl/moe/triton_pdl.py's rules) each program loads its first K tile of
weights into registers, then waits for x. Each program owns BLOCK_N weight rows and walks K in
BLOCK_K steps, fp32 products summed per row at the end; with M rows each weight tile is loaded
once and multiplied by all of them.

Measured on the H200 (scripts/gpu/bench_gemv.py, each projection after the norm kernel that feeds
it, weights from HBM; notes/runs/2026-12-04-gemv-bench-h200.log): o_proj (2560 x 4096, 21 MB)
6.3 us against cuBLAS's 11.5 (78% of the copy bandwidth against 43%), KDA's fused input
projection 27.9 against 30.3 us, MLA's 11.2 against 13.2, the dense MLP's 9.3-9.6 against
12.5-14.4. Without PDL the same tiles take 1.3-1.6 us more; asking for the rows in L2 before the
wait (`prefetch.global.L2`) cost 0.5-3.3 us more than not, and is not done.

`linear` is the models' projection call: this kernel for up to MAX_ROWS rows of 16-bit
activations on a GPU, F.linear otherwise. `gemv_reference` is the fp32 product rounded to the output dtype.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from impl import backends
from impl.moe.triton_pdl import pdl_release, pdl_supported, pdl_wait
from impl.triton_env import tl, triton


@dataclass(frozen=True)
class GemvLaunch:
    """A launch configuration: weight rows a program, hidden elements a loop step, warps, and
    `pdl` (start while the launch before runs, wait for x; where the GPU has PDL, sm_90 on)."""
    block_n: int = 2
    block_k: int = 1024
    num_warps: int = 4
    pdl: bool = True

    def __post_init__(self) -> None:
        for name in ("block_n", "block_k"):
            v = getattr(self, name)
            if v < 1 or v & (v - 1):
                raise ValueError(f"GemvLaunch.{name} must be a power of two, got {v}")
        if self.num_warps not in (1, 2, 4, 8, 16):
            raise ValueError(f"GemvLaunch.num_warps must be 1, 2, 4, 8 or 16, got {self.num_warps}")


# (N, K) -> launch, from scripts/gpu/bench_gemv.py's sweep on the H200 (best of 24 tiles each);
# every other shape takes DEFAULT_LAUNCH, the best tile at all the others measured.
TUNED = {(2560, 4096): GemvLaunch(block_n=4, block_k=1024, num_warps=8)}
DEFAULT_LAUNCH = GemvLaunch()
DTYPES = (torch.bfloat16, torch.float16)
# Rows one launch takes: a decode token, or the 4 tokens of an MTP verify step at k = 3 drafts.
MAX_ROWS = 4


def launch_for(n: int, k: int) -> GemvLaunch:
    return TUNED.get((n, k), DEFAULT_LAUNCH)


@triton.jit
def _products(w, x, BLOCK_M: tl.constexpr):
    """One K tile's products in fp32: w [BLOCK_N, BLOCK_K] times x [BLOCK_M, BLOCK_K], as
    [BLOCK_N, BLOCK_K] for one row (x broadcast) and [BLOCK_M, BLOCK_N, BLOCK_K] for more."""
    if BLOCK_M == 1:
        return w.to(tl.float32) * x.to(tl.float32)
    else:
        return w.to(tl.float32)[None, :, :] * x.to(tl.float32)[:, None, :]


@triton.jit
def gemv_kernel(x_ptr, w_ptr, out_ptr, M, N, K, stride_xm, stride_om, stride_wn, BLOCK_M: tl.constexpr,
                BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr):
    """out[m, n] = sum_k x[m, k] * w[n, k] for this program's BLOCK_N rows of w and every m < M
    (BLOCK_M >= M): each weight tile is loaded once for all rows."""
    pid = tl.program_id(0)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_ok = offs_m < M
    n_ok = offs_n < N
    rows = w_ptr + offs_n.to(tl.int64)[:, None] * stride_wn
    xs = x_ptr + offs_m[:, None] * stride_xm
    # The first tile is read before the wait: weights were written long before this launch.
    w = tl.load(rows + offs_k[None, :], mask=n_ok[:, None] & (offs_k < K)[None, :], other=0.0,
                eviction_policy="evict_first")
    pdl_wait(PDL)  # x comes from the launch before this one
    pdl_release(PDL)
    x = tl.load(xs + offs_k[None, :], mask=m_ok[:, None] & (offs_k < K)[None, :], other=0.0)
    acc = _products(w, x, BLOCK_M)
    for k0 in range(BLOCK_K, K, BLOCK_K):
        k_ok = (k0 + offs_k) < K
        w = tl.load(rows + (k0 + offs_k)[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0,
                    eviction_policy="evict_first")
        x = tl.load(xs + (k0 + offs_k)[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        acc += _products(w, x, BLOCK_M)
    if BLOCK_M == 1:
        out = tl.sum(acc, axis=1)[None, :]
    else:
        out = tl.sum(acc, axis=2)
    tl.store(out_ptr + offs_m[:, None] * stride_om + offs_n[None, :], out.to(out_ptr.dtype.element_ty),
             mask=m_ok[:, None] & n_ok[None, :])


def gemv_reference(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x @ w.T in fp32, rounded to x's dtype."""
    return (x.float() @ w.float().t()).to(x.dtype)


def _rows(x: torch.Tensor, k: int) -> int:
    return x.numel() // k if k and x.shape[-1] == k else 0


def _check(x: torch.Tensor, w: torch.Tensor) -> None:
    rows = _rows(x, w.shape[1]) if w.dim() == 2 else 0
    if w.dim() != 2 or not 1 <= rows <= MAX_ROWS:
        raise ValueError(f"gemv: x {tuple(x.shape)} must hold 1 to {MAX_ROWS} rows of w's "
                         f"{w.shape[1] if w.dim() == 2 else '?'} inputs (w {tuple(w.shape)})")
    if x.dtype != w.dtype:
        raise TypeError(f"gemv: x is {x.dtype}, w is {w.dtype}")
    if x.device != w.device:
        raise ValueError(f"gemv: x on {x.device}, w on {w.device}")
    if w.stride(1) != 1:
        raise ValueError(f"gemv: w's rows must be contiguous, strides {w.stride()}")


def gemv(x: torch.Tensor, w: torch.Tensor, launch: GemvLaunch = DEFAULT_LAUNCH,
         out: torch.Tensor | None = None) -> torch.Tensor:
    """x @ w.T for up to MAX_ROWS rows x (shape [..., K]) in one launch of `gemv_kernel`."""
    _check(x, w)
    n, k = w.shape
    m = _rows(x, k)
    xc = x.reshape(m, k)
    if xc.stride(1) != 1:
        xc = xc.contiguous()
    if out is None:
        out = torch.empty(x.shape[:-1] + (n,), dtype=x.dtype, device=x.device)
    elif (out.numel() != m * n or out.shape[-1] != n or out.dtype != x.dtype or out.device != x.device
          or (n > 1 and out.stride(-1) != 1) or (m > 1 and not out.is_contiguous())):
        raise ValueError(f"gemv: out must hold {m} x {n} {x.dtype} values with contiguous rows on {x.device}, got "
                         f"{tuple(out.shape)} {out.dtype} on {out.device} with strides {out.stride()}")
    pdl = launch.pdl and pdl_supported(x.device)
    gemv_kernel[(triton.cdiv(n, launch.block_n),)](
        xc, w, out, m, n, k, xc.stride(0), n, w.stride(0), BLOCK_M=triton.next_power_of_2(m),
        BLOCK_N=launch.block_n, BLOCK_K=launch.block_k, PDL=pdl, launch_pdl=pdl, num_warps=launch.num_warps)
    return out


def gemv_applies(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """Whether `linear` takes the kernel: up to MAX_ROWS rows (a decode token, a verify step's
    tokens) of 16-bit activations and a weight of the same dtype with contiguous rows, on a GPU,
    no bias. (A prompt's rows stay with cuBLAS's tensor-core GEMMs.)"""
    return (bias is None and x.is_cuda and x.dtype in DTYPES and w.dtype == x.dtype and w.dim() == 2
            and 1 <= _rows(x, w.shape[1]) <= MAX_ROWS and w.stride(1) == 1)


def linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, w, bias), through `gemv_kernel` where `gemv_applies` (noted as provenance)."""
    if not gemv_applies(x, w, bias):
        return F.linear(x, w, bias)
    n, k = w.shape
    backends.note("projection", "gemv", "gemv_kernel", n=n, k=k, rows=_rows(x, k))
    return gemv(x, w, launch_for(n, k))


__all__ = ["DEFAULT_LAUNCH", "MAX_ROWS", "TUNED", "GemvLaunch", "gemv", "gemv_applies", "gemv_kernel", "gemv_reference",
           "launch_for", "linear"]
