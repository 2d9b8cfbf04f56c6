"""One token's bf16 projection, `x @ w.T` for x [1, K] and w [N, K], as a Triton GEMV that starts
streaming its weight before the kernel ahead of it has finished.

Why: a decode step is a chain of short dependent launches, and a projection's weight (the bytes
that matter) does not depend on the launch before it; only x does. Launched with programmatic
dependent launch (PDL; impl/moe/triton_pdl.py's rules) each program loads its first K tile of
weights into registers, then waits for x. Each program owns BLOCK_N weight rows and walks K in
BLOCK_K steps, fp32 products summed per row at the end.

Measured on the H200 (scripts/gpu/bench_gemv.py, each projection after the norm kernel that feeds
it, weights from HBM; notes/runs/2026-12-04-gemv-bench-h200-rows.log): o_proj (2560 x 4096, 21 MB)
6.7 us against cuBLAS's 11.5 (73% of the copy bandwidth against 42%), KDA's fused input
projection 26.3 against 30.8 us, MLA's 10.0 against 13.2, the dense MLP's 8.8-9.0 against
12.5-14.3. Without PDL the same tiles take 1.3-1.6 us more; asking for the rows in L2 before the
wait (`prefetch.global.L2`) cost 0.5-3.3 us more than not (notes/runs/2026-12-04-gemv-bench-h200.log),
and is not done.

`linear` is the models' projection call: this kernel for one row of 16-bit activations on a GPU,
F.linear otherwise. `gemv_reference` is the fp32 product rounded to the output dtype.
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


def launch_for(n: int, k: int) -> GemvLaunch:
    return TUNED.get((n, k), DEFAULT_LAUNCH)


@triton.jit
def gemv_kernel(x_ptr, w_ptr, out_ptr, N, K, stride_wn, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                PDL: tl.constexpr):
    """out[n] = sum_k x[k] * w[n, k] for this program's BLOCK_N rows (x read as [1, BLOCK_K] tiles,
    the sums stored as a [1, BLOCK_N] one)."""
    pid = tl.program_id(0)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    n_ok = offs_n < N
    rows = w_ptr + offs_n.to(tl.int64)[:, None] * stride_wn
    # The first tile is read before the wait: weights were written long before this launch.
    w = tl.load(rows + offs_k[None, :], mask=n_ok[:, None] & (offs_k < K)[None, :], other=0.0,
                eviction_policy="evict_first")
    pdl_wait(PDL)  # x comes from the launch before this one
    pdl_release(PDL)
    x = tl.load(x_ptr + offs_k[None, :], mask=(offs_k < K)[None, :], other=0.0)
    acc = w.to(tl.float32) * x.to(tl.float32)
    for k0 in range(BLOCK_K, K, BLOCK_K):
        k_ok = (k0 + offs_k) < K
        w = tl.load(rows + (k0 + offs_k)[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0,
                    eviction_policy="evict_first")
        x = tl.load(x_ptr + (k0 + offs_k)[None, :], mask=k_ok[None, :], other=0.0)
        acc += w.to(tl.float32) * x.to(tl.float32)
    tl.store(out_ptr + offs_n[None, :], tl.sum(acc, axis=1)[None, :].to(out_ptr.dtype.element_ty),
             mask=n_ok[None, :])


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


def gemv(x: torch.Tensor, w: torch.Tensor, launch: GemvLaunch = DEFAULT_LAUNCH,
         out: torch.Tensor | None = None) -> torch.Tensor:
    """x @ w.T for one row x (shape [..., K] with one row in all) in one launch of `gemv_kernel`."""
    _check(x, w)
    n, k = w.shape
    xc = x.reshape(k)
    if xc.stride(0) != 1:
        xc = xc.contiguous()
    if out is None:
        out = torch.empty(x.shape[:-1] + (n,), dtype=x.dtype, device=x.device)
    elif out.numel() != n or out.dtype != x.dtype or out.device != x.device or (n > 1 and out.stride(-1) != 1):
        raise ValueError(f"gemv: out must hold {n} contiguous {x.dtype} values on {x.device}, got "
                         f"{tuple(out.shape)} {out.dtype} on {out.device} with strides {out.stride()}")
    pdl = launch.pdl and pdl_supported(x.device)
    gemv_kernel[(triton.cdiv(n, launch.block_n),)](
        xc, w, out, n, k, w.stride(0), BLOCK_N=launch.block_n, BLOCK_K=launch.block_k, PDL=pdl,
        launch_pdl=pdl, num_warps=launch.num_warps)
    return out


def gemv_applies(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """Whether `linear` takes the kernel: one row of 16-bit activations and a weight of the same
    dtype with contiguous rows, on a GPU, no bias. (More rows, a verify pass's or a prompt's,
    stay with cuBLAS: this kernel with each weight tile loaded once for a verify step's 4 rows
    took 1.27-2.26x cuBLAS's time, notes/ling-ladder.md.)"""
    return (bias is None and x.is_cuda and x.dtype in DTYPES and w.dtype == x.dtype and w.dim() == 2
            and x.numel() == w.shape[1] and w.stride(1) == 1)


def _gemv_linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, w, bias), through `gemv_kernel` where `gemv_applies`; each call noted."""
    if not gemv_applies(x, w, bias):
        backends.note("projection", "gemv", "F.linear", rows=x.numel() // max(w.shape[1], 1))
        return F.linear(x, w, bias)
    n, k = w.shape
    backends.note("projection", "gemv", "gemv_kernel", n=n, k=k)
    return gemv(x, w, launch_for(n, k))


def _cublas_linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    backends.note("projection", "cublas", "F.linear", rows=x.numel() // max(w.shape[1], 1))
    return F.linear(x, w, bias)


GEMV_BACKEND = backends.register(backends.Backend(
    "projection", "gemv", _gemv_linear, "one row of 16-bit activations on CUDA through the PDL-launched Triton "
    "GEMV; more rows (a verify or prompt pass) and other devices through F.linear"))
backends.register(backends.Backend("projection", "cublas", _cublas_linear, "F.linear (cuBLAS on CUDA) always"))


def linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None,
           backend: backends.Backend | None = None) -> torch.Tensor:
    """The models' projection: F.linear(x, w, bias) through the projection backend `backend`
    (default `gemv`: the kernel where `gemv_applies`)."""
    return (backend or GEMV_BACKEND).fn(x, w, bias)


__all__ = ["DEFAULT_LAUNCH", "TUNED", "GemvLaunch", "gemv", "gemv_applies", "gemv_kernel", "gemv_reference",
           "launch_for", "linear"]
