"""FP8 (e4m3) weight x bf16 activation GEMV/GEMM for small M (decode and verify), in Triton.

out[m, n] = scale[n] * sum_k x[m, k] * w[n, k]   (scale per row [N], or one per tensor [])
out[m, n] = sum_k scale[n // bn, k // bk] * x[m, k] * w[n, k]   (scale per block of bn x bk weights)

The block form is how FP8 checkpoints ship their projections (DeepSeek-V3's layout, 128 x 128
blocks): each K tile's products take their block's scale before they are added up, so a K tile
never spans two blocks (BLOCK_K is cut to bk where it is larger; bk a power of two).

Bandwidth is the whole story at decode: the weight [N, K] is read once (N*K bytes), the
activations (M*K*2 bytes) and the output (M*N*2 or *4 bytes) are small. The grid runs over
blocks of BLOCK_N weight rows (a 150k vocabulary gives thousands of programs, enough to fill
every SM several times; no split over K is needed); each program walks K in steps of BLOCK_K,
software-pipelined `num_stages` deep, and applies the weight scale once per output at the end.

Three inner products (`PATH`), all accumulating in fp32 (H200 figures: scripts/gpu/bench_head.py):
  * "split" (PATH 2, the fast one on Hopper; bf16 activations): the e4m3 weight tile goes from
    memory through shared memory to the FP8 tensor cores as it is, with no conversion at all
    (converting every weight element to 16 or 32 bits is what capped the other paths at 55-72% of
    the byte floor on the H200). The activations are made e4m3 instead, exactly: per K tile and
    row, a power-of-two scale s (amax / s in [128, 256)) and x / s = hi + lo / 32, hi and lo both
    e4m3 values (the residual x / s - hi is at most half an ulp of hi, <= 8, so 32 times it stays
    below 256). A bf16 value has 8 significant bits and an e4m3 value 4, so the two terms
    reproduce it exactly for every element with x / s >= 2**-7, i.e. x >= amax * 2**-15 (the
    scaled residual is then a multiple of 2**-9, the e4m3 subnormal step); smaller elements are
    off by at most s * 2**-15 (< amax * 2**-22): negligible even next to outlier channels 1000x
    the typical activation. hi and lo of BLOCK_M rows form one MMA operand of 2 * BLOCK_M
    columns (scales s and s / 32), so the weight tile passes through the tensor cores once.
    Each tile's products are scaled and added into the fp32 accumulator, so the tensor cores'
    own accumulation (fewer bits than fp32 for FP8 on Hopper) spans one tile only: 2e-4
    relative to the fp32 reference on the H200 with BLOCK_K = 256, below the bf16 rounding of
    the logits. A row whose tile holds a NaN or an
    Inf gets s = NaN, so it gives NaN logits, and only that row does.
  * "dot" (PATH 1): the weight tile upcast (exactly) to the activations' dtype, 16-bit tensor
    cores; fp32 activations use an IEEE fp32 dot. Used for fp16 / fp32 activations, and on GPUs
    without FP8 tensor cores.
  * "fma" (PATH 0): an fp32 [BLOCK_M, BLOCK_N, BLOCK_K] multiply-accumulate on CUDA cores,
    reduced over K once at the end (M <= 4; an alternative for the sweep, not used by the table).
Rows past N are clamped to row N-1 for loading (never stored), so weight loads need no mask;
the K tail is masked only when K is not a multiple of BLOCK_K; activation rows past M load as
zeros (masked, so they cost no memory traffic) and are never stored.

Under Triton's interpreter (CPU) bf16 arithmetic is wrong, so `FP32_MATH` upcasts both operands
of every dot to fp32 (IEEE); the split of the activations runs as on the GPU except for the
rounding to e4m3 itself (`_to_e4m3`: the interpreter's fp32 -> fp8 cast is wrong at binade edges).
"""

from __future__ import annotations

import functools

import torch

from impl.head.gemv_config import DOT_ROWS, GemvConfig, lookup
from impl.launch_tables import config_devices
from impl.quant.fp8 import block_scale_shape, check_block, dequantize_fp8
from impl.triton_env import FP32_MATH, INTERPRET, tl, triton

__all__ = ["ACTIVATION_DTYPES", "OUTPUT_DTYPES", "fp8_gemv", "fp8_gemv_kernel", "fp8_gemv_reference",
           "kernel_path", "launch_config"]

ACTIVATION_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
OUTPUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_PATH_IDS = {"fma": 0, "dot": 1, "split": 2}


@triton.jit
def _dot(a, b, acc, FP32_MATH: tl.constexpr):
    if FP32_MATH:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    else:
        return tl.dot(a, b, acc)


@triton.jit
def _to_e4m3(r, FP32_MATH: tl.constexpr):
    """fp32 r (|r| < 448) rounded to the nearest e4m3 value, ties to even. On the GPU: the hardware
    conversion to e4m3. Under the interpreter, whose fp32 -> fp8 cast does not carry a rounding into
    the exponent (127.99 -> 64), the same value computed in fp32: 3 mantissa bits kept (ties to
    even) for normals, multiples of 2**-9 below 2**-6 (e4m3 subnormals)."""
    if FP32_MATH:
        bits = r.to(tl.int32, bitcast=True)
        normal = ((bits + 0x7FFFF + ((bits >> 20) & 1)) & -1048576).to(tl.float32, bitcast=True)
        subnormal = (r + 24576.0) - 24576.0  # 24576 = 1.5 * 2**14: its fp32 ulp is 2**-9
        return tl.where(tl.abs(r) < 0.015625, subnormal, normal)
    else:
        return r.to(tl.float8e4nv)


@triton.jit
def _block_scales(scale_ptr, rows_n, stride_sn, k0, SCALE_BN: tl.constexpr, SCALE_BK: tl.constexpr):
    """The weight scale of each row's block at K offset k0 [BLOCK_N]."""
    return tl.load(scale_ptr + (rows_n // SCALE_BN) * stride_sn + k0 // SCALE_BK)


@triton.jit
def _scale_and_store(acc, scale_ptr, rows_n, out_ptr, offs_n, offs_m, stride_om, N, m_ok, SCALE: tl.constexpr):
    """acc [BLOCK_N, BLOCK_M] (vocab rows by tokens) times the weight scales (block scales were
    applied per K tile already), stored as out[m, n]."""
    if SCALE == 1:
        acc = acc * tl.load(scale_ptr + rows_n)[:, None]
    elif SCALE == 0:
        acc = acc * tl.load(scale_ptr)
    # 64-bit row offsets: a prompt's logits pass past 2**31 elements (13,663 tokens of a 157,184 vocabulary).
    out_ptrs = out_ptr + offs_m.to(tl.int64)[None, :] * stride_om + offs_n[:, None]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=(offs_n[:, None] < N) & m_ok[None, :])


@triton.jit
def fp8_gemv_kernel(
    x_ptr, w_ptr, scale_ptr, out_ptr,
    M, N, K,
    stride_xm, stride_wn, stride_om, stride_sn,
    SCALE: tl.constexpr, SCALE_BN: tl.constexpr, SCALE_BK: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    PATH: tl.constexpr, EVEN_K: tl.constexpr, IEEE_DOT: tl.constexpr,
    FP32_MATH: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_k = tl.arange(0, BLOCK_K)
    rows_n = tl.minimum(offs_n, N - 1).to(tl.int64)  # clamped: weight loads stay in bounds, unmasked
    m_ok = offs_m < M
    w_ptrs = w_ptr + rows_n[:, None] * stride_wn + offs_k[None, :]

    if PATH == 2:
        # FP8 tensor cores: w [BLOCK_N, BLOCK_K] e4m3 as stored; x split into two e4m3 terms that
        # form one MMA operand of 2 * BLOCK_M columns [hi_0, lo_0, hi_1, lo_1, ...].
        x_ptrs = x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm + offs_k[None, :]
        acc2 = tl.zeros((BLOCK_N, 2 * BLOCK_M), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            if EVEN_K:
                w = tl.load(w_ptrs)
                x = tl.load(x_ptrs, mask=m_ok[:, None], other=0.0).to(tl.float32)
            else:
                k_ok = offs_k[None, :] < K - k0
                w = tl.load(w_ptrs, mask=k_ok, other=0.0)
                x = tl.load(x_ptrs, mask=m_ok[:, None] & k_ok, other=0.0).to(tl.float32)
            # Per row: amax (a NaN or an Inf counts as +Inf) -> power-of-two s, amax / s in [128, 256).
            amax = tl.max(tl.where(tl.abs(x) < float("inf"), tl.abs(x), float("inf")), axis=1)
            ebits = (amax.to(tl.int32, bitcast=True) >> 23) & 0xFF
            sbits = tl.minimum(tl.maximum(ebits - 7, 1), 253)
            s = (sbits << 23).to(tl.float32, bitcast=True)
            s = tl.where(ebits == 255, float("nan"), s)
            inv = ((254 - sbits) << 23).to(tl.float32, bitcast=True)  # exactly 1 / s
            r = x * inv[:, None]  # |r| < 256
            hi = _to_e4m3(r, FP32_MATH).to(tl.float32)
            # The residual is at most half an e4m3 ulp of hi (<= 8): scaled by 32 it stays below
            # 256 and its own subnormal floor moves 32x lower. Its columns are scaled by s / 32.
            lo = _to_e4m3((r - hi) * 32.0, FP32_MATH).to(tl.float32)
            # Interleave in fp32, then cast (exact: both are e4m3 values). Joining the fp8 tensors
            # themselves miscompiled with Triton 3.6 on the H200 (NaN / wrong logits).
            hl = tl.reshape(tl.permute(tl.join(hi, lo), (0, 2, 1)), (2 * BLOCK_M, BLOCK_K))
            if not FP32_MATH:
                hl = hl.to(tl.float8e4nv)
            part = _dot(w, tl.trans(hl), tl.zeros((BLOCK_N, 2 * BLOCK_M), dtype=tl.float32), FP32_MATH)
            if SCALE == 2:
                part = part * _block_scales(scale_ptr, rows_n, stride_sn, k0, SCALE_BN, SCALE_BK)[:, None]
            acc2 += part * tl.reshape(tl.join(s, s * 0.03125), (2 * BLOCK_M,))[None, :]
            w_ptrs += BLOCK_K
            x_ptrs += BLOCK_K
        a, b = tl.split(tl.reshape(acc2, (BLOCK_N, BLOCK_M, 2)))
        acc = a + b
        _scale_and_store(acc, scale_ptr, rows_n, out_ptr, offs_n, offs_m, stride_om, N, m_ok, SCALE)
    elif PATH == 1:
        # 16-bit (or IEEE fp32) tensor cores: w upcast exactly to x's dtype; x^T [BLOCK_K, BLOCK_M].
        x_ptrs = x_ptr + offs_m.to(tl.int64)[None, :] * stride_xm + offs_k[:, None]
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            if EVEN_K:
                w = tl.load(w_ptrs)
                xt = tl.load(x_ptrs, mask=m_ok[None, :], other=0.0)
            else:
                w = tl.load(w_ptrs, mask=offs_k[None, :] < K - k0, other=0.0)
                xt = tl.load(x_ptrs, mask=m_ok[None, :] & (offs_k[:, None] < K - k0), other=0.0)
            if SCALE == 2:  # each tile's products take its block's scale before they are added
                ws = _block_scales(scale_ptr, rows_n, stride_sn, k0, SCALE_BN, SCALE_BK)[:, None]
                if FP32_MATH or IEEE_DOT:
                    acc += tl.dot(w.to(tl.float32), xt.to(tl.float32), input_precision="ieee") * ws
                else:
                    acc += tl.dot(w.to(xt.dtype), xt) * ws
            elif FP32_MATH:
                acc += tl.dot(w.to(tl.float32), xt.to(tl.float32), input_precision="ieee")
            elif IEEE_DOT:
                acc = tl.dot(w.to(tl.float32), xt, acc, input_precision="ieee")
            else:
                acc = tl.dot(w.to(xt.dtype), xt, acc)
            w_ptrs += BLOCK_K
            x_ptrs += BLOCK_K
        _scale_and_store(acc, scale_ptr, rows_n, out_ptr, offs_n, offs_m, stride_om, N, m_ok, SCALE)
    else:
        # fp32 multiply-accumulate on CUDA cores; the K reduction is deferred to the end.
        x_ptrs = x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm + offs_k[None, :]
        acc3 = tl.zeros((BLOCK_M, BLOCK_N, BLOCK_K), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            if EVEN_K:
                w = tl.load(w_ptrs)
                x = tl.load(x_ptrs, mask=m_ok[:, None], other=0.0)
            else:
                w = tl.load(w_ptrs, mask=offs_k[None, :] < K - k0, other=0.0)
                x = tl.load(x_ptrs, mask=m_ok[:, None] & (offs_k[None, :] < K - k0), other=0.0)
            wf = w.to(tl.float32)
            if SCALE == 2:  # e4m3 times its block's scale, rounded once in fp32 as the reference does
                wf = wf * _block_scales(scale_ptr, rows_n, stride_sn, k0, SCALE_BN, SCALE_BK)[:, None]
            acc3 += wf[None, :, :] * x.to(tl.float32)[:, None, :]
            w_ptrs += BLOCK_K
            x_ptrs += BLOCK_K
        acc = tl.sum(acc3, axis=2)  # [BLOCK_M, BLOCK_N]
        if SCALE == 1:
            acc = acc * tl.load(scale_ptr + rows_n)[None, :]
        elif SCALE == 0:
            acc = acc * tl.load(scale_ptr)
        out_ptrs = out_ptr + offs_m.to(tl.int64)[:, None] * stride_om + offs_n[None, :]
        tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=m_ok[:, None] & (offs_n[None, :] < N))


@functools.lru_cache(maxsize=None)
def _capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def launch_config(n: int, k: int, m: int, device: torch.device) -> tuple[GemvConfig, str]:
    """The configuration `fp8_gemv` uses for this call, and the lookup rule that chose it."""
    return lookup(n, k, m, config_devices(device), interpreter=INTERPRET)


def _check(x: torch.Tensor, data: torch.Tensor, scale: torch.Tensor, out_dtype: torch.dtype,
           block: tuple[int, int] | None) -> None:
    for what, t in (("x", x), ("data", data), ("scale", scale)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"fp8_gemv: {what} must be a torch.Tensor, got {type(t).__name__}")
    if x.ndim != 2:
        raise ValueError(f"fp8_gemv: x must be 2-D [M, K], got shape {tuple(x.shape)}")
    if x.dtype not in ACTIVATION_DTYPES:
        raise TypeError(f"fp8_gemv: x must be bfloat16, float16 or float32, got {x.dtype}")
    if data.ndim != 2 or data.dtype != torch.float8_e4m3fn:
        raise TypeError(f"fp8_gemv: data must be a 2-D float8_e4m3fn [N, K] tensor, got {data.dtype} "
                        f"{tuple(data.shape)}")
    if block is not None:
        if check_block(block)[1] & (block[1] - 1):
            raise ValueError(f"fp8_gemv: block must be (rows, columns) with a power-of-two column count "
                             f"(a K tile never spans two blocks), got {block!r}")
        expected = block_scale_shape(tuple(data.shape), block)
        if scale.dtype != torch.float32 or tuple(scale.shape) != expected:
            raise ValueError(f"fp8_gemv: a scale per block of {block[0]}x{block[1]} of a {tuple(data.shape)} weight "
                             f"must be float32 {list(expected)}, got {scale.dtype} {tuple(scale.shape)}")
    elif scale.dtype != torch.float32 or tuple(scale.shape) not in ((data.shape[0],), ()):
        raise ValueError(f"fp8_gemv: scale must be float32 [N={data.shape[0]}] (per row) or [] (per tensor), "
                         f"or per block with `block` given, got {scale.dtype} {tuple(scale.shape)}")
    if x.shape[1] != data.shape[1]:
        raise ValueError(f"fp8_gemv: x has K={x.shape[1]} but the weight has K={data.shape[1]}")
    if out_dtype not in OUTPUT_DTYPES:
        raise TypeError(f"fp8_gemv: out_dtype must be bfloat16, float16 or float32, got {out_dtype}")
    if not (x.device == data.device == scale.device):
        raise ValueError(f"fp8_gemv: x ({x.device}), data ({data.device}) and scale ({scale.device}) "
                         "must be on one device")
    if x.device.type == "cpu" and not INTERPRET:
        raise ValueError("fp8_gemv: CPU tensors need Triton's interpreter (TRITON_INTERPRET=1 before impl "
                         "is imported); this process compiles Triton kernels for CUDA")
    if x.device.type not in ("cpu", "cuda"):
        raise ValueError(f"fp8_gemv: unsupported device {x.device}")


def fp8_gemv(x: torch.Tensor, data: torch.Tensor, scale: torch.Tensor, out_dtype: torch.dtype | None = None,
             config: GemvConfig | None = None, block: tuple[int, int] | None = None) -> torch.Tensor:
    """x [M, K] (bf16, fp16 or fp32) @ (data e4m3 [N, K] * scale).T -> [M, N] in `out_dtype`
    (default: x's dtype), accumulated in fp32. scale: per row [N], per tensor [], or with `block`
    = (bn, bk) per block [ceil(N/bn), ceil(K/bk)]. `config` overrides the table in
    impl.head.gemv_config."""
    out_dtype = x.dtype if out_dtype is None and isinstance(x, torch.Tensor) else out_dtype
    _check(x, data, scale, out_dtype, block)
    block = tuple(block) if block is not None else None
    m, k = x.shape
    n = data.shape[0]
    out = torch.empty(m, n, dtype=out_dtype, device=x.device)
    if m == 0 or n == 0:
        return out
    if k == 0:
        return out.zero_()
    if x.stride(1) != 1:
        x = x.contiguous()
    if data.stride(1) != 1:
        data = data.contiguous()
    cfg = config if config is not None else launch_config(n, k, m, x.device)[0]
    path = kernel_path(cfg, x.dtype, x.device)
    block_m = cfg.rows_per_program(m) if path == cfg.path else max(cfg.block_m, DOT_ROWS)
    block_k = cfg.block_k if block is None else min(cfg.block_k, block[1])  # a tile within one block
    if block is not None and scale.stride(1) != 1:
        scale = scale.contiguous()
    grid = (triton.cdiv(n, cfg.block_n), triton.cdiv(m, block_m))
    fp8_gemv_kernel[grid](
        x, data, scale, out, m, n, k, x.stride(0), data.stride(0), out.stride(0),
        scale.stride(0) if block is not None else 0,
        SCALE=2 if block is not None else scale.ndim, SCALE_BN=block[0] if block else 1,
        SCALE_BK=block[1] if block else 1, BLOCK_M=block_m, BLOCK_N=cfg.block_n, BLOCK_K=block_k,
        PATH=_PATH_IDS[path], EVEN_K=k % block_k == 0,
        IEEE_DOT=x.dtype == torch.float32, FP32_MATH=FP32_MATH,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return out


def kernel_path(config: GemvConfig, x_dtype: torch.dtype, device: torch.device) -> str:
    """The path a call takes. The split path is exact for bf16 activations only (8 significant
    bits = two e4m3 terms), so fp16 and fp32 activations take the "dot" path instead (fp16 tensor
    cores, IEEE fp32 dot); they need FP8 tensor cores (compute capability 8.9+), so older GPUs
    take the "dot" path too."""
    if config.path == "split":
        if x_dtype != torch.bfloat16:
            return "dot"
        if device.type == "cuda" and _capability(device.index or 0) < (8, 9):
            return "dot"
    return config.path


def fp8_gemv_reference(x: torch.Tensor, data: torch.Tensor, scale: torch.Tensor,
                       out_dtype: torch.dtype | None = None, block: tuple[int, int] | None = None) -> torch.Tensor:
    """The oracle: dequantize to fp32 (e4m3 value times the fp32 scale, rounded once), fp32 matmul."""
    out_dtype = x.dtype if out_dtype is None else out_dtype
    w = dequantize_fp8(data, scale, torch.float32, block=block)
    return (x.to(torch.float32) @ w.t()).to(out_dtype)
