"""The Triton routing (impl.moe.triton_routing.route_triton) against the oracle routing of
impl.routing, in each launch variant: the default tiles and warps, fewer warps for the top-k or
logits kernels, more K steps, programmatic dependent launches.

Logits are computed by the kernels in fp32 in another summation order than torch's, so the
oracle gets the float64 logits rounded to fp32 (a difference of ~1e-6); examples are fixed seeds
whose k-th and (k+1)-th choices (and group sets) are far from ties, so ids must match exactly,
and the weights (a sigmoid or softmax and a renormalization in fp32) within 1e-5 relative.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from impl.moe.triton_routing import route_triton
from impl.routing import sigmoid_grouped_topk, softmax_topk

DEVICE = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
W_RTOL = 1e-5

CONFIGS = {
    "softmax-e64-k6": SimpleNamespace(router="softmax", num_experts=64, top_k=6, n_group=1, topk_group=1,
                                      norm_topk_prob=True, routed_scaling_factor=1.0),
    "sigmoid-e64-8groups-top4-k8": SimpleNamespace(router="sigmoid_grouped", num_experts=64, top_k=8, n_group=8,
                                                   topk_group=4, norm_topk_prob=True, routed_scaling_factor=2.5),
}
VARIANTS = {
    "two-kernels": {},
    "topk-1-warp": dict(topk_warps=1),
    "logits-1-warp": dict(logits_warps=1),
    "k-tiles-of-32": dict(block_k=32),  # several K steps of the logits loop (the default takes one)
    # Programmatic dependent launches (on a GPU; the interpreter runs launches in order anyway).
    "pdl": dict(pdl=True),
    "pdl-prefetch": dict(pdl=True, prefetch=True),
}


def oracle(x, w, bias, cfg):
    logits = (x.double() @ w.double().T).float()
    if cfg.router == "softmax":
        return softmax_topk(logits, cfg.top_k, cfg.norm_topk_prob)
    return sigmoid_grouped_topk(logits, cfg.top_k, cfg.n_group, cfg.topk_group, bias, cfg.routed_scaling_factor,
                                cfg.norm_topk_prob)


@pytest.mark.parametrize("tokens", [1, 2, 4, 16])
@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("name", list(CONFIGS))
def test_route_triton_variants_match_the_oracle(name, variant, tokens):
    cfg = CONFIGS[name]
    g = torch.Generator().manual_seed(tokens)
    hidden = 96
    x = torch.randn(tokens, hidden, generator=g)
    w = torch.randn(cfg.num_experts, hidden, generator=g) / hidden**0.5
    bias = torch.randn(cfg.num_experts, generator=g) * 0.1 if cfg.router != "softmax" else None
    want_w, want_ids = oracle(x, w, bias, cfg)
    slots, got_w, got_ids = route_triton(x.to(DEVICE), w.to(DEVICE), None if bias is None else bias.to(DEVICE),
                                         cfg, **VARIANTS[variant])
    got_w, got_ids = got_w.cpu(), got_ids.cpu().long()
    for t in range(tokens):
        order_got, order_want = got_ids[t].argsort(), want_ids[t].argsort()
        assert got_ids[t][order_got].tolist() == want_ids[t][order_want].tolist(), f"token {t}"
        torch.testing.assert_close(got_w[t][order_got], want_w[t][order_want], rtol=W_RTOL, atol=0)
    # The slots group the same pairs: each distinct expert once, with its tokens' weights.
    experts = slots.expert.cpu().tolist()
    chosen = sorted(set(want_ids.flatten().tolist()))
    assert sorted(e for e in experts if e >= 0) == chosen
    for s, e in enumerate(experts):
        if e < 0:
            continue
        for t in range(tokens):
            hit = (got_ids[t] == e)
            assert bool((slots.tokens[s].item() >> t) & 1) == bool(hit.any())
            torch.testing.assert_close(slots.weight[s, t].cpu(), got_w[t][hit].sum(), rtol=1e-6, atol=0)


def tie_oracle(choice: torch.Tensor, n_group: int, topk_group: int, top_k: int) -> list[list[int]]:
    """Grouped top-k with exact ties going to the lower group, then the lower expert index (what
    the kernels' keys encode), by stable sorts in Python."""
    out = []
    for row in choice.tolist():
        per = len(row) // n_group
        score = [sum(sorted(row[g * per:(g + 1) * per], reverse=True)[:min(2, per)]) for g in range(n_group)]
        kept = sorted(range(n_group), key=lambda g: (-score[g], g))[:topk_group]
        pool = [e for g in kept for e in range(g * per, (g + 1) * per)]
        out.append(sorted(pool, key=lambda e: (-row[e], e))[:top_k])
    return out


@pytest.mark.parametrize("tokens", [1, 4, 16])
@pytest.mark.parametrize("experts", [64, 512])
def test_route_triton_breaks_exact_ties_by_lower_index(experts, tokens):
    """Exact ties (a zero router, so every logit is 0, and a correction bias of a few repeated
    values, so whole groups and experts tie) go to the lower group and then the lower expert,
    deterministically: at the Ling-3.0-flash shape (512 experts in 8 groups, top 4 groups, top 8)
    and at 64 experts, with the candidates ranked by counting (1 and 4 tokens) and by rounds (16)."""
    cfg = SimpleNamespace(router="sigmoid_grouped", num_experts=experts, top_k=8, n_group=8, topk_group=4,
                          norm_topk_prob=True, routed_scaling_factor=2.5)
    g = torch.Generator().manual_seed(experts + tokens)
    x = torch.randn(tokens, 64, generator=g)
    w = torch.zeros(experts, 64)
    bias = torch.randint(0, 4, (experts,), generator=g).float() / 4  # 0.5 + bias is exact in fp32
    want = tie_oracle((torch.sigmoid(torch.zeros(tokens, experts)) + bias), 8, 4, 8)
    _, got_w, got_ids = route_triton(x.to(DEVICE), w.to(DEVICE), bias.to(DEVICE), cfg)
    assert got_ids.cpu().tolist() == want  # best first, ties by index
    torch.testing.assert_close(got_w.cpu(), torch.full((tokens, 8), 2.5 / 8), rtol=W_RTOL, atol=0)


def test_route_triton_rejects_bad_warps():
    cfg = CONFIGS["softmax-e64-k6"]
    x, w = torch.randn(1, 32, device=DEVICE), torch.randn(64, 32, device=DEVICE)
    with pytest.raises(ValueError, match="topk_warps and logits_warps must be 1, 2, 4 or 8, got 3, 4"):
        route_triton(x, w, None, cfg, topk_warps=3)


def test_route_triton_rejects_prefetch_without_pdl():
    cfg = CONFIGS["softmax-e64-k6"]
    x, w = torch.randn(1, 32, device=DEVICE), torch.randn(64, 32, device=DEVICE)
    with pytest.raises(ValueError, match="prefetch needs pdl"):
        route_triton(x, w, None, cfg, prefetch=True)


@pytest.mark.parametrize("tiles", [dict(block_e=3), dict(block_e=0), dict(block_k=48), dict(block_k=16)])
def test_route_triton_rejects_bad_tiles(tiles):
    cfg = CONFIGS["softmax-e64-k6"]
    x, w = torch.randn(1, 32, device=DEVICE), torch.randn(64, 32, device=DEVICE)
    with pytest.raises(ValueError, match="block_e must be a power of two and block_k a power of two >= 32"):
        route_triton(x, w, None, cfg, **tiles)


@pytest.mark.parametrize("tokens", [1, 3])
def test_router_splits_x_as_the_moe_would(tokens):
    """With `x_split` the logits programs also split x for the dp4a MoE (blocks of 32 columns, a
    program each in turn; here 5 blocks over 32 programs, and over 4 so that one takes two):
    the same planes and scales, bit for bit, as the MoE's own split kernel; the routing itself is
    unchanged."""
    from impl.moe.triton_dp4a import split_int8_kernel
    cfg = CONFIGS["sigmoid-e64-8groups-top4-k8"]
    g = torch.Generator().manual_seed(7)
    hidden = 160
    x = torch.randn(tokens, hidden, generator=g).to(DEVICE)
    w = (torch.randn(cfg.num_experts, hidden, generator=g) / hidden**0.5).to(DEVICE)
    want_q = torch.empty(tokens, 4, hidden // 8, dtype=torch.int32, device=DEVICE)
    want_s = torch.empty(tokens, hidden // 32, dtype=torch.float32, device=DEVICE)
    split_int8_kernel[(tokens, 1)](x, x.stride(0), want_q, want_s, hidden, BLOCK_K=256)
    _, want_w, want_ids = route_triton(x, w, None, cfg)
    for block_e in (2, 16):
        q, s = torch.full_like(want_q, -1), torch.full_like(want_s, float("nan"))
        _, got_w, got_ids = route_triton(x, w, None, cfg, block_e=block_e, x_split=(q, s))
        assert torch.equal(q, want_q) and torch.equal(s, want_s)
        assert torch.equal(got_ids, want_ids) and torch.equal(got_w, want_w)


def test_route_triton_rejects_malformed_split_buffers():
    cfg = CONFIGS["softmax-e64-k6"]
    x, w = torch.randn(2, 64, device=DEVICE), torch.randn(64, 64, device=DEVICE)
    good = (torch.empty(2, 4, 8, dtype=torch.int32, device=DEVICE), torch.empty(2, 2, device=DEVICE))
    route_triton(x, w, None, cfg, x_split=good)
    for bad in [(good[0][:1], good[1]), (good[0].float(), good[1]), (good[0], good[1][:, :1])]:
        with pytest.raises(ValueError, match="x_split must be contiguous int32 planes .* on "):
            route_triton(x, w, None, cfg, x_split=bad)
    x40 = torch.randn(2, 40, device=DEVICE)  # not whole blocks of 32
    with pytest.raises(ValueError, match="x_split needs the hidden size to be a multiple of 32, .* got 40"):
        route_triton(x40, torch.randn(64, 40, device=DEVICE), None, cfg,
                     x_split=(torch.empty(2, 4, 5, dtype=torch.int32, device=DEVICE), torch.empty(2, 1, device=DEVICE)))

