"""A projection, the residual add after it and the RMS norm after that, as one GEMV: for one token,
`(rms_norm(residual + x @ w.T), residual + x @ w.T)`.

Why: a decode token's attention layer ends in two dependent launches, its o_proj GEMV
(impl/model/gemv.py) and the add + norm feeding the MoE layer (impl/model/add_rms_norm.py, one
program), and each hop of a chain of short launches costs its wait and its memory flush. The norm
needs the whole projected row, which no one GEMV program holds, so here the programs count
themselves done on a counter: each stores its rows of the projection, then adds one (acquire and
release at GPU scope, after a CTA barrier, so its rows are visible to whoever counts after it);
the program that counts last reads the whole row back from L2, adds the residual stream, norms
the sum, stores both and zeroes the counter for the next launch (a CUDA graph replays it as is).
The launch after it waits for the whole grid, that last program's norm included.

The counter is one int32 the call site owns (a module's buffer, `new_counter`), zero when it is
made and after every launch; it is never allocated in the decode step, whose CUDA graph replays
the launches as captured.

Numerics are the two launches': the projection rounded to the activations' dtype (as
gemv_kernel stores it), the sum rounded to the stream's dtype, fp32 statistics over it, the norm
weight taken in the activations' dtype. The statistics' sum runs in another order than
add_rms_norm_kernel's (another layout), so a normed value may land on the other neighbour of its
rounding.

`gemv_norm_reference` is the two steps in torch; the kernel runs on CUDA tensors and under
Triton's interpreter in the tests (there the programs run one after another, so the counting is
exercised but not its races: tests/test_gemv_norm.py runs it on a GPU too).
"""

from __future__ import annotations

import torch

from impl.model.add_rms_norm import add_rms_norm_reference
from impl.model.gemv import DTYPES, GemvLaunch, gemv_applies, gemv_reference, launch_for, row_sums, weight_rows
from impl.moe.triton_pdl import pdl_release, pdl_supported, pdl_wait
from impl.triton_env import tl, triton


@triton.jit
def gemv_norm_kernel(x_ptr, w_ptr, residual_ptr, norm_w_ptr, delta_ptr, out_ptr, sum_ptr, count_ptr, N, K,
                     stride_wn, eps, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_H: tl.constexpr,
                     PDL: tl.constexpr):
    """delta[n] = sum_k x[k] * w[n, k] for this program's BLOCK_N rows (as gemv_kernel); the last
    program to finish then stores sum = round(residual + delta) and out = rms_norm(sum) * norm_w.
    BLOCK_H: N rounded up to a power of two."""
    rows, offs_n, n_ok, offs_k, w = weight_rows(w_ptr, stride_wn, N, K, BLOCK_N, BLOCK_K)
    pdl_wait(PDL)  # x comes from the launch before this one
    pdl_release(PDL)
    acc = row_sums(rows, n_ok, offs_k, w, x_ptr, K, x_ptr, x_ptr, 1.0, BLOCK_K, False)
    tl.store(delta_ptr + offs_n[None, :], acc[None, :].to(delta_ptr.dtype.element_ty), mask=n_ok[None, :])
    tl.debug_barrier()  # every thread's rows stored before this program counts itself done
    done = tl.atomic_add(count_ptr, 1, sem="acq_rel", scope="gpu")
    if done == tl.num_programs(0) - 1:
        offs_h = tl.arange(0, BLOCK_H)
        h_ok = offs_h < N
        # .cg: from L2, where the other programs' rows are; this SM's L1 may hold none of them.
        d = tl.load(delta_ptr + offs_h, mask=h_ok, other=0.0, cache_modifier=".cg").to(tl.float32)
        r = tl.load(residual_ptr + offs_h, mask=h_ok, other=0.0).to(tl.float32)
        s = (r + d).to(sum_ptr.dtype.element_ty)
        tl.store(sum_ptr + offs_h, s, mask=h_ok)
        sf = s.to(tl.float32)
        inv = tl.rsqrt(tl.sum(sf * sf, axis=0) / N + eps)
        nw = tl.load(norm_w_ptr + offs_h, mask=h_ok, other=0.0).to(out_ptr.dtype.element_ty).to(tl.float32)
        tl.store(out_ptr + offs_h, (sf * inv * nw).to(out_ptr.dtype.element_ty), mask=h_ok)
        tl.atomic_xchg(count_ptr, 0, sem="relaxed", scope="gpu")  # ready for the next launch


def gemv_norm_reference(x: torch.Tensor, w: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor,
                        eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(residual + x @ w.T), residual + x @ w.T) in torch: the fp32 product rounded to
    x's dtype, then add_rms_norm_reference."""
    return add_rms_norm_reference(gemv_reference(x, w).view(residual.shape), residual, norm_weight, eps)


def new_counter(device=None) -> torch.Tensor:
    """A call site's done counter: one zeroed int32 (keep it as a module's non-persistent buffer,
    so it moves with the module and stays out of its state dict)."""
    return torch.zeros(1, dtype=torch.int32, device=device)


def _check(x: torch.Tensor, w: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor,
           counter: torch.Tensor) -> None:
    if w.dim() != 2 or w.stride(1) != 1:
        raise ValueError(f"gemv_norm: w must be 2-d with contiguous rows, got {tuple(w.shape)} strides {w.stride()}")
    n, k = w.shape
    if x.shape[-1] != k or x.numel() != k:
        raise ValueError(f"gemv_norm: x {tuple(x.shape)} must hold one row of w's {k} inputs (w {tuple(w.shape)})")
    if residual.shape[-1] != n or residual.numel() != n:
        raise ValueError(f"gemv_norm: residual {tuple(residual.shape)} must hold one row of w's {n} outputs")
    if norm_weight.shape != (n,):
        raise ValueError(f"gemv_norm: norm weight {tuple(norm_weight.shape)} does not match the {n} outputs")
    if not x.dtype == residual.dtype == w.dtype or w.dtype not in DTYPES + (torch.float32,):
        raise TypeError(f"gemv_norm: x {x.dtype}, residual {residual.dtype} and w {w.dtype} must be one float dtype")
    if counter.dtype != torch.int32 or counter.numel() != 1:
        raise TypeError(f"gemv_norm: the done counter must be one int32 (new_counter), got {counter.dtype} "
                        f"{tuple(counter.shape)}")
    devices = {x.device, w.device, residual.device, norm_weight.device, counter.device}
    if len(devices) != 1:
        raise ValueError(f"gemv_norm: tensors on {sorted(map(str, devices))}")


def gemv_norm(x: torch.Tensor, w: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor, eps: float,
              counter: torch.Tensor, launch: GemvLaunch | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """`gemv_norm_reference` in one launch of `gemv_norm_kernel` (launch: the GEMV's tile, by
    default impl.model.gemv's for w's shape; counter: the call site's `new_counter`). Returns (out,
    sum), both shaped as residual."""
    _check(x, w, residual, norm_weight, counter)
    n, k = w.shape
    launch = launch or launch_for(n, k)
    xc, r = x.reshape(k), residual.reshape(n)
    xc = xc if xc.stride(0) == 1 else xc.contiguous()
    r = r if r.stride(0) == 1 else r.contiguous()
    delta, out, total = (torch.empty_like(r) for _ in range(3))
    pdl = launch.pdl and pdl_supported(w.device)
    gemv_norm_kernel[(triton.cdiv(n, launch.block_n),)](
        xc, w, r, norm_weight, delta, out, total, counter, n, k, w.stride(0), float(eps),
        BLOCK_N=launch.block_n, BLOCK_K=launch.block_k, BLOCK_H=triton.next_power_of_2(n), PDL=pdl,
        launch_pdl=pdl, num_warps=launch.num_warps)
    return out.view(residual.shape), total.view(residual.shape)


# Whether `gemv_norm` takes a call in a model: exactly what the plain GEMV takes (one row of 16-bit
# activations on a GPU, a weight of its dtype with contiguous rows, no bias).
gemv_norm_applies = gemv_applies


__all__ = ["gemv_norm", "gemv_norm_applies", "gemv_norm_kernel", "gemv_norm_reference", "new_counter"]
