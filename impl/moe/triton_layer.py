"""A whole MoE layer of a decode or verify step (at most 4 tokens) in one persistent launch:
router logits, top-k, routed experts (MXFP4 through the dp4a decode, or plain weights), the
shared expert and the combine, with no launch boundary between them (`moe_layer_kernel`).

Why: at batch 1 the layer is bound by bytes and by the latency between its dependent steps. As
four launches (impl/moe/triton_moe.py) every kernel's drain and the next one's start sit on the
critical path, the expert kernels' programs come in uneven waves (1.45 routed gate_up programs
an SM at Ling-3.0-flash M=1), and the down kernel combines fp32 partials through memory. Here
one program an SM runs every step in turn, meeting the others at two grid-wide barriers, and a
program's share of each step is a contiguous range balanced to within one unit:

A. x split for the dp4a decode and the router logits of a range of experts; arrive at barrier
   1; then a range of the shared expert's gate/up rows while the other programs arrive;
B. wait at barrier 1; the top-k of all logits, each program for itself into its own scratch
   row (no round trip to hear the result from one of them);
C. routed gate_up over a range of (slot, column block) units, the K steps of consecutive units
   in one stream so that loads run ahead across units; SwiGLU with the routing weight folded in,
   written split for the dp4a down projection (or fp32); arrive at barrier 2;
D. wait at barrier 2; the down projection of a range of hidden rows over every slot, then the
   shared expert's, summed in registers in slot order and written once: deterministic, no
   partials and no combine step.

`L2_PREFETCH` asks for weights in L2 as soon as a program knows it will read them (1: its down
rows while it waits at barrier 2; 2: also its router and shared rows at the start and its
routed rows right after the top-k), so that DRAM has them in flight while the program waits
or computes.

Every program must be resident at once (a grid-wide wait): by default one program an SM;
`layer_programs` beyond the SM count is refused unless the compiled kernel's registers and
shared memory let every program be resident (`_check_resident`). Work that holds SMs on other
streams or processes while the layer runs can still keep programs out: on such a GPU use
`layer_launches=3`. Calls of the layer on one device must not overlap (they share the barrier
counters, which the last program to leave resets). Under the interpreter programs run one after
another, so a wait would never end: there the phases run as three launches (`PHASE` 1, 2, 3),
the same code between the barriers, and the top-k runs in each launch that needs it.

Status: correct, and about 1.7x slower than the four launches on the H200 at Ling-3.0-flash M=1
(42.5 against 24.7 us; notes/moe-h200.md, run 15, says where its phases lose), so it is opt-in
(`MoELaunchConfig.one_launch`) and no committed config takes it.
"""

from __future__ import annotations

import functools

import torch

from impl import backends
from impl.moe.configs import MoELaunchConfig, lookup
from impl.moe.shared import SharedExpert
from impl.moe.triton_dp4a import empty_split, store_split_int8
from impl.moe.triton_moe import (KernelLaunch, _gemv_rows, _gemv_step, _partial_cols, _rows_tile, _step_weights,
                                 _weight_args, check_triton_inputs, write_slots)
from impl.moe.triton_pdl import prefetch_l2
from impl.moe.triton_routing import check_router_weight, logits_block, split_x_block, topk_consts
from impl.moe.triton_topk import batch_ids, choice_weights, decode_route
from impl.quant.mxfp4 import MXFP4Tensor
from impl.triton_env import ASM, INTERPRET, tl, triton

MAX_TOKENS = 4  # the register path's rows (1, 2 or 4 tokens a call)
PHASES = (1, 2, 3)  # the launches of one call under the interpreter (0: one launch with barriers)


@triton.jit
def _span(p, P, n):
    """[lo, hi): program p's share of n units among P programs (sizes differ by one at most)."""
    return p * n // P, (p + 1) * n // P


@triton.jit
def _arrive(counter_ptr):
    """Announce this program's writes: every thread's stores are issued, then one release."""
    tl.debug_barrier()
    tl.atomic_add(counter_ptr, 1, sem="release", scope="gpu")


@triton.jit
def _wait(counter_ptr, target):
    """Until `target` programs have arrived at the counter (acquire: their writes are visible)."""
    seen = tl.atomic_add(counter_ptr, 0, sem="acquire", scope="gpu")
    while seen < target:
        seen = tl.atomic_add(counter_ptr, 0, sem="acquire", scope="gpu")
    tl.debug_barrier()


@triton.jit
def _route(p, logits_ptr, bias_ptr, M, E, TOP_K, routed_scaling, ids_ptr, weights_ptr,
           r_expert_ptr, r_weight_ptr, r_tokens_ptr,
           ROUTER: tl.constexpr, RENORMALIZE: tl.constexpr, HAS_BIAS: tl.constexpr, N_GROUP: tl.constexpr,
           TOPK_GROUP: tl.constexpr, ROWS: tl.constexpr, E_PAD: tl.constexpr, K_PAD: tl.constexpr,
           S_PAD: tl.constexpr):
    """The step's routing from all logits into this program's scratch row (slot experts, weights
    [S_PAD, ROWS], token bit masks), program 0 also into the caller's ids/weights [M, k].
    Returns the number of slots (distinct experts; one token's k experts are distinct)."""
    offs_k = tl.arange(0, K_PAD)
    in_k = offs_k < TOP_K
    if ROWS == 1:
        ids, weights = decode_route(logits_ptr, bias_ptr, E, TOP_K, routed_scaling, ROUTER, RENORMALIZE, HAS_BIAS,
                                    N_GROUP, TOPK_GROUP, E_PAD, K_PAD)
        ids = tl.reshape(ids, (K_PAD,))
        weights = tl.reshape(weights, (K_PAD,))
        tl.store(r_expert_ptr + offs_k, ids, mask=in_k)
        tl.store(r_weight_ptr + offs_k, weights, mask=in_k)
        tl.store(r_tokens_ptr + offs_k, tl.full((K_PAD,), 1, tl.int32), mask=in_k)
        if p == 0:
            tl.store(ids_ptr + offs_k, ids, mask=in_k)
            tl.store(weights_ptr + offs_k, weights, mask=in_k)
        num_slots = TOP_K
    else:
        offs_m = tl.arange(0, ROWS)
        scores, ids = batch_ids(logits_ptr, bias_ptr, M, E, TOP_K, ROUTER, HAS_BIAS, N_GROUP, TOPK_GROUP, ROWS,
                                E_PAD, K_PAD, ".cg")
        weights = choice_weights(scores, ids, TOP_K, RENORMALIZE, routed_scaling, K_PAD)
        valid = (offs_m[:, None] < M) & in_k[None, :]
        if p == 0:
            tl.store(ids_ptr + offs_m[:, None] * TOP_K + offs_k[None, :], ids, mask=valid)
            tl.store(weights_ptr + offs_m[:, None] * TOP_K + offs_k[None, :], weights, mask=valid)
        PAIRS: tl.constexpr = ROWS * K_PAD
        num_slots = write_slots(tl.reshape(ids, (PAIRS,)), tl.reshape(weights, (PAIRS,)), tl.reshape(valid, (PAIRS,)),
                                tl.arange(0, PAIRS) // K_PAD, r_expert_ptr, r_weight_ptr, r_tokens_ptr, S_PAD, PAIRS,
                                S_PAD, ROWS)
    tl.debug_barrier()  # the scratch row is written before any thread reads it back
    return num_slots


@triton.jit
def _gate_up_tiles(t, T, u_lo, KSTEPS, NB, r_expert_ptr, w_ptr, ws_ptr, stride_we, stride_wn, stride_se, stride_sn,
                   H, I, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DP4A: tl.constexpr, EVEN: tl.constexpr):
    """Step t of a program's gate_up stream: unit u_lo + t // KSTEPS (slot, column block), K
    step t % KSTEPS; its gate and up tiles (`_step_weights`), nothing read past the stream."""
    u = u_lo + t // KSTEPS
    expert = tl.load(r_expert_ptr + u // NB, mask=t < T, other=0)
    g_ptr = w_ptr + expert.to(tl.int64) * stride_we
    gs_ptr = ws_ptr + expert.to(tl.int64) * stride_se
    offs_n = (u % NB) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = (offs_n < I) | EVEN
    return _step_weights(g_ptr, gs_ptr, g_ptr + I * stride_wn, gs_ptr + I * stride_sn, offs_n, n_mask, stride_wn,
                         stride_sn, (t % KSTEPS) * BLOCK_K, H, tl.arange(0, 1) + t < T, BLOCK_N, BLOCK_K, DP4A, True,
                         EVEN)


@triton.jit
def _gate_up_store(u, NB, g, up, r_weight_ptr, r_tokens_ptr, M, I, act_ptr, stride_as, stride_am, act_s_ptr,
                   stride_ass, ROWS: tl.constexpr, BLOCK_N: tl.constexpr, DP4A: tl.constexpr):
    """A unit's activations silu(g) * up [ROWS, BLOCK_N], times the routing weight of each token
    that chose the slot's expert and exactly 0 for the others (not 0 * inf), stored split for the
    dp4a down projection or as fp32."""
    slot = u // NB
    offs_m = tl.arange(0, ROWS)
    offs_n = (u % NB) * BLOCK_N + tl.arange(0, BLOCK_N)
    tokens = tl.load(r_tokens_ptr + slot)
    chose = (((tokens >> offs_m) & 1) != 0) & (offs_m < M)
    weight = tl.load(r_weight_ptr + slot * ROWS + offs_m)
    act = tl.where(chose[:, None], g / (1.0 + tl.exp(-g)) * up * weight[:, None], 0.0)
    if DP4A:
        store_split_int8(act_ptr + slot * stride_as, stride_am, act_s_ptr + slot * stride_ass, I // 32, act, offs_m,
                         offs_m < ROWS, (u % NB) * BLOCK_N, I, ROWS, BLOCK_N)
    else:
        tl.store(act_ptr + slot * stride_as + offs_m[:, None] * stride_am + offs_n[None, :], act,
                 mask=(offs_n < I)[None, :])


@triton.jit
def _gate_up_step(t, T, KSTEPS, NB, u_lo, w, ws, w2, ws2, a0, a1, a2, a3, b0, b1, b2, b3, a_ptr, stride_a, as_ptr,
                  r_weight_ptr, r_tokens_ptr, M, H, I, act_ptr, stride_as, stride_am, act_s_ptr, stride_ass,
                  ROWS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, COLS: tl.constexpr,
                  DP4A: tl.constexpr, EVEN: tl.constexpr):
    """Step t of a program's gate_up stream on its loaded tiles (nothing past the stream's end):
    the partials a<r> (gate) and b<r> (up) updated; at a unit's last K step its activations
    stored and the partials zeroed."""
    if t < T:
        a0, a1, a2, a3, b0, b1, b2, b3 = _gemv_step(a0, a1, a2, a3, b0, b1, b2, b3, w, ws, w2, ws2, a_ptr, stride_a,
                                                    as_ptr, tl.arange(0, BLOCK_N), (t % KSTEPS) * BLOCK_K, H, M,
                                                    BLOCK_N, BLOCK_K, ROWS, COLS, DP4A, True, EVEN)
        if t % KSTEPS == KSTEPS - 1:
            g = _rows_tile(tl.sum(a0, axis=1), tl.sum(a1, axis=1), tl.sum(a2, axis=1), tl.sum(a3, axis=1), 0, ROWS,
                           ROWS)
            up = _rows_tile(tl.sum(b0, axis=1), tl.sum(b1, axis=1), tl.sum(b2, axis=1), tl.sum(b3, axis=1), 0, ROWS,
                            ROWS)
            _gate_up_store(u_lo + t // KSTEPS, NB, g, up, r_weight_ptr, r_tokens_ptr, M, I, act_ptr, stride_as,
                           stride_am, act_s_ptr, stride_ass, ROWS, BLOCK_N, DP4A)
            zero = tl.zeros_like(a0)
            a0, a1, a2, a3, b0, b1, b2, b3 = zero, zero, zero, zero, zero, zero, zero, zero
    return a0, a1, a2, a3, b0, b1, b2, b3


@triton.jit
def _routed_gate_up(p, P, num_slots, r_expert_ptr, r_weight_ptr, r_tokens_ptr, a_ptr, stride_a, as_ptr, M, H, I,
                    w_ptr, ws_ptr, stride_we, stride_wn, stride_se, stride_sn,
                    act_ptr, stride_as, stride_am, act_s_ptr, stride_ass,
                    ROWS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DP4A: tl.constexpr,
                    AHEAD: tl.constexpr, STAGES: tl.constexpr, EVEN: tl.constexpr):
    """Phase C for program p: its units' K steps as one stream across unit boundaries, AHEAD
    (0-2) steps of loads in flight while a step computes (STAGES > 1: Triton's software pipeline
    of that many stages instead, the loads in flight in shared memory rather than registers). The stream runs AHEAD + 1 steps a
    pass, each from its own register set, reloaded in place once its step is done: a set handed
    on from one register to another would be copied, and a copy waits for its load (notes/
    moe-h200.md, run 11), which would leave one memory round trip per step."""
    NB = tl.cdiv(I, BLOCK_N)
    KSTEPS = tl.cdiv(H, BLOCK_K)
    u_lo, u_hi = _span(p, P, num_slots * NB)
    T = (u_hi - u_lo) * KSTEPS
    COLS: tl.constexpr = _partial_cols(BLOCK_K, ROWS, DP4A, w_ptr.dtype.element_ty.primitive_bitwidth)
    zero = tl.zeros((BLOCK_N, COLS), dtype=tl.float32)
    a0, a1, a2, a3, b0, b1, b2, b3 = zero, zero, zero, zero, zero, zero, zero, zero
    if STAGES > 1:  # Triton's software pipeline: the loads of STAGES - 1 steps in flight in shared memory
        for t in tl.range(0, T, num_stages=STAGES):
            w, ws, w2, ws2 = _gate_up_tiles(t, T, u_lo, KSTEPS, NB, r_expert_ptr, w_ptr, ws_ptr, stride_we, stride_wn,
                                            stride_se, stride_sn, H, I, BLOCK_N, BLOCK_K, DP4A, EVEN)
            a0, a1, a2, a3, b0, b1, b2, b3 = _gate_up_step(
                t, T, KSTEPS, NB, u_lo, w, ws, w2, ws2, a0, a1, a2, a3, b0, b1, b2, b3, a_ptr, stride_a, as_ptr,
                r_weight_ptr, r_tokens_ptr, M, H, I, act_ptr, stride_as, stride_am, act_s_ptr, stride_ass, ROWS,
                BLOCK_N, BLOCK_K, COLS, DP4A, EVEN)
        return
    tl.static_assert(AHEAD <= 2)
    G: tl.constexpr = AHEAD + 1
    c0w, c0ws, c0w2, c0ws2 = _gate_up_tiles(0, T, u_lo, KSTEPS, NB, r_expert_ptr, w_ptr, ws_ptr, stride_we, stride_wn,
                                            stride_se, stride_sn, H, I, BLOCK_N, BLOCK_K, DP4A, EVEN)
    if G >= 2:
        c1w, c1ws, c1w2, c1ws2 = _gate_up_tiles(1, T, u_lo, KSTEPS, NB, r_expert_ptr, w_ptr, ws_ptr, stride_we,
                                                stride_wn, stride_se, stride_sn, H, I, BLOCK_N, BLOCK_K, DP4A, EVEN)
    if G >= 3:
        c2w, c2ws, c2w2, c2ws2 = _gate_up_tiles(2, T, u_lo, KSTEPS, NB, r_expert_ptr, w_ptr, ws_ptr, stride_we,
                                                stride_wn, stride_se, stride_sn, H, I, BLOCK_N, BLOCK_K, DP4A, EVEN)
    for t0 in range(0, T, G):
        a0, a1, a2, a3, b0, b1, b2, b3 = _gate_up_step(
            t0, T, KSTEPS, NB, u_lo, c0w, c0ws, c0w2, c0ws2, a0, a1, a2, a3, b0, b1, b2, b3, a_ptr, stride_a, as_ptr,
            r_weight_ptr, r_tokens_ptr, M, H, I, act_ptr, stride_as, stride_am, act_s_ptr, stride_ass, ROWS, BLOCK_N,
            BLOCK_K, COLS, DP4A, EVEN)
        c0w, c0ws, c0w2, c0ws2 = _gate_up_tiles(t0 + G, T, u_lo, KSTEPS, NB, r_expert_ptr, w_ptr, ws_ptr, stride_we,
                                                stride_wn, stride_se, stride_sn, H, I, BLOCK_N, BLOCK_K, DP4A, EVEN)
        if G >= 2:
            a0, a1, a2, a3, b0, b1, b2, b3 = _gate_up_step(
                t0 + 1, T, KSTEPS, NB, u_lo, c1w, c1ws, c1w2, c1ws2, a0, a1, a2, a3, b0, b1, b2, b3, a_ptr, stride_a,
                as_ptr, r_weight_ptr, r_tokens_ptr, M, H, I, act_ptr, stride_as, stride_am, act_s_ptr, stride_ass,
                ROWS, BLOCK_N, BLOCK_K, COLS, DP4A, EVEN)
            c1w, c1ws, c1w2, c1ws2 = _gate_up_tiles(t0 + 1 + G, T, u_lo, KSTEPS, NB, r_expert_ptr, w_ptr, ws_ptr,
                                                    stride_we, stride_wn, stride_se, stride_sn, H, I, BLOCK_N,
                                                    BLOCK_K, DP4A, EVEN)
        if G >= 3:
            a0, a1, a2, a3, b0, b1, b2, b3 = _gate_up_step(
                t0 + 2, T, KSTEPS, NB, u_lo, c2w, c2ws, c2w2, c2ws2, a0, a1, a2, a3, b0, b1, b2, b3, a_ptr, stride_a,
                as_ptr, r_weight_ptr, r_tokens_ptr, M, H, I, act_ptr, stride_as, stride_am, act_s_ptr, stride_ass,
                ROWS, BLOCK_N, BLOCK_K, COLS, DP4A, EVEN)
            c2w, c2ws, c2w2, c2ws2 = _gate_up_tiles(t0 + 2 + G, T, u_lo, KSTEPS, NB, r_expert_ptr, w_ptr, ws_ptr,
                                                    stride_we, stride_wn, stride_se, stride_sn, H, I, BLOCK_N,
                                                    BLOCK_K, DP4A, EVEN)


@triton.jit
def _down_tiles(t, T, KSTEPS, r_expert_ptr, w_ptr, ws_ptr, stride_we, stride_se, offs_n, n_mask, stride_wn, stride_sn,
                I, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DP4A: tl.constexpr, EVEN: tl.constexpr):
    """Step t of a down stream over the slots: slot t // KSTEPS, K step t % KSTEPS, rows offs_n."""
    expert = tl.load(r_expert_ptr + t // KSTEPS, mask=t < T, other=0)
    w, ws, _, _ = _step_weights(w_ptr + expert.to(tl.int64) * stride_we, ws_ptr + expert.to(tl.int64) * stride_se,
                                w_ptr, ws_ptr, offs_n, n_mask, stride_wn, stride_sn, (t % KSTEPS) * BLOCK_K, I,
                                tl.arange(0, 1) + t < T, BLOCK_N, BLOCK_K, DP4A, False, EVEN)
    return w, ws


@triton.jit
def _down_step(t, T, KSTEPS, w, ws, a0, a1, a2, a3, act_ptr, stride_as, stride_am, act_s_ptr, stride_ass, offs_n, M, I,
               BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, ROWS: tl.constexpr, COLS: tl.constexpr,
               DP4A: tl.constexpr, EVEN: tl.constexpr):
    """Step t of a down stream (slot t // KSTEPS, its weighted activations) on its loaded tiles."""
    if t < T:
        slot = t // KSTEPS
        a0, a1, a2, a3, _, _, _, _ = _gemv_step(a0, a1, a2, a3, a0, a1, a2, a3, w, ws, w, ws, act_ptr + slot * stride_as,
                                                stride_am, act_s_ptr + slot * stride_ass, offs_n,
                                                (t % KSTEPS) * BLOCK_K, I, M, BLOCK_N, BLOCK_K, ROWS, COLS, DP4A,
                                                False, EVEN)
    return a0, a1, a2, a3


@triton.jit
def _down_stream(T, KSTEPS, a0, a1, a2, a3, r_expert_ptr, w_ptr, ws_ptr, stride_we, stride_se, offs_n, n_mask,
                 stride_wn, stride_sn, act_ptr, stride_as, stride_am, act_s_ptr, stride_ass, M, I,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, ROWS: tl.constexpr, COLS: tl.constexpr,
                 DP4A: tl.constexpr, AHEAD: tl.constexpr, STAGES: tl.constexpr, EVEN: tl.constexpr):
    """A block's down stream over (slot, K step): AHEAD + 1 steps a pass from their own register
    sets (as `_routed_gate_up`), or STAGES > 1 Triton's software pipeline."""
    if STAGES > 1:
        for t in tl.range(0, T, num_stages=STAGES):
            w, ws = _down_tiles(t, T, KSTEPS, r_expert_ptr, w_ptr, ws_ptr, stride_we, stride_se, offs_n, n_mask,
                                stride_wn, stride_sn, I, BLOCK_N, BLOCK_K, DP4A, EVEN)
            a0, a1, a2, a3 = _down_step(t, T, KSTEPS, w, ws, a0, a1, a2, a3, act_ptr, stride_as, stride_am,
                                        act_s_ptr, stride_ass, offs_n, M, I, BLOCK_N, BLOCK_K, ROWS, COLS, DP4A, EVEN)
        return a0, a1, a2, a3
    tl.static_assert(AHEAD <= 2)
    G: tl.constexpr = AHEAD + 1
    c0w, c0ws = _down_tiles(0, T, KSTEPS, r_expert_ptr, w_ptr, ws_ptr, stride_we, stride_se, offs_n, n_mask,
                            stride_wn, stride_sn, I, BLOCK_N, BLOCK_K, DP4A, EVEN)
    if G >= 2:
        c1w, c1ws = _down_tiles(1, T, KSTEPS, r_expert_ptr, w_ptr, ws_ptr, stride_we, stride_se, offs_n, n_mask,
                                stride_wn, stride_sn, I, BLOCK_N, BLOCK_K, DP4A, EVEN)
    if G >= 3:
        c2w, c2ws = _down_tiles(2, T, KSTEPS, r_expert_ptr, w_ptr, ws_ptr, stride_we, stride_se, offs_n, n_mask,
                                stride_wn, stride_sn, I, BLOCK_N, BLOCK_K, DP4A, EVEN)
    for t0 in range(0, T, G):
        a0, a1, a2, a3 = _down_step(t0, T, KSTEPS, c0w, c0ws, a0, a1, a2, a3, act_ptr, stride_as, stride_am,
                                    act_s_ptr, stride_ass, offs_n, M, I, BLOCK_N, BLOCK_K, ROWS, COLS, DP4A, EVEN)
        c0w, c0ws = _down_tiles(t0 + G, T, KSTEPS, r_expert_ptr, w_ptr, ws_ptr, stride_we, stride_se, offs_n, n_mask,
                                stride_wn, stride_sn, I, BLOCK_N, BLOCK_K, DP4A, EVEN)
        if G >= 2:
            a0, a1, a2, a3 = _down_step(t0 + 1, T, KSTEPS, c1w, c1ws, a0, a1, a2, a3, act_ptr, stride_as, stride_am,
                                        act_s_ptr, stride_ass, offs_n, M, I, BLOCK_N, BLOCK_K, ROWS, COLS, DP4A, EVEN)
            c1w, c1ws = _down_tiles(t0 + 1 + G, T, KSTEPS, r_expert_ptr, w_ptr, ws_ptr, stride_we, stride_se, offs_n,
                                    n_mask, stride_wn, stride_sn, I, BLOCK_N, BLOCK_K, DP4A, EVEN)
        if G >= 3:
            a0, a1, a2, a3 = _down_step(t0 + 2, T, KSTEPS, c2w, c2ws, a0, a1, a2, a3, act_ptr, stride_as, stride_am,
                                        act_s_ptr, stride_ass, offs_n, M, I, BLOCK_N, BLOCK_K, ROWS, COLS, DP4A, EVEN)
            c2w, c2ws = _down_tiles(t0 + 2 + G, T, KSTEPS, r_expert_ptr, w_ptr, ws_ptr, stride_we, stride_se, offs_n,
                                    n_mask, stride_wn, stride_sn, I, BLOCK_N, BLOCK_K, DP4A, EVEN)
    return a0, a1, a2, a3


@triton.jit
def _down_rows(p, P, num_slots, r_expert_ptr, act_ptr, stride_as, stride_am, act_s_ptr, stride_ass, shared_act_ptr,
               M, H, I, I_SHARED, w_ptr, ws_ptr, stride_we, stride_wn, stride_se, stride_sn, sd_ptr, stride_sdn,
               out_ptr, stride_om, ROWS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
               DP4A: tl.constexpr, AHEAD: tl.constexpr, STAGES: tl.constexpr, HAS_SHARED: tl.constexpr,
               SHARED_BLOCK_K: tl.constexpr, SHARED_PIPELINE: tl.constexpr, EVEN: tl.constexpr,
               EVEN_SHARED: tl.constexpr):
    """Phase D for program p: its range of hidden rows, blocks of BLOCK_N; per block the (slot,
    K step) stream of the routed down projection (activations weighted already,
    `_down_stream`), then the shared expert's, summed in registers and written once in the
    output dtype."""
    h_lo, h_hi = _span(p, P, H)
    KSTEPS = tl.cdiv(I, BLOCK_K)
    T = num_slots * KSTEPS
    COLS: tl.constexpr = _partial_cols(BLOCK_K, ROWS, DP4A, w_ptr.dtype.element_ty.primitive_bitwidth)
    offs_m = tl.arange(0, ROWS)
    for h0 in range(h_lo, h_hi, BLOCK_N):
        offs_n = h0 + tl.arange(0, BLOCK_N)
        n_mask = offs_n < h_hi
        zero = tl.zeros((BLOCK_N, COLS), dtype=tl.float32)
        a0, a1, a2, a3 = _down_stream(T, KSTEPS, zero, zero, zero, zero, r_expert_ptr, w_ptr, ws_ptr, stride_we,
                                      stride_se, offs_n, n_mask, stride_wn, stride_sn, act_ptr, stride_as, stride_am,
                                      act_s_ptr, stride_ass, M, I, BLOCK_N, BLOCK_K, ROWS, COLS, DP4A, AHEAD, STAGES,
                                      EVEN)
        out = _rows_tile(tl.sum(a0, axis=1), tl.sum(a1, axis=1), tl.sum(a2, axis=1), tl.sum(a3, axis=1), 0, ROWS,
                         ROWS)
        if HAS_SHARED:
            shared, _ = _gemv_rows(shared_act_ptr, I_SHARED, shared_act_ptr, M, I_SHARED, sd_ptr, sd_ptr, sd_ptr,
                                   sd_ptr, offs_n, n_mask, stride_sdn, 0, 0, ROWS, BLOCK_N, SHARED_BLOCK_K, ROWS,
                                   False, False, SHARED_PIPELINE, EVEN_SHARED)
            out += shared
        tl.store(out_ptr + offs_m[:, None] * stride_om + offs_n[None, :], out.to(out_ptr.dtype.element_ty),
                 mask=(offs_m < M)[:, None] & n_mask[None, :])


@triton.jit
def _shared_gate_up(p, P, x_ptr, stride_xm, M, H, I_SHARED, sg_ptr, su_ptr, stride_sgn, shared_act_ptr,
                    ROWS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PIPELINE: tl.constexpr,
                    EVEN: tl.constexpr):
    """Phase A's shared expert: a range of its intermediate columns, silu(x Wg^T) * (x Wu^T) as
    fp32 [ROWS, I_SHARED] (rows past M are 0: their x reads 0)."""
    s_lo, s_hi = _span(p, P, I_SHARED)
    offs_m = tl.arange(0, ROWS)
    for s0 in range(s_lo, s_hi, BLOCK_N):
        offs_s = s0 + tl.arange(0, BLOCK_N)
        s_mask = offs_s < s_hi
        g, up = _gemv_rows(x_ptr, stride_xm, x_ptr, M, H, sg_ptr, sg_ptr, su_ptr, su_ptr, offs_s, s_mask, stride_sgn,
                           0, 0, ROWS, BLOCK_N, BLOCK_K, ROWS, False, True, PIPELINE, EVEN)
        tl.store(shared_act_ptr + offs_m[:, None] * I_SHARED + offs_s[None, :], g / (1.0 + tl.exp(-g)) * up,
                 mask=s_mask[None, :])


@triton.jit
def _prefetch_rows(base_ptr, stride_row, lo, hi):
    """Ask for rows [lo, hi) of a row-major weight in L2 (contiguous; strides in elements)."""
    prefetch_l2(base_ptr + lo.to(tl.int64) * stride_row, base_ptr + hi.to(tl.int64) * stride_row, ASM)


@triton.jit
def moe_layer_kernel(
        x_ptr, stride_xm, M, H, I, I_SHARED, E, TOP_K, routed_scaling,
        router_ptr, stride_re, bias_ptr, logits_ptr, xq_ptr, xs_ptr,
        w1_ptr, w1s_ptr, stride_w1e, stride_w1n, stride_s1e, stride_s1n,
        w2_ptr, w2s_ptr, stride_w2e, stride_w2n, stride_s2e, stride_s2n,
        sg_ptr, su_ptr, sd_ptr, stride_sgn, stride_sdn,
        r_expert_ptr, r_weight_ptr, r_tokens_ptr,
        act_ptr, stride_as, stride_am, act_s_ptr, stride_ass, shared_act_ptr,
        ids_ptr, weights_ptr, out_ptr, stride_om, sync_ptr,
        ROWS: tl.constexpr, DP4A: tl.constexpr, HAS_SHARED: tl.constexpr,
        ROUTER: tl.constexpr, RENORMALIZE: tl.constexpr, HAS_BIAS: tl.constexpr, N_GROUP: tl.constexpr,
        TOPK_GROUP: tl.constexpr, E_PAD: tl.constexpr, K_PAD: tl.constexpr, S_PAD: tl.constexpr,
        BLOCK_E: tl.constexpr, LOGITS_BLOCK_K: tl.constexpr,
        BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GATE_UP_AHEAD: tl.constexpr, EVEN_GATE_UP: tl.constexpr,
        BLOCK_H: tl.constexpr, DOWN_BLOCK_K: tl.constexpr, DOWN_AHEAD: tl.constexpr, EVEN_DOWN: tl.constexpr,
        SHARED_BLOCK_N: tl.constexpr, SHARED_BLOCK_K: tl.constexpr, SHARED_PIPELINE: tl.constexpr,
        EVEN_SHARED_H: tl.constexpr, EVEN_SHARED_I: tl.constexpr, STREAM_STAGES: tl.constexpr,
        L2_PREFETCH: tl.constexpr, PHASE: tl.constexpr):
    """The layer for M <= ROWS tokens (module docstring): PHASE 0 runs phases A to D with the
    grid-wide barriers (sync_ptr: three counters, zero between calls); 1, 2, 3 run A, B + C and
    B + D alone (one launch each, in that order: the interpreter's way). r_*: scratch rows of
    S_PAD slots per program. With DP4A, x is split into xq/xs (planes, scales) and the
    activations into act/act_s; else the activations are fp32 at act."""
    p = tl.program_id(0)
    P = tl.num_programs(0)
    ALL: tl.constexpr = PHASE == 0
    r_expert_ptr += p * S_PAD
    r_weight_ptr += p * S_PAD * ROWS
    r_tokens_ptr += p * S_PAD
    e_lo, e_hi = _span(p, P, E)
    if ALL or PHASE == 1:
        if L2_PREFETCH >= 2:
            _prefetch_rows(router_ptr, stride_re, e_lo, e_hi)
            if HAS_SHARED:
                s_lo, s_hi = _span(p, P, I_SHARED)
                _prefetch_rows(sg_ptr, stride_sgn, s_lo, s_hi)
                _prefetch_rows(su_ptr, stride_sgn, s_lo, s_hi)
        if DP4A:
            for c in range(p * 32, H, P * 32):
                split_x_block(x_ptr, stride_xm, xq_ptr, xs_ptr, M, H, c, ROWS)
        for e0 in range(e_lo, e_hi, BLOCK_E):
            logits_block(x_ptr, stride_xm, router_ptr, stride_re, logits_ptr, M, E, H, e0 + tl.arange(0, BLOCK_E), e_hi,
                         ROWS, BLOCK_E, LOGITS_BLOCK_K)
        if ALL:
            _arrive(sync_ptr)
        if HAS_SHARED:
            _shared_gate_up(p, P, x_ptr, stride_xm, M, H, I_SHARED, sg_ptr, su_ptr, stride_sgn, shared_act_ptr, ROWS,
                            SHARED_BLOCK_N, SHARED_BLOCK_K, SHARED_PIPELINE, EVEN_SHARED_H)
    if ALL or PHASE >= 2:
        if ALL:
            _wait(sync_ptr, P)
        num_slots = _route(p, logits_ptr, bias_ptr, M, E, TOP_K, routed_scaling, ids_ptr, weights_ptr, r_expert_ptr,
                           r_weight_ptr, r_tokens_ptr, ROUTER, RENORMALIZE, HAS_BIAS, N_GROUP, TOPK_GROUP, ROWS,
                           E_PAD, K_PAD, S_PAD)
        h_lo, h_hi = _span(p, P, H)
        if L2_PREFETCH >= 2:
            NB = tl.cdiv(I, BLOCK_N)
            u_lo, u_hi = _span(p, P, num_slots * NB)
            for u in range(u_lo, u_hi):
                e = tl.load(r_expert_ptr + u // NB).to(tl.int64)
                n0 = (u % NB) * BLOCK_N
                n1 = tl.minimum(n0 + BLOCK_N, I)
                for half in tl.static_range(2):  # gate rows, then up rows
                    _prefetch_rows(w1_ptr + e * stride_w1e, stride_w1n, half * I + n0, half * I + n1)
                    if DP4A:
                        _prefetch_rows(w1s_ptr + e * stride_s1e, stride_s1n, half * I + n0, half * I + n1)
    if ALL or PHASE == 2:
        if DP4A:
            a_ptr, stride_a, as_ptr = xq_ptr, H // 2, xs_ptr
        else:
            a_ptr, stride_a, as_ptr = x_ptr, stride_xm, x_ptr
        _routed_gate_up(p, P, num_slots, r_expert_ptr, r_weight_ptr, r_tokens_ptr, a_ptr, stride_a, as_ptr, M, H, I,
                        w1_ptr, w1s_ptr, stride_w1e, stride_w1n, stride_s1e, stride_s1n, act_ptr, stride_as,
                        stride_am, act_s_ptr, stride_ass, ROWS, BLOCK_N, BLOCK_K, DP4A, GATE_UP_AHEAD, STREAM_STAGES,
                        EVEN_GATE_UP)
        if ALL:
            _arrive(sync_ptr + 1)
        if L2_PREFETCH >= 1:  # this program's down rows of every slot, and of the shared expert
            for s in range(0, num_slots):
                e = tl.load(r_expert_ptr + s).to(tl.int64)
                _prefetch_rows(w2_ptr + e * stride_w2e, stride_w2n, h_lo, h_hi)
                if DP4A:
                    _prefetch_rows(w2s_ptr + e * stride_s2e, stride_s2n, h_lo, h_hi)
            if HAS_SHARED:
                _prefetch_rows(sd_ptr, stride_sdn, h_lo, h_hi)
    if ALL or PHASE == 3:
        if ALL:
            _wait(sync_ptr + 1, P)
        _down_rows(p, P, num_slots, r_expert_ptr, act_ptr, stride_as, stride_am, act_s_ptr, stride_ass, shared_act_ptr,
                   M, H, I, I_SHARED, w2_ptr, w2s_ptr, stride_w2e, stride_w2n, stride_s2e, stride_s2n, sd_ptr,
                   stride_sdn, out_ptr, stride_om, ROWS, BLOCK_H, DOWN_BLOCK_K, DP4A, DOWN_AHEAD, STREAM_STAGES,
                   HAS_SHARED, SHARED_BLOCK_K, SHARED_PIPELINE, EVEN_DOWN, EVEN_SHARED_I)
    if ALL:  # the last program out resets the counters for the next call (every other has passed both waits)
        tl.debug_barrier()
        if tl.atomic_add(sync_ptr + 2, 1, sem="acq_rel", scope="gpu") == P - 1:
            tl.store(sync_ptr, 0)
            tl.store(sync_ptr + 1, 0)
            tl.store(sync_ptr + 2, 0)


@functools.lru_cache(maxsize=None)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def _device_sms(device: torch.device) -> int:
    """SMs of a CUDA device (cached: the layer asks on every call)."""
    return _sm_count(device.index if device.index is not None else torch.cuda.current_device())


INTERPRET_PROGRAMS = 3  # programs under the interpreter: shares of unequal sizes, as on a GPU
_SYNC: dict = {}


def _sync(device: torch.device) -> torch.Tensor:
    """The barrier counters of the one launch, zero between calls (its last program resets
    them); one persistent buffer per device, so that CUDA graphs capture a fixed address."""
    buf = _SYNC.get(device)
    if buf is None and device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        # Made inside a capture, its zeros would be written only when the graph replays.
        raise RuntimeError("call the one-launch MoE layer once outside CUDA-graph capture first (its barrier "
                           "counters are allocated and zeroed on the first call)")
    if buf is None:
        buf = _SYNC[device] = torch.zeros(4, dtype=torch.int32, device=device)
    return buf


def resident_programs(regs: int, num_warps: int, shared: int, regs_per_sm: int = 65536, threads_per_sm: int = 2048,
                      shared_per_sm: int = 227 * 1024, programs_per_sm: int = 32) -> int:
    """Programs of a kernel one SM holds at once (registers are given out 256 a warp at a time);
    the defaults are an H100/H200 SM's."""
    regs_a_warp = -(-regs * 32 // 256) * 256
    return min(regs_per_sm // (regs_a_warp * num_warps), threads_per_sm // (32 * num_warps), programs_per_sm,
               shared_per_sm // shared if shared else programs_per_sm)


_RESIDENT: dict = {}


def _check_resident(programs: int, device: torch.device, args: tuple, consts: dict, num_warps: int) -> None:
    """A clear error instead of a hang: more programs than one an SM only when the compiled
    kernel's registers and shared memory let the GPU hold all of them at once (a program not
    resident would never reach the barrier the others wait at)."""
    sms = _device_sms(device)
    if programs <= sms:
        return
    key = (device, num_warps, tuple(sorted(consts.items())))
    if key not in _RESIDENT:
        compiled = moe_layer_kernel.warmup(*args, grid=(programs,), **consts, num_warps=num_warps, num_stages=1)
        compiled._init_handles()  # loads the binary: its register count comes from the driver
        _RESIDENT[key] = (compiled.n_regs, compiled.metadata.shared)
    regs, shared = _RESIDENT[key]
    per_sm = resident_programs(regs, num_warps, shared)
    if programs > per_sm * sms:
        raise ValueError(f"layer_programs={programs} cannot all be resident: the kernel takes {regs} registers a "
                         f"thread and {shared} bytes of shared memory at {num_warps} warps, {per_sm} programs an SM "
                         f"on {sms} SMs ({per_sm * sms} at once); its grid-wide barriers would wait forever")


def layer_programs(cfg: MoELaunchConfig, device: torch.device) -> int:
    """Programs of the one launch: `layer_programs`, else one an SM (INTERPRET_PROGRAMS on CPU)."""
    if cfg.layer_programs:
        return cfg.layer_programs
    if device.type == "cuda" and not INTERPRET:
        return _device_sms(device)
    return INTERPRET_PROGRAMS


def slot_capacity(tokens: int, top_k: int, experts: int) -> int:
    """Slots of a program's scratch row: at least the distinct experts `tokens` tokens can choose."""
    return triton.next_power_of_2(min(triton.next_power_of_2(tokens) * top_k, experts))


def layer_launch(cfg: MoELaunchConfig, *, tokens: int, experts: int, hidden: int, inter: int, i_shared: int,
                 top_k: int, mxfp4: bool, programs: int, topk: dict):
    """The one launch of `moe_layer` as data (grid, constexprs, warps): what it runs, and what
    tests/test_moe_gpu_compile.py builds for sm_90. `topk`: the router's top-k constexprs
    (`triton_routing.topk_consts`). The per-program tiles of the logits, the shared expert's
    gate/up and the down rows follow from the programs' shares; the routed products take the
    config's register-path tiles and prefetch depths."""
    rows = triton.next_power_of_2(tokens)
    if rows > MAX_TOKENS:
        raise ValueError(f"the one-launch MoE layer takes at most {MAX_TOKENS} tokens, got {tokens}")
    if mxfp4 and (cfg.gate_up_block_n % 32 or cfg.gemv_decode != "dp4a"):
        raise ValueError(f"the one-launch MoE layer runs MXFP4 through the dp4a decode, whose activations are "
                         f"split in blocks of 32 columns: needs gemv_decode 'dp4a' and gate_up_block_n a multiple of "
                         f"32, got {cfg.gemv_decode!r} and {cfg.gate_up_block_n}")
    # Per-program tiles of the phases split by programs; at most 64 rows (with few programs a
    # program loops over several blocks instead of holding one huge tile).
    block_e = min(64, triton.next_power_of_2(triton.cdiv(experts, programs)))
    # The logits tile at most 16 fp32 values a thread: the kernel's registers are the most any of
    # its phases needs, and a [4, 4096] tile (128 a thread at 4 warps) set them for every phase.
    logits_k = min(triton.next_power_of_2(hidden), max(32, 16 * 32 * cfg.gate_up_warps // block_e))
    shared_k = cfg.shared_block_k or cfg.gate_up_block_k
    consts = dict(
        ROWS=rows, DP4A=mxfp4, HAS_SHARED=i_shared > 0, **topk, S_PAD=slot_capacity(tokens, top_k, experts),
        BLOCK_E=block_e, LOGITS_BLOCK_K=logits_k,
        BLOCK_N=cfg.gate_up_block_n, BLOCK_K=cfg.gate_up_block_k, GATE_UP_AHEAD=cfg.gate_up_prefetch,
        EVEN_GATE_UP=hidden % cfg.gate_up_block_k == 0 and inter % cfg.gate_up_block_n == 0,
        BLOCK_H=min(cfg.down_block_n, triton.next_power_of_2(triton.cdiv(hidden, programs))),
        DOWN_BLOCK_K=cfg.down_block_k, DOWN_AHEAD=cfg.down_prefetch, EVEN_DOWN=inter % cfg.down_block_k == 0,
        SHARED_BLOCK_N=min(64, triton.next_power_of_2(triton.cdiv(max(i_shared, 1), programs))),
        SHARED_BLOCK_K=shared_k,
        SHARED_PIPELINE=cfg.shared_prefetch, EVEN_SHARED_H=hidden % shared_k == 0,
        EVEN_SHARED_I=i_shared % shared_k == 0, STREAM_STAGES=cfg.gemv_stages, L2_PREFETCH=cfg.l2_prefetch,
        PHASE=0)
    return KernelLaunch((programs, 1), consts, cfg.gate_up_warps, 1)


def check_router(router, experts: int, hidden: int, device: torch.device) -> None:
    """The routing kernels' demands (`check_router_weight`), plus what the one launch reads
    beside them: the router and its correction bias (fp32 [experts], contiguous) on x's device."""
    w, bias = router.weight, router.e_score_correction_bias
    check_router_weight(w, router.config, experts, hidden)
    if w.device != device:
        raise ValueError(f"router weight must be on {device}, with x, got {w.device}")
    if bias is not None and (bias.shape != (experts,) or bias.dtype != torch.float32 or bias.device != device
                             or bias.stride(0) != 1):
        raise ValueError(f"router correction bias must be contiguous fp32 [{experts}] on {device}, got {bias.dtype} "
                         f"{tuple(bias.shape)} strides {bias.stride()} on {bias.device}")
    if not 1 <= router.config.top_k <= experts:
        raise ValueError(f"top_k must be in [1, {experts}], got {router.config.top_k}")


def moe_layer_routed(x: torch.Tensor, router, w_gate_up, w_down, shared: SharedExpert | None = None,
                     config: MoELaunchConfig | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The whole layer for x [T, H], T <= 4, in one launch: (out [T, H] in x's dtype, the routing
    weights fp32 [T, k] and ids int32 [T, k] it chose). `router` has `weight` (fp32 [E, H]),
    `e_score_correction_bias` and `config` (impl.model.layers.Router); routed weights are plain
    tensors or MXFP4Tensor (both of one kind), `shared` a SharedExpert or None."""
    experts, hidden, inter = check_triton_inputs(x, None, None, w_gate_up, w_down, shared)
    m = x.shape[0]
    if not 1 <= m <= MAX_TOKENS:
        raise ValueError(f"the one-launch MoE layer takes 1 to {MAX_TOKENS} tokens, got {m}")
    mxfp4 = isinstance(w_gate_up, MXFP4Tensor)
    if mxfp4 != isinstance(w_down, MXFP4Tensor):
        raise TypeError("gate_up and down weights must both be MXFP4 or both be plain tensors")
    dev = x.device
    check_router(router, experts, hidden, dev)
    top_k = router.config.top_k
    fmt = "mxfp4" if mxfp4 else "bf16"
    cfg = config or lookup(experts, hidden, inter, top_k, m, fmt, dev)
    bias = router.e_score_correction_bias
    topk, scaling = topk_consts(router.config, experts, bias is not None)
    programs = layer_programs(cfg, dev)
    i_shared = shared.gate.shape[0] if shared is not None else 0
    launch = layer_launch(cfg, tokens=m, experts=experts, hidden=hidden, inter=inter, i_shared=i_shared, top_k=top_k,
                          mxfp4=mxfp4, programs=programs, topk=topk)
    rows, s_pad = launch.consts["ROWS"], launch.consts["S_PAD"]
    backends.note("moe", "triton", "moe_layer_kernel", format=fmt, tokens=m, shared=shared is not None, config=cfg,
                  product="gemv-dp4a" if mxfp4 else "gemv-plain", one_launch=True, programs=programs)
    logits = torch.empty(m, experts, dtype=torch.float32, device=dev)
    if mxfp4:
        xq, xs = empty_split(m, hidden, dev)
        act = torch.empty(s_pad, rows, 4, inter // 8, dtype=torch.int32, device=dev)
        act_s = torch.empty(s_pad, rows, inter // 32, dtype=torch.float32, device=dev)
        act_strides = (act.stride(0), act.stride(1), act_s.stride(0))
    else:
        xq = xs = x
        act = act_s = torch.empty(s_pad, rows, inter, dtype=torch.float32, device=dev)
        act_strides = (act.stride(0), act.stride(1), act.stride(0))
    shared_act = torch.empty(rows, max(i_shared, 1), dtype=torch.float32, device=dev)
    r_expert = torch.empty(programs, s_pad, dtype=torch.int32, device=dev)
    r_weight = torch.empty(programs, s_pad, rows, dtype=torch.float32, device=dev)
    r_tokens = torch.empty(programs, s_pad, dtype=torch.int32, device=dev)
    ids = torch.empty(m, top_k, dtype=torch.int32, device=dev)
    weights = torch.empty(m, top_k, dtype=torch.float32, device=dev)
    out = torch.empty(m, hidden, dtype=x.dtype, device=dev)
    w1, w1s, s_w1e, s_w1n, s_s1e, s_s1n = _weight_args(w_gate_up, mxfp4)
    w2, w2s, s_w2e, s_w2n, s_s2e, s_s2n = _weight_args(w_down, mxfp4)
    sg, su, sd = (shared.gate, shared.up, shared.down) if shared is not None else (x, x, x)
    args = (x, x.stride(0), m, hidden, inter, i_shared, experts, top_k, scaling,
            router.weight, router.weight.stride(0), bias if bias is not None else logits, logits, xq, xs,
            w1, w1s, s_w1e, s_w1n, s_s1e, s_s1n, w2, w2s, s_w2e, s_w2n, s_s2e, s_s2n,
            sg, su, sd, sg.stride(0), sd.stride(0), r_expert, r_weight, r_tokens,
            act, act_strides[0], act_strides[1], act_s, act_strides[2], shared_act,
            ids, weights, out, out.stride(0), _sync(dev))
    phases = PHASES if INTERPRET or cfg.layer_launches == 3 else (0,)
    if phases == (0,):
        _check_resident(programs, dev, args, launch.consts, launch.num_warps)
    # Programs run one after another under the interpreter: the phases as launches in order.
    for phase in phases:
        moe_layer_kernel[(programs,)](*args, **dict(launch.consts, PHASE=phase), num_warps=launch.num_warps,
                                      num_stages=1)
    return out, weights, ids


def moe_layer(x: torch.Tensor, router, w_gate_up, w_down, shared: SharedExpert | None = None,
              config: MoELaunchConfig | None = None) -> torch.Tensor:
    """`moe_layer_routed`'s output alone."""
    return moe_layer_routed(x, router, w_gate_up, w_down, shared, config)[0]


def moe_triton_layer(x: torch.Tensor, router, w_gate_up, w_down, shared: SharedExpert | None = None,
                     config: MoELaunchConfig | None = None) -> torch.Tensor:
    """The `triton` backend's whole layer for x [T, H], in chunks of M_PAD tokens, each as its
    launch config says (`config`, else the committed one for the chunk's size): in one launch
    (`one_launch`, at most MAX_TOKENS tokens), else routing (`route_layer`: overlapping
    launches, fused, or the top-k in the expert kernels) and the expert kernels, where with the
    dp4a decode the router's logits kernel also splits x for the experts."""
    from impl.moe.triton_moe import M_PAD, launch_config, moe_experts, split_buffers
    from impl.moe.triton_routing import route_layer
    outs = []
    for i in range(0, x.shape[0], M_PAD):
        chunk = x[i:i + M_PAD]
        cfg = launch_config(chunk, router.config.top_k, w_gate_up, w_down, config)
        if cfg.one_launch and chunk.shape[0] <= MAX_TOKENS:
            outs.append(moe_layer(chunk, router, w_gate_up, w_down, shared, cfg))
            continue
        x_split = split_buffers(chunk, router.config.top_k, w_gate_up, w_down, cfg)
        routing = route_layer(chunk, router, cfg, x_split)
        outs.append(moe_experts(chunk, routing, w_gate_up, w_down, shared, cfg, x_split=x_split))
    return outs[0] if len(outs) == 1 else torch.cat(outs)
