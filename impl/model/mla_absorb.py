"""MLA's absorbed decode around its attention kernel, in two Triton kernels instead of some thirty
small torch launches: the query side before it and the output side after it.

- `mla_query_kernel`: for each token row, every head's latent query q_lat = W_uk^T q_nope and its
  rotated rope part, written as the attention kernel's [rows, H, r + dr] query; and the token's
  cache row [rms_norm(latent), rotated k_rope] written at its position. Programs (head, block of
  latent values) each hold their slice of W_uk in registers for all rows; one more program writes
  the cache rows.
- `mla_output_kernel`: each head's value up-projection W_uv o_lat of the attention-weighted
  latents, rounded to the activation dtype, times the head's output gate sigmoid(g) where the
  model has one (Ling 3.0; DeepSeek-V3 has none), written in
  the [rows, H * dv] layout o_proj reads.

Why: at batch 1 the glue (two interleaved ropes, the latent norm, the cache write, the two
absorbed einsums, the gate) was some thirty launches a layer around four that read the bytes, and
in a CUDA graph each costs its launch gap whatever it computes. Both kernels launch with
programmatic dependent launch (impl/moe/triton_pdl.py's rules): their weight slices load while
the launch before still runs. On the H200 an MLA layer of a Ling-3.0-flash decode step went from
82 to 38 us at 1k context in the whole step (15.4 us byte floor; notes/ling-ladder.md), and
alone from 99.6 to 44.2 us with the GEMV projections (notes/runs/2026-12-04-attention-h200-mla-absorb.log).

The arithmetic is the torch form's (impl.model.mla `MLAAttention._absorbed`), with fp32 products
and sums: the rope is applied in fp32 and rounded once (the torch form rounds cos, sin and each
product to the activation dtype), the norm as F.rms_norm computes it, the up-projection rounded
to the activation dtype before the gate as the einsum's output is. `mla_query_reference` and
`mla_output_reference` are that torch form, for the tests.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from impl.model.layers import apply_rope
from impl.moe.triton_pdl import pdl_release, pdl_supported, pdl_wait
from impl.triton_env import tl, triton


@dataclass(frozen=True)
class MLAAbsorbLaunch:
    """Tiles: `block_r` latent values a query program writes (its W_uk slice is [dn, block_r]),
    `block_v` value channels an output program writes (its W_uv slice [block_v, r]); warps; `pdl`
    (where the GPU has it)."""
    block_r: int = 128
    block_v: int = 32
    num_warps: int = 4
    pdl: bool = True

    def __post_init__(self) -> None:
        for name in ("block_r", "block_v"):
            v = getattr(self, name)
            if v < 1 or v & (v - 1):
                raise ValueError(f"MLAAbsorbLaunch.{name} must be a power of two, got {v}")
        if self.num_warps not in (1, 2, 4, 8, 16):
            raise ValueError(f"MLAAbsorbLaunch.num_warps must be 1, 2, 4, 8 or 16, got {self.num_warps}")


DEFAULT_LAUNCH = MLAAbsorbLaunch()


@triton.jit
def _rope_inputs(x_ptr, cos_ptr, sin_ptr, HALF: tl.constexpr):
    """The loads of Ling's rope of 2 * HALF values (x's pairs (2i, 2i + 1), fp32 cos/sin rows in
    the rotate-half layout), issued together so that a program waits for memory once."""
    offs = tl.arange(0, HALF)
    return (tl.load(x_ptr + 2 * offs).to(tl.float32), tl.load(x_ptr + 2 * offs + 1).to(tl.float32),
            tl.load(cos_ptr + offs), tl.load(cos_ptr + HALF + offs), tl.load(sin_ptr + offs),
            tl.load(sin_ptr + HALF + offs))


@triton.jit
def _store_rope(out_ptr, even, odd, cos_lo, cos_hi, sin_lo, sin_hi, HALF: tl.constexpr):
    """Pair i rotated by frequency i, written as [rotated evens, rotated odds] (impl.model.mla
    `apply_interleaved_rope`)."""
    offs = tl.arange(0, HALF)
    tl.store(out_ptr + offs, (even * cos_lo - odd * sin_lo).to(out_ptr.dtype.element_ty))
    tl.store(out_ptr + HALF + offs, (odd * cos_hi + even * sin_hi).to(out_ptr.dtype.element_ty))


@triton.jit
def mla_query_kernel(q_ptr, kv_a_ptr, w_uk_ptr, cos_ptr, sin_ptr, norm_w_ptr, pos_ptr, query_ptr, cache_ptr,
                     ROWS, TOKENS, H, eps,
                     stride_q, stride_kv_a, stride_wuk_h, stride_wuk_d, stride_cos, stride_sin,
                     stride_query_row, stride_query_h, stride_cache_b, stride_cache_s,
                     DN: tl.constexpr, R: tl.constexpr, DR: tl.constexpr, QK: tl.constexpr,
                     BLOCK_DN: tl.constexpr, BLOCK_R: tl.constexpr, PDL: tl.constexpr):
    """Row i = b * TOKENS + t: token t of batch row b, at position pos[t]. q rows hold each head's
    [q_nope (DN), q_rope (DR)] (QK apart), kv_a rows [latent (R), k_rope (DR)]. A program loads
    its weights before its wait, and after it all of a row's inputs before it stores anything (a
    load after a store waits for memory once more)."""
    pid = tl.program_id(0)
    blocks_r = tl.cdiv(R, BLOCK_R)
    if pid < H * blocks_r:
        h = pid // blocks_r
        block = pid % blocks_r
        offs_d = tl.arange(0, BLOCK_DN)
        offs_r = block * BLOCK_R + tl.arange(0, BLOCK_R)
        d_ok = offs_d < DN
        w = tl.load(w_uk_ptr + h * stride_wuk_h + offs_d[:, None] * stride_wuk_d + offs_r[None, :],
                    mask=d_ok[:, None] & (offs_r < R)[None, :], other=0.0)
        pdl_wait(PDL)  # q comes from the projection launched just before
        pdl_release(PDL)
        for i in range(ROWS):
            t = i % TOKENS
            q_row = q_ptr + i * stride_q + h * QK
            q_nope = tl.load(q_row + offs_d, mask=d_ok, other=0.0).to(tl.float32)
            out_row = query_ptr + i * stride_query_row + h * stride_query_h
            if block == 0:
                even, odd, cos_lo, cos_hi, sin_lo, sin_hi = _rope_inputs(q_row + DN, cos_ptr + t * stride_cos,
                                                                         sin_ptr + t * stride_sin, DR // 2)
                _store_rope(out_row + R, even, odd, cos_lo, cos_hi, sin_lo, sin_hi, DR // 2)
            q_lat = tl.sum(w.to(tl.float32) * q_nope[:, None], axis=0)
            tl.store(out_row + offs_r, q_lat.to(query_ptr.dtype.element_ty), mask=offs_r < R)
    else:  # the cache rows: the latent's RMS norm and the shared key's rope, written at the positions
        offs_l = tl.arange(0, R)
        norm_w = tl.load(norm_w_ptr + offs_l).to(tl.float32)
        pdl_wait(PDL)
        pdl_release(PDL)
        for i in range(ROWS):
            t = i % TOKENS
            row = kv_a_ptr + i * stride_kv_a
            latent = tl.load(row + offs_l).to(tl.float32)
            even, odd, cos_lo, cos_hi, sin_lo, sin_hi = _rope_inputs(row + R, cos_ptr + t * stride_cos,
                                                                     sin_ptr + t * stride_sin, DR // 2)
            pos = tl.load(pos_ptr + t)
            rstd = 1.0 / tl.sqrt(tl.sum(latent * latent, axis=0) / R + eps)
            cache_row = cache_ptr + (i // TOKENS) * stride_cache_b + pos * stride_cache_s
            tl.store(cache_row + offs_l, (latent * rstd * norm_w).to(cache_ptr.dtype.element_ty))
            _store_rope(cache_row + R, even, odd, cos_lo, cos_hi, sin_lo, sin_hi, DR // 2)


@triton.jit
def mla_output_kernel(lat_ptr, g_ptr, w_uv_ptr, out_ptr, ROWS,
                      stride_lat_row, stride_lat_h, stride_g, stride_wuv_h, stride_wuv_v, stride_out,
                      R: tl.constexpr, DV: tl.constexpr, BLOCK_V: tl.constexpr, GATE: tl.constexpr,
                      PDL: tl.constexpr):
    """out[i, h * DV + v] = round(round(W_uv[h, v] . lat[i, h]) * round(sigmoid(g[i, h]))); without
    GATE (DeepSeek-V3's MLA) round(W_uv[h, v] . lat[i, h]), g_ptr unread."""
    blocks_v = tl.cdiv(DV, BLOCK_V)
    h = tl.program_id(0) // blocks_v
    offs_v = (tl.program_id(0) % blocks_v) * BLOCK_V + tl.arange(0, BLOCK_V)
    offs_r = tl.arange(0, R)
    v_ok = offs_v < DV
    w = tl.load(w_uv_ptr + h * stride_wuv_h + offs_v[:, None] * stride_wuv_v + offs_r[None, :],
                mask=v_ok[:, None], other=0.0)
    pdl_release(PDL)  # before the wait: o_proj's GEMV after it loads its weight during the attention
    pdl_wait(PDL)  # the latents come from the attention's combine, launched just before
    dtype = out_ptr.dtype.element_ty
    for i in range(ROWS):
        lat = tl.load(lat_ptr + i * stride_lat_row + h * stride_lat_h + offs_r).to(tl.float32)
        y = tl.sum(w.to(tl.float32) * lat[None, :], axis=1).to(dtype).to(tl.float32)
        if GATE:
            g = tl.load(g_ptr + i * stride_g + h)
            # A product of two 16-bit values is exact in fp32: rounding it once is the 16-bit multiply.
            y = y * tl.sigmoid(g.to(tl.float32)).to(dtype).to(tl.float32)
        tl.store(out_ptr + i * stride_out + h * DV + offs_v, y.to(dtype), mask=v_ok)


def _rows_2d(name: str, t: torch.Tensor, width: int) -> None:
    if t.dim() != 2 or t.shape[1] < width or t.stride(1) != 1:
        raise ValueError(f"{name} must be [rows, >= {width}] with contiguous rows, got {tuple(t.shape)} "
                         f"strides {t.stride()}")


def mla_query(q: torch.Tensor, kv_a: torch.Tensor, w_uk: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
              norm_weight: torch.Tensor, eps: float, input_pos: torch.Tensor, cache: torch.Tensor,
              launch: MLAAbsorbLaunch = DEFAULT_LAUNCH) -> torch.Tensor:
    """For rows = B * T token rows (q [rows, H * (dn + dr)], kv_a [rows, r + dr], both views with
    contiguous rows; T = input_pos's length, the tokens of each batch row, at positions input_pos
    [T]; cos/sin [T, dr] fp32): writes every row's cache row into cache [>= B, S, r + dr] at its
    position and returns query [rows, H, r + dr] in q's dtype.
    w_uk [H, dn, r] (a view of kv_b_proj's weight), norm_weight [r] (kv_a_layernorm's)."""
    h, dn, r = w_uk.shape
    tokens = input_pos.shape[0] if input_pos.dim() == 1 else 0
    dr = cos.shape[-1] if cos.dim() == 2 else 0
    _rows_2d("q", q, h * (dn + dr))
    _rows_2d("kv_a", kv_a, r + dr)
    rows = q.shape[0]
    if tokens < 1 or rows % tokens or kv_a.shape[0] != rows:
        raise ValueError(f"mla_query: q ({rows} rows) and kv_a ({kv_a.shape[0]}) must hold B x T rows for "
                         f"input_pos [T] (got {tuple(input_pos.shape)})")
    if cos.shape != (tokens, dr) or sin.shape != cos.shape or cos.stride(1) != 1 or sin.stride(1) != 1:
        raise ValueError(f"mla_query: cos and sin must be [T={tokens}, dr] with contiguous rows, got "
                         f"{tuple(cos.shape)} and {tuple(sin.shape)}")
    if r & (r - 1) or dr < 2 or dr & (dr - 1):
        raise ValueError(f"mla_query: the latent ({r}) and rope ({dr}) widths must be powers of two (the kernel's tiles)")
    if (cache.dim() != 3 or cache.shape[0] < rows // tokens or cache.shape[2] != r + dr or cache.stride(2) != 1
            or norm_weight.shape != (r,) or w_uk.stride(2) != 1):
        raise ValueError(f"mla_query: cache {tuple(cache.shape)} must be [>= B={rows // tokens}, S, r + dr={r + dr}] "
                         f"with contiguous rows, norm_weight {tuple(norm_weight.shape)} [r={r}], w_uk's rows contiguous")
    query = torch.empty(rows, h, r + dr, dtype=q.dtype, device=q.device)
    input_pos = input_pos if input_pos.stride(0) == 1 else input_pos.contiguous()  # read as pos[t]
    pdl = launch.pdl and pdl_supported(q.device)
    grid = (h * triton.cdiv(r, launch.block_r) + 1,)
    mla_query_kernel[grid](q, kv_a, w_uk, cos, sin, norm_weight, input_pos, query, cache,
                           rows, tokens, h, float(eps), q.stride(0), kv_a.stride(0), w_uk.stride(0), w_uk.stride(1),
                           cos.stride(0), sin.stride(0), query.stride(0), query.stride(1), cache.stride(0),
                           cache.stride(1), DN=dn, R=r, DR=dr, QK=dn + dr, BLOCK_DN=triton.next_power_of_2(dn),
                           BLOCK_R=min(launch.block_r, r), PDL=pdl, launch_pdl=pdl, num_warps=launch.num_warps)
    return query


def mla_output(lat: torch.Tensor, g: torch.Tensor | None, w_uv: torch.Tensor,
               launch: MLAAbsorbLaunch = DEFAULT_LAUNCH) -> torch.Tensor:
    """lat [rows, H, r] (attention-weighted latents, contiguous latents), g [rows, H] (the gate's
    pre-activation, a view with contiguous rows; None: no gate), w_uv [H, dv, r] (a view of
    kv_b_proj's weight): returns [rows, H * dv] in lat's dtype, each head's W_uv lat times
    sigmoid(g). The launch after
    this one may start before the launch before it has finished: before its wait it may read only
    weights (o_proj's GEMV)."""
    h, dv, r = w_uv.shape
    if lat.dim() != 3 or lat.shape[1:] != (h, r) or lat.stride(2) != 1:
        raise ValueError(f"mla_output: lat must be [rows, H={h}, r={r}] with contiguous latents, got {tuple(lat.shape)}")
    if g is not None:
        _rows_2d("g", g, h)
        if g.shape[0] != lat.shape[0]:
            raise ValueError(f"mla_output: g {tuple(g.shape)} must have lat's {lat.shape[0]} rows")
    if w_uv.stride(2) != 1 or r & (r - 1):
        raise ValueError(f"mla_output: w_uv's rows must be contiguous and r ({r}) a power of two")
    rows = lat.shape[0]
    out = torch.empty(rows, h * dv, dtype=lat.dtype, device=lat.device)
    block_v = min(launch.block_v, triton.next_power_of_2(dv))
    pdl = launch.pdl and pdl_supported(lat.device)
    mla_output_kernel[(h * triton.cdiv(dv, block_v),)](
        lat, lat if g is None else g, w_uv, out, rows, lat.stride(0), lat.stride(1), 0 if g is None else g.stride(0),
        w_uv.stride(0), w_uv.stride(1), out.stride(0), R=r, DV=dv, BLOCK_V=block_v, GATE=g is not None, PDL=pdl,
        launch_pdl=pdl,
        num_warps=launch.num_warps)
    return out


def _interleaved_rope_reference(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [..., T, d] at the positions of cos/sin [T, d]: the torch form's rope."""
    return apply_rope(torch.cat((x[..., 0::2], x[..., 1::2]), dim=-1), cos, sin)


def mla_query_reference(q, kv_a, w_uk, cos, sin, norm_weight, eps, input_pos, cache):
    """`mla_query` in torch ops, as impl.model.mla's torch form computes it (same arguments; writes
    the cache rows too)."""
    h, dn, r = w_uk.shape
    tokens, dr = cos.shape
    rows = q.shape[0]
    q = q[:, :h * (dn + dr)].reshape(rows // tokens, tokens, h, dn + dr).transpose(1, 2)  # [B, H, T, dn + dr]
    q_lat = torch.einsum("bhtd,hdr->bthr", q[..., :dn], w_uk.to(q.dtype))
    q_rope = _interleaved_rope_reference(q[..., dn:], cos, sin).transpose(1, 2)
    query = torch.cat((q_lat, q_rope), dim=-1).reshape(rows, h, r + dr)
    kv_a = kv_a[:, :r + dr].reshape(rows // tokens, tokens, r + dr)
    latent = torch.nn.functional.rms_norm(kv_a[..., :r], (r,), norm_weight.to(kv_a.dtype), eps)
    k_rope = _interleaved_rope_reference(kv_a[..., r:].unsqueeze(1), cos, sin).squeeze(1)
    cache[:rows // tokens].index_copy_(1, input_pos, torch.cat((latent, k_rope), dim=-1).to(cache.dtype))
    return query


def mla_output_reference(lat, g, w_uv):
    """`mla_output` in torch ops (the torch form's einsum, then the gate where there is one)."""
    rows, h, _ = lat.shape
    y = torch.einsum("bhr,hvr->bhv", lat, w_uv.to(lat.dtype))
    if g is not None:
        y = y * torch.sigmoid(g[:, :h].float()).to(lat.dtype).unsqueeze(-1)
    return y.reshape(rows, -1)


__all__ = ["DEFAULT_LAUNCH", "MLAAbsorbLaunch", "mla_output", "mla_output_kernel", "mla_output_reference", "mla_query",
           "mla_query_kernel", "mla_query_reference"]
