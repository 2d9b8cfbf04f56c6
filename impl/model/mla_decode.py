"""MLA's absorbed attention for one decode token, as a split-K ("flash-decoding") Triton kernel.

Every head's query lives in the latent space (q_lat = W_uk^T q_nope, r values, beside its rope
part, dr values) and attends over the same cache rows [latent c (r), k_rope (dr)], whose latents
are also the values. So one program takes a chunk of cache rows for all heads at once and reads
each row once: scores [H, rows] = q_lat c^T + q_rope k_rope^T, an online softmax over the chunk,
and the weighted latents [H, r]; a second kernel combines the chunks' partial results. Rows at or
past the valid length (the position of the token + 1, read on the device) are never loaded, so a
static cache longer than the context costs nothing but a few idle programs.

The torch form (impl.model.mla: `MLAAttention._absorbed` through SDPA over the masked cache) is
its reference.
"""

from __future__ import annotations

import torch

from impl.triton_env import FP32_MATH, tl, triton

CHUNK_ROWS = 512  # cache rows a program of the first kernel takes: 72 programs over a 36k cache
BLOCK_ROWS = 32   # rows per step inside a chunk


@triton.jit
def mla_decode_kernel(q_ptr, kv_ptr, length_ptr, m_ptr, l_ptr, acc_ptr,
                      H, S, NSPLIT, stride_qb, stride_qh, stride_kvb, stride_kvs, scale,
                      R: tl.constexpr, DR: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_ROWS: tl.constexpr,
                      CHUNK_ROWS: tl.constexpr, FP32: tl.constexpr, IEEE: tl.constexpr):
    b = tl.program_id(0)
    split = tl.program_id(1)
    n = tl.load(length_ptr)
    offs_h = tl.arange(0, BLOCK_H)
    offs_r = tl.arange(0, R)
    offs_dr = tl.arange(0, DR)
    h_ok = offs_h < H
    q_row = q_ptr + b * stride_qb + offs_h[:, None] * stride_qh
    q_lat = tl.load(q_row + offs_r[None, :], mask=h_ok[:, None], other=0.0)
    q_rope = tl.load(q_row + R + offs_dr[None, :], mask=h_ok[:, None], other=0.0)
    if FP32:
        q_lat, q_rope = q_lat.to(tl.float32), q_rope.to(tl.float32)
    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, R], tl.float32)
    start = split * CHUNK_ROWS
    end = tl.minimum(start + CHUNK_ROWS, n)
    for row0 in range(start, end, BLOCK_ROWS):
        offs_s = row0 + tl.arange(0, BLOCK_ROWS)
        s_ok = offs_s < end
        rows = kv_ptr + b * stride_kvb + offs_s[:, None] * stride_kvs
        c = tl.load(rows + offs_r[None, :], mask=s_ok[:, None], other=0.0)
        kr = tl.load(rows + R + offs_dr[None, :], mask=s_ok[:, None], other=0.0)
        if FP32:
            c, kr = c.to(tl.float32), kr.to(tl.float32)
        if IEEE:  # fp32 inputs: no TF32 rounding (tl.dot's default for them)
            scores = (tl.dot(q_lat, tl.trans(c), input_precision="ieee")
                      + tl.dot(q_rope, tl.trans(kr), input_precision="ieee"))
        else:
            scores = tl.dot(q_lat, tl.trans(c)) + tl.dot(q_rope, tl.trans(kr))
        scores = tl.where(s_ok[None, :], scores * scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, axis=1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(scores - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        if IEEE:
            acc = acc * alpha[:, None] + tl.dot(p, c, input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(c.dtype), c)
        m_i = m_new
    part = (b * NSPLIT + split) * BLOCK_H + offs_h
    tl.store(m_ptr + part, m_i)
    tl.store(l_ptr + part, l_i)
    tl.store(acc_ptr + part[:, None] * R + offs_r[None, :], acc)


@triton.jit
def mla_combine_kernel(m_ptr, l_ptr, acc_ptr, length_ptr, out_ptr, H, NSPLIT, stride_ob, stride_oh,
                       R: tl.constexpr, BLOCK_H: tl.constexpr, CHUNK_ROWS: tl.constexpr):
    b = tl.program_id(0)
    h = tl.program_id(1)
    n = tl.load(length_ptr)
    offs_r = tl.arange(0, R)
    used = tl.cdiv(n, CHUNK_ROWS)  # chunks that saw at least one row
    m_all = float("-inf")
    for split in range(0, used):
        m_all = tl.maximum(m_all, tl.load(m_ptr + (b * NSPLIT + split) * BLOCK_H + h))
    total = 0.0
    o = tl.zeros([R], tl.float32)
    for split in range(0, used):
        part = (b * NSPLIT + split) * BLOCK_H + h
        w = tl.exp(tl.load(m_ptr + part) - m_all)
        total += w * tl.load(l_ptr + part)
        o += w * tl.load(acc_ptr + part * R + offs_r)
    tl.store(out_ptr + b * stride_ob + h * stride_oh + offs_r, (o / total).to(out_ptr.dtype.element_ty))


def mla_decode_attention(query: torch.Tensor, kv: torch.Tensor, length: torch.Tensor, kv_lora_rank: int,
                         scale: float) -> torch.Tensor:
    """query [B, H, r + dr] (latent query, then rope part), kv [B, S, r + dr] (the cache), length
    [1] int on the device (rows 0..length-1 are attended); returns the attention-weighted latents
    [B, H, r] in query's dtype."""
    b, h, width = query.shape
    r, dr = kv_lora_rank, query.shape[-1] - kv_lora_rank
    if kv.shape[0] < b or kv.shape[-1] != width or kv.stride(-1) != 1 or query.stride(-1) != 1:
        raise ValueError(f"mla_decode_attention: query {tuple(query.shape)} and cache {tuple(kv.shape)} must share "
                         "their last dim (latent + rope), contiguous")
    s = kv.shape[1]
    nsplit = triton.cdiv(s, CHUNK_ROWS)
    block_h = max(16, triton.next_power_of_2(h))
    f32 = dict(dtype=torch.float32, device=query.device)
    m = torch.empty(b, nsplit, block_h, **f32)
    lse = torch.empty(b, nsplit, block_h, **f32)
    acc = torch.empty(b, nsplit, block_h, r, **f32)
    mla_decode_kernel[(b, nsplit)](query, kv, length, m, lse, acc, h, s, nsplit, query.stride(0), query.stride(1),
                                   kv.stride(0), kv.stride(1), float(scale), R=r, DR=dr, BLOCK_H=block_h,
                                   BLOCK_ROWS=BLOCK_ROWS, CHUNK_ROWS=CHUNK_ROWS, FP32=FP32_MATH,
                                   IEEE=(query.dtype == torch.float32 and not FP32_MATH), num_warps=8)
    out = torch.empty(b, h, r, dtype=query.dtype, device=query.device)
    mla_combine_kernel[(b, h)](m, lse, acc, length, out, h, nsplit, out.stride(0), out.stride(1), R=r,
                               BLOCK_H=block_h, CHUNK_ROWS=CHUNK_ROWS, num_warps=4)
    return out
