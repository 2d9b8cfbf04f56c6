"""MXFP4 products as exact integer dot products (PTX `dp4a`): how the Triton MoE's register path
(at most `gemv_max_tokens` <= 4 tokens) multiplies MXFP4 experts.

Why: decoding codes to fp32 in registers and multiply-adding costs about ten instructions a code
in the compiled sm_90 loop (shifts and masks, a rescale, a multiply-add, activation loads and
widening; those decodes were measured slower and removed: notes/moe-h200.md). Two times an E2M1 value is an integer in [-12, 12], so byte
permutes (`prmt`) look four codes up at a time in tables held in registers (three permutes per
four codes: the positive table, the negative one, a pick by the sign bits), and one `dp4a`
multiplies four such bytes by four int8 activations and adds them: about five instructions a
code in the compiled loop, address arithmetic included.

Numerics. The weights are exact (2 x E2M1). Each activation row is split, per block of 32 along
K, into two int8 terms: a ~ s * (hi + lo / 128), s = 2**(e - 6) for e the exponent of the block's
largest magnitude, so |a - s (hi + lo / 128)| <= s / 128 <= 2**-13 x (the block's largest
magnitude); bf16 activations within 2**6 of their block's largest are represented exactly. The
integer sums are exact (|128 hi-sum + lo-sum| < 2**23, so also exact in fp32) and meet the
E8M0 and activation scales in fp32 once per block. A block holding NaN or inf gets a NaN scale,
so its token's outputs are NaN. Blocks whose largest magnitude is below 2**-106 are split as if
it were 2**-106 (keeping the scales normal fp32 numbers), i.e. with absolute error <= 2**-119.

Layout of a split row (`split_int8_kernel`, and the gate_up kernel's epilogue for the down
projection's input): int32 "planes" [rows, 4, K/8], whose word w holds the int8 of k = 8w..8w+3
(plane 0: hi, plane 2: lo) and 8w+4..8w+7 (planes 1, 3), matching the weights' int32 words of 8
codes; fp32 scales [rows, K/32] (s / 256: the 1/128 of lo and the 1/2 of 2 x E2M1 folded in).

On the GPU `_prmt` and `_dp4a` are one PTX instruction each; under the interpreter they are
emulated bit for bit with integer ops, so CI runs the same tables and selectors as the GPU.
"""

from __future__ import annotations

import torch

from impl.triton_env import ASM, tl, triton


def empty_split(m: int, k: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Buffers for m rows of k columns split: int32 planes [m, 4, k/8], fp32 scales [m, k/32]."""
    return (torch.empty(m, 4, k // 8, dtype=torch.int32, device=device),
            torch.empty(m, k // 32, dtype=torch.float32, device=device))


def check_split(split: tuple[torch.Tensor, torch.Tensor], m: int, k: int, device) -> None:
    """A clear error unless `split` is (planes, scales) as `empty_split(m, k, device)` makes them."""
    q, s = split
    if k % 32:
        raise ValueError(f"x_split needs the hidden size to be a multiple of 32, whole blocks; got {k}")
    if (q.shape != (m, 4, k // 8) or s.shape != (m, k // 32) or q.dtype != torch.int32 or s.dtype != torch.float32
            or not (q.is_contiguous() and s.is_contiguous()) or q.device != device or s.device != device):
        raise ValueError(f"x_split must be contiguous int32 planes [{m}, 4, {k // 8}] and fp32 scales [{m}, {k // 32}] "
                         f"on {device}, got {q.dtype} {tuple(q.shape)} on {q.device} and {s.dtype} {tuple(s.shape)} "
                         f"on {s.device}")


def _int32(v: int) -> int:
    return v - (1 << 32) if v >= 1 << 31 else v


# Byte tables of 2 x E2M1 for magnitude codes 0-3 and 4-7 (0, 1, 2, 3 | 4, 6, 8, 12), and their
# negatives (codes 8-11 and 12-15; -0 is 0).
POS_LO = tl.constexpr(0x03020100)
POS_HI = tl.constexpr(0x0C080604)
NEG_LO = tl.constexpr(_int32(0xFDFEFF00))
NEG_HI = tl.constexpr(_int32(0xF4F8FAFC))
SPLIT_E_MIN = tl.constexpr(21)  # smallest block exponent field used: keeps s / 256 >= 2**-120


@triton.jit
def _prmt(a, b, sel, ASM: tl.constexpr):
    """PTX `prmt.b32` (default mode): byte i of the result is byte (nibble i of sel) & 7 of the
    eight bytes {b, a} (a holds bytes 0-3), replaced by its sign (0x00 or 0xFF) when the
    nibble's bit 3 is set. Only sel's low 16 bits are read."""
    if ASM:
        return tl.inline_asm_elementwise("prmt.b32 $0, $1, $2, $3;", "=r,r,r,r", [a, b, sel], dtype=tl.int32,
                                         is_pure=True, pack=1)
    # The interpreter's cost is per operation, not per element: the four bytes side by side on a
    # new last axis take a quarter of the operations of a loop over them (bytes are disjoint bits,
    # so their sum is their OR).
    byte_i = tl.arange(0, 4)
    nib = (tl.expand_dims(sel, -1) >> (4 * byte_i)) & 0xF
    idx = nib & 7
    byte = (tl.where(idx < 4, tl.expand_dims(a, -1), tl.expand_dims(b, -1)) >> (8 * (idx & 3))) & 0xFF
    byte = tl.where((nib & 8) != 0, tl.where((byte & 0x80) != 0, 0xFF, 0), byte)
    return tl.sum(byte << (8 * byte_i), axis=-1)


@triton.jit
def _dp4a(a, b, c, ASM: tl.constexpr):
    """c + the sum of the four products of a's and b's signed bytes (PTX `dp4a.s32.s32`)."""
    if ASM:
        return tl.inline_asm_elementwise("dp4a.s32.s32 $0, $1, $2, $3;", "=r,r,r,r", [a, b, c], dtype=tl.int32,
                                         is_pure=True, pack=1)
    up = 24 - 8 * tl.arange(0, 4)  # each signed byte moved to the top, then shifted down with its sign
    return c + tl.sum(((tl.expand_dims(a, -1) << up) >> 24) * ((tl.expand_dims(b, -1) << up) >> 24), axis=-1)


@triton.jit
def _e2m1_word_to_int8x4(words, ASM: tl.constexpr):
    """int32 words of 8 E2M1 codes (code i in bits 4i..4i+3) -> (codes 0-3, codes 4-7) as four
    int8 each, 2 x E2M1 (exact integers). Per four codes: one permute from the positive table,
    one from the negative, one picking per byte by the code's sign."""
    mag = words & 0x77777777  # the selectors without the sign bit (bit 3 would replicate a sign)
    pos_lo = tl.zeros_like(words) + POS_LO
    pos_hi = tl.zeros_like(words) + POS_HI
    neg_lo = tl.zeros_like(words) + NEG_LO
    neg_hi = tl.zeros_like(words) + NEG_HI
    mag_hi = mag >> 16
    # Byte i of the pick: i (the positive value) or 4 + i (the negative) by the code's sign bit.
    pick = ((words >> 1) & 0x44444444) | 0x32103210
    d0 = _prmt(_prmt(pos_lo, pos_hi, mag, ASM), _prmt(neg_lo, neg_hi, mag, ASM), pick, ASM)
    d1 = _prmt(_prmt(pos_lo, pos_hi, mag_hi, ASM), _prmt(neg_lo, neg_hi, mag_hi, ASM), pick >> 16, ASM)
    return d0, d1


@triton.jit
def _or(a, b):
    return a | b


@triton.jit
def _split_int8(a, ROWS: tl.constexpr, COLS: tl.constexpr):
    """a [ROWS, COLS] fp32 (COLS a multiple of 32) -> the split of the module docstring: planes
    (hi 0-3, hi 4-7, lo 0-3, lo 4-7), each [ROWS, COLS/8] int32, and scales [ROWS, COLS/32]."""
    G: tl.constexpr = COLS // 32
    t = tl.reshape(a, (ROWS, G, 32))
    finite = tl.abs(t) < float("inf")  # False for inf and NaN
    t = tl.where(finite, t, 0.0)
    bad = tl.max(tl.where(finite, 0, 1), axis=2) > 0
    e = (tl.max(tl.abs(t), axis=2).to(tl.int32, bitcast=True) >> 23) & 0xFF
    e = tl.maximum(e, SPLIT_E_MIN)[:, :, None]
    s = ((e - 6) << 23).to(tl.float32, bitcast=True)  # 2**(E - 6), E = e - 127 the unbiased exponent
    inv_s = ((260 - e) << 23).to(tl.float32, bitcast=True)  # 1 / s, exactly
    hi = tl.minimum(tl.maximum(tl.floor(t * inv_s + 0.5), -127.0), 127.0)
    lo = tl.minimum(tl.maximum(tl.floor((t - hi * s) * inv_s * 128.0 + 0.5), -127.0), 127.0)
    scale = ((e - 14) << 23).to(tl.float32, bitcast=True)  # s / 256
    scale = tl.where(bad, float("nan"), tl.reshape(scale, (ROWS, G)))
    shifts = 8 * tl.arange(0, 4)
    hi_w = tl.reduce((tl.reshape(hi.to(tl.int32), (ROWS, COLS // 4, 4)) & 0xFF) << shifts[None, None, :], 2, _or)
    lo_w = tl.reduce((tl.reshape(lo.to(tl.int32), (ROWS, COLS // 4, 4)) & 0xFF) << shifts[None, None, :], 2, _or)
    hi0, hi1 = tl.split(tl.reshape(hi_w, (ROWS, COLS // 8, 2)))
    lo0, lo1 = tl.split(tl.reshape(lo_w, (ROWS, COLS // 8, 2)))
    return hi0, hi1, lo0, lo1, scale


@triton.jit
def store_split_int8(q_ptr, stride_qr, s_ptr, stride_sr, a, offs_r, r_mask, col0, K,
                     ROWS: tl.constexpr, COLS: tl.constexpr):
    """Split a [ROWS, COLS] fp32 tile holding columns col0.. (col0 a multiple of 32) of rows
    offs_r, and store it into planes (row stride stride_qr, plane stride K/8) and scales."""
    hi0, hi1, lo0, lo1, scale = _split_int8(a, ROWS, COLS)
    offs_w = col0 // 8 + tl.arange(0, COLS // 8)
    w_mask = r_mask[:, None] & (offs_w < K // 8)[None, :]
    q = q_ptr + offs_r[:, None] * stride_qr + offs_w[None, :]
    tl.store(q, hi0, mask=w_mask)
    tl.store(q + K // 8, hi1, mask=w_mask)
    tl.store(q + 2 * (K // 8), lo0, mask=w_mask)
    tl.store(q + 3 * (K // 8), lo1, mask=w_mask)
    offs_g = col0 // 32 + tl.arange(0, COLS // 32)
    tl.store(s_ptr + offs_r[:, None] * stride_sr + offs_g[None, :], scale,
             mask=r_mask[:, None] & (offs_g < K // 32)[None, :])


@triton.jit
def split_int8_kernel(a_ptr, stride_am, q_ptr, s_ptr, K, BLOCK_K: tl.constexpr):
    """Program (row, K block): split row `row` of a [M, K] (any float dtype) into planes
    [M, 4, K/8] and scales [M, K/32], both contiguous."""
    row = tl.program_id(0)
    offs_k = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    a = tl.load(a_ptr + row * stride_am + offs_k, mask=offs_k < K, other=0.0).to(tl.float32)
    offs_r = row + tl.arange(0, 1)
    store_split_int8(q_ptr, K // 2, s_ptr, K // 32, a[None, :], offs_r, offs_r >= 0, tl.program_id(1) * BLOCK_K, K,
                     1, BLOCK_K)
