"""The register path of the Triton MoE (at most 4 tokens, `gemv_max_tokens`): products as fp32
multiply-adds in registers instead of tensor-core dots, with no tensor-core operand layout to
convert decoded weights into and no padding of the tokens to 16 rows.

`gemv_rows` multiplies the first ROWS rows of the activations by one weight, or by two at once
(gate and up rows in one K loop, both weights' loads in flight together). MXFP4 weights go
through the exact int8 dot products of impl/moe/triton_dp4a.py on activations split into int8
terms; plain bf16/fp16/fp32 weights (the shared expert, bf16 experts) meet the activations as
they are. Each thread keeps its own partial sums across the K loop and they are reduced once
after it, and each K step may load the weights of a later step into registers first
(look-ahead): the loop holds no barrier and no copy of a loaded tile, which
tests/test_moe_gpu_compile.py checks in the compiled sm_90 code.
"""

from __future__ import annotations

from impl.moe.triton_dp4a import _dp4a, _e2m1_word_to_int8x4
from impl.moe.triton_mxfp4 import e8m0_to_fp32
from impl.triton_env import ASM, tl, triton


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


@triton.jit
def _live(k0, K):
    """[1] bool: whether a K step from column k0 lies inside K (False: a look-ahead past the end).
    A tensor, not a scalar: masks combine with it elementwise, under the interpreter too."""
    return tl.arange(0, 1) + k0 < K


@triton.jit
def _plain_weights(w_ptr, offs_n, n_mask, stride_wn, k0, K, live, BLOCK_K: tl.constexpr, EVEN: tl.constexpr):
    """One K step's plain weight tile [BLOCK_N, BLOCK_K] from column k0, in its stored dtype
    (nothing is read where `live` is False: a look-ahead past K). Widened where it is used, not
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
    """One K step of `gemv_rows` on plain weights: the tiles w (and w2 when TWO) against each
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
    column k0 (nothing is read where `live` is False: a look-ahead past K).
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
    """One K step of `gemv_rows` on MXFP4 words for one weight: its decoded words against each
    row's split."""
    G: tl.constexpr = BLOCK_K // 32
    blk = k0 // 32 + tl.arange(0, G)
    offs_w = tl.arange(0, 4)
    offs_word = blk[:, None] * 4 + offs_w[None, :]  # [G, 4] words of 8 codes
    blk_mask = (blk < K // 32) | EVEN  # K is a multiple of 32: whole blocks are in or out
    word_mask = blk_mask[:, None] & (offs_w < 4)[None, :]
    wscale = e8m0_to_fp32(codes)
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
    """One K step of `gemv_rows` from column k0 on its loaded tiles (`_step_weights`): the
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
    """Columns of `gemv_rows`' per-thread partials a K step: dp4a, one sum a block of 32; plain
    weights, one a weight at one row, else one a 16-byte run of weights (what a thread loads)."""
    if dp4a_words:
        return block_k // 32
    return block_k if rows == 1 else block_k // (128 // bits)


@triton.jit
def gemv_rows(a_ptr, stride_am, as_ptr, M, K, w_ptr, ws_ptr, w2_ptr, ws2_ptr, offs_n, n_mask, stride_wn, stride_sn,
              first_row, M_PAD: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, ROWS: tl.constexpr,
              DP4A_WORDS: tl.constexpr, TWO: tl.constexpr, AHEAD: tl.constexpr, EVEN: tl.constexpr):
    """a[:ROWS] @ W[offs_n]^T over all of K on the register path, and the same with W2 when TWO
    (gate and up rows in one loop: both weights' loads in flight at once, half the dependent K
    steps of two loops). DP4A_WORDS: W MXFP4 as int32 words (the packed bytes viewed as int32,
    8 codes a word, little-endian: code i of word w is k = 8 w + i; scales at ws_ptr) and `a`
    split into int8 planes (a_ptr, row stride stride_am) with scales at as_ptr (row stride K/32;
    impl/moe/triton_dp4a.py); else W plain (bf16/fp16/fp32) and `a` as it is.
    The K loop keeps fp32 partial sums in registers, each thread its own (`_partial_cols`),
    summed across threads once after the loop: no cross-thread reduction (shuffles, shared
    memory, barriers) inside it. AHEAD (0, 1 or 2): each K step loads the weights of the step
    AHEAD steps ahead into registers before computing on its own, so that many memory round
    trips are in flight without shared memory. EVEN: K is a multiple of BLOCK_K (no K mask). Returns the two [M_PAD, BLOCK_N] fp32 results (the second
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
    tl.static_assert(AHEAD <= 2)
    if AHEAD >= 1:  # the sets loaded before the loop: step 0 and (AHEAD == 2) step 1
        n1w, n1ws, n1w2, n1ws2 = _step_weights(w_ptr, ws_ptr, w2_ptr, ws2_ptr, offs_n, n_mask, stride_wn, stride_sn,
                                               0, K, _live(0, K), BLOCK_N, BLOCK_K, DP4A_WORDS, TWO, EVEN)
        if AHEAD == 2:
            n2w, n2ws, n2w2, n2ws2 = _step_weights(w_ptr, ws_ptr, w2_ptr, ws2_ptr, offs_n, n_mask, stride_wn,
                                                   stride_sn, BLOCK_K, K, _live(BLOCK_K, K), BLOCK_N, BLOCK_K,
                                                   DP4A_WORDS, TWO, EVEN)
    if AHEAD == 0:
        # num_stages=1: never Triton's software pipeline, whose copies through shared memory wait
        # at a barrier a K step (slower than loading ahead into registers on the H200).
        for k0 in tl.range(0, K, BLOCK_K, num_stages=1):
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
        # registers here: a program an SM fewer, a wave more.
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
        # shared expert's programs the gate_up kernel's longest (seen in the sm_90 SASS).
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

