"""MLA's absorbed attention for one decode token, as a split-K ("flash-decoding") Triton kernel.

Every head's query lives in the latent space (q_lat = W_uk^T q_nope, r values, beside its rope
part, dr values) and attends over the same cache rows [latent c (r), k_rope (dr)], whose latents
are also the values. So one program takes a chunk of cache rows for all heads at once and reads
each row once: scores [rows, H] = c q_lat^T + k_rope q_rope^T, an online softmax over the chunk,
and the weighted latents [r, H] = c^T p; a second kernel combines the chunks' partial results.
The cache tile is the A operand of both products, the rows their M: on Hopper (64-row tiles) that
is wgmma reading the tile from shared memory where the pipelined load left it, which beat the
transposed form (the heads as M: mma.sync, its operands in registers) by 8-18% on the H200 at 1k,
8k and 32k rows, each form at its best swept config in one process (notes/ling.md).

The grid is static (a CUDA graph replays it at every position) but the split follows the valid
length n (the token's position + 1, read on the device): the n rows are cut into `splits` chunks
of at least `min_chunk_rows`, so a short context runs on few programs with few partial results
and a long one on all of them; rows at or past n are never loaded, so a static cache longer than
the context costs a few idle programs only.

Called with the step's positions instead of lengths (the model's call), both kernels read them
before waiting for the launch before (PDL), so a program knows its chunk while the query kernel
still runs. The combine lets the launch after it start before it waits (impl/moe/triton_pdl.py's
rules: that launch reads nothing but weights before its wait, as MLA's output kernel does). A
build that spills registers is refused before it launches (`_refuse_spills`).

The torch form (impl.model.mla: `MLAAttention._absorbed` through SDPA over the masked cache) is
its reference.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

import torch

from impl.launch_tables import LaunchTable, check_power_of_two, config_devices, device_name, first_entry
from impl.moe.triton_pdl import pdl_release, pdl_supported, pdl_wait
from impl.triton_env import FP32_MATH, tl, triton


@dataclass(frozen=True)
class MLADecodeConfig:
    """Launch configuration of `mla_decode_attention`: `splits` programs per batch row share the
    valid rows, each at least `min_chunk_rows` of them (rounded up to `block_rows`, the rows of one
    loop step); `combine_block_r` latent values per program of the combine kernel. The default's
    32-row tiles in two stages take 74 KB of shared memory (64-row tiles: 184 KB, Hopper's size)."""
    splits: int = 64
    min_chunk_rows: int = 64
    block_rows: int = 32
    num_warps: int = 4
    num_stages: int = 2
    combine_block_r: int = 32

    def __post_init__(self) -> None:
        if self.splits < 1:
            raise ValueError(f"MLADecodeConfig.splits must be >= 1, got {self.splits}")
        check_power_of_two(self, ("min_chunk_rows", "block_rows", "combine_block_r"))
        if self.block_rows < 16:
            raise ValueError(f"MLADecodeConfig.block_rows must be >= 16 (tl.dot), got {self.block_rows}")


DEFAULT_CONFIG = MLADecodeConfig()
# Keyed by device name alone; written by scripts/gpu/bench_attention.py --adopt-best (the config of
# the least time summed over 1k, 8k and 32k rows, the kernel alone), each entry naming the run it
# came from.
TABLE = LaunchTable(Path(__file__).with_name("mla_decode_tuned.json"), MLADecodeConfig, ("device",), "MLA decode")
TUNED: dict[tuple[str], MLADecodeConfig] = TABLE.load()
INTERPRETER = MLADecodeConfig(splits=4, min_chunk_rows=16, block_rows=16, num_warps=4, num_stages=1,
                              combine_block_r=16)


def launch_config(device: torch.device, element_size: int = 2) -> MLADecodeConfig:
    """The device's tuned config for 16-bit rows. 32-bit rows (fp32 checks) take 16-row tiles,
    one stage and at least 8 warps: the tuned 64-row tiles would need twice the shared memory, and
    16-row tiles at 4 warps in two stages still spilled 120 bytes a thread on the H200."""
    if device.type != "cuda":
        return INTERPRETER
    hit = first_entry(TUNED, [()], config_devices(device))
    cfg = hit[0] if hit else DEFAULT_CONFIG
    if element_size > 2:
        cfg = dataclasses.replace(cfg, block_rows=16, num_stages=1, num_warps=max(cfg.num_warps, 8))
    return cfg


@triton.jit
def _chunk_rows(n, NSPLIT, BLOCK_ROWS: tl.constexpr, MIN_CHUNK: tl.constexpr):
    """Rows per program for n valid rows: n / NSPLIT rounded up to BLOCK_ROWS, at least MIN_CHUNK."""
    return tl.maximum(tl.cdiv(tl.cdiv(n, NSPLIT), BLOCK_ROWS) * BLOCK_ROWS, MIN_CHUNK)


@triton.jit
def _valid_rows(length_ptr, b, stride_len, EARLY: tl.constexpr):
    """Batch row b's valid cache rows: its length, or its position + 1 under EARLY."""
    return tl.load(length_ptr + b * stride_len).to(tl.int32) + (1 if EARLY else 0)


@triton.jit
def _latent_and_rope(row_ptrs, offs_r, offs_dr, ok, R: tl.constexpr, FP32: tl.constexpr):
    """The cache rows' latent [.., R] and rope [.., DR] parts, masked by `ok`; in fp32 under the
    interpreter (FP32)."""
    lat = tl.load(row_ptrs + offs_r[None, :], mask=ok[:, None], other=0.0)
    rope = tl.load(row_ptrs + R + offs_dr[None, :], mask=ok[:, None], other=0.0)
    if FP32:
        lat, rope = lat.to(tl.float32), rope.to(tl.float32)
    return lat, rope


@triton.jit
def mla_decode_kernel(q_ptr, kv_ptr, length_ptr, m_ptr, l_ptr, acc_ptr,
                      H, NSPLIT, stride_qb, stride_qh, stride_kvb, stride_kvs, stride_len, scale,
                      R: tl.constexpr, DR: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_ROWS: tl.constexpr,
                      MIN_CHUNK: tl.constexpr, FP32: tl.constexpr, IEEE: tl.constexpr, EARLY: tl.constexpr,
                      PDL: tl.constexpr):
    """Program (b, split): batch row b's chunk `split` of the valid rows, for all heads; writes the
    chunk's maximum, softmax sum and weighted latents (fp32) per head.

    EARLY: length_ptr holds positions (length - 1) written two or more launches back: the program
    reads its position, and so its chunk, before it waits for the launch just before (the query
    kernel). Otherwise length_ptr holds lengths, read after the wait."""
    b = tl.program_id(0)
    split = tl.program_id(1)
    kv_row = kv_ptr + b * stride_kvb
    if EARLY:
        n = _valid_rows(length_ptr, b, stride_len, EARLY)
    pdl_wait(PDL)  # the query and the newest cache row (and without EARLY the length) come from the launch before
    pdl_release(PDL)
    if not EARLY:
        n = _valid_rows(length_ptr, b, stride_len, EARLY)
    chunk = _chunk_rows(n, NSPLIT, BLOCK_ROWS, MIN_CHUNK)
    start = split * chunk
    end = tl.minimum(start + chunk, n)
    if start < n:
        offs_h = tl.arange(0, BLOCK_H)
        offs_r = tl.arange(0, R)
        offs_dr = tl.arange(0, DR)
        q_heads = q_ptr + b * stride_qb + offs_h[None, :] * stride_qh
        h_ok = offs_h < H
        q_lat = tl.load(q_heads + offs_r[:, None], mask=h_ok[None, :], other=0.0)  # [R, H]
        q_rope = tl.load(q_heads + R + offs_dr[:, None], mask=h_ok[None, :], other=0.0)  # [DR, H]
        if FP32:
            q_lat, q_rope = q_lat.to(tl.float32), q_rope.to(tl.float32)
        m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_H], tl.float32)
        acc = tl.zeros([R, BLOCK_H], tl.float32)
        for row0 in range(start, end, BLOCK_ROWS):
            offs_s = row0 + tl.arange(0, BLOCK_ROWS)
            s_ok = offs_s < end
            c, kr = _latent_and_rope(kv_row + offs_s[:, None] * stride_kvs, offs_r, offs_dr, s_ok, R, FP32)
            if IEEE:  # fp32 inputs: no TF32 rounding (tl.dot's default for them)
                scores = tl.dot(c, q_lat, input_precision="ieee") + tl.dot(kr, q_rope, input_precision="ieee")
            else:
                scores = tl.dot(c, q_lat) + tl.dot(kr, q_rope)
            scores = tl.where(s_ok[:, None], scores * scale, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(scores, axis=0))
            alpha = tl.exp(m_i - m_new)
            p = tl.exp(scores - m_new[None, :])
            l_i = l_i * alpha + tl.sum(p, axis=0)
            if IEEE:
                acc = acc * alpha[None, :] + tl.dot(tl.trans(c), p, input_precision="ieee")
            else:
                acc = acc * alpha[None, :] + tl.dot(tl.trans(c), p.to(c.dtype))
            m_i = m_new
        part = (b * NSPLIT + split) * BLOCK_H + offs_h
        tl.store(m_ptr + part, m_i)
        tl.store(l_ptr + part, l_i)
        tl.store(acc_ptr + part[None, :] * R + offs_r[:, None], acc)


@triton.jit
def mla_combine_kernel(m_ptr, l_ptr, acc_ptr, length_ptr, out_ptr, NSPLIT, stride_ob, stride_oh, stride_len,
                       R: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_SPLITS: tl.constexpr,
                       BLOCK_ROWS: tl.constexpr, MIN_CHUNK: tl.constexpr, EARLY: tl.constexpr, PDL: tl.constexpr):
    """One head's BLOCK_R latent values from every chunk's partial result, loaded at once
    (BLOCK_SPLITS >= NSPLIT): one round trip to memory, not one a group of chunks. The length
    (a position under EARLY) was written two or more launches back: read before the wait."""
    b = tl.program_id(0)
    h = tl.program_id(1)
    offs_r = tl.program_id(2) * BLOCK_R + tl.arange(0, BLOCK_R)
    offs_p = tl.arange(0, BLOCK_SPLITS)
    n = _valid_rows(length_ptr, b, stride_len, EARLY)
    ok = offs_p < tl.cdiv(n, _chunk_rows(n, NSPLIT, BLOCK_ROWS, MIN_CHUNK))  # the chunks that saw rows
    part = (b * NSPLIT + offs_p) * BLOCK_H + h
    pdl_release(PDL)  # before the wait: the output kernel after it loads its weights during the attention
    pdl_wait(PDL)  # the partials come from the launch before
    m = tl.load(m_ptr + part, mask=ok, other=float("-inf"))
    w = tl.exp(m - tl.max(m, axis=0))
    total = tl.sum(w * tl.load(l_ptr + part, mask=ok, other=0.0), axis=0)
    o = tl.sum(w[:, None] * tl.load(acc_ptr + part[:, None] * R + offs_r[None, :], mask=ok[:, None], other=0.0),
               axis=0)
    tl.store(out_ptr + b * stride_ob + h * stride_oh + offs_r, (o / total).to(out_ptr.dtype.element_ty))


_NO_SPILLS: set = set()  # the builds checked by `_refuse_spills`


def _refuse_spills(kernel, cfg: MLADecodeConfig, grid: tuple, args: tuple, meta: dict) -> None:
    """Compile `kernel` (the attention's) for these arguments without launching it and refuse a build
    that spills registers to local memory: on the H200 (Triton 3.6) the two builds seen spilling
    (64-row tiles at 4 warps, one stage; and from positions at two) computed garbage or made an
    illegal memory access that took the CUDA context down. Checked once per build."""
    # What Triton specializes a build on: the constexprs, the dtypes, 16-byte alignment, ints of 1 or multiples of 16.
    key = (args[0].device, cfg, tuple(meta.items()),
           tuple((a.dtype, a.data_ptr() % 16 == 0) if isinstance(a, torch.Tensor) else
                 (a == 1, a % 16 == 0) if isinstance(a, int) else type(a) for a in args))
    if key in _NO_SPILLS:
        return
    compiled = kernel.warmup(*args, grid=grid, **meta)
    compiled._init_handles()  # loads the binary: what the driver reports of its registers and spills
    if compiled.n_spills:
        raise ValueError(f"mla_decode_attention: config {cfg} spills {4 * compiled.n_spills} bytes a thread on "
                         f"{device_name(args[0].device)} ({compiled.n_regs} registers) with {args[0].dtype} rows "
                         "(spilling builds computed garbage there): take fewer block_rows or more num_warps")
    _NO_SPILLS.add(key)


def mla_decode_attention(query: torch.Tensor, kv: torch.Tensor, length: torch.Tensor | None, kv_lora_rank: int,
                         scale: float, config: MLADecodeConfig | None = None, *,
                         positions: torch.Tensor | None = None) -> torch.Tensor:
    """query [B, H, r + dr] (latent query, then rope part), kv [B, S, r + dr] (the cache; a batch
    stride of 0 lets B queries share one cache: a verify step's tokens), length [1] or [B] int on
    the device (row b attends to cache rows 0..length[b]-1, 1 <= length <= S); returns the
    attention-weighted latents [B, H, r] in query's dtype. `config` overrides `launch_config`.

    Instead of `length`, `positions` ([1] or [B]: row b attends to rows 0..positions[b]) lets the
    kernel read each row's length before the launch just before it has finished (PDL): the caller
    promises the positions were written two or more launches back (the step's input positions).
    The launch after this call may start before its attention kernel has finished: before its own
    wait it may read only what was written before this call (weights).
    """
    b, h, width = query.shape
    if (length is None) == (positions is None):
        raise ValueError("mla_decode_attention: give exactly one of length and positions")
    early = positions is not None
    lengths = positions if early else length
    name = "positions" if early else "length"
    if lengths.dim() != 1 or lengths.shape[0] not in (1, b):
        raise ValueError(f"mla_decode_attention: {name} must be [1] or [B={b}], got {tuple(lengths.shape)}")
    if lengths.dtype not in (torch.int32, torch.int64) or lengths.device != query.device:
        raise ValueError(f"mla_decode_attention: {name} must be int32 or int64 on the query's device "
                         f"({query.device}), got {lengths.dtype} on {lengths.device}")
    stride_len = lengths.stride(0) if lengths.shape[0] == b and b > 1 else 0
    r, dr = kv_lora_rank, query.shape[-1] - kv_lora_rank
    if kv.shape[0] < b or kv.shape[-1] != width or kv.stride(-1) != 1 or query.stride(-1) != 1:
        raise ValueError(f"mla_decode_attention: query {tuple(query.shape)} and cache {tuple(kv.shape)} must share "
                         "their last dim (latent + rope), contiguous")
    if r & (r - 1) or dr & (dr - 1):
        raise ValueError(f"mla_decode_attention: kv_lora_rank ({r}) and the rope dim ({dr}) must be powers of two "
                         "(the kernel's tiles)")
    cfg = config if config is not None else launch_config(query.device, query.element_size())
    pdl = pdl_supported(query.device)  # each launch starts while the one before finishes (impl/moe/triton_pdl.py)
    # No more programs than chunks of the whole cache could fill.
    nsplit = max(1, min(cfg.splits, triton.cdiv(kv.shape[1], max(cfg.min_chunk_rows, cfg.block_rows))))
    block_h = max(16, triton.next_power_of_2(h))
    block_r = min(cfg.combine_block_r, r)
    f32 = dict(dtype=torch.float32, device=query.device)
    m = torch.empty(b, nsplit, block_h, **f32)
    lse = torch.empty(b, nsplit, block_h, **f32)
    acc = torch.empty(b, nsplit, block_h, r, **f32)
    args = (query, kv, lengths, m, lse, acc, h, nsplit, query.stride(0), query.stride(1), kv.stride(0),
            kv.stride(1), stride_len, float(scale))
    meta = dict(R=r, DR=dr, BLOCK_H=block_h, BLOCK_ROWS=cfg.block_rows, MIN_CHUNK=cfg.min_chunk_rows, FP32=FP32_MATH,
                IEEE=(query.dtype == torch.float32 and not FP32_MATH), EARLY=early, PDL=pdl, launch_pdl=pdl,
                num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    if query.is_cuda:
        _refuse_spills(mla_decode_kernel, cfg, (b, nsplit), args, meta)
    mla_decode_kernel[(b, nsplit)](*args, **meta)
    out = torch.empty(b, h, r, dtype=query.dtype, device=query.device)
    mla_combine_kernel[(b, h, triton.cdiv(r, block_r))](
        m, lse, acc, lengths, out, nsplit, out.stride(0), out.stride(1), stride_len, R=r, BLOCK_H=block_h,
        BLOCK_R=block_r, BLOCK_SPLITS=triton.next_power_of_2(nsplit), BLOCK_ROWS=cfg.block_rows,
        MIN_CHUNK=cfg.min_chunk_rows, EARLY=early, PDL=pdl, launch_pdl=pdl, num_warps=4)
    return out
