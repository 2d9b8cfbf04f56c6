"""The two expert kernels of the Triton MoE for decode and verify steps (at most M_PAD = 16
tokens a call), routed experts in bf16 or MXFP4, SwiGLU, the weighted combine and an optional
shared expert, after the slots are known (impl/moe/triton_slots.py):

1. `moe_gate_up_kernel` (slot x intermediate block): act = silu(x Wg^T) * (x Wu^T) for all
   tokens of the slot at once (clipped when CLIP: impl.moe.reference.swiglu_act), into a small
   scratch buffer; the shared expert in the programs after the slots;
2. `moe_down_kernel` (hidden block x slot): weight * act Wd^T per slot, plus the shared expert,
   summed by the last program to arrive at a block and written once in the output dtype
   (deterministic: no atomics on the output).

Products take one of two paths, by the launch config: up to `gemv_max_tokens` tokens register
multiply-adds (impl/moe/triton_gemv.py; MXFP4 through exact int8 dot products), else tensor-core
tiles (impl/moe/triton_tiles.py).
"""

from __future__ import annotations

from impl.moe.triton_dp4a import store_split_int8
from impl.moe.triton_gemv import gemv_rows
from impl.moe.triton_pdl import pdl_release, pdl_wait, prefetch_l2
from impl.moe.triton_tiles import tile_dot
from impl.triton_env import ASM, tl, triton

# Partial values the down kernel's combine has in flight at once (up to 8 partial tiles): at
# the committed tiles no kernel takes more registers for it (tests/test_moe_gpu_compile.py configs).
COMBINE_ELEMENTS = tl.constexpr(8192)


@triton.jit
def _matmul(a_ptr, stride_am, as_ptr, M, K, w_ptr, ws_ptr, w2_ptr, ws2_ptr, offs_n, n_mask, stride_wn, stride_sn,
            tokens, M_PAD: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, MXFP4: tl.constexpr,
            GEMV_ROWS: tl.constexpr, FP32_MATH: tl.constexpr, TWO: tl.constexpr, AHEAD: tl.constexpr,
            EVEN: tl.constexpr):
    """(a[:M, :K] @ W[offs_n, :K]^T, the same with W2 when TWO, else zeros) as [M_PAD, BLOCK_N]
    fp32. Up to GEMV_ROWS > 0 tokens the register path (`gemv_rows`: MXFP4 W as int32 words
    against `a` split into int8 planes with scales at as_ptr, impl/moe/triton_dp4a.py; plain W
    against `a` as it is), both weights in one K loop when TWO, AHEAD steps of look-ahead, no K
    mask when EVEN; else (one weight) a K loop of tensor-core tiles (`tile_dot`).

    `tokens` is the bit mask of the rows that chose this expert (-1: all rows). With MXFP4 on the
    register path and exactly one such row (most experts of a verify step, where each is chosen
    by one token) only that row is computed: a quarter of the multiply-adds and activation loads
    at 4 rows. The other rows are 0 (what a row that did not choose the expert contributes)."""
    if MXFP4 and GEMV_ROWS > 1:
        if (tokens > 0) & ((tokens & (tokens - 1)) == 0):
            t = ((tokens >> 1) & 1) + 2 * ((tokens >> 2) & 1) + 3 * ((tokens >> 3) & 1)  # its row (< 4)
            acc, acc2 = gemv_rows(a_ptr + t * stride_am, stride_am, as_ptr + t * (K // 32), 1, K, w_ptr, ws_ptr,
                                  w2_ptr, ws2_ptr, offs_n, n_mask, stride_wn, stride_sn, t, M_PAD, BLOCK_N, BLOCK_K,
                                  1, True, TWO, AHEAD, EVEN)
        else:
            acc, acc2 = gemv_rows(a_ptr, stride_am, as_ptr, M, K, w_ptr, ws_ptr, w2_ptr, ws2_ptr, offs_n, n_mask,
                                  stride_wn, stride_sn, 0, M_PAD, BLOCK_N, BLOCK_K, GEMV_ROWS, True, TWO, AHEAD, EVEN)
    elif GEMV_ROWS > 0:
        acc, acc2 = gemv_rows(a_ptr, stride_am, as_ptr, M, K, w_ptr, ws_ptr, w2_ptr, ws2_ptr, offs_n, n_mask,
                              stride_wn, stride_sn, 0, M_PAD, BLOCK_N, BLOCK_K, GEMV_ROWS, MXFP4, TWO, AHEAD, EVEN)
    else:
        tl.static_assert(not TWO)
        offs_m = tl.arange(0, M_PAD)
        acc = tl.zeros((M_PAD, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            acc += tile_dot(a_ptr, stride_am, offs_m, offs_m < M, k0, K, w_ptr, ws_ptr, offs_n, n_mask, stride_wn,
                            stride_sn, BLOCK_K, MXFP4, FP32_MATH)
        acc2 = tl.zeros((M_PAD, BLOCK_N), dtype=tl.float32)
    return acc, acc2


@triton.jit
def _swiglu_tile(x_ptr, stride_xm, xs_ptr, M, K, g_ptr, u_ptr, gs_ptr, us_ptr, offs_n, n_mask,
                 stride_wn, stride_sn, tokens, M_PAD: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_K: tl.constexpr, MXFP4: tl.constexpr, GEMV_ROWS: tl.constexpr, FP32_MATH: tl.constexpr,
                 AHEAD: tl.constexpr, EVEN: tl.constexpr, limit, CLIP: tl.constexpr):
    """silu(x Wg^T) * (x Wu^T) [M_PAD, BLOCK_N] fp32 for the gate rows at g_ptr and the up rows at
    u_ptr (`_matmul`'s arguments); when CLIP, silu(x Wg^T) capped at `limit` and x Wu^T clamped
    to +-limit (an infinite limit: none)."""
    if GEMV_ROWS > 0:  # one K loop for both: their loads in flight together
        acc_g, acc_u = _matmul(x_ptr, stride_xm, xs_ptr, M, K, g_ptr, gs_ptr, u_ptr, us_ptr, offs_n, n_mask, stride_wn,
                               stride_sn, tokens, M_PAD, BLOCK_N, BLOCK_K, MXFP4, GEMV_ROWS, FP32_MATH, True, AHEAD,
                               EVEN)
    else:
        offs_m = tl.arange(0, M_PAD)
        acc_g = tl.zeros((M_PAD, BLOCK_N), dtype=tl.float32)
        acc_u = tl.zeros((M_PAD, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            acc_g += tile_dot(x_ptr, stride_xm, offs_m, offs_m < M, k0, K, g_ptr, gs_ptr, offs_n, n_mask, stride_wn,
                              stride_sn, BLOCK_K, MXFP4, FP32_MATH)
            acc_u += tile_dot(x_ptr, stride_xm, offs_m, offs_m < M, k0, K, u_ptr, us_ptr, offs_n, n_mask, stride_wn,
                              stride_sn, BLOCK_K, MXFP4, FP32_MATH)
    act = acc_g / (1.0 + tl.exp(-acc_g))
    if CLIP:
        act = tl.minimum(act, limit)
        acc_u = tl.minimum(tl.maximum(acc_u, -limit), limit)
    return act * acc_u


@triton.jit
def moe_gate_up_kernel(x_ptr, stride_xm, xq_ptr, stride_xqm, xs_ptr, M, H, I, I_SHARED,
                       slot_expert_ptr, slot_tokens_ptr, num_slots,
                       w_ptr, ws_ptr, stride_we, stride_wn, stride_se, stride_sn,
                       sg_ptr, su_ptr, stride_shn,
                       act_ptr, stride_as, stride_am, act_s_ptr, stride_ass, shared_act_ptr, stride_sam,
                       swiglu_limit, shared_limit,
                       M_PAD: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                       MXFP4: tl.constexpr, HAS_SHARED: tl.constexpr, GEMV_ROWS: tl.constexpr,
                       FP32_MATH: tl.constexpr, SHARED_SPLIT: tl.constexpr, SHARED_BLOCK_K: tl.constexpr,
                       EVEN: tl.constexpr, AHEAD: tl.constexpr, SHARED_AHEAD: tl.constexpr, PDL: tl.constexpr,
                       CLIP: tl.constexpr):
    """Program (slot, n-block): activations of intermediate columns n-block for every token.
    The SHARED_SPLIT programs after the last routed slot compute the shared expert instead, each
    BLOCK_N / SHARED_SPLIT of the block's rows, in K tiles of SHARED_BLOCK_K: its bf16 rows hold
    4x the bytes of MXFP4 ones, so with MXFP4 experts whole blocks of it would be the kernel's
    longest programs (and its tiles the kernel's largest register footprint). EVEN: every tile,
    routed and shared, lies whole inside its weight (no masks on the register paths). AHEAD,
    SHARED_AHEAD: the register loops' look-ahead (`MoELaunchConfig.gate_up_lookahead`,
    `shared_lookahead`); the shared expert is never MXFP4.
    MXFP4 on the register path (the dp4a products): the routed experts read x split into int8
    planes (xq_ptr, row stride stride_xqm; scales xs_ptr) and write their activations split the
    same way (act_ptr planes, act_s_ptr scales, slot strides stride_as / stride_ass), ready for
    the down kernel. CLIP: the routed experts' SwiGLU clipped at swiglu_limit, the shared
    expert's at shared_limit (fp32; infinite for none); without it neither is read."""
    DP4A: tl.constexpr = MXFP4 and GEMV_ROWS > 0
    slot = tl.program_id(0)
    n0 = tl.program_id(1) * BLOCK_N
    offs_n = n0 + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, M_PAD)
    if slot < num_slots:
        pdl_wait(PDL)  # the slots come from the launch before this one
        pdl_release(PDL)
        expert = tl.load(slot_expert_ptr + slot)
        tokens = tl.load(slot_tokens_ptr + slot)
        if expert >= 0:
            if n0 < I:
                n_mask = (offs_n < I) | EVEN
                g_ptr = w_ptr + expert.to(tl.int64) * stride_we
                gs_ptr = ws_ptr + expert.to(tl.int64) * stride_se
                if DP4A:  # x as its int8 split
                    a_ptr, stride_a, as_ptr = xq_ptr, stride_xqm, xs_ptr
                else:
                    a_ptr, stride_a, as_ptr = x_ptr, stride_xm, x_ptr
                act = _swiglu_tile(a_ptr, stride_a, as_ptr, M, H, g_ptr, g_ptr + I * stride_wn, gs_ptr,
                                   gs_ptr + I * stride_sn, offs_n, n_mask, stride_wn, stride_sn,
                                   tokens, M_PAD, BLOCK_N, BLOCK_K, MXFP4, GEMV_ROWS, FP32_MATH, AHEAD, EVEN,
                                   swiglu_limit, CLIP)
                if DP4A:
                    tl.static_assert(BLOCK_N % 32 == 0)  # whole blocks of 32 to split
                    store_split_int8(act_ptr + slot * stride_as, stride_am, act_s_ptr + slot * stride_ass, I // 32,
                                     act, offs_m, offs_m < M_PAD, tl.program_id(1) * BLOCK_N, I, M_PAD, BLOCK_N)
                else:
                    tl.store(act_ptr + slot * stride_as + offs_m[:, None] * stride_am + offs_n[None, :],
                             act.to(act_ptr.dtype.element_ty), mask=n_mask[None, :])
    else:  # after the slots: the shared expert's programs
        # Reads x and the shared weights only (two or more launches old): computes before the slots.
        pdl_release(PDL)
        if HAS_SHARED:
            BLOCK_S: tl.constexpr = BLOCK_N // SHARED_SPLIT
            s0 = n0 + (slot - num_slots) * BLOCK_S
            offs_s = s0 + tl.arange(0, BLOCK_S)
            if n0 < I_SHARED:
                s_mask = (offs_s < I_SHARED) | EVEN
                act = _swiglu_tile(x_ptr, stride_xm, x_ptr, M, H, sg_ptr, su_ptr, sg_ptr, su_ptr, offs_s, s_mask,
                                   stride_shn, 0, -1, M_PAD, BLOCK_S, SHARED_BLOCK_K, False, GEMV_ROWS, FP32_MATH,
                                   SHARED_AHEAD, EVEN, shared_limit, CLIP)
                pdl_wait(PDL)  # writes wait (see impl/moe/triton_pdl.py)
                tl.store(shared_act_ptr + offs_m[:, None] * stride_sam + offs_s[None, :],
                         act.to(shared_act_ptr.dtype.element_ty), mask=s_mask[None, :])


@triton.jit
def moe_down_kernel(act_ptr, stride_as, stride_am, act_s_ptr, stride_ass, shared_act_ptr, stride_sam,
                    slot_expert_ptr, slot_weight_ptr, slot_tokens_ptr, num_slots,
                    w_ptr, ws_ptr, stride_we, stride_wn, stride_se, stride_sn,
                    sd_ptr, stride_sdn, partial_ptr, stride_ps, counter_ptr,
                    out_ptr, stride_om, M, H, I, I_SHARED, shared_chunk,
                    M_PAD: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                    MXFP4: tl.constexpr, HAS_SHARED: tl.constexpr, GEMV_ROWS: tl.constexpr,
                    FP32_MATH: tl.constexpr, SHARED_SPLIT: tl.constexpr, SHARED_BLOCK_K: tl.constexpr,
                    EVEN: tl.constexpr, AHEAD: tl.constexpr, SHARED_AHEAD: tl.constexpr, PDL: tl.constexpr,
                    L2_PREFETCH: tl.constexpr):
    """Program (hidden block, slot): weight * act[slot] Wd[e_slot]^T for that block, or for the
    SHARED_SPLIT slots after the last, the shared expert's product over a share of its K
    (`shared_chunk` columns, whole blocks of 32: `_shared_chunk`) in K tiles of SHARED_BLOCK_K.
    EVEN: every tile, routed and shared, lies whole inside its weight (no masks on the register
    paths). Each writes an fp32 partial; the program that arrives last at a block (an atomic
    counter) sums the block's partials in slot order and writes the output once in its dtype,
    then resets the counter for the next call: deterministic, no memset.
    MXFP4 on the register path: the routed activations come split (planes at act_ptr, scales at
    act_s_ptr), as the gate_up kernel wrote them. L2_PREFETCH (with PDL): while the gate_up
    kernel runs, each program asks for its weight rows in L2."""
    hb = tl.program_id(0)
    slot = tl.program_id(1)
    arrivals = tl.num_programs(1)
    offs_n = hb * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = (offs_n < H) | EVEN
    offs_m = tl.arange(0, M_PAD)
    acc = tl.zeros((M_PAD, BLOCK_N), dtype=tl.float32)
    # The slots are two launches old: read before waiting for the gate_up kernel's activations.
    expert = tl.load(slot_expert_ptr + slot, mask=slot < num_slots, other=-1)
    w_e = w_ptr + expert.to(tl.int64) * stride_we
    ws_e = ws_ptr + expert.to(tl.int64) * stride_se
    if L2_PREFETCH:  # this program's weight rows, while the gate_up kernel runs
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
                          stride_wn, stride_sn, tokens, M_PAD, BLOCK_N, BLOCK_K, MXFP4, GEMV_ROWS, FP32_MATH, False,
                          AHEAD, EVEN)[0]
            chose = ((tokens >> offs_m) & 1) != 0
            # A token that did not choose this expert adds exactly nothing (not 0 * inf = NaN).
            acc = tl.where(chose[:, None], acc * tl.load(slot_weight_ptr + slot * M_PAD + offs_m)[:, None], 0.0)
    elif HAS_SHARED:
        k_lo = tl.multiple_of((slot - num_slots) * shared_chunk, 32)  # aligned, so its loads vectorize as x's do
        acc = _matmul(shared_act_ptr + k_lo, stride_sam, shared_act_ptr, M, tl.minimum(shared_chunk, I_SHARED - k_lo),
                      sd_ptr + k_lo, sd_ptr, sd_ptr, sd_ptr, offs_n, n_mask, stride_sdn, 0, -1, M_PAD, BLOCK_N,
                      SHARED_BLOCK_K, False, GEMV_ROWS, FP32_MATH, False, SHARED_AHEAD, EVEN)[0]
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
