"""Fused routing for decode in two launches (or one: `fused=True`), so that a whole MoE layer
is four kernels (or three):

1. `router_logits_kernel` (expert blocks): logits = x Wr^T in fp32 (exact fp32 products, not
   tf32: a top-k choice flips on tiny differences);
2. `router_topk_kernel` (one program): softmax or sigmoid + correction bias + group-limited
   top-k, renormalization and routed scaling, then the expert slots the MoE kernels consume.

Same semantics as `impl.routing` (the oracle); grouped routing needs a power-of-two number of
groups and of experts per group (every model in the presets), other shapes use the oracle.
"""

from __future__ import annotations

import torch

from impl.moe.triton_dp4a import check_split, store_split_int8
from impl.moe.triton_moe import M_PAD, Slots, write_slots
from impl.moe.triton_pdl import pdl_release, pdl_wait, prefetch_l2, use_pdl
from impl.triton_env import ASM, tl, triton

ROUTER_SOFTMAX, ROUTER_SIGMOID_GROUPED = 0, 1


@triton.jit
def router_logits_kernel(x_ptr, stride_xm, w_ptr, stride_we, logits_ptr, M, E, H, xq_ptr, xs_ptr,
                         ROWS: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_X: tl.constexpr,
                         PDL: tl.constexpr, PREFETCH: tl.constexpr):
    """logits[:, block] = x Wr[block]^T as fp32 multiply-adds (a GEMV per token: no tensor-core
    padding to 16 rows, and no tf32 rounding). Each weight tile is loaded once and met by the
    tokens one at a time, so the tile (and the number of K steps, each a memory round trip) does
    not shrink as tokens are added.
    SPLIT_X: the programs also split x for the MoE's dp4a decode (impl.moe.triton_dp4a), a block
    of 32 columns each in turn, into planes xq_ptr [M, 4, H/8] and scales xs_ptr [M, H/32]: the
    MoE's own split launch is saved.
    PREFETCH (with PDL): the program's router rows are asked for in L2 while x's writer finishes."""
    if PREFETCH:
        e0 = tl.program_id(0) * BLOCK_E
        prefetch_l2(w_ptr + e0 * stride_we, w_ptr + tl.minimum(e0 + BLOCK_E, E) * stride_we, ASM)
    pdl_wait(PDL)  # x's writer
    pdl_release(PDL)
    if SPLIT_X:
        offs_r = tl.arange(0, ROWS)
        for c in range(tl.program_id(0) * 32, H, tl.num_programs(0) * 32):
            offs_c = c + tl.arange(0, 32)
            a = tl.load(x_ptr + offs_r[:, None] * stride_xm + offs_c[None, :], mask=(offs_r < M)[:, None],
                        other=0.0).to(tl.float32)
            store_split_int8(xq_ptr, H // 2, xs_ptr, H // 32, a, offs_r, offs_r < M, c, H, ROWS, 32)
    offs_e = tl.program_id(0) * BLOCK_E + tl.arange(0, BLOCK_E)
    offs_m = tl.arange(0, ROWS)
    acc = tl.zeros((ROWS, BLOCK_E), dtype=tl.float32)
    for k0 in range(0, H, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < H
        w = tl.load(w_ptr + offs_e[:, None] * stride_we + offs_k[None, :],
                    mask=(offs_e[:, None] < E) & k_mask[None, :], other=0.0).to(tl.float32)
        for r in tl.static_range(ROWS):
            x = tl.load(x_ptr + r * stride_xm + offs_k, mask=k_mask & (offs_k * 0 + r < M), other=0.0).to(tl.float32)
            acc += tl.where(offs_m[:, None] == r, tl.sum(w * x[None, :], axis=1)[None, :], 0.0)
    tl.store(logits_ptr + offs_m[:, None] * E + offs_e[None, :], acc,
             mask=(offs_m[:, None] < M) & (offs_e[None, :] < E))


MIN_KEY = tl.constexpr(-(2**63))  # below every key: a chosen or masked entry


@triton.jit
def _order_keys(values, offs, WIDTH: tl.constexpr):
    """fp32 values -> int64 keys ordered as the values, ties going to the lower index (the larger
    key): the value's bits made order-preserving as a signed int in the high word, WIDTH - 1 -
    index in the low word. One max reduction then yields the best value and its index at once
    (instead of a max, then a min over the indices that reach it)."""
    bits = values.to(tl.int32, bitcast=True)
    ordered = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)
    return (ordered.to(tl.int64) << 32) | (WIDTH - 1 - offs).to(tl.int64)


@triton.jit
def _key_value(key):
    ordered = (key >> 32).to(tl.int32)
    return tl.where(ordered < 0, ordered ^ 0x7FFFFFFF, ordered).to(tl.float32, bitcast=True)


@triton.jit
def _key_index(key, WIDTH: tl.constexpr):
    return WIDTH - 1 - (key & 0xFFFFFFFF).to(tl.int32)


@triton.constexpr_function
def _chunks(e_pad, n_group, k_pad):
    """Chunks `_decode_ids` takes candidates from: the model's groups, else runs of 64 experts (at
    least k_pad each): a chunk's reductions then stay within a warp at the shapes in use."""
    return n_group if n_group > 1 else max(1, e_pad // max(64, k_pad))


@triton.constexpr_function
def _rounds(per_chunk, k_pad, grouped):
    """Candidates a chunk gives: its best k_pad (all of it if smaller), and at least its best two
    when the chunks are the model's groups (a group's score is its two best choices)."""
    rounds = min(k_pad, per_chunk)
    return max(rounds, min(2, per_chunk)) if grouped else rounds


@triton.jit
def _decode_ids(logits_ptr, bias_ptr, E, ROUTER: tl.constexpr, HAS_BIAS: tl.constexpr, N_GROUP: tl.constexpr,
                TOPK_GROUP: tl.constexpr, E_PAD: tl.constexpr, K_PAD: tl.constexpr, CACHE: tl.constexpr):
    """(scores [1, E_PAD], ids [1, K_PAD]) for one token (a decode step): the routing scores and
    the experts of the K_PAD best choices, best first, among the TOPK_GROUP groups whose two best
    choices sum highest (N_GROUP > 1); the same as `_batch_ids` on one row, with a short
    dependent chain.

    `_batch_ids` does K_PAD rounds of max reductions over every expert, each a block-wide
    reduction (shuffles, then shared memory and barriers), one after another. Here the logits are
    loaded as [chunks, experts a chunk] (`_chunks`), a chunk's experts in a few threads of one
    warp; each chunk gives its best keys in a few rounds of reductions within the warp, all chunks
    at once; the groups are kept by counting, for each, the groups that score higher; then every
    candidate's rank among the kept ones is counted at once (all pairs compared) and the k first
    are read off by rank. Keys are distinct (the index is in the low word), so ranks are.
    Two-dimensional tensors only: Triton 3.6 on the H200 got some three-dimensional reductions
    over small tiles wrong (a first version, rows x chunks x experts, failed the routing tests
    there at 2 and 4 tokens of 64 experts while the interpreter passed them)."""
    CH: tl.constexpr = _chunks(E_PAD, N_GROUP, K_PAD)
    R: tl.constexpr = _rounds(E_PAD // CH, K_PAD, N_GROUP > 1)
    offs_e = tl.arange(0, CH)[:, None] * (E_PAD // CH) + tl.arange(0, E_PAD // CH)[None, :]
    live = offs_e < E
    logits = tl.load(logits_ptr + offs_e, mask=live, other=float("-inf"), cache_modifier=CACHE)
    if ROUTER == 0:  # softmax over the experts
        exp = tl.exp(logits - tl.max(tl.max(logits, axis=1), axis=0))
        choice = tl.where(live, exp / tl.maximum(tl.sum(tl.sum(exp, axis=1), axis=0), 1e-30), float("-inf"))
        scores = choice
    else:  # sigmoid; the correction bias moves the choice, not the weights
        scores = 1.0 / (1.0 + tl.exp(-logits))
        choice = scores
        if HAS_BIAS:
            choice = choice + tl.load(bias_ptr + offs_e, mask=live, other=0.0)
        choice = tl.where(live, choice, float("-inf"))
    keys = _order_keys(choice, offs_e, E_PAD)
    offs_r = tl.arange(0, R)
    cand = tl.full((CH, R), MIN_KEY, tl.int64)
    group_score = tl.zeros((CH,), dtype=tl.float32)
    for r in tl.static_range(R):
        best = tl.max(keys, axis=1)
        cand = tl.where(offs_r[None, :] == r, best[:, None], cand)
        if r < 2:
            group_score += _key_value(best)
        keys = tl.where(keys == best[:, None], MIN_KEY, keys)
    if N_GROUP > 1:
        group_keys = _order_keys(group_score, tl.arange(0, CH), CH)
        higher = tl.sum((group_keys[None, :] > group_keys[:, None]).to(tl.int32), axis=1)
        cand = tl.where((higher < TOPK_GROUP)[:, None], cand, MIN_KEY)
    flat = tl.reshape(cand, (CH * R,))
    if CH == 1:  # one chunk (few experts, ungrouped): its rounds already gave the K_PAD best in order
        ids = _key_index(flat, E_PAD)
    else:
        rank = tl.sum((flat[None, :] > flat[:, None]).to(tl.int32), axis=1)
        # Past the kept candidates (rank >= their count) ranks may repeat: those ids are never stored.
        offs_k = tl.arange(0, K_PAD)
        ids = tl.max(tl.where(rank[:, None] == offs_k[None, :], _key_index(flat, E_PAD)[:, None], 0), axis=0)
    return tl.reshape(scores, (1, E_PAD)), tl.reshape(ids, (1, K_PAD))


@triton.jit
def _batch_ids(logits_ptr, bias_ptr, M, E, TOP_K, ROUTER: tl.constexpr, HAS_BIAS: tl.constexpr,
               N_GROUP: tl.constexpr, TOPK_GROUP: tl.constexpr, ROWS: tl.constexpr, E_PAD: tl.constexpr,
               K_PAD: tl.constexpr, CACHE: tl.constexpr):
    """(scores [ROWS, E_PAD], ids [ROWS, K_PAD]) for ROWS tokens: as `_decode_ids`, by rounds of
    max reductions over every expert (the group's best two, TOPK_GROUP groups, then TOP_K
    experts). At 4 and 16 tokens `_decode_ids`' candidates were no faster (notes/moe-h200.md)."""
    offs_m = tl.arange(0, ROWS)
    offs_e = tl.arange(0, E_PAD)
    offs_k = tl.arange(0, K_PAD)
    live = (offs_m[:, None] < M) & (offs_e[None, :] < E)
    logits = tl.load(logits_ptr + offs_m[:, None] * E + offs_e[None, :], mask=live, other=float("-inf"),
                     cache_modifier=CACHE)
    if ROUTER == 0:  # softmax over the experts
        row_max = tl.where(offs_m < M, tl.max(logits, axis=1), 0.0)  # padded rows are all -inf
        denom = tl.maximum(tl.sum(tl.exp(logits - row_max[:, None]), axis=1), 1e-30)
        choice = tl.where(live, tl.exp(logits - row_max[:, None]) / denom[:, None], float("-inf"))
        scores = choice
    else:  # sigmoid; the correction bias moves the choice, not the weights
        scores = 1.0 / (1.0 + tl.exp(-logits))
        choice = scores
        if HAS_BIAS:
            choice = choice + tl.load(bias_ptr + offs_e, mask=offs_e < E, other=0.0)[None, :]
        choice = tl.where(live, choice, float("-inf"))
        if N_GROUP > 1:
            PER_GROUP: tl.constexpr = E_PAD // N_GROUP
            keys = tl.reshape(_order_keys(choice, offs_e[None, :], E_PAD), (ROWS, N_GROUP, PER_GROUP))
            top1 = tl.max(keys, axis=2)
            group_score = _key_value(top1)
            if PER_GROUP > 1:  # plus the runner-up: the best after removing the best (one entry)
                group_score += _key_value(tl.max(tl.where(keys == top1[:, :, None], MIN_KEY, keys), axis=2))
            offs_g = tl.arange(0, N_GROUP)
            group_keys = _order_keys(group_score, offs_g[None, :], N_GROUP)
            keep = tl.zeros((ROWS, N_GROUP), dtype=tl.int1)
            for _ in tl.static_range(TOPK_GROUP):
                g_hit = group_keys == tl.max(group_keys, axis=1)[:, None]
                keep = keep | g_hit
                group_keys = tl.where(g_hit, MIN_KEY, group_keys)
            keep_e = tl.reshape(tl.broadcast_to(keep[:, :, None], (ROWS, N_GROUP, PER_GROUP)), (ROWS, E_PAD))
            choice = tl.where(keep_e, choice, float("-inf"))
    # One max reduction a round: the key holds the choice and its index.
    keys = _order_keys(choice, offs_e[None, :], E_PAD)
    ids = tl.zeros((ROWS, K_PAD), dtype=tl.int32)
    for j in range(0, TOP_K):
        best = tl.max(keys, axis=1)
        ids = tl.where(offs_k[None, :] == j, _key_index(best, E_PAD)[:, None], ids)
        keys = tl.where(keys == best[:, None], MIN_KEY, keys)
    return scores, ids


@triton.jit
def router_topk_kernel(logits_ptr, bias_ptr, ids_ptr, weights_ptr,
                       slot_expert_ptr, slot_weight_ptr, slot_tokens_ptr,
                       M, E, TOP_K, num_slots, routed_scaling,
                       ROUTER: tl.constexpr, RENORMALIZE: tl.constexpr, HAS_BIAS: tl.constexpr,
                       N_GROUP: tl.constexpr, TOPK_GROUP: tl.constexpr, ROWS: tl.constexpr,
                       M_PAD: tl.constexpr, E_PAD: tl.constexpr, K_PAD: tl.constexpr, S_PAD: tl.constexpr,
                       PDL: tl.constexpr):
    """One program; tiles of ROWS = next_power_of_2(M) tokens (1 at decode), so a decode step
    does 1/16 of the work of a padded verify step."""
    pdl_wait(PDL)
    pdl_release(PDL)
    _topk_and_slots(logits_ptr, bias_ptr, ids_ptr, weights_ptr, slot_expert_ptr, slot_weight_ptr, slot_tokens_ptr,
                    M, E, TOP_K, num_slots, routed_scaling, ROUTER, RENORMALIZE, HAS_BIAS, N_GROUP, TOPK_GROUP,
                    ROWS, M_PAD, E_PAD, K_PAD, S_PAD, "")


@triton.jit
def router_fused_kernel(x_ptr, stride_xm, w_ptr, stride_we, logits_ptr, counter_ptr, bias_ptr, ids_ptr, weights_ptr,
                        slot_expert_ptr, slot_weight_ptr, slot_tokens_ptr,
                        M, E, H, TOP_K, num_slots, routed_scaling, xq_ptr, xs_ptr,
                        BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_X: tl.constexpr,
                        ROUTER: tl.constexpr, RENORMALIZE: tl.constexpr, HAS_BIAS: tl.constexpr,
                        N_GROUP: tl.constexpr, TOPK_GROUP: tl.constexpr, ROWS: tl.constexpr,
                        M_PAD: tl.constexpr, E_PAD: tl.constexpr, K_PAD: tl.constexpr, S_PAD: tl.constexpr,
                        PDL: tl.constexpr, PREFETCH: tl.constexpr):
    """Both routing steps in one launch: each program computes its experts' logits as
    `router_logits_kernel`; the program that arrives last (an atomic counter, as the MoE's down
    kernel does) reads all logits back past L1 and does `router_topk_kernel`'s work, then resets
    the counter for the next call. Saves a launch per layer."""
    router_logits_kernel(x_ptr, stride_xm, w_ptr, stride_we, logits_ptr, M, E, H, xq_ptr, xs_ptr, ROWS, BLOCK_E,
                         BLOCK_K, SPLIT_X, PDL, PREFETCH)
    tl.debug_barrier()  # every thread's logits are written before the release below
    if tl.atomic_add(counter_ptr, 1, sem="acq_rel", scope="gpu") == tl.num_programs(0) - 1:
        _topk_and_slots(logits_ptr, bias_ptr, ids_ptr, weights_ptr, slot_expert_ptr, slot_weight_ptr,
                        slot_tokens_ptr, M, E, TOP_K, num_slots, routed_scaling, ROUTER, RENORMALIZE, HAS_BIAS,
                        N_GROUP, TOPK_GROUP, ROWS, M_PAD, E_PAD, K_PAD, S_PAD, ".cg")
        tl.store(counter_ptr, 0)


@triton.jit
def _topk_and_slots(logits_ptr, bias_ptr, ids_ptr, weights_ptr, slot_expert_ptr, slot_weight_ptr, slot_tokens_ptr,
                    M, E, TOP_K, num_slots, routed_scaling,
                    ROUTER: tl.constexpr, RENORMALIZE: tl.constexpr, HAS_BIAS: tl.constexpr,
                    N_GROUP: tl.constexpr, TOPK_GROUP: tl.constexpr, ROWS: tl.constexpr,
                    M_PAD: tl.constexpr, E_PAD: tl.constexpr, K_PAD: tl.constexpr, S_PAD: tl.constexpr,
                    CACHE: tl.constexpr):
    """Scores, group-limited top-k, weights and slots from the logits [M, E] (one program)."""
    offs_m = tl.arange(0, ROWS)
    offs_k = tl.arange(0, K_PAD)
    if ROWS == 1:
        scores, ids = _decode_ids(logits_ptr, bias_ptr, E, ROUTER, HAS_BIAS, N_GROUP, TOPK_GROUP, E_PAD, K_PAD, CACHE)
    else:
        scores, ids = _batch_ids(logits_ptr, bias_ptr, M, E, TOP_K, ROUTER, HAS_BIAS, N_GROUP, TOPK_GROUP, ROWS,
                                 E_PAD, K_PAD, CACHE)
    # The chosen experts' scores (without the correction bias), gathered from registers.
    in_k = offs_k[None, :] < TOP_K
    weights = tl.where(in_k, tl.gather(scores, ids, axis=1), 0.0)
    if RENORMALIZE:
        weights = weights / (tl.sum(tl.where(in_k, weights, 0.0), axis=1)[:, None] + 1e-20)
    weights = weights * routed_scaling
    valid = (offs_m[:, None] < M) & in_k
    tl.store(ids_ptr + offs_m[:, None] * TOP_K + offs_k[None, :], ids, mask=valid)
    tl.store(weights_ptr + offs_m[:, None] * TOP_K + offs_k[None, :], weights, mask=valid)
    if ROWS == 1:  # a decode step: its k experts are distinct, so slot j is choice j (no grouping)
        tl.store(slot_expert_ptr + offs_k, tl.reshape(ids, (K_PAD,)), mask=offs_k < TOP_K)
        tl.store(slot_tokens_ptr + offs_k, tl.full((K_PAD,), 1, tl.int32), mask=offs_k < TOP_K)
        offs_t = tl.arange(0, M_PAD)
        tl.store(slot_weight_ptr + offs_k[:, None] * M_PAD + offs_t[None, :],
                 tl.where(offs_t[None, :] == 0, tl.reshape(weights, (K_PAD, 1)), 0.0), mask=(offs_k < TOP_K)[:, None])
    else:
        P: tl.constexpr = ROWS * K_PAD
        write_slots(tl.reshape(ids, (P,)), tl.reshape(weights, (P,)), tl.reshape(valid, (P,)),
                    tl.arange(0, P) // K_PAD, slot_expert_ptr, slot_weight_ptr, slot_tokens_ptr, num_slots,
                    P, S_PAD, M_PAD)


def fused_routing_supported(router_config) -> bool:
    c = router_config
    if c.router == "softmax" or c.n_group == 1:
        return True
    per_group = c.num_experts // c.n_group
    return c.n_group & (c.n_group - 1) == 0 and per_group & (per_group - 1) == 0


def route_triton(x: torch.Tensor, router_weight: torch.Tensor, bias: torch.Tensor | None, config,
                 block_e: int = 2, block_k: int | None = None, fused: bool = False, topk_warps: int = 4,
                 logits_warps: int = 4, x_split: tuple[torch.Tensor, torch.Tensor] | None = None,
                 pdl: bool = False, prefetch: bool = False) -> tuple[Slots, torch.Tensor, torch.Tensor]:
    """Route at most M_PAD tokens x [M, H] with an fp32 router [E, H]; returns the slots and the
    (weights fp32 [M, k], ids int32 [M, k]) they were built from. `fused`: one launch
    (`router_fused_kernel`) instead of two; `topk_warps`: warps of the one-program top-k kernel
    (fewer warps, fewer block-wide barriers in its k rounds of reductions); `logits_warps`: of
    the logits kernel (and of the fused one, top-k included). `x_split` (from
    `triton_moe.split_buffers`): buffers the logits kernel fills with x split for the dp4a MoE.
    `pdl`: programmatic dependent launches (impl/moe/triton_pdl.py), as the MoE's `pdl`; `prefetch`
    (with `pdl`): the logits programs ask for their router rows in L2 while waiting, as the MoE's
    `pdl_prefetch`."""
    m, hidden = x.shape
    experts = router_weight.shape[0]
    if m > M_PAD:
        raise ValueError(f"route_triton takes at most {M_PAD} tokens, got {m}")
    if router_weight.shape != (experts, hidden) or router_weight.dtype != torch.float32:
        raise ValueError(f"router weight must be fp32 [E, {hidden}], got {router_weight.dtype} "
                         f"{tuple(router_weight.shape)}")
    if not fused_routing_supported(config):
        raise ValueError(f"fused routing needs power-of-two groups and experts per group, got "
                         f"{config.num_experts} experts in {config.n_group} groups")
    if prefetch and not pdl:
        raise ValueError("prefetch needs pdl (it prefetches while waiting for the launch before)")
    if topk_warps not in (1, 2, 4, 8) or logits_warps not in (1, 2, 4, 8):
        raise ValueError(f"topk_warps and logits_warps must be 1, 2, 4 or 8, got {topk_warps}, {logits_warps}")
    if block_e < 1 or block_e & (block_e - 1) or (block_k is not None and (block_k < 32 or block_k & (block_k - 1))):
        raise ValueError(f"block_e must be a power of two and block_k a power of two >= 32, got {block_e}, {block_k}")
    top_k = config.top_k
    dev = x.device
    xq = xs = x  # read only when SPLIT_X
    if x_split is not None:
        check_split(x_split, m, hidden, dev)
        xq, xs = x_split
    logits = torch.empty(m, experts, dtype=torch.float32, device=dev)
    rows = triton.next_power_of_2(m)
    # Few experts per program, so that E / block_e programs (256 at E = 512) stream the router
    # weight from many SMs at once (8 programs of 64 experts took 55 us on the H200, run 2 in
    # notes/moe-h200.md; 2 experts a program beat 4 and 8 in run 4); a K tile as long as the row
    # where that fits (<= 4096 columns, <= 8K weights a program), so a program issues its loads
    # in one memory round trip at H <= 4096.
    block_k = block_k or min(triton.next_power_of_2(hidden), max(32, 8192 // block_e))
    slots = Slots.empty(m, top_k, experts, dev)
    ids = torch.empty(m, top_k, dtype=torch.int32, device=dev)
    weights = torch.empty(m, top_k, dtype=torch.float32, device=dev)
    sigmoid = config.router == "sigmoid_grouped"
    e_pad = triton.next_power_of_2(experts)
    if sigmoid and config.n_group > 1 and e_pad != experts:
        raise ValueError(f"grouped routing needs a power-of-two expert count, got {experts}")
    topk_args = (bias if bias is not None else logits, ids, weights, slots.expert, slots.weight, slots.tokens)
    topk_meta = dict(ROUTER=int(sigmoid), RENORMALIZE=bool(config.norm_topk_prob), HAS_BIAS=bias is not None,
                     N_GROUP=config.n_group if sigmoid else 1, TOPK_GROUP=config.topk_group if sigmoid else 1,
                     ROWS=rows, M_PAD=M_PAD, E_PAD=e_pad, K_PAD=triton.next_power_of_2(top_k),
                     S_PAD=triton.next_power_of_2(slots.num_slots), PDL=use_pdl(pdl, dev))
    prefetch = prefetch and topk_meta["PDL"]
    scaling = float(config.routed_scaling_factor if sigmoid else 1.0)
    grid = (triton.cdiv(experts, block_e),)
    if fused:
        router_fused_kernel[grid](
            x, x.stride(0), router_weight, router_weight.stride(0), logits, _counter(dev), *topk_args,
            m, experts, hidden, top_k, slots.num_slots, scaling, xq, xs, BLOCK_E=block_e, BLOCK_K=block_k,
            SPLIT_X=x_split is not None, **topk_meta, PREFETCH=prefetch, num_warps=logits_warps,
            launch_pdl=topk_meta["PDL"])
        return slots, weights, ids
    router_logits_kernel[grid](
        x, x.stride(0), router_weight, router_weight.stride(0), logits, m, experts, hidden, xq, xs,
        ROWS=rows, BLOCK_E=block_e, BLOCK_K=block_k, SPLIT_X=x_split is not None, PDL=topk_meta["PDL"],
        PREFETCH=prefetch, num_warps=logits_warps, launch_pdl=topk_meta["PDL"])
    router_topk_kernel[(1,)](logits, *topk_args, m, experts, top_k, slots.num_slots, scaling, **topk_meta,
                             num_warps=topk_warps, launch_pdl=topk_meta["PDL"])
    return slots, weights, ids


_COUNTERS: dict = {}


def _counter(device: torch.device) -> torch.Tensor:
    """The fused kernel's arrival counter: zero between calls (the last arrival resets it), one
    persistent int32 per device so that CUDA graphs capture a fixed address."""
    buf = _COUNTERS.get(device)
    if buf is None:
        buf = _COUNTERS[device] = torch.zeros(1, dtype=torch.int32, device=device)
    return buf
