"""Fused MoE for decode and verify steps (M <= 16 tokens) in Triton: routed experts in bf16 or
MXFP4 (E2M1 pairs + one E8M0 scale per 32 along K, decoded in registers), SwiGLU, the weighted
combine and an optional shared expert, in three launches with no host synchronization:

1. `moe_slots_kernel` (one program): groups the (token, expert) pairs by expert into "slots",
   so each chosen expert is read once however many tokens chose it;
2. `moe_gate_up_kernel` (slot x intermediate block): act = silu(x Wg^T) * (x Wu^T) for all
   tokens of the slot at once, into a small scratch buffer;
3. `moe_down_kernel` (hidden block): sum over slots of weight * act Wd^T, plus the shared
   expert, written once in the output dtype (deterministic: no atomics on the output).

Tokens are padded to M_PAD = 16 rows so the products run on tensor cores; at decode sizes the
wasted arithmetic is free, the weight bytes are what cost. Up to `gemv_max_tokens` tokens the
products are register multiply-adds instead. MXFP4 has two decodes on each path, chosen by the
launch configuration (tuned per shape, format and M bucket): on the tensor-core path our integer
decode + tl.dot ("bits") or tl.dot_scaled ("scaled"); on the register path a bf16 decode per
byte ("bits16"), an fp32 decode per 32-bit word of 8 codes, one code ("word32") or two codes
("word32x2") per set of shifts and masks, or exact int8 dot products ("dp4a",
impl/moe/triton_dp4a.py: x split into int8 terms by `split_int8_kernel`, or by the router's
logits kernel in a whole layer; the gate_up kernel writes its output split the same way).
Provenance records which one ran as `product`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from impl import backends
from impl.moe.configs import WORD_DECODES, MoELaunchConfig, lookup
from impl.moe.shared import SharedExpert, check_shared_expert
from impl.moe.triton_dp4a import (_dp4a, _e2m1_word_to_int8x4, check_split, empty_split, split_int8_kernel,
                                  store_split_int8)
from impl.moe.triton_pdl import pdl_release, pdl_wait, prefetch_l2, use_pdl
from impl.moe.triton_topk import decode_route, store_decode_routing
from impl.quant.mxfp4 import MXFP4Tensor
from impl.triton_env import ASM, FP32_MATH, INTERPRET, tl, triton

M_PAD = 16  # tokens per kernel call; larger batches are processed in chunks of M_PAD
SPLIT_BLOCK_K = 512  # columns of x a program of `split_int8_kernel` splits (the dp4a decode)
TWO_POW_126 = tl.constexpr(2.0 ** 126)  # undoes the 2**-126 of `_e2m1_word_to_fp32`, exactly
DP4A = tl.constexpr(WORD_DECODES["dp4a"])  # the kernels' WORD32 level of the dp4a decode
# Partial values the down kernel's combine has in flight at once (up to 8 partial tiles): at
# the committed tiles no kernel takes more registers for it (tests/test_moe_gpu_compile.py configs).
COMBINE_ELEMENTS = tl.constexpr(8192)


@triton.jit
def _e2m1_to_bf16(nib):
    """uint8 E2M1 codes -> bf16, exactly (0, 0.5, 1, 1.5, 2, 3, 4, 6 and negatives), by assembling
    the bits: integer work only, no table and no layout shuffles."""
    code = nib.to(tl.int16)
    exp = (code >> 1) & 3
    man = code & 1
    bits = tl.where(exp == 0, man * (126 << 7), ((exp + 126) << 7) | (man << 6))
    return (bits | ((code & 8) << 12)).to(tl.bfloat16, bitcast=True)


@triton.jit
def _e8m0_to_bf16(code):
    """uint8 E8M0 codes -> bf16 2**(code - 127), exactly; 0 is the subnormal 2**-127, 255 is NaN."""
    c = code.to(tl.int16)
    bits = tl.where(c == 0, 0x40, tl.where(c == 255, 0x7FC0, c << 7))
    return bits.to(tl.bfloat16, bitcast=True)


@triton.jit
def _e8m0_to_fp32(code):
    """uint8 E8M0 codes -> fp32 2**(code - 127) by the bits; 0 is the fp32 subnormal 2**-127, 255 NaN."""
    c = code.to(tl.int32)
    bits = tl.where(c == 0, 0x00400000, tl.where(c == 255, 0x7FC00000, c << 23))
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _tile_dot_scaled(a_ptr, stride_am, offs_m, m_mask, k0, K, w_ptr, ws_ptr, offs_n, n_mask, stride_wn, stride_sn,
                     BLOCK_K: tl.constexpr, FP32_MATH: tl.constexpr):
    """The MXFP4 product of `_tile_dot` through tl.dot_scaled: the packed codes go in as they are
    stored ([BLOCK_K/2, BLOCK_N] bytes, packed along K, low nibble = even k, which is dot_scaled's
    convention too) with the E8M0 scales as [BLOCK_N, BLOCK_K/32], so the upcast to the tensor
    cores' operand is Triton's own lowering for the target instead of our integer decode."""
    offs_j = k0 // 2 + tl.arange(0, BLOCK_K // 2)
    offs_g = k0 // 32 + tl.arange(0, BLOCK_K // 32)
    offs_k = k0 + tl.arange(0, BLOCK_K)
    packed = tl.load(w_ptr + offs_n[None, :] * stride_wn + offs_j[:, None],
                     mask=(offs_j < K // 2)[:, None] & n_mask[None, :], other=0)
    codes = tl.load(ws_ptr + offs_n[:, None] * stride_sn + offs_g[None, :],
                    mask=n_mask[:, None] & (offs_g < K // 32)[None, :], other=127)
    a = tl.load(a_ptr + offs_m[:, None] * stride_am + offs_k[None, :], mask=m_mask[:, None] & (offs_k < K)[None, :],
                other=0.0)
    if FP32_MATH:
        # The interpreter widens a bf16 lhs through fp16 (losing values outside fp16's range), so
        # there dot_scaled decodes the tile against an identity (1.0 and 0.0 are exact in every
        # format) and fp32 activations meet the decoded W^T in an fp32 dot: the same packing and
        # scale layout as on the GPU, computed exactly.
        offs_r = tl.arange(0, BLOCK_K)
        eye = tl.where(offs_r[:, None] == offs_r[None, :], 1.0, 0.0).to(tl.bfloat16)
        w_t = tl.dot_scaled(eye, None, "bf16", packed, codes, "e2m1")  # [BLOCK_K, BLOCK_N] fp32
        return tl.dot(a.to(tl.float32), w_t)
    return tl.dot_scaled(a.to(tl.bfloat16), None, "bf16", packed, codes, "e2m1")


@triton.jit
def _tile_dot(a_ptr, stride_am, offs_m, m_mask, k0, K, w_ptr, ws_ptr, offs_n, n_mask, stride_wn, stride_sn,
              BLOCK_K: tl.constexpr, MXFP4: tl.constexpr, SCALED: tl.constexpr, FP32_MATH: tl.constexpr):
    """a[offs_m, k0:k0+BLOCK_K] @ W[offs_n, k0:k0+BLOCK_K]^T with fp32 accumulation, for a [N, K]
    weight stored as bf16/fp16/fp32 or as MXFP4 (packed [N, K/2] + scales [N, K/32]); MXFP4 goes
    through tl.dot_scaled when SCALED (`_tile_dot_scaled`).

    MXFP4 is never interleaved in registers: the low nibbles (even k) meet the even columns of
    `a` and the high nibbles (odd k) the odd ones, so the product needs no layout shuffle. The
    products are exact in bf16 (activations are bf16, E2M1 x 2**s is exact), the sums fp32."""
    if MXFP4:
        if SCALED:
            return _tile_dot_scaled(a_ptr, stride_am, offs_m, m_mask, k0, K, w_ptr, ws_ptr, offs_n, n_mask,
                                    stride_wn, stride_sn, BLOCK_K, FP32_MATH)
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
        lo = _e2m1_to_bf16(packed & 0xF)
        hi = _e2m1_to_bf16(packed >> 4)
        if FP32_MATH:  # the interpreter gets bf16 arithmetic wrong
            # Scales decoded straight to fp32: the interpreter's bf16 -> fp32 conversion flushes
            # subnormals, and E8M0 code 0 is the bf16 subnormal 2**-127.
            scale = _e8m0_to_fp32(codes)
            lo = lo.to(tl.float32) * scale
            hi = hi.to(tl.float32) * scale
            return (tl.dot(a_even.to(tl.float32), tl.trans(lo)) + tl.dot(a_odd.to(tl.float32), tl.trans(hi)))
        scale = _e8m0_to_bf16(codes)
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


@triton.jit
def _tile_gemv(a_ptr, stride_am, offs_m, M, k0, K, w_ptr, ws_ptr, offs_n, n_mask, stride_wn, stride_sn,
               M_PAD: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, ROWS: tl.constexpr):
    """The MXFP4 product of `_tile_dot` for the first ROWS (<= 4) tokens, as fp32 multiply-adds
    in registers ("bits16"): no tensor-core operand layout to convert the decoded weights into.
    Tiles are loaded as [BLOCK_N, groups, 16 bytes], so each 32-element scale multiplies a
    partial sum once instead of every element."""
    acc = tl.zeros((M_PAD, BLOCK_N), dtype=tl.float32)
    G: tl.constexpr = BLOCK_K // 32
    offs_g = k0 // 32 + tl.arange(0, G)
    offs_t = tl.arange(0, 16)
    offs_j = offs_g[:, None] * 16 + offs_t[None, :]  # [G, 16] byte columns
    j_mask = offs_j < K // 2
    packed = tl.load(w_ptr + offs_n[:, None, None] * stride_wn + offs_j[None, :, :],
                     mask=n_mask[:, None, None] & j_mask[None, :, :], other=0)
    codes = tl.load(ws_ptr + offs_n[:, None] * stride_sn + offs_g[None, :],
                    mask=n_mask[:, None] & (offs_g[None, :] < K // 32), other=127)
    scale = _e8m0_to_fp32(codes)
    lo = _e2m1_to_bf16(packed & 0xF).to(tl.float32)
    hi = _e2m1_to_bf16(packed >> 4).to(tl.float32)
    for r in tl.static_range(ROWS):
        a_mask = j_mask & (tl.zeros_like(offs_j) + r < M)
        a_even = tl.load(a_ptr + r * stride_am + 2 * offs_j, mask=a_mask, other=0.0).to(tl.float32)
        a_odd = tl.load(a_ptr + r * stride_am + 2 * offs_j + 1, mask=a_mask, other=0.0).to(tl.float32)
        part = tl.sum(lo * a_even[None, :, :] + hi * a_odd[None, :, :], axis=2)  # [BLOCK_N, G]
        row = tl.sum(part * scale, axis=1)
        acc += tl.where(offs_m[:, None] == r, row[None, :], 0.0)
    return acc


@triton.jit
def _e2m1_word_to_fp32(word, I: tl.constexpr):
    """Code I (bits 4I..4I+3, i.e. k = 8 w + I) of int32 words -> fp32 E2M1 value * 2**-126:
    the code's exponent and mantissa bits land on fp32's lowest exponent bits and top mantissa
    bit, its sign on bit 31, so exponent 0 (+-0.5) is the fp32 subnormal and the others are
    normal numbers, all exact; a shift and a mask each, no compare or select."""
    if 4 * I <= 22:
        mag = (word << (22 - 4 * I)) & 0x01C00000
    else:
        mag = (word >> (4 * I - 22)) & 0x01C00000
    sign = (word << (28 - 4 * I)) & -2147483648
    return (mag | sign).to(tl.float32, bitcast=True)


@triton.jit
def _e2m1_word_pair_to_fp32(word, I: tl.constexpr):
    """Codes I and I + 4 (bits 4I.. and 16 + 4I..) of int32 words -> both fp32 E2M1 values
    * 2**-126 from one set of shifts and masks: the two codes land at once on the word's two bf16
    halves (magnitude on bf16 bits 6-8, sign on bit 15: the bf16 pattern of E2M1 * 2**-126, so
    the same exact values as `_e2m1_word_to_fp32`), and each half widens to fp32 by one shift or
    one mask. About three integer operations a code instead of four."""
    if I <= 1:
        mag = (word << (6 - 4 * I)) & 0x01C001C0
    else:
        mag = (word >> (4 * I - 6)) & 0x01C001C0
    sign = (word << (12 - 4 * I)) & -2147450880  # 0x80008000: the sign bit of both halves
    halves = mag | sign
    return (halves << 16).to(tl.float32, bitcast=True), (halves & -65536).to(tl.float32, bitcast=True)


@triton.jit
def _fma_rows(part0, part1, part2, part3, w, a_ptr, stride_am, a_offs, word_mask, M, ROWS: tl.constexpr):
    """part_r += w * a[r, a_offs] for the first ROWS (1, 2 or 4) rows of `a` (rows >= M read 0)."""
    rows = tl.zeros_like(a_offs)  # a row number compared with M, as a mask
    part0 += w * tl.load(a_ptr + a_offs, mask=word_mask, other=0.0).to(tl.float32)[None, :, :]
    if ROWS > 1:
        a1 = tl.load(a_ptr + stride_am + a_offs, mask=word_mask & (rows + 1 < M), other=0.0).to(tl.float32)
        part1 += w * a1[None, :, :]
    if ROWS > 2:
        a2 = tl.load(a_ptr + 2 * stride_am + a_offs, mask=word_mask & (rows + 2 < M), other=0.0).to(tl.float32)
        a3 = tl.load(a_ptr + 3 * stride_am + a_offs, mask=word_mask & (rows + 3 < M), other=0.0).to(tl.float32)
        part2 += w * a2[None, :, :]
        part3 += w * a3[None, :, :]
    return part0, part1, part2, part3


@triton.jit
def _gemv_word32(a_ptr, stride_am, M, K, w_ptr, ws_ptr, offs_n, n_mask, stride_wn, stride_sn, first_row,
                 M_PAD: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, ROWS: tl.constexpr,
                 PAIRS: tl.constexpr):
    """a[:ROWS] @ W[offs_n]^T over all of K for MXFP4 W given as int32 words (w_ptr, stride_wn in
    words: the packed bytes viewed as int32, 8 codes a word, little-endian so code i of word w is
    k = 8 w + i). Per code: one shift-and-mask pair (PAIRS: two codes per pair,
    `_e2m1_word_pair_to_fp32`), one multiply by 2**126 (exact: it turns the subnormal back into
    the E2M1 value) and one multiply-add per token; the E8M0 scale multiplies
    each word's partial sum once, and the sums stay in the words' shape and layout [BLOCK_N,
    BLOCK_K/32, 4] until after the K loop, so the cross-thread reduction happens once per output,
    not per K step (the compiled sm_90 loop has no shuffles; the scales' one [BLOCK_N, BLOCK_K/32]
    layout conversion per K step remains).
    Row r of `a` lands in row first_row + r of the [M_PAD, BLOCK_N] result."""
    G: tl.constexpr = BLOCK_K // 32
    offs_g = tl.arange(0, G)
    offs_w = tl.arange(0, 4)
    acc0 = tl.zeros((BLOCK_N, G, 4), dtype=tl.float32)
    acc1 = tl.zeros((BLOCK_N, G, 4), dtype=tl.float32)
    acc2 = tl.zeros((BLOCK_N, G, 4), dtype=tl.float32)
    acc3 = tl.zeros((BLOCK_N, G, 4), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        blk = k0 // 32 + offs_g  # [G] scale blocks
        offs_word = blk[:, None] * 4 + offs_w[None, :]  # [G, 4] word columns
        # K is a multiple of 32: whole blocks are in or out, so the masks are constant along a
        # block's 4 words.
        blk_mask = blk < K // 32
        word_mask = blk_mask[:, None] & (offs_w < 4)[None, :]
        words = tl.load(w_ptr + offs_n[:, None, None] * stride_wn + offs_word[None, :, :],
                        mask=n_mask[:, None, None] & blk_mask[None, :, None], other=0)
        codes = tl.load(ws_ptr + offs_n[:, None] * stride_sn + blk[None, :],
                        mask=n_mask[:, None] & blk_mask[None, :], other=127)
        scale = _e8m0_to_fp32(codes)[:, :, None]  # [BLOCK_N, G, 1]
        part0 = tl.zeros((BLOCK_N, G, 4), dtype=tl.float32)
        part1 = tl.zeros((BLOCK_N, G, 4), dtype=tl.float32)
        part2 = tl.zeros((BLOCK_N, G, 4), dtype=tl.float32)
        part3 = tl.zeros((BLOCK_N, G, 4), dtype=tl.float32)
        if PAIRS:  # codes i and i + 4 decoded together
            for i in tl.static_range(4):
                w_lo, w_hi = _e2m1_word_pair_to_fp32(words, i)
                part0, part1, part2, part3 = _fma_rows(part0, part1, part2, part3, w_lo * TWO_POW_126, a_ptr,
                                                       stride_am, offs_word * 8 + i, word_mask, M, ROWS)
                part0, part1, part2, part3 = _fma_rows(part0, part1, part2, part3, w_hi * TWO_POW_126, a_ptr,
                                                       stride_am, offs_word * 8 + i + 4, word_mask, M, ROWS)
        else:
            for i in tl.static_range(8):
                part0, part1, part2, part3 = _fma_rows(part0, part1, part2, part3,
                                                       _e2m1_word_to_fp32(words, i) * TWO_POW_126, a_ptr,
                                                       stride_am, offs_word * 8 + i, word_mask, M, ROWS)
        # Sums kept in the words' layout: no reduction and no layout conversion inside the loop.
        acc0 += part0 * scale
        if ROWS > 1:
            acc1 += part1 * scale
        if ROWS > 2:
            acc2 += part2 * scale
            acc3 += part3 * scale
    return _rows_tile(tl.sum(tl.sum(acc0, axis=2), axis=1), tl.sum(tl.sum(acc1, axis=2), axis=1),
                      tl.sum(tl.sum(acc2, axis=2), axis=1), tl.sum(tl.sum(acc3, axis=2), axis=1), first_row, ROWS,
                      M_PAD)


@triton.jit
def _rows_tile(r0, r1, r2, r3, first_row, ROWS: tl.constexpr, M_PAD: tl.constexpr):
    """[M_PAD, BLOCK_N] fp32 holding the first ROWS of the [BLOCK_N] rows r0..r3 at rows first_row..,
    zeros elsewhere (the rows not used are never computed)."""
    offs_m = tl.arange(0, M_PAD)
    out = tl.where(offs_m[:, None] == first_row, r0[None, :], 0.0)
    if ROWS > 1:
        out += tl.where(offs_m[:, None] == first_row + 1, r1[None, :], 0.0)
    if ROWS > 2:
        out += tl.where(offs_m[:, None] == first_row + 2, r2[None, :], 0.0)
        out += tl.where(offs_m[:, None] == first_row + 3, r3[None, :], 0.0)
    return out


@triton.jit
def _plain_row(a_ptr, offs_k, k_mask, offs_n, r: tl.constexpr, M):
    """Row r of the activations at offs_k as fp32 (0 past row M - 1; row 0 always exists),
    broadcast to the weight tile [offs_n, offs_k]: loaded in the tile's shape, it gets the tile's
    layout, so the loop needs no layout conversion (the thread's repeated reads of the same
    address are one load)."""
    offs = offs_k[None, :] + 0 * offs_n[:, None]
    mask = k_mask[None, :] & ((tl.zeros_like(offs) + r < M) | (r == 0))
    return tl.load(a_ptr + offs, mask=mask, other=0.0).to(tl.float32)


@triton.constexpr_function
def _stages(pipeline):
    """The register loops' PIPELINE: 0, each K step loads its own weights; n > 0, each step loads
    the weights of the step n steps ahead into registers before computing on its own (n round
    trips in flight, no shared memory); -n, Triton's software pipeline of n stages
    (`tl.range(num_stages=n)`, which pipelines a loop without dot products only when asked so:
    asynchronous copies into shared memory, n - 1 steps in flight without holding them in
    registers, a barrier a step). Returns the loop's num_stages (1: not pipelined by Triton)."""
    return -pipeline if pipeline < 0 else 1


@triton.constexpr_function
def _ahead(pipeline):
    """K steps the register loops load ahead under PIPELINE (`_stages`)."""
    return max(pipeline, 0)


@triton.jit
def _live(k0, K):
    """[1] bool: whether a K step from column k0 lies inside K (False: a prefetch past the end).
    A tensor, not a scalar: masks combine with it elementwise, under the interpreter too."""
    return tl.arange(0, 1) + k0 < K


@triton.jit
def _plain_weights(w_ptr, offs_n, n_mask, stride_wn, k0, K, live, BLOCK_K: tl.constexpr, EVEN: tl.constexpr):
    """One K step's plain weight tile [BLOCK_N, BLOCK_K] from column k0, in its stored dtype
    (nothing is read where `live` is False: a prefetch past K). Widened where it is used, not
    here: a tile loaded ahead and converted at once would wait for its load in the step that
    issued it."""
    offs_k = k0 + tl.arange(0, BLOCK_K)
    k_mask = ((offs_k < K) | EVEN) & live
    return tl.load(w_ptr + offs_n[:, None] * stride_wn + offs_k[None, :], mask=n_mask[:, None] & k_mask[None, :],
                   other=0.0)


@triton.jit
def _plain_rows(g0, g1, g2, g3, u0, u1, u2, u3, w, w2, a_ptr, stride_am, offs_n, k0, K, M,
                BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, ROWS: tl.constexpr, V: tl.constexpr,
                TWO: tl.constexpr, EVEN: tl.constexpr):
    """One K step of `_gemv_rows` on plain weights: the tiles w (and w2 when TWO) against each
    row of `a` from column k0, into per-thread partials (per weight at one row, V = 1; per
    16-byte run of V weights at more rows)."""
    S: tl.constexpr = BLOCK_K // V
    offs_k = k0 + tl.arange(0, BLOCK_K)
    k_mask = (offs_k < K) | EVEN
    w = w.to(tl.float32)
    w2 = w2.to(tl.float32)
    a = _plain_row(a_ptr, offs_k, k_mask, offs_n, 0, M)
    g0 += _run_sums(w * a, BLOCK_N, S, V)
    if TWO:
        u0 += _run_sums(w2 * a, BLOCK_N, S, V)
    if ROWS > 1:
        a = _plain_row(a_ptr + stride_am, offs_k, k_mask, offs_n, 1, M)
        g1 += _run_sums(w * a, BLOCK_N, S, V)
        if TWO:
            u1 += _run_sums(w2 * a, BLOCK_N, S, V)
    if ROWS > 2:
        a = _plain_row(a_ptr + 2 * stride_am, offs_k, k_mask, offs_n, 2, M)
        g2 += _run_sums(w * a, BLOCK_N, S, V)
        if TWO:
            u2 += _run_sums(w2 * a, BLOCK_N, S, V)
        a = _plain_row(a_ptr + 3 * stride_am, offs_k, k_mask, offs_n, 3, M)
        g3 += _run_sums(w * a, BLOCK_N, S, V)
        if TWO:
            u3 += _run_sums(w2 * a, BLOCK_N, S, V)
    return g0, g1, g2, g3, u0, u1, u2, u3


@triton.jit
def _run_sums(prod, BLOCK_N: tl.constexpr, S: tl.constexpr, V: tl.constexpr):
    """[BLOCK_N, S * V] -> the sums of its S runs of V along the row (a thread's own loads)."""
    if V == 1:
        return prod
    return tl.sum(tl.reshape(prod, (BLOCK_N, S, V)), axis=2)


@triton.jit
def _dp4a_row(acc, d0, d1, wscale, q_ptr, s_ptr, K, offs_word, blk, word_mask, blk_mask, r: tl.constexpr, M,
              ASM: tl.constexpr):
    """acc [BLOCK_N, G] += this K step's block sums of split activation row r (planes at q_ptr,
    scales at s_ptr; a row >= M reads 0, row 0 always exists) against the decoded weights d0, d1
    [BLOCK_N, G, 4]."""
    row_ok = (tl.zeros_like(blk) + r < M) | (r == 0)
    m = word_mask & row_ok[:, None]
    plane = tl.multiple_of(K // 8, 4)  # K is a multiple of 32: every plane starts 16-byte aligned
    hi0 = tl.load(q_ptr + offs_word, mask=m, other=0)[None, :, :]
    hi1 = tl.load(q_ptr + plane + offs_word, mask=m, other=0)[None, :, :]
    lo0 = tl.load(q_ptr + 2 * plane + offs_word, mask=m, other=0)[None, :, :]
    lo1 = tl.load(q_ptr + 3 * plane + offs_word, mask=m, other=0)[None, :, :]
    zero = tl.zeros_like(d0)
    i_hi = _dp4a(d1, hi1, _dp4a(d0, hi0, zero, ASM), ASM)
    i_lo = _dp4a(d1, lo1, _dp4a(d0, lo0, zero, ASM), ASM)
    block = tl.sum(i_hi * 128 + i_lo, axis=2)  # [BLOCK_N, G], exact
    xs = tl.load(s_ptr + blk, mask=blk_mask & row_ok, other=0.0)
    return acc + block.to(tl.float32) * xs[None, :] * wscale


@triton.jit
def _dp4a_weights(w_ptr, ws_ptr, offs_n, n_mask, stride_wn, stride_sn, k0, K, live,
                  BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN: tl.constexpr):
    """One K step's MXFP4 words [BLOCK_N, G, 4] and E8M0 codes [BLOCK_N, G] of rows offs_n from
    column k0 (nothing is read where `live` is False: a prefetch past K).
    Layouts, so that the loop needs no shared memory and no barrier: the words are loaded as rows
    of 4G contiguous words (lanes along a row, 16 bytes each), and the scales with no known
    alignment, so one byte a lane, lanes along a row as well: that puts scale (n, g) in the thread
    holding block g of row n, as the block sums are (checked on the sm_90 build:
    tests/test_moe_gpu_compile.py)."""
    G: tl.constexpr = BLOCK_K // 32
    blk = k0 // 32 + tl.arange(0, G)
    offs_kw = k0 // 8 + tl.arange(0, G * 4)
    words = tl.load(w_ptr + offs_n[:, None] * stride_wn + offs_kw[None, :],
                    mask=n_mask[:, None] & (((offs_kw < K // 8) | EVEN) & live)[None, :], other=0)
    offs_s = tl.multiple_of(offs_n[:, None] * stride_sn + blk[None, :], [1, 1])
    codes = tl.load(ws_ptr + offs_s, mask=n_mask[:, None] & (((blk < K // 32) | EVEN) & live)[None, :], other=127)
    return tl.reshape(words, (BLOCK_N, G, 4)), codes


@triton.jit
def _dp4a_rows(acc0, acc1, acc2, acc3, words, codes, q_ptr, stride_qm, s_ptr, K, k0, M,
               BLOCK_K: tl.constexpr, ROWS: tl.constexpr, EVEN: tl.constexpr):
    """One K step of `_gemv_rows` on MXFP4 words for one weight: its decoded words against each
    row's split."""
    G: tl.constexpr = BLOCK_K // 32
    blk = k0 // 32 + tl.arange(0, G)
    offs_w = tl.arange(0, 4)
    offs_word = blk[:, None] * 4 + offs_w[None, :]  # [G, 4] words of 8 codes
    blk_mask = (blk < K // 32) | EVEN  # K is a multiple of 32: whole blocks are in or out
    word_mask = blk_mask[:, None] & (offs_w < 4)[None, :]
    wscale = _e8m0_to_fp32(codes)
    d0, d1 = _e2m1_word_to_int8x4(words, ASM)
    acc0 = _dp4a_row(acc0, d0, d1, wscale, q_ptr, s_ptr, K, offs_word, blk, word_mask, blk_mask, 0, M, ASM)
    if ROWS > 1:
        acc1 = _dp4a_row(acc1, d0, d1, wscale, q_ptr + stride_qm, s_ptr + K // 32, K, offs_word, blk,
                         word_mask, blk_mask, 1, M, ASM)
    if ROWS > 2:
        acc2 = _dp4a_row(acc2, d0, d1, wscale, q_ptr + 2 * stride_qm, s_ptr + 2 * (K // 32), K, offs_word,
                         blk, word_mask, blk_mask, 2, M, ASM)
        acc3 = _dp4a_row(acc3, d0, d1, wscale, q_ptr + 3 * stride_qm, s_ptr + 3 * (K // 32), K, offs_word,
                         blk, word_mask, blk_mask, 3, M, ASM)
    return acc0, acc1, acc2, acc3


@triton.jit
def _step_weights(w_ptr, ws_ptr, w2_ptr, ws2_ptr, offs_n, n_mask, stride_wn, stride_sn, k0, K, live,
                  BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DP4A_WORDS: tl.constexpr, TWO: tl.constexpr,
                  EVEN: tl.constexpr):
    """One K step's tiles of W and (TWO) W2 from column k0, nothing read where `live` is False:
    (W, its scales, W2, its scales). DP4A_WORDS: MXFP4 int32 words and E8M0 codes
    (`_dp4a_weights`); else plain tiles as stored (`_plain_weights`) and a constant in the scale
    slots. Without TWO, W2's slots repeat W's."""
    if DP4A_WORDS:
        w, ws = _dp4a_weights(w_ptr, ws_ptr, offs_n, n_mask, stride_wn, stride_sn, k0, K, live, BLOCK_N, BLOCK_K,
                              EVEN)
        w2, ws2 = w, ws
        if TWO:
            w2, ws2 = _dp4a_weights(w2_ptr, ws2_ptr, offs_n, n_mask, stride_wn, stride_sn, k0, K, live, BLOCK_N,
                                    BLOCK_K, EVEN)
    else:
        w = _plain_weights(w_ptr, offs_n, n_mask, stride_wn, k0, K, live, BLOCK_K, EVEN)
        w2 = w
        if TWO:
            w2 = _plain_weights(w2_ptr, offs_n, n_mask, stride_wn, k0, K, live, BLOCK_K, EVEN)
        ws = tl.zeros((1,), dtype=tl.int8)  # unused: a constant, so a carried copy folds away
        ws2 = ws
    return w, ws, w2, ws2


@triton.jit
def _gemv_step(a0, a1, a2, a3, b0, b1, b2, b3, w, ws, w2, ws2, a_ptr, stride_am, as_ptr, offs_n, k0, K, M,
               BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, ROWS: tl.constexpr, COLS: tl.constexpr,
               DP4A_WORDS: tl.constexpr, TWO: tl.constexpr, EVEN: tl.constexpr):
    """One K step of `_gemv_rows` from column k0 on its loaded tiles (`_step_weights`): the
    partials a<r> (W) and b<r> (W2) of each row r, updated."""
    if DP4A_WORDS:
        a0, a1, a2, a3 = _dp4a_rows(a0, a1, a2, a3, w, ws, a_ptr, stride_am, as_ptr, K, k0, M, BLOCK_K, ROWS, EVEN)
        if TWO:
            b0, b1, b2, b3 = _dp4a_rows(b0, b1, b2, b3, w2, ws2, a_ptr, stride_am, as_ptr, K, k0, M, BLOCK_K, ROWS,
                                        EVEN)
    else:
        a0, a1, a2, a3, b0, b1, b2, b3 = _plain_rows(a0, a1, a2, a3, b0, b1, b2, b3, w, w2, a_ptr, stride_am, offs_n,
                                                     k0, K, M, BLOCK_N, BLOCK_K, ROWS, BLOCK_K // COLS, TWO, EVEN)
    return a0, a1, a2, a3, b0, b1, b2, b3


@triton.constexpr_function
def _partial_cols(block_k, rows, dp4a_words, bits):
    """Columns of `_gemv_rows`' per-thread partials a K step: dp4a, one sum a block of 32; plain
    weights, one a weight at one row, else one a 16-byte run of weights (what a thread loads)."""
    if dp4a_words:
        return block_k // 32
    return block_k if rows == 1 else block_k // (128 // bits)


@triton.jit
def _gemv_rows(a_ptr, stride_am, as_ptr, M, K, w_ptr, ws_ptr, w2_ptr, ws2_ptr, offs_n, n_mask, stride_wn, stride_sn,
               first_row, M_PAD: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, ROWS: tl.constexpr,
               DP4A_WORDS: tl.constexpr, TWO: tl.constexpr, PIPELINE: tl.constexpr, EVEN: tl.constexpr):
    """a[:ROWS] @ W[offs_n]^T over all of K on the register path, and the same with W2 when TWO
    (gate and up rows in one loop: both weights' loads in flight at once, half the dependent K
    steps of two loops). DP4A_WORDS: W MXFP4 as int32 words (as `_gemv_word32`, scales at ws_ptr)
    and `a` split into int8 planes (a_ptr, row stride stride_am) with scales at as_ptr (row
    stride K/32; impl/moe/triton_dp4a.py); else W plain (bf16/fp16/fp32) and `a` as it is.
    The K loop keeps fp32 partial sums in registers, each thread its own (`_partial_cols`),
    summed across threads once after the loop: no cross-thread reduction (shuffles, shared
    memory, barriers) inside it. PIPELINE: how loads stay in flight (`_stages`). EVEN: K is a
    multiple of BLOCK_K (no K mask). Returns the two [M_PAD, BLOCK_N] fp32 results (the second
    zeros unless TWO); row r of `a` lands in row first_row + r."""
    COLS: tl.constexpr = _partial_cols(BLOCK_K, ROWS, DP4A_WORDS, w_ptr.dtype.element_ty.primitive_bitwidth)
    # Partials per row r: a<r> of W, b<r> of W2.
    a0 = tl.zeros((BLOCK_N, COLS), dtype=tl.float32)
    a1 = tl.zeros((BLOCK_N, COLS), dtype=tl.float32)
    a2 = tl.zeros((BLOCK_N, COLS), dtype=tl.float32)
    a3 = tl.zeros((BLOCK_N, COLS), dtype=tl.float32)
    b0 = tl.zeros((BLOCK_N, COLS), dtype=tl.float32)
    b1 = tl.zeros((BLOCK_N, COLS), dtype=tl.float32)
    b2 = tl.zeros((BLOCK_N, COLS), dtype=tl.float32)
    b3 = tl.zeros((BLOCK_N, COLS), dtype=tl.float32)
    AHEAD: tl.constexpr = _ahead(PIPELINE)
    tl.static_assert(AHEAD <= 2)
    if AHEAD >= 1:  # the sets loaded before the loop: step 0 and (AHEAD == 2) step 1
        n1w, n1ws, n1w2, n1ws2 = _step_weights(w_ptr, ws_ptr, w2_ptr, ws2_ptr, offs_n, n_mask, stride_wn, stride_sn,
                                               0, K, _live(0, K), BLOCK_N, BLOCK_K, DP4A_WORDS, TWO, EVEN)
        if AHEAD == 2:
            n2w, n2ws, n2w2, n2ws2 = _step_weights(w_ptr, ws_ptr, w2_ptr, ws2_ptr, offs_n, n_mask, stride_wn,
                                                   stride_sn, BLOCK_K, K, _live(BLOCK_K, K), BLOCK_N, BLOCK_K,
                                                   DP4A_WORDS, TWO, EVEN)
    if AHEAD == 0:
        for k0 in tl.range(0, K, BLOCK_K, num_stages=_stages(PIPELINE)):
            w, ws, w2, ws2 = _step_weights(w_ptr, ws_ptr, w2_ptr, ws2_ptr, offs_n, n_mask, stride_wn, stride_sn, k0,
                                           K, _live(k0, K), BLOCK_N, BLOCK_K, DP4A_WORDS, TWO, EVEN)
            a0, a1, a2, a3, b0, b1, b2, b3 = _gemv_step(a0, a1, a2, a3, b0, b1, b2, b3, w, ws, w2, ws2, a_ptr,
                                                        stride_am, as_ptr, offs_n, k0, K, M, BLOCK_N, BLOCK_K, ROWS,
                                                        COLS, DP4A_WORDS, TWO, EVEN)
    elif DP4A_WORDS:
        # One step a iteration, the sets loaded ahead rotating (n1 <- n2 <- a new load). Two steps
        # ahead, the long decode makes ptxas issue the new load after the step's products, straight
        # into the rotating registers; one step ahead it copies the new load at the end of the
        # step, which waits for it. The buffered form below avoids that copy but holds more
        # registers here: a program an SM fewer, a wave more (notes/moe-h200.md, run 11).
        for k0 in range(0, K, BLOCK_K):
            w, ws, w2, ws2 = n1w, n1ws, n1w2, n1ws2
            if AHEAD == 2:
                n1w, n1ws, n1w2, n1ws2 = n2w, n2ws, n2w2, n2ws2
            k_next = k0 + AHEAD * BLOCK_K
            nw, nws, nw2, nws2 = _step_weights(w_ptr, ws_ptr, w2_ptr, ws2_ptr, offs_n, n_mask, stride_wn, stride_sn,
                                               k_next, K, _live(k_next, K), BLOCK_N, BLOCK_K, DP4A_WORDS, TWO, EVEN)
            if AHEAD == 2:
                n2w, n2ws, n2w2, n2ws2 = nw, nws, nw2, nws2
            else:
                n1w, n1ws, n1w2, n1ws2 = nw, nws, nw2, nws2
            a0, a1, a2, a3, b0, b1, b2, b3 = _gemv_step(a0, a1, a2, a3, b0, b1, b2, b3, w, ws, w2, ws2, a_ptr,
                                                        stride_am, as_ptr, offs_n, k0, K, M, BLOCK_N, BLOCK_K, ROWS,
                                                        COLS, DP4A_WORDS, TWO, EVEN)
    else:
        # Plain weights: AHEAD + 1 K steps an iteration, each from its own set of registers, so
        # that no loaded tile is ever copied: a set held across iterations (c0, c1) is reloaded
        # only after its step has used it, straight into its registers; the set of the step AHEAD
        # ahead (n) is loaded first and used last. With one rotating set, as above, ptxas hoists
        # this short loop's loads to its top and copies them into the rotating registers at its
        # end, and the copy waits for the load: one memory round trip a K step, which made the
        # shared expert's programs the gate_up kernel's longest (notes/moe-h200.md, run 11).
        STRIDE: tl.constexpr = (AHEAD + 1) * BLOCK_K
        c0w, c0ws, c0w2, c0ws2 = n1w, n1ws, n1w2, n1ws2
        if AHEAD == 2:
            c1w, c1ws, c1w2, c1ws2 = n2w, n2ws, n2w2, n2ws2
        for k0 in range(0, K, STRIDE):
            kn = k0 + AHEAD * BLOCK_K
            nw, nws, nw2, nws2 = _step_weights(w_ptr, ws_ptr, w2_ptr, ws2_ptr, offs_n, n_mask, stride_wn, stride_sn,
                                               kn, K, _live(kn, K), BLOCK_N, BLOCK_K, DP4A_WORDS, TWO, EVEN)
            a0, a1, a2, a3, b0, b1, b2, b3 = _gemv_step(a0, a1, a2, a3, b0, b1, b2, b3, c0w, c0ws, c0w2, c0ws2,
                                                        a_ptr, stride_am, as_ptr, offs_n, k0, K, M, BLOCK_N, BLOCK_K,
                                                        ROWS, COLS, DP4A_WORDS, TWO, EVEN)
            c0w, c0ws, c0w2, c0ws2 = _step_weights(w_ptr, ws_ptr, w2_ptr, ws2_ptr, offs_n, n_mask, stride_wn,
                                                   stride_sn, k0 + STRIDE, K, _live(k0 + STRIDE, K), BLOCK_N,
                                                   BLOCK_K, DP4A_WORDS, TWO, EVEN)
            if AHEAD == 2:
                k1 = k0 + BLOCK_K
                if k1 < K:
                    a0, a1, a2, a3, b0, b1, b2, b3 = _gemv_step(a0, a1, a2, a3, b0, b1, b2, b3, c1w, c1ws, c1w2,
                                                                c1ws2, a_ptr, stride_am, as_ptr, offs_n, k1, K, M,
                                                                BLOCK_N, BLOCK_K, ROWS, COLS, DP4A_WORDS, TWO, EVEN)
                c1w, c1ws, c1w2, c1ws2 = _step_weights(w_ptr, ws_ptr, w2_ptr, ws2_ptr, offs_n, n_mask, stride_wn,
                                                       stride_sn, k1 + STRIDE, K, _live(k1 + STRIDE, K), BLOCK_N,
                                                       BLOCK_K, DP4A_WORDS, TWO, EVEN)
            if kn < K:
                a0, a1, a2, a3, b0, b1, b2, b3 = _gemv_step(a0, a1, a2, a3, b0, b1, b2, b3, nw, nws, nw2, nws2,
                                                            a_ptr, stride_am, as_ptr, offs_n, kn, K, M, BLOCK_N,
                                                            BLOCK_K, ROWS, COLS, DP4A_WORDS, TWO, EVEN)
    first = _rows_tile(tl.sum(a0, axis=1), tl.sum(a1, axis=1), tl.sum(a2, axis=1), tl.sum(a3, axis=1),
                       first_row, ROWS, M_PAD)
    second = tl.zeros((M_PAD, BLOCK_N), dtype=tl.float32)
    if TWO:
        second = _rows_tile(tl.sum(b0, axis=1), tl.sum(b1, axis=1), tl.sum(b2, axis=1), tl.sum(b3, axis=1),
                            first_row, ROWS, M_PAD)
    return first, second


@triton.jit
def _gemv_words(a_ptr, stride_am, as_ptr, M, K, w_ptr, ws_ptr, w2_ptr, ws2_ptr, offs_n, n_mask, stride_wn,
                stride_sn, first_row, M_PAD: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                ROWS: tl.constexpr, WORD32: tl.constexpr, TWO: tl.constexpr, PIPELINE: tl.constexpr,
                EVEN: tl.constexpr):
    """The register path on MXFP4 int32 words: `_gemv_rows` on split activations (a_ptr: planes,
    as_ptr: scales) for WORD32 == DP4A, else `_gemv_word32` on bf16/fp32 activations (one weight,
    no prefetch). Returns a pair as `_gemv_rows`."""
    if WORD32 == DP4A:
        first, second = _gemv_rows(a_ptr, stride_am, as_ptr, M, K, w_ptr, ws_ptr, w2_ptr, ws2_ptr, offs_n, n_mask,
                                   stride_wn, stride_sn, first_row, M_PAD, BLOCK_N, BLOCK_K, ROWS, True, TWO, PIPELINE,
                                   EVEN)
    else:
        tl.static_assert(not TWO)
        first = _gemv_word32(a_ptr, stride_am, M, K, w_ptr, ws_ptr, offs_n, n_mask, stride_wn, stride_sn, first_row,
                             M_PAD, BLOCK_N, BLOCK_K, ROWS, WORD32 == 2)
        second = tl.zeros((M_PAD, BLOCK_N), dtype=tl.float32)
    return first, second


@triton.jit
def _tile_product(a_ptr, stride_am, offs_m, M, k0, K, w_ptr, ws_ptr, offs_n, n_mask, stride_wn, stride_sn,
                  M_PAD: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, MXFP4: tl.constexpr,
                  GEMV_ROWS: tl.constexpr, SCALED: tl.constexpr, FP32_MATH: tl.constexpr):
    """`_tile_gemv` for GEMV_ROWS > 0 (a few tokens; MXFP4 weights, plain ones go through
    `_gemv_rows`), `_tile_dot` (tensor cores) otherwise."""
    if GEMV_ROWS > 0:
        tl.static_assert(MXFP4)
        return _tile_gemv(a_ptr, stride_am, offs_m, M, k0, K, w_ptr, ws_ptr, offs_n, n_mask, stride_wn,
                          stride_sn, M_PAD, BLOCK_N, BLOCK_K, GEMV_ROWS)
    return _tile_dot(a_ptr, stride_am, offs_m, offs_m < M, k0, K, w_ptr, ws_ptr, offs_n, n_mask, stride_wn,
                     stride_sn, BLOCK_K, MXFP4, SCALED, FP32_MATH)


@triton.jit
def _matmul(a_ptr, stride_am, as_ptr, M, K, w_ptr, ws_ptr, w2_ptr, ws2_ptr, offs_n, n_mask, stride_wn, stride_sn,
            tokens, M_PAD: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, MXFP4: tl.constexpr,
            GEMV_ROWS: tl.constexpr, WORD32: tl.constexpr, SCALED: tl.constexpr, FP32_MATH: tl.constexpr,
            TWO: tl.constexpr, PIPELINE: tl.constexpr, EVEN: tl.constexpr):
    """(a[:M, :K] @ W[offs_n, :K]^T, the same with W2 when TWO, else zeros) as [M_PAD, BLOCK_N]
    fp32: `_gemv_words` when WORD32 (MXFP4 W given as int32 words, at most GEMV_ROWS tokens; for
    WORD32 == DP4A `a` is split into int8 planes with scales at as_ptr, see impl.moe.triton_dp4a),
    `_gemv_rows` for plain W and at most GEMV_ROWS tokens, else (one weight) a K loop of
    `_tile_product`. TWO: both weights in one K loop (register paths with dp4a or plain weights).
    PIPELINE: how the register loops keep loads in flight (`_stages`). EVEN: K is a multiple of
    BLOCK_K (the register paths then load without a K mask).

    `tokens` is the bit mask of the rows that chose this expert (-1: all rows). With WORD32 and
    exactly one such row (most experts of a verify step, where each is chosen by one token) only
    that row is computed: a quarter of the multiply-adds and activation loads at 4 rows. The
    other rows are 0 (what a row that did not choose the expert contributes anyway)."""
    if WORD32 > 0:
        tl.static_assert(MXFP4)
        tl.static_assert(GEMV_ROWS > 0)
        if GEMV_ROWS > 1:
            if (tokens > 0) & ((tokens & (tokens - 1)) == 0):
                t = ((tokens >> 1) & 1) + 2 * ((tokens >> 2) & 1) + 3 * ((tokens >> 3) & 1)  # its row (< 4)
                acc, acc2 = _gemv_words(a_ptr + t * stride_am, stride_am, as_ptr + t * (K // 32), 1, K, w_ptr, ws_ptr,
                                        w2_ptr, ws2_ptr, offs_n, n_mask, stride_wn, stride_sn, t, M_PAD, BLOCK_N,
                                        BLOCK_K, 1, WORD32, TWO, PIPELINE, EVEN)
            else:
                acc, acc2 = _gemv_words(a_ptr, stride_am, as_ptr, M, K, w_ptr, ws_ptr, w2_ptr, ws2_ptr, offs_n, n_mask,
                                        stride_wn, stride_sn, 0, M_PAD, BLOCK_N, BLOCK_K, GEMV_ROWS, WORD32, TWO,
                                        PIPELINE, EVEN)
        else:
            acc, acc2 = _gemv_words(a_ptr, stride_am, as_ptr, M, K, w_ptr, ws_ptr, w2_ptr, ws2_ptr, offs_n, n_mask,
                                    stride_wn, stride_sn, 0, M_PAD, BLOCK_N, BLOCK_K, GEMV_ROWS, WORD32, TWO,
                                    PIPELINE, EVEN)
    elif GEMV_ROWS > 0 and not MXFP4:
        acc, acc2 = _gemv_rows(a_ptr, stride_am, a_ptr, M, K, w_ptr, w_ptr, w2_ptr, w2_ptr, offs_n, n_mask, stride_wn,
                               0, 0, M_PAD, BLOCK_N, BLOCK_K, GEMV_ROWS, False, TWO, PIPELINE, EVEN)
    else:
        tl.static_assert(not TWO)
        offs_m = tl.arange(0, M_PAD)
        acc = tl.zeros((M_PAD, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            acc += _tile_product(a_ptr, stride_am, offs_m, M, k0, K, w_ptr, ws_ptr, offs_n, n_mask, stride_wn,
                                 stride_sn, M_PAD, BLOCK_N, BLOCK_K, MXFP4, GEMV_ROWS, SCALED, FP32_MATH)
        acc2 = tl.zeros((M_PAD, BLOCK_N), dtype=tl.float32)
    return acc, acc2


@triton.jit
def _swiglu_tile(x_ptr, stride_xm, xs_ptr, M, K, g_ptr, u_ptr, gs_ptr, us_ptr, offs_n, n_mask,
                 stride_wn, stride_sn, tokens, M_PAD: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_K: tl.constexpr, MXFP4: tl.constexpr, GEMV_ROWS: tl.constexpr, WORD32: tl.constexpr,
                 SCALED: tl.constexpr, FP32_MATH: tl.constexpr, PIPELINE: tl.constexpr, EVEN: tl.constexpr):
    if WORD32 == DP4A or (GEMV_ROWS > 0 and not MXFP4):  # one K loop for both: their loads in flight together
        acc_g, acc_u = _matmul(x_ptr, stride_xm, xs_ptr, M, K, g_ptr, gs_ptr, u_ptr, us_ptr, offs_n, n_mask, stride_wn,
                               stride_sn, tokens, M_PAD, BLOCK_N, BLOCK_K, MXFP4, GEMV_ROWS, WORD32, SCALED,
                               FP32_MATH, True, PIPELINE, EVEN)
    elif WORD32:  # the fp32 word decodes: each weight in its own K loop (the tile-shaped sums of one live at a time)
        acc_g = _matmul(x_ptr, stride_xm, xs_ptr, M, K, g_ptr, gs_ptr, g_ptr, gs_ptr, offs_n, n_mask, stride_wn,
                        stride_sn, tokens, M_PAD, BLOCK_N, BLOCK_K, MXFP4, GEMV_ROWS, WORD32, SCALED, FP32_MATH,
                        False, False, EVEN)[0]
        acc_u = _matmul(x_ptr, stride_xm, xs_ptr, M, K, u_ptr, us_ptr, u_ptr, us_ptr, offs_n, n_mask, stride_wn,
                        stride_sn, tokens, M_PAD, BLOCK_N, BLOCK_K, MXFP4, GEMV_ROWS, WORD32, SCALED, FP32_MATH,
                        False, False, EVEN)[0]
    else:
        offs_m = tl.arange(0, M_PAD)
        acc_g = tl.zeros((M_PAD, BLOCK_N), dtype=tl.float32)
        acc_u = tl.zeros((M_PAD, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            acc_g += _tile_product(x_ptr, stride_xm, offs_m, M, k0, K, g_ptr, gs_ptr, offs_n, n_mask, stride_wn,
                                   stride_sn, M_PAD, BLOCK_N, BLOCK_K, MXFP4, GEMV_ROWS, SCALED, FP32_MATH)
            acc_u += _tile_product(x_ptr, stride_xm, offs_m, M, k0, K, u_ptr, us_ptr, offs_n, n_mask, stride_wn,
                                   stride_sn, M_PAD, BLOCK_N, BLOCK_K, MXFP4, GEMV_ROWS, SCALED, FP32_MATH)
    return acc_g / (1.0 + tl.exp(-acc_g)) * acc_u


@triton.jit
def write_slots(expert, weight, valid, token, slot_expert_ptr, slot_weight_ptr, slot_tokens_ptr, num_slots,
                P_PAD: tl.constexpr, S_PAD: tl.constexpr, M_PAD: tl.constexpr):
    """Pairs (token, expert) [P_PAD] -> slots: slot_expert[s] (-1 if unused), slot_weight[s, m]
    (sum of token m's weights for that expert) and slot_tokens[s] (bit m set if token m chose it).
    Called by a single program. Returns the number of slots used (they come first)."""
    offs_p = tl.arange(0, P_PAD)
    same = (expert[:, None] == expert[None, :]) & valid[:, None] & valid[None, :]
    seen_before = tl.sum((same & (offs_p[None, :] < offs_p[:, None])).to(tl.int32), axis=1)
    first = valid & (seen_before == 0)
    first_slot = tl.cumsum(first.to(tl.int32), axis=0) - 1
    slot = tl.max(tl.where(same & first[None, :], first_slot[None, :], -1), axis=1)
    offs_s = tl.arange(0, S_PAD)
    tl.store(slot_expert_ptr + offs_s, tl.full((S_PAD,), -1, tl.int32), mask=offs_s < num_slots)
    tl.store(slot_tokens_ptr + offs_s, tl.zeros((S_PAD,), tl.int32), mask=offs_s < num_slots)
    offs_sm = tl.arange(0, S_PAD * M_PAD)
    tl.store(slot_weight_ptr + offs_sm, tl.zeros((S_PAD * M_PAD,), tl.float32), mask=offs_sm < num_slots * M_PAD)
    tl.debug_barrier()
    tl.store(slot_expert_ptr + first_slot, expert, mask=first)
    tl.atomic_add(slot_weight_ptr + slot * M_PAD + token, weight, mask=valid)
    tl.atomic_or(slot_tokens_ptr + slot, 1 << token, mask=valid)
    tl.static_assert(M_PAD <= 31)  # slot_tokens is a 32-bit mask of tokens
    return tl.sum(first.to(tl.int32), axis=0)


@triton.jit
def moe_slots_kernel(ids_ptr, weights_ptr, slot_expert_ptr, slot_weight_ptr, slot_tokens_ptr,
                     num_pairs, top_k, num_slots,
                     P_PAD: tl.constexpr, S_PAD: tl.constexpr, M_PAD: tl.constexpr):
    """Slots from routing given as ids/weights [M, k] (one program)."""
    offs_p = tl.arange(0, P_PAD)
    valid = offs_p < num_pairs
    expert = tl.load(ids_ptr + offs_p, mask=valid, other=-1).to(tl.int32)
    weight = tl.load(weights_ptr + offs_p, mask=valid, other=0.0)
    write_slots(expert, weight, valid, offs_p // top_k, slot_expert_ptr, slot_weight_ptr, slot_tokens_ptr,
                num_slots, P_PAD, S_PAD, M_PAD)


@triton.jit
def moe_gate_up_kernel(x_ptr, stride_xm, xq_ptr, stride_xqm, xs_ptr, M, H, I, I_SHARED,
                       slot_expert_ptr, slot_weight_ptr, slot_tokens_ptr, num_slots,
                       logits_ptr, bias_ptr, ids_ptr, weights_ptr, E, TOP_K, routed_scaling,
                       w_ptr, ws_ptr, stride_we, stride_wn, stride_se, stride_sn,
                       sg_ptr, su_ptr, stride_shn,
                       act_ptr, stride_as, stride_am, act_s_ptr, stride_ass, shared_act_ptr, stride_sam,
                       M_PAD: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                       MXFP4: tl.constexpr, HAS_SHARED: tl.constexpr, GEMV_ROWS: tl.constexpr,
                       WORD32: tl.constexpr, SCALED: tl.constexpr, FP32_MATH: tl.constexpr,
                       SHARED_SPLIT: tl.constexpr, SHARED_BLOCK_K: tl.constexpr, EVEN: tl.constexpr,
                       GEMV_PIPELINE: tl.constexpr, SHARED_PIPELINE: tl.constexpr, PDL: tl.constexpr,
                       TOPK: tl.constexpr, ROUTER: tl.constexpr, RENORMALIZE: tl.constexpr, HAS_BIAS: tl.constexpr,
                       N_GROUP: tl.constexpr, TOPK_GROUP: tl.constexpr, E_PAD: tl.constexpr, K_PAD: tl.constexpr):
    """Program (slot, n-block): activations of intermediate columns n-block for every token.
    The SHARED_SPLIT programs after the last routed slot compute the shared expert instead, each
    BLOCK_N / SHARED_SPLIT of the block's rows, in K tiles of SHARED_BLOCK_K: its bf16 rows hold
    4x the bytes of MXFP4 ones, so with MXFP4 experts whole blocks of it would be the kernel's
    longest programs (and its tiles the kernel's largest register footprint). EVEN: every tile,
    routed and shared, lies whole inside its weight (no masks on the register paths). WORD32 and
    SCALED choose the MXFP4 decode (see `MoELaunchConfig`); the shared expert is never MXFP4.
    With the dp4a decode (WORD32 == DP4A) the routed experts read x split into int8 planes (xq_ptr,
    row stride stride_xqm; scales xs_ptr) and write their activations split the same way (act_ptr
    planes, act_s_ptr scales, slot strides stride_as / stride_ass), ready for the down kernel.
    TOPK (one token): the slots are not given; each routed program takes its expert from the
    router's logits (`decode_route`, the router constexprs and E, TOP_K, routed_scaling as the
    top-k kernel's), and program (num_slots, 0), after the routed ones and its share of the shared
    expert if any, writes ids, weights and slots as that kernel would."""
    slot = tl.program_id(0)
    n0 = tl.program_id(1) * BLOCK_N
    offs_n = n0 + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, M_PAD)
    if slot < num_slots:
        pdl_wait(PDL)  # the slots (or the logits) come from the launch before this one
        pdl_release(PDL)
        if TOPK:
            ids, _ = decode_route(logits_ptr, bias_ptr, E, TOP_K, routed_scaling, ROUTER, RENORMALIZE, HAS_BIAS,
                                  N_GROUP, TOPK_GROUP, E_PAD, K_PAD)
            # Every routed program writes the slots' experts (the same values), then reads its own
            # back: ptxas keeps a value loaded from one address in uniform registers, and the weight
            # addresses built on it with it (taken from `ids` by a reduction, the Ling-3.0-flash
            # gate_up tiles would take about 25 more registers a thread).
            offs_k = tl.arange(0, K_PAD)
            tl.store(slot_expert_ptr + offs_k, tl.reshape(ids, (K_PAD,)), mask=offs_k < TOP_K)
            tl.debug_barrier()  # the program's stores are visible to all its threads
            expert = tl.load(slot_expert_ptr + slot)
            tokens = slot * 0 + 1  # token 0 alone (an int32 like the slots' bit masks)
        else:
            expert = tl.load(slot_expert_ptr + slot)
            tokens = tl.load(slot_tokens_ptr + slot)
        if expert >= 0:
            if n0 < I:
                n_mask = (offs_n < I) | EVEN
                g_ptr = w_ptr + expert.to(tl.int64) * stride_we
                gs_ptr = ws_ptr + expert.to(tl.int64) * stride_se
                if WORD32 == DP4A:  # x as its int8 split
                    a_ptr, stride_a, as_ptr = xq_ptr, stride_xqm, xs_ptr
                else:
                    a_ptr, stride_a, as_ptr = x_ptr, stride_xm, x_ptr
                act = _swiglu_tile(a_ptr, stride_a, as_ptr, M, H, g_ptr, g_ptr + I * stride_wn, gs_ptr,
                                   gs_ptr + I * stride_sn, offs_n, n_mask, stride_wn, stride_sn,
                                   tokens, M_PAD, BLOCK_N, BLOCK_K, MXFP4, GEMV_ROWS, WORD32,
                                   SCALED, FP32_MATH, GEMV_PIPELINE, EVEN)
                if WORD32 == DP4A:
                    tl.static_assert(BLOCK_N % 32 == 0)  # whole blocks of 32 to split
                    store_split_int8(act_ptr + slot * stride_as, stride_am, act_s_ptr + slot * stride_ass, I // 32,
                                     act, offs_m, offs_m < M_PAD, tl.program_id(1) * BLOCK_N, I, M_PAD, BLOCK_N)
                else:
                    tl.store(act_ptr + slot * stride_as + offs_m[:, None] * stride_am + offs_n[None, :],
                             act.to(act_ptr.dtype.element_ty), mask=n_mask[None, :])
    else:  # after the slots: the shared expert's programs, and (TOPK) the routing's writer
        # Reads x and the shared weights only (two or more launches old): computes before the slots.
        pdl_release(PDL)
        if HAS_SHARED:
            BLOCK_S: tl.constexpr = BLOCK_N // SHARED_SPLIT
            s0 = n0 + (slot - num_slots) * BLOCK_S
            offs_s = s0 + tl.arange(0, BLOCK_S)
            if n0 < I_SHARED:
                s_mask = (offs_s < I_SHARED) | EVEN
                act = _swiglu_tile(x_ptr, stride_xm, x_ptr, M, H, sg_ptr, su_ptr, sg_ptr, su_ptr, offs_s, s_mask,
                                   stride_shn, 0, -1, M_PAD, BLOCK_S, SHARED_BLOCK_K, False, GEMV_ROWS, False, False,
                                   FP32_MATH, SHARED_PIPELINE, EVEN)
                pdl_wait(PDL)  # writes wait (see impl/moe/triton_pdl.py)
                tl.store(shared_act_ptr + offs_m[:, None] * stride_sam + offs_s[None, :],
                         act.to(shared_act_ptr.dtype.element_ty), mask=s_mask[None, :])
        if TOPK:
            # One program, after its share of the shared expert, writes the whole routing for the
            # down kernel and the caller (done by a routed program, the weights' gather and stores
            # cost the Ling-3.0-flash gate_up tiles 60 registers a thread).
            if (slot == num_slots) & (n0 == 0):
                pdl_wait(PDL)  # the logits
                ids, weights = decode_route(logits_ptr, bias_ptr, E, TOP_K, routed_scaling, ROUTER, RENORMALIZE,
                                            HAS_BIAS, N_GROUP, TOPK_GROUP, E_PAD, K_PAD)
                store_decode_routing(ids, weights, ids_ptr, weights_ptr, slot_expert_ptr, slot_weight_ptr,
                                     slot_tokens_ptr, TOP_K, K_PAD, M_PAD)


@triton.jit
def moe_down_kernel(act_ptr, stride_as, stride_am, act_s_ptr, stride_ass, shared_act_ptr, stride_sam,
                    slot_expert_ptr, slot_weight_ptr, slot_tokens_ptr, num_slots,
                    w_ptr, ws_ptr, stride_we, stride_wn, stride_se, stride_sn,
                    sd_ptr, stride_sdn, partial_ptr, stride_ps, counter_ptr,
                    out_ptr, stride_om, M, H, I, I_SHARED, shared_chunk,
                    M_PAD: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                    MXFP4: tl.constexpr, HAS_SHARED: tl.constexpr, GEMV_ROWS: tl.constexpr,
                    WORD32: tl.constexpr, SCALED: tl.constexpr, FP32_MATH: tl.constexpr,
                    SHARED_SPLIT: tl.constexpr, SHARED_BLOCK_K: tl.constexpr, EVEN: tl.constexpr,
                    GEMV_PIPELINE: tl.constexpr, SHARED_PIPELINE: tl.constexpr, PDL: tl.constexpr,
                    PREFETCH: tl.constexpr, TOPK: tl.constexpr):
    """Program (hidden block, slot): weight * act[slot] Wd[e_slot]^T for that block, or for the
    SHARED_SPLIT slots after the last, the shared expert's product over a share of its K
    (`shared_chunk` columns, whole blocks of 32: `_shared_chunk`) in K tiles of SHARED_BLOCK_K.
    EVEN: every tile, routed and shared, lies whole inside its weight (no masks on the register
    paths). Each writes an fp32 partial; the program that arrives last at a block (an atomic
    counter) sums the block's partials in slot order and writes the output once in its dtype,
    then resets the counter for the next call: deterministic, no memset.
    With the dp4a decode (WORD32 == DP4A) the routed activations come split (planes at act_ptr,
    scales at act_s_ptr), as the gate_up kernel wrote them.
    TOPK: the gate_up kernel, the launch before, wrote the slots (its own top-k of a decode
    step): they are read after the wait, and no weights are asked for in L2 before it."""
    hb = tl.program_id(0)
    slot = tl.program_id(1)
    arrivals = tl.num_programs(1)
    offs_n = hb * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = (offs_n < H) | EVEN
    offs_m = tl.arange(0, M_PAD)
    acc = tl.zeros((M_PAD, BLOCK_N), dtype=tl.float32)
    if TOPK:  # the slots come from the gate_up kernel
        pdl_wait(PDL)
        pdl_release(PDL)
    # Else the slots are two launches old: read before waiting for the gate_up kernel's activations.
    expert = tl.load(slot_expert_ptr + slot, mask=slot < num_slots, other=-1)
    w_e = w_ptr + expert.to(tl.int64) * stride_we
    ws_e = ws_ptr + expert.to(tl.int64) * stride_se
    if not TOPK:
        if PREFETCH:  # this program's weight rows, while the gate_up kernel runs
            n1 = tl.minimum(hb * BLOCK_N + BLOCK_N, H)
            if expert >= 0:
                prefetch_l2(w_e + hb * BLOCK_N * stride_wn, w_e + n1 * stride_wn, ASM)
                if MXFP4:
                    prefetch_l2(ws_e + hb * BLOCK_N * stride_sn, ws_e + n1 * stride_sn, ASM)
            elif slot >= num_slots and HAS_SHARED and SHARED_SPLIT == 1:  # whole shared rows: one range
                prefetch_l2(sd_ptr + hb * BLOCK_N * stride_sdn, sd_ptr + n1 * stride_sdn, ASM)
        pdl_wait(PDL)  # the gate_up kernel's activations
        pdl_release(PDL)
    if slot < num_slots:
        if expert >= 0:
            a_ptr = act_ptr + slot * stride_as
            tokens = tl.load(slot_tokens_ptr + slot)
            acc = _matmul(a_ptr, stride_am, act_s_ptr + slot * stride_ass, M, I, w_e, ws_e, w_e, ws_e, offs_n, n_mask,
                          stride_wn, stride_sn, tokens, M_PAD, BLOCK_N, BLOCK_K, MXFP4, GEMV_ROWS, WORD32, SCALED,
                          FP32_MATH, False, GEMV_PIPELINE, EVEN)[0]
            chose = ((tokens >> offs_m) & 1) != 0
            # A token that did not choose this expert adds exactly nothing (not 0 * inf = NaN).
            acc = tl.where(chose[:, None], acc * tl.load(slot_weight_ptr + slot * M_PAD + offs_m)[:, None], 0.0)
    elif HAS_SHARED:
        k_lo = tl.multiple_of((slot - num_slots) * shared_chunk, 32)  # aligned, so its loads vectorize as x's do
        acc = _matmul(shared_act_ptr + k_lo, stride_sam, shared_act_ptr, M, tl.minimum(shared_chunk, I_SHARED - k_lo),
                      sd_ptr + k_lo, sd_ptr, sd_ptr, sd_ptr, offs_n, n_mask, stride_sdn, 0, -1, M_PAD, BLOCK_N,
                      SHARED_BLOCK_K, False, GEMV_ROWS, False, False, FP32_MATH, False, SHARED_PIPELINE, EVEN)[0]
    # The partials of the tokens there are (a decode step writes 1 row of M_PAD, not 16).
    tl.store(partial_ptr + slot * stride_ps + offs_m[:, None] * H + offs_n[None, :], acc,
             mask=(offs_m[:, None] < M) & n_mask[None, :])
    tl.debug_barrier()  # every thread's partial is written before the release below
    if tl.atomic_add(counter_ptr + hb, 1, sem="acq_rel", scope="gpu") == arrivals - 1:
        mask = (offs_m[:, None] < M) & n_mask[None, :]
        total = tl.zeros((M_PAD, BLOCK_N), dtype=tl.float32)
        # Several partials in flight at a time (up to COMBINE_ELEMENTS values), added in slot
        # order (deterministic): a load at a time, the combine was one L2 round trip per slot on
        # the step's critical path.
        LOADS: tl.constexpr = max(1, min(8, COMBINE_ELEMENTS // (M_PAD * BLOCK_N)))
        for s0 in range(0, arrivals, LOADS):
            for j in tl.static_range(LOADS):
                total += tl.load(partial_ptr + (s0 + j) * stride_ps + offs_m[:, None] * H + offs_n[None, :],
                                 mask=mask & (offs_m[:, None] * 0 + s0 + j < arrivals), other=0.0,
                                 cache_modifier=".cg")
        tl.store(out_ptr + offs_m[:, None] * stride_om + offs_n[None, :], total.to(out_ptr.dtype.element_ty),
                 mask=mask)
        tl.store(counter_ptr + hb, 0)


def _weight_args(w, words: bool = False):
    """(weight pointer, scale pointer, strides) for a routed weight [E, N, K] of either format;
    with `words`, MXFP4 codes as int32 words ([E, N, K/8], strides in words) for `_gemv_word32`."""
    if isinstance(w, MXFP4Tensor):
        q, s = w.packed, w.scales
        if words:  # K is a multiple of 32, so a row is 16 * (K / 32) bytes: whole, aligned words
            q = q.view(torch.int32)
        return q, s, q.stride(0), q.stride(1), s.stride(0), s.stride(1)
    return w, w, w.stride(0), w.stride(1), 0, 0


def check_triton_inputs(x, weights, ids, w_gate_up, w_down, shared) -> tuple[int, int, int]:
    """Shapes, dtypes, devices and layout the kernels rely on; returns (E, H, I). Routing None
    (weights and ids): a layer that routes itself, checked without."""
    from impl.moe.reference import check_moe_inputs, logical_weight
    gu, dn = logical_weight(w_gate_up), logical_weight(w_down)
    # The kernels take CUDA tensors (CPU ones under the interpreter); meta or other devices
    # would otherwise fail deep inside (reading the ids back, or at launch) with unrelated errors.
    devices = ("cuda", "cpu") if INTERPRET else ("cuda",)
    if x.device.type not in devices:
        raise ValueError(f"the Triton MoE needs {' or '.join(devices)} tensors, got x on {x.device}")
    check_moe_inputs(x, weights, ids, gu, dn, check_ids=not _capturing(x))
    if ids is not None and ids.shape[1] == 0:  # no (token, expert) pair: the kernels would leave the output unwritten
        raise ValueError(f"the Triton MoE needs top_k >= 1, got routing ids of shape {tuple(ids.shape)}")
    experts, two_i, hidden = gu.shape
    for name, w in (("gate_up", w_gate_up), ("down", w_down)):
        t = w.packed if isinstance(w, MXFP4Tensor) else w
        if not t.is_contiguous() or (isinstance(w, MXFP4Tensor) and not w.scales.is_contiguous()):
            raise ValueError(f"{name} weight must be contiguous")
        if not isinstance(w, MXFP4Tensor) and w.dtype not in (torch.bfloat16, torch.float16, torch.float32):
            raise TypeError(f"{name} weight must be bf16, fp16, fp32 or MXFP4, got {w.dtype}")
    if x.stride(-1) != 1:
        raise ValueError("x must be contiguous along the hidden dimension")
    if hidden % 32 or (two_i // 2) % 32:
        raise ValueError(f"the Triton MoE needs H and I to be multiples of 32, got H={hidden}, I={two_i // 2}")
    if shared is not None:
        check_shared_expert(shared, hidden, x.device)
    return experts, hidden, two_i // 2


_COUNTERS: dict = {}


def _counters(device: torch.device, n: int) -> torch.Tensor:
    """Arrival counters of the down kernel, zero between calls (the last arrival resets its own);
    one persistent buffer per device, so CUDA graphs capture a fixed address."""
    buf = _COUNTERS.get(device)
    if buf is None or buf.numel() < n:
        buf = _COUNTERS[device] = torch.zeros(max(n, 1024), dtype=torch.int32, device=device)
    return buf


def _capturing(x: torch.Tensor) -> bool:
    return x.is_cuda and torch.cuda.is_current_stream_capturing()


@dataclass(frozen=True)
class Slots:
    """Routing grouped by expert, on the device: what the expert kernels consume."""

    expert: torch.Tensor  # int32 [S]: expert of each slot, -1 if unused
    weight: torch.Tensor  # fp32 [S, M_PAD]: routing weight of token m for the slot's expert
    tokens: torch.Tensor  # int32 [S]: bit m set if token m chose the slot's expert
    num_tokens: int
    top_k: int

    @classmethod
    def empty(cls, num_tokens: int, top_k: int, experts: int, device) -> "Slots":
        n = min(num_tokens * top_k, experts)
        return cls(torch.empty(n, dtype=torch.int32, device=device),
                   torch.empty(n, M_PAD, dtype=torch.float32, device=device),
                   torch.empty(n, dtype=torch.int32, device=device), num_tokens, top_k)

    @property
    def num_slots(self) -> int:
        return self.expert.shape[0]


# The gate_up kernel's top-k constexprs when the slots are given (no top-k in the kernels).
NO_TOPK = dict(ROUTER=0, RENORMALIZE=False, HAS_BIAS=False, N_GROUP=1, TOPK_GROUP=1, E_PAD=1, K_PAD=1)


@dataclass(frozen=True)
class DecodeRouting:
    """A decode step's routing left to the expert kernels (`MoELaunchConfig.topk_in_experts`): the
    router's logits [1, E], its correction bias, the top-k's constexprs (`NO_TOPK`'s keys) and
    routed scaling; the gate_up kernel fills `slots`, `weights` and `ids` as the top-k kernel
    would (`impl.moe.triton_routing.route_logits`)."""

    logits: torch.Tensor
    bias: torch.Tensor | None
    consts: dict
    routed_scaling: float
    slots: Slots
    weights: torch.Tensor
    ids: torch.Tensor


def slots_from_routing(weights: torch.Tensor, ids: torch.Tensor, experts: int) -> Slots:
    m, top_k = ids.shape
    slots = Slots.empty(m, top_k, experts, ids.device)
    moe_slots_kernel[(1,)](ids.contiguous(), weights.float().contiguous(), slots.expert, slots.weight, slots.tokens,
                           m * top_k, top_k, slots.num_slots, P_PAD=max(1, triton.next_power_of_2(m * top_k)),
                           S_PAD=max(1, triton.next_power_of_2(slots.num_slots)), M_PAD=M_PAD, num_warps=4)
    return slots


def moe_triton(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, w_gate_up, w_down,
               shared: SharedExpert | None = None, config: MoELaunchConfig | None = None) -> torch.Tensor:
    """Fused MoE for x [T, H]: routed experts (bf16/fp16/fp32 tensors or MXFP4Tensor) chosen by
    ids/weights [T, k], plus `shared`; returns [T, H] in x's dtype."""
    experts, _, _ = check_triton_inputs(x, weights, ids, w_gate_up, w_down, shared)
    if x.shape[0] > M_PAD:
        return torch.cat([moe_triton(x[i:i + M_PAD], weights[i:i + M_PAD], ids[i:i + M_PAD], w_gate_up,
                                     w_down, shared, config) for i in range(0, x.shape[0], M_PAD)])
    backends.note("moe", "triton", "moe_slots_kernel", tokens=x.shape[0])
    return moe_experts(x, slots_from_routing(weights, ids, experts), w_gate_up, w_down, shared, config)


def _products(cfg: MoELaunchConfig, m: int, mxfp4: bool) -> tuple[int, int]:
    """(GEMV rows (0: tensor cores), word decode level) for M tokens under `cfg`: a few tokens
    take register multiply-adds, more take tensor cores (tokens padded to M_PAD rows)."""
    gemv_rows = triton.next_power_of_2(m) if m <= cfg.gemv_max_tokens else 0
    return gemv_rows, WORD_DECODES.get(cfg.gemv_decode, 0) if mxfp4 and gemv_rows > 0 else 0


def _plan(m: int, top_k: int, w_gate_up, w_down, device, config: MoELaunchConfig | None):
    """(launch config, format, GEMV rows (0: tensor cores), word decode level) for M tokens."""
    mxfp4 = isinstance(w_gate_up, MXFP4Tensor)
    if mxfp4 != isinstance(w_down, MXFP4Tensor):
        raise TypeError("gate_up and down weights must both be MXFP4 or both be plain tensors")
    experts, _, hidden = w_gate_up.shape
    fmt = "mxfp4" if mxfp4 else "bf16"
    cfg = config or lookup(experts, hidden, w_down.shape[-1], top_k, m, fmt, device)
    return (cfg, fmt) + _products(cfg, m, mxfp4)


def launch_config(x: torch.Tensor, top_k: int, w_gate_up, w_down,
                  config: MoELaunchConfig | None = None) -> MoELaunchConfig:
    """The launch config `moe_experts` runs for these tokens and weights (the router follows its
    `pdl`, `pdl_prefetch` and `router_fused`)."""
    return _plan(x.shape[0], top_k, w_gate_up, w_down, x.device, config)[0]


def split_buffers(x: torch.Tensor, top_k: int, w_gate_up, w_down,
                  config: MoELaunchConfig | None = None) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Empty (planes, scales) for x split as the dp4a decode reads it, when `moe_experts` will run
    that decode for these tokens and weights (else None): whoever reads x before the MoE (the
    router's logits kernel) can fill them, saving the MoE's split launch."""
    m, hidden = x.shape
    if _plan(m, top_k, w_gate_up, w_down, x.device, config)[3] != DP4A.value:
        return None
    return empty_split(m, hidden, x.device)


def _shared_block_k(cfg: MoELaunchConfig, gemv_rows: int) -> tuple[int, int]:
    """The shared expert's K tiles in the (gate_up, down) kernels: `shared_block_k` on the
    register path, else (tensor-core tiles) the routed experts' K tiles."""
    if gemv_rows and cfg.shared_block_k:
        return cfg.shared_block_k, cfg.shared_block_k
    return cfg.gate_up_block_k, cfg.down_block_k


def _shared_chunk(i_shared: int, split: int) -> int:
    """The down kernel's share of the shared expert's K a program: whole blocks of 32 columns."""
    return -(-i_shared // (32 * split)) * 32


def _even_tiles(cfg: MoELaunchConfig, hidden: int, inter: int, i_shared: int, split: int,
                shared_k: tuple[int, int]) -> tuple[bool, bool]:
    """(gate_up, down): whether every tile of that kernel, routed and shared, lies whole inside
    its weight, so the kernel may load without masks (the presets' shapes; odd ones keep them)."""
    gate_up = inter % cfg.gate_up_block_n == 0 and hidden % cfg.gate_up_block_k == 0
    down = hidden % cfg.down_block_n == 0 and inter % cfg.down_block_k == 0
    if i_shared:
        gate_up = gate_up and i_shared % (cfg.gate_up_block_n // split) == 0 and hidden % shared_k[0] == 0
        chunk = _shared_chunk(i_shared, split)
        down = down and all(min(chunk, i_shared - lo) % shared_k[1] == 0 for lo in range(0, i_shared, chunk))
    return gate_up, down


@dataclass(frozen=True)
class KernelLaunch:
    """One kernel's grid and compile-time parameters (constexprs, warps, pipeline stages)."""

    grid: tuple[int, int]
    consts: dict
    num_warps: int
    num_stages: int


@dataclass(frozen=True)
class ExpertLaunch:
    """The expert kernels of one `moe_experts` call as data: what it launches, and what
    tests/test_moe_gpu_compile.py builds for sm_90 from the committed configs (registers, spills,
    programs an SM) without a GPU."""

    gate_up: KernelLaunch
    down: KernelLaunch
    shared_chunk: int  # the down kernel's share of the shared expert's K a program


def expert_launch(cfg: MoELaunchConfig, *, tokens: int, num_slots: int, hidden: int, inter: int, i_shared: int,
                  mxfp4: bool, pdl: bool, topk: dict | None = None) -> ExpertLaunch:
    """The launches `moe_experts` makes for `tokens` tokens grouped in `num_slots` slots, weights
    [E, 2 * inter, hidden] and [E, hidden, inter] (MXFP4 or plain), a shared expert of width
    `i_shared` (0: none), with programmatic dependent launch or not; `topk`: the router's top-k
    constexprs (`DecodeRouting.consts`) when the kernels route a decode step themselves."""
    if topk is not None and tokens != 1:
        raise ValueError(f"the expert kernels route one token (a decode step) themselves, got {tokens}")
    gemv_rows, word32 = _products(cfg, tokens, mxfp4)
    # The shared expert's share of programs (register path only: a tensor-core tile needs 16 rows).
    split = (cfg.shared_split if gemv_rows else 1) if i_shared else 1
    shared_slots = split if i_shared else 0
    shared_k = _shared_block_k(cfg, gemv_rows)
    even_a, even_b = _even_tiles(cfg, hidden, inter, i_shared, split, shared_k)
    common = dict(M_PAD=M_PAD, MXFP4=mxfp4, HAS_SHARED=i_shared > 0, GEMV_ROWS=gemv_rows, WORD32=word32,
                  SCALED=mxfp4 and gemv_rows == 0 and cfg.mxfp4_product == "scaled", FP32_MATH=FP32_MATH,
                  SHARED_SPLIT=split, PDL=pdl, TOPK=topk is not None)
    # With the top-k in the kernels, the routing's writer is the gate_up program after the slots:
    # the shared expert's first, else one more.
    topk_writer = 1 if topk is not None and not i_shared else 0

    def pipeline(prefetch: int) -> int:  # the register loops' GEMV_PIPELINE: see `_stages`
        return (prefetch or -cfg.gemv_stages) if gemv_rows else 0

    gate_up = KernelLaunch(
        (num_slots + shared_slots + topk_writer, triton.cdiv(max(inter, i_shared), cfg.gate_up_block_n)),
        dict(common, **(topk or NO_TOPK), BLOCK_N=cfg.gate_up_block_n, BLOCK_K=cfg.gate_up_block_k,
             SHARED_BLOCK_K=shared_k[0], EVEN=even_a, GEMV_PIPELINE=pipeline(cfg.gate_up_prefetch),
             SHARED_PIPELINE=pipeline(cfg.shared_prefetch)),
        cfg.gate_up_warps, cfg.gate_up_stages)
    down = KernelLaunch(
        (triton.cdiv(hidden, cfg.down_block_n), num_slots + shared_slots),
        dict(common, BLOCK_N=cfg.down_block_n, BLOCK_K=cfg.down_block_k, SHARED_BLOCK_K=shared_k[1], EVEN=even_b,
             GEMV_PIPELINE=pipeline(cfg.down_prefetch), SHARED_PIPELINE=pipeline(0),  # see shared_prefetch
             PREFETCH=pdl and cfg.pdl_prefetch),
        cfg.down_warps, cfg.down_stages)
    return ExpertLaunch(gate_up, down, _shared_chunk(i_shared, split))


def moe_experts(x: torch.Tensor, routing: Slots | DecodeRouting, w_gate_up, w_down,
                shared: SharedExpert | None = None, config: MoELaunchConfig | None = None,
                x_split: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """The expert kernels for at most M_PAD tokens whose routing is already grouped in slots, or
    for one token whose top-k the kernels do themselves from the router's logits (`routing` a
    `DecodeRouting`). `x_split`: x already split for the dp4a decode, in buffers from
    `split_buffers` (ignored by the other decodes)."""
    route = routing if isinstance(routing, DecodeRouting) else None
    slots = route.slots if route is not None else routing
    m, top_k, num_slots = slots.num_tokens, slots.top_k, slots.num_slots
    cfg, fmt, gemv_rows, word32 = _plan(m, top_k, w_gate_up, w_down, x.device, config)
    mxfp4 = fmt == "mxfp4"
    hidden = w_gate_up.shape[-1]
    inter = w_down.shape[-1]
    i_shared = shared.gate.shape[0] if shared is not None else 0
    product = (f"gemv-{cfg.gemv_decode if mxfp4 else 'plain'}" if gemv_rows
               else f"dot-{cfg.mxfp4_product if mxfp4 else 'plain'}")
    dp4a = word32 == DP4A.value
    split_here = dp4a and x_split is None
    backends.note("moe", "triton", ("split_int8_kernel+" if split_here else "") + "moe_gate_up_kernel+moe_down_kernel",
                  format=fmt, tokens=m, shared=shared is not None, config=cfg, product=product,
                  topk_in_experts=route is not None)
    act_dtype = torch.float32 if FP32_MATH else x.dtype
    dev = x.device
    pdl = use_pdl(cfg.pdl, dev)
    launch = expert_launch(cfg, tokens=m, num_slots=num_slots, hidden=hidden, inter=inter, i_shared=i_shared,
                           mxfp4=mxfp4, pdl=pdl, topk=route.consts if route is not None else None)
    if dp4a:  # x and the routed activations as int8 splits (impl.moe.triton_dp4a)
        if x_split is not None:
            check_split(x_split, m, hidden, dev)
        xq, xs = x_split or empty_split(m, hidden, dev)
        if split_here:
            split_int8_kernel[(m, triton.cdiv(hidden, SPLIT_BLOCK_K))](x, x.stride(0), xq, xs, hidden,
                                                                       BLOCK_K=SPLIT_BLOCK_K, num_warps=4)
        act = torch.empty(num_slots, M_PAD, 4, inter // 8, dtype=torch.int32, device=dev)
        act_s = torch.empty(num_slots, M_PAD, inter // 32, dtype=torch.float32, device=dev)
    else:
        xq, xs = x, x
        act = torch.empty(num_slots, M_PAD, inter, dtype=act_dtype, device=dev)
        act_s = act
    shared_act = torch.empty(M_PAD, max(i_shared, 1), dtype=act_dtype, device=dev)
    out = torch.empty(m, hidden, dtype=x.dtype, device=dev)
    slot_expert, slot_weight, slot_tokens = slots.expert, slots.weight, slots.tokens
    if route is not None:  # for the gate_up kernel's top-k: logits and bias, ids and weights to fill
        bias = route.bias if route.bias is not None else route.logits
        topk_args = (route.logits, bias, route.logits.shape[1], top_k, route.routed_scaling)
        outputs = (route.ids, route.weights)
    else:  # unread
        topk_args, outputs = (slot_weight, slot_weight, 0, top_k, 1.0), (slot_expert, slot_weight)

    gw, gs, s_we, s_wn, s_se, s_sn = _weight_args(w_gate_up, word32)
    sg = shared.gate if shared is not None else x
    su = shared.up if shared is not None else x
    k = launch.gate_up
    moe_gate_up_kernel[k.grid](
        x, x.stride(0), xq, xq.stride(0), xs, m, hidden, inter, i_shared, slot_expert, slot_weight, slot_tokens,
        num_slots, *topk_args[:2], *outputs, *topk_args[2:], gw, gs, s_we, s_wn, s_se, s_sn, sg, su, sg.stride(0),
        act, act.stride(0), act.stride(1), act_s, act_s.stride(0), shared_act, shared_act.stride(0),
        **k.consts, launch_pdl=pdl, num_warps=k.num_warps, num_stages=k.num_stages)
    dw, ds, d_we, d_wn, d_se, d_sn = _weight_args(w_down, word32)
    sd = shared.down if shared is not None else x
    k = launch.down
    partial = torch.empty(k.grid[1], M_PAD, hidden, dtype=torch.float32, device=dev)
    moe_down_kernel[k.grid](
        act, act.stride(0), act.stride(1), act_s, act_s.stride(0), shared_act, shared_act.stride(0),
        slot_expert, slot_weight, slot_tokens, num_slots, dw, ds, d_we, d_wn, d_se, d_sn,
        sd, sd.stride(0), partial, partial.stride(0), _counters(dev, k.grid[0]),
        out, out.stride(0), m, hidden, inter, i_shared, launch.shared_chunk,
        **k.consts, launch_pdl=pdl, num_warps=k.num_warps, num_stages=k.num_stages)
    return out
