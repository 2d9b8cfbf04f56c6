"""Top-k selection for the router, as Triton functions the routing kernels and the expert
kernels share: the routing scores (softmax, or sigmoid with the correction bias moving the
choice), group-limited top-k by max reductions over order-preserving int64 keys, and the chosen
experts' weights (renormalized, scaled). Same semantics as `impl.routing` (the oracle).

A decode step (one token) takes `decode_ids`, a short dependent chain; more tokens take
`batch_ids`.
"""

from __future__ import annotations

from impl.triton_env import tl, triton

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
    """Chunks `decode_ids` takes candidates from: the model's groups, else runs of 64 experts (at
    least k_pad each): a chunk's reductions then stay within a warp at the shapes in use."""
    return n_group if n_group > 1 else max(1, e_pad // max(64, k_pad))


@triton.constexpr_function
def _rounds(per_chunk, k_pad, grouped):
    """Candidates a chunk gives: its best k_pad (all of it if smaller), and at least its best two
    when the chunks are the model's groups (a group's score is its two best choices)."""
    rounds = min(k_pad, per_chunk)
    return max(rounds, min(2, per_chunk)) if grouped else rounds


@triton.jit
def decode_ids(logits_ptr, bias_ptr, E, ROUTER: tl.constexpr, HAS_BIAS: tl.constexpr, N_GROUP: tl.constexpr,
                TOPK_GROUP: tl.constexpr, E_PAD: tl.constexpr, K_PAD: tl.constexpr):
    """(scores [1, E_PAD], ids [1, K_PAD]) for one token (a decode step): the routing scores and
    the experts of the K_PAD best choices, best first, among the TOPK_GROUP groups whose two best
    choices sum highest (N_GROUP > 1); the same as `batch_ids` on one row, with a short
    dependent chain.

    `batch_ids` does K_PAD rounds of max reductions over every expert, each a block-wide
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
    logits = tl.load(logits_ptr + offs_e, mask=live, other=float("-inf"))
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
def batch_ids(logits_ptr, bias_ptr, M, E, TOP_K, ROUTER: tl.constexpr, HAS_BIAS: tl.constexpr,
               N_GROUP: tl.constexpr, TOPK_GROUP: tl.constexpr, ROWS: tl.constexpr, E_PAD: tl.constexpr,
               K_PAD: tl.constexpr):
    """(scores [ROWS, E_PAD], ids [ROWS, K_PAD]) for ROWS tokens: as `decode_ids`, by rounds of
    max reductions over every expert (the group's best two, TOPK_GROUP groups, then TOP_K
    experts). On the H200 `decode_ids`' candidates at 4 tokens were 0.66 us faster a layer (11.20
    against 11.86 us), at 16 tokens slower (notes/moe-h200.md); this one serves every M > 1."""
    offs_m = tl.arange(0, ROWS)
    offs_e = tl.arange(0, E_PAD)
    offs_k = tl.arange(0, K_PAD)
    live = (offs_m[:, None] < M) & (offs_e[None, :] < E)
    logits = tl.load(logits_ptr + offs_m[:, None] * E + offs_e[None, :], mask=live, other=float("-inf"))
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
def choice_weights(scores, ids, TOP_K, RENORMALIZE: tl.constexpr, routed_scaling, K_PAD: tl.constexpr):
    """The chosen experts' weights [rows, K_PAD] (0 past TOP_K): their scores without the
    correction bias, gathered from registers, renormalized over the k if asked, then scaled."""
    in_k = tl.arange(0, K_PAD)[None, :] < TOP_K
    weights = tl.where(in_k, tl.gather(scores, ids, axis=1), 0.0)
    if RENORMALIZE:
        weights = weights / (tl.sum(tl.where(in_k, weights, 0.0), axis=1)[:, None] + 1e-20)
    return weights * routed_scaling


@triton.jit
def store_decode_routing(ids, weights, ids_ptr, weights_ptr, slot_expert_ptr, slot_weight_ptr, slot_tokens_ptr,
                         TOP_K, K_PAD: tl.constexpr, M_PAD: tl.constexpr):
    """One token's routing (ids, weights [1, K_PAD]) as ids/weights [1, k] and as slots: its k
    experts are distinct, so slot j is choice j (no grouping), token 0 its only token."""
    offs_k = tl.arange(0, K_PAD)
    in_k = offs_k < TOP_K
    ids = tl.reshape(ids, (K_PAD,))
    weights = tl.reshape(weights, (K_PAD,))
    tl.store(ids_ptr + offs_k, ids, mask=in_k)
    tl.store(weights_ptr + offs_k, weights, mask=in_k)
    tl.store(slot_expert_ptr + offs_k, ids, mask=in_k)
    tl.store(slot_tokens_ptr + offs_k, tl.full((K_PAD,), 1, tl.int32), mask=in_k)
    offs_t = tl.arange(0, M_PAD)
    tl.store(slot_weight_ptr + offs_k[:, None] * M_PAD + offs_t[None, :],
             tl.where(offs_t[None, :] == 0, weights[:, None], 0.0), mask=in_k[:, None])
