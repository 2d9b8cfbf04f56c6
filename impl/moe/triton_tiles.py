"""The tensor-core tile product of the Triton MoE (more tokens than the register path takes):
a tile of activations times a tile of a plain or MXFP4 weight, through tl.dot with fp32
accumulation. Tokens are padded to M_PAD rows for the tensor cores; at decode sizes the wasted
arithmetic is free, the weight bytes are what cost.
"""

from __future__ import annotations

from impl.moe.triton_mxfp4 import e2m1_to_bf16, e8m0_to_bf16, e8m0_to_fp32
from impl.triton_env import tl, triton


@triton.jit
def tile_dot(a_ptr, stride_am, offs_m, m_mask, k0, K, w_ptr, ws_ptr, offs_n, n_mask, stride_wn, stride_sn,
             BLOCK_K: tl.constexpr, MXFP4: tl.constexpr, FP32_MATH: tl.constexpr):
    """a[offs_m, k0:k0+BLOCK_K] @ W[offs_n, k0:k0+BLOCK_K]^T with fp32 accumulation, for a [N, K]
    weight stored as bf16/fp16/fp32 or as MXFP4 (packed [N, K/2] + scales [N, K/32]).

    MXFP4 is never interleaved in registers: the low nibbles (even k) meet the even columns of
    `a` and the high nibbles (odd k) the odd ones, so the product needs no layout shuffle. The
    products are exact in bf16 (activations are bf16, E2M1 x 2**s is exact), the sums fp32."""
    if MXFP4:
        offs_j = k0 // 2 + tl.arange(0, BLOCK_K // 2)
        j_mask = offs_j < K // 2
        packed = tl.load(w_ptr + offs_n[:, None] * stride_wn + offs_j[None, :],
                         mask=n_mask[:, None] & j_mask[None, :], other=0)
        codes = tl.load(ws_ptr + offs_n[:, None] * stride_sn + (offs_j // 16)[None, :],
                        mask=n_mask[:, None] & j_mask[None, :], other=127)
        a_even = tl.load(a_ptr + offs_m[:, None] * stride_am + 2 * offs_j[None, :],
                         mask=m_mask[:, None] & j_mask[None, :], other=0.0)
        a_odd = tl.load(a_ptr + offs_m[:, None] * stride_am + 2 * offs_j[None, :] + 1,
                        mask=m_mask[:, None] & j_mask[None, :], other=0.0)
        lo = e2m1_to_bf16(packed & 0xF)
        hi = e2m1_to_bf16(packed >> 4)
        if FP32_MATH:  # the interpreter gets bf16 arithmetic wrong
            # Scales decoded straight to fp32: the interpreter's bf16 -> fp32 conversion flushes
            # subnormals, and E8M0 code 0 is the bf16 subnormal 2**-127.
            scale = e8m0_to_fp32(codes)
            lo = lo.to(tl.float32) * scale
            hi = hi.to(tl.float32) * scale
            return (tl.dot(a_even.to(tl.float32), tl.trans(lo)) + tl.dot(a_odd.to(tl.float32), tl.trans(hi)))
        scale = e8m0_to_bf16(codes)
        lo = lo * scale
        hi = hi * scale
        return (tl.dot(a_even.to(tl.bfloat16), tl.trans(lo)) + tl.dot(a_odd.to(tl.bfloat16), tl.trans(hi)))
    offs_k = k0 + tl.arange(0, BLOCK_K)
    k_mask = offs_k < K
    w = tl.load(w_ptr + offs_n[:, None] * stride_wn + offs_k[None, :], mask=n_mask[:, None] & k_mask[None, :],
                other=0.0)
    a = tl.load(a_ptr + offs_m[:, None] * stride_am + offs_k[None, :], mask=m_mask[:, None] & k_mask[None, :],
                other=0.0)
    if FP32_MATH:
        return tl.dot(a.to(tl.float32), tl.trans(w.to(tl.float32)))
    return tl.dot(a.to(tl.bfloat16), tl.trans(w.to(tl.bfloat16)))

