"""MLA's absorbed attention for one decode token, as a split-K ("flash-decoding") Triton kernel.

Every head's query lives in the latent space (q_lat = W_uk^T q_nope, r values, beside its rope
part, dr values) and attends over the same cache rows [latent c (r), k_rope (dr)], whose latents
are also the values. So one program takes a chunk of cache rows for all heads at once and reads
each row once: scores [H, rows] = q_lat c^T + q_rope k_rope^T, an online softmax over the chunk,
and the weighted latents [H, r]; a second kernel combines the chunks' partial results.

The grid is static (a CUDA graph replays it at every position) but the split follows the valid
length n (the token's position + 1, read on the device): the n rows are cut into `splits` chunks
of at least `min_chunk_rows`, so a short context runs on few programs with few partial results
and a long one on all of them; rows at or past n are never loaded, so a static cache longer than
the context costs a few idle programs only.

The torch form (impl.model.mla: `MLAAttention._absorbed` through SDPA over the masked cache) is
its reference.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from impl.moe.triton_pdl import pdl_release, pdl_supported, pdl_wait
from impl.triton_env import FP32_MATH, device_name, tl, triton


@dataclass(frozen=True)
class MLADecodeConfig:
    """Launch configuration of `mla_decode_attention`: `splits` programs per batch row share the
    valid rows, each at least `min_chunk_rows` of them (rounded up to `block_rows`, the rows of one
    loop step); `combine_block_r` latent values per program of the combine kernel."""
    splits: int = 64
    min_chunk_rows: int = 128
    block_rows: int = 32
    num_warps: int = 8
    num_stages: int = 2
    combine_block_r: int = 128

    def __post_init__(self) -> None:
        for name in ("splits", "min_chunk_rows", "block_rows", "combine_block_r"):
            v = getattr(self, name)
            if v < 1 or v & (v - 1):
                raise ValueError(f"MLADecodeConfig.{name} must be a power of two, got {v}")
        if self.block_rows < 16:
            raise ValueError(f"MLADecodeConfig.block_rows must be >= 16 (tl.dot), got {self.block_rows}")


DEFAULT_CONFIG = MLADecodeConfig()
# Per device name, from scripts/gpu/bench_attention.py's sweep of the kernel alone (--kinds parts).
# H200, 2026-12-03, 576-wide bf16 rows, 32 heads: 19.3 / 27.8 / 47.2 us at 1k / 8k / 32k rows, against
# 25.2 / 32.8 / 74.9 us for the default (notes/runs/2026-12-03-attention-h200-parts.log).
TUNED: dict[str, MLADecodeConfig] = {
    "NVIDIA H200": MLADecodeConfig(splits=128, min_chunk_rows=64, block_rows=16, num_warps=4, num_stages=3),
}
INTERPRETER = MLADecodeConfig(splits=4, min_chunk_rows=16, block_rows=16, num_warps=4, num_stages=1,
                              combine_block_r=16)


def launch_config(device: torch.device) -> MLADecodeConfig:
    if device.type != "cuda":
        return INTERPRETER
    return TUNED.get(device_name(device), DEFAULT_CONFIG)


@triton.jit
def _chunk_rows(n, NSPLIT, BLOCK_ROWS: tl.constexpr, MIN_CHUNK: tl.constexpr):
    """Rows per program for n valid rows: n / NSPLIT rounded up to BLOCK_ROWS, at least MIN_CHUNK."""
    return tl.maximum(tl.cdiv(tl.cdiv(n, NSPLIT), BLOCK_ROWS) * BLOCK_ROWS, MIN_CHUNK)


@triton.jit
def _latent_and_rope(row_ptrs, offs_r, offs_dr, ok, R: tl.constexpr, FP32: tl.constexpr):
    """The rows' latent [.., R] and rope [.., DR] parts (query heads or cache rows), masked by `ok`;
    in fp32 under the interpreter (FP32)."""
    lat = tl.load(row_ptrs + offs_r[None, :], mask=ok[:, None], other=0.0)
    rope = tl.load(row_ptrs + R + offs_dr[None, :], mask=ok[:, None], other=0.0)
    if FP32:
        lat, rope = lat.to(tl.float32), rope.to(tl.float32)
    return lat, rope


@triton.jit
def mla_decode_kernel(q_ptr, kv_ptr, length_ptr, m_ptr, l_ptr, acc_ptr,
                      H, NSPLIT, stride_qb, stride_qh, stride_kvb, stride_kvs, stride_len, scale,
                      R: tl.constexpr, DR: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_ROWS: tl.constexpr,
                      MIN_CHUNK: tl.constexpr, FP32: tl.constexpr, IEEE: tl.constexpr, PDL: tl.constexpr):
    b = tl.program_id(0)
    split = tl.program_id(1)
    pdl_wait(PDL)  # the query, the length and the newest cache row come from the launch before
    pdl_release(PDL)
    n = tl.load(length_ptr + b * stride_len)
    chunk = _chunk_rows(n, NSPLIT, BLOCK_ROWS, MIN_CHUNK)
    start = split * chunk
    if start < n:
        offs_h = tl.arange(0, BLOCK_H)
        offs_r = tl.arange(0, R)
        offs_dr = tl.arange(0, DR)
        q_lat, q_rope = _latent_and_rope(q_ptr + b * stride_qb + offs_h[:, None] * stride_qh, offs_r, offs_dr,
                                         offs_h < H, R, FP32)
        m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_H], tl.float32)
        acc = tl.zeros([BLOCK_H, R], tl.float32)
        end = tl.minimum(start + chunk, n)
        for row0 in range(start, end, BLOCK_ROWS):
            offs_s = row0 + tl.arange(0, BLOCK_ROWS)
            s_ok = offs_s < end
            c, kr = _latent_and_rope(kv_ptr + b * stride_kvb + offs_s[:, None] * stride_kvs, offs_r, offs_dr, s_ok,
                                     R, FP32)
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
def mla_combine_kernel(m_ptr, l_ptr, acc_ptr, length_ptr, out_ptr, NSPLIT, stride_ob, stride_oh, stride_len,
                       R: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_SPLITS: tl.constexpr,
                       BLOCK_ROWS: tl.constexpr, MIN_CHUNK: tl.constexpr, PDL: tl.constexpr):
    b = tl.program_id(0)
    h = tl.program_id(1)
    offs_r = tl.program_id(2) * BLOCK_R + tl.arange(0, BLOCK_R)
    offs_p = tl.arange(0, BLOCK_SPLITS)
    pdl_wait(PDL)  # the partials come from the launch before
    pdl_release(PDL)
    n = tl.load(length_ptr + b * stride_len)
    used = tl.cdiv(n, _chunk_rows(n, NSPLIT, BLOCK_ROWS, MIN_CHUNK))  # chunks that saw rows
    m_max = tl.full([BLOCK_SPLITS], float("-inf"), tl.float32)
    for p0 in range(0, used, BLOCK_SPLITS):
        ok = p0 + offs_p < used
        m_max = tl.maximum(m_max, tl.load(m_ptr + (b * NSPLIT + p0 + offs_p) * BLOCK_H + h, mask=ok,
                                          other=float("-inf")))
    m_all = tl.max(m_max, axis=0)
    total = tl.zeros([BLOCK_SPLITS], tl.float32)
    o = tl.zeros([BLOCK_R], tl.float32)
    for p0 in range(0, used, BLOCK_SPLITS):
        ok = p0 + offs_p < used
        part = (b * NSPLIT + p0 + offs_p) * BLOCK_H + h
        w = tl.exp(tl.load(m_ptr + part, mask=ok, other=float("-inf")) - m_all)
        total += w * tl.load(l_ptr + part, mask=ok, other=0.0)
        o += tl.sum(w[:, None] * tl.load(acc_ptr + part[:, None] * R + offs_r[None, :], mask=ok[:, None],
                                         other=0.0), axis=0)
    tl.store(out_ptr + b * stride_ob + h * stride_oh + offs_r,
             (o / tl.sum(total, axis=0)).to(out_ptr.dtype.element_ty))


COMBINE_SPLITS = 16  # partial results per loop step of the combine kernel


def mla_decode_attention(query: torch.Tensor, kv: torch.Tensor, length: torch.Tensor, kv_lora_rank: int,
                         scale: float, config: MLADecodeConfig | None = None) -> torch.Tensor:
    """query [B, H, r + dr] (latent query, then rope part), kv [B, S, r + dr] (the cache; a batch
    stride of 0 lets B queries share one cache: a verify step's tokens), length [1] or [B] int on
    the device (row b attends to cache rows 0..length[b]-1, 1 <= length <= S); returns the
    attention-weighted latents [B, H, r] in query's dtype. `config` overrides `launch_config`."""
    b, h, width = query.shape
    if length.dim() != 1 or length.shape[0] not in (1, b):
        raise ValueError(f"mla_decode_attention: length must be [1] or [B={b}], got {tuple(length.shape)}")
    stride_len = length.stride(0) if length.shape[0] == b and b > 1 else 0
    r, dr = kv_lora_rank, query.shape[-1] - kv_lora_rank
    if kv.shape[0] < b or kv.shape[-1] != width or kv.stride(-1) != 1 or query.stride(-1) != 1:
        raise ValueError(f"mla_decode_attention: query {tuple(query.shape)} and cache {tuple(kv.shape)} must share "
                         "their last dim (latent + rope), contiguous")
    if r & (r - 1) or dr & (dr - 1):
        raise ValueError(f"mla_decode_attention: kv_lora_rank ({r}) and the rope dim ({dr}) must be powers of two "
                         "(the kernel's tiles)")
    cfg = config if config is not None else launch_config(query.device)
    pdl = pdl_supported(query.device)  # each launch starts while the one before finishes (impl/moe/triton_pdl.py)
    # No more programs than chunks of the whole cache could fill.
    nsplit = max(1, min(cfg.splits, triton.cdiv(kv.shape[1], max(cfg.min_chunk_rows, cfg.block_rows))))
    block_h = max(16, triton.next_power_of_2(h))
    block_r = min(cfg.combine_block_r, r)
    f32 = dict(dtype=torch.float32, device=query.device)
    m = torch.empty(b, nsplit, block_h, **f32)
    lse = torch.empty(b, nsplit, block_h, **f32)
    acc = torch.empty(b, nsplit, block_h, r, **f32)
    mla_decode_kernel[(b, nsplit)](query, kv, length, m, lse, acc, h, nsplit, query.stride(0), query.stride(1),
                                   kv.stride(0), kv.stride(1), stride_len, float(scale), R=r, DR=dr, BLOCK_H=block_h,
                                   BLOCK_ROWS=cfg.block_rows, MIN_CHUNK=cfg.min_chunk_rows, FP32=FP32_MATH,
                                   IEEE=(query.dtype == torch.float32 and not FP32_MATH), PDL=pdl,
                                   launch_pdl=pdl, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    out = torch.empty(b, h, r, dtype=query.dtype, device=query.device)
    mla_combine_kernel[(b, h, triton.cdiv(r, block_r))](
        m, lse, acc, length, out, nsplit, out.stride(0), out.stride(1), stride_len, R=r, BLOCK_H=block_h, BLOCK_R=block_r,
        BLOCK_SPLITS=COMBINE_SPLITS, BLOCK_ROWS=cfg.block_rows, MIN_CHUNK=cfg.min_chunk_rows, PDL=pdl,
        launch_pdl=pdl, num_warps=4)
    return out
