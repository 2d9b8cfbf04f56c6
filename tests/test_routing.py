"""Tests for impl.routing against brute-force references written here in plain Python.

The references enumerate instead of vectorize: softmax by math.exp and a Python sort; grouped
routing by trying every combination of `topk_group` groups and keeping the best. They run in
float64 on the same fp32 logits, and every example is checked to be away from a tie (in
float64) before ids are compared exactly.
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from impl.routing import sigmoid_grouped_topk, softmax_topk

# Weights: fp32 (ours) vs float64 (reference) on the same inputs; a handful of fp32 ops, each
# within an ulp or two, so 2e-6 relative is ample while a wrong normalization is off by >= 1e-2.
W_RTOL, W_ATOL = 2e-6, 1e-9
# Examples whose k-th and (k+1)-th candidates (or chosen and next group set) differ by less
# than this in float64 are skipped by `assume`: fp32 rounding could legitimately flip them.
TIE_GAP = 1e-5


def brute_softmax(row: list[float], k: int, renorm: bool) -> tuple[dict[int, float], float]:
    """{expert: weight} and the gap between the k-th and (k+1)-th probability."""
    top = max(row)
    exps = [math.exp(v - top) for v in row]
    total = sum(exps)
    probs = [e / total for e in exps]
    order = sorted(range(len(row)), key=lambda e: probs[e], reverse=True)
    chosen = order[:k]
    gap = probs[order[k - 1]] - probs[order[k]] if k < len(row) else math.inf
    w = [probs[e] for e in chosen]
    if renorm:
        s = sum(w)
        w = [x / s for x in w]
    return dict(zip(chosen, w)), gap


def brute_grouped(row: list[float], k: int, n_group: int, topk_group: int, bias: list[float] | None,
                  scale: float, renorm: bool) -> tuple[dict[int, float], float]:
    """DeepSeek-V3 style routing by enumeration: every set of `topk_group` groups is scored by
    the sum over its groups of each group's (up to) two best biased scores; the best set wins;
    then the k best biased scores inside it; weights are the unbiased sigmoid scores."""
    n = len(row)
    per = n // n_group
    score = [1.0 / (1.0 + math.exp(-v)) for v in row]
    choice = [score[e] + (bias[e] if bias is not None else 0.0) for e in range(n)]
    group_score = [sum(sorted(choice[g * per:(g + 1) * per])[-2:]) for g in range(n_group)]
    sets = sorted(itertools.combinations(range(n_group), topk_group),
                  key=lambda s: sum(group_score[g] for g in s), reverse=True)
    gap = (sum(group_score[g] for g in sets[0]) - sum(group_score[g] for g in sets[1])
           if len(sets) > 1 else math.inf)
    allowed = [e for g in sets[0] for e in range(g * per, (g + 1) * per)]
    order = sorted(allowed, key=lambda e: choice[e], reverse=True)
    chosen = order[:k]
    if k < len(order):
        gap = min(gap, choice[order[k - 1]] - choice[order[k]])
    w = [score[e] for e in chosen]
    if renorm:
        s = sum(w)
        w = [x / s for x in w]
    return {e: x * scale for e, x in zip(chosen, w)}, gap


def as_dict(weights: torch.Tensor, ids: torch.Tensor, row: int) -> dict[int, float]:
    return {int(e): float(w) for e, w in zip(ids[row], weights[row])}


def assert_route_equal(got: dict[int, float], want: dict[int, float]) -> None:
    assert sorted(got) == sorted(want), f"experts {sorted(got)} != reference {sorted(want)}"
    for e in want:
        assert math.isclose(got[e], want[e], rel_tol=W_RTOL, abs_tol=W_ATOL), (e, got[e], want[e])


def rand_logits(seed: int, tokens: int, experts: int, std: float = 2.0) -> torch.Tensor:
    return torch.randn(tokens, experts, generator=torch.Generator().manual_seed(seed)) * std


# --------------------------------------------------------------------------- softmax_topk


@settings(max_examples=max(60, settings.default.max_examples), deadline=None)  # more under the fuzz profile
@given(seed=st.integers(0, 2**31 - 1), tokens=st.integers(1, 8), experts=st.integers(1, 64),
       k_frac=st.floats(0, 1), renorm=st.booleans())
def test_softmax_topk_matches_brute_force(seed, tokens, experts, k_frac, renorm):
    k = 1 + int(k_frac * (experts - 1))
    logits = rand_logits(seed, tokens, experts)
    refs = [brute_softmax(logits[t].double().tolist(), k, renorm) for t in range(tokens)]
    assume(all(gap > TIE_GAP for _, gap in refs))
    weights, ids = softmax_topk(logits, k, renorm)
    assert weights.shape == ids.shape == (tokens, k)
    assert weights.dtype == torch.float32 and ids.dtype == torch.int64
    for t, (want, _) in enumerate(refs):
        assert_route_equal(as_dict(weights, ids, t), want)


def test_softmax_topk_renormalize_on_off():
    logits = rand_logits(1, 16, 32)
    w_on, ids_on = softmax_topk(logits, 4, True)
    w_off, ids_off = softmax_topk(logits, 4, False)
    assert torch.equal(ids_on, ids_off)
    torch.testing.assert_close(w_on.sum(-1), torch.ones(16), rtol=0, atol=1e-6)  # fp32 sum of 4 terms
    # Without renormalization the top-4 of 32 experts hold strictly less than all the mass.
    assert (w_off.sum(-1) < 1 - 1e-3).all()
    torch.testing.assert_close(w_on, w_off / w_off.sum(-1, keepdim=True), rtol=1e-6, atol=0)


def test_softmax_topk_low_precision_logits_give_fp32_weights():
    logits = rand_logits(2, 8, 16).to(torch.bfloat16)
    weights, ids = softmax_topk(logits, 3, True)
    ref_w, ref_ids = softmax_topk(logits.float(), 3, True)
    assert weights.dtype == torch.float32
    assert torch.equal(ids, ref_ids) and torch.equal(weights, ref_w)


def test_softmax_all_experts_is_the_full_distribution():
    logits = rand_logits(3, 5, 6)
    weights, ids = softmax_topk(logits, 6, False)
    full = torch.softmax(logits.double(), -1)
    torch.testing.assert_close(weights.double(), full.gather(1, ids), rtol=W_RTOL, atol=W_ATOL)
    assert torch.equal(ids.sort(-1).values, torch.arange(6).expand(5, 6))


# --------------------------------------------------------------------------- sigmoid_grouped_topk


@st.composite
def grouped_case(draw):
    n_group = draw(st.sampled_from([1, 2, 4, 8]))
    per = draw(st.sampled_from([1, 2, 3, 4, 8]))
    topk_group = draw(st.integers(1, n_group))
    k = draw(st.integers(1, topk_group * per))
    return dict(n_group=n_group, experts=n_group * per, topk_group=topk_group, k=k,
                tokens=draw(st.integers(1, 6)), seed=draw(st.integers(0, 2**31 - 1)),
                use_bias=draw(st.booleans()), scale=draw(st.sampled_from([1.0, 2.5, 0.7])),
                renorm=draw(st.booleans()))


@settings(max_examples=max(80, settings.default.max_examples), deadline=None)
@given(case=grouped_case())
def test_sigmoid_grouped_topk_matches_brute_force(case):
    c = case
    logits = rand_logits(c["seed"], c["tokens"], c["experts"])
    bias = (torch.randn(c["experts"], generator=torch.Generator().manual_seed(c["seed"] + 1)) * 0.3
            if c["use_bias"] else None)
    bias_list = bias.double().tolist() if bias is not None else None
    refs = [brute_grouped(logits[t].double().tolist(), c["k"], c["n_group"], c["topk_group"], bias_list,
                          c["scale"], c["renorm"]) for t in range(c["tokens"])]
    assume(all(gap > TIE_GAP for _, gap in refs))
    weights, ids = sigmoid_grouped_topk(logits, c["k"], c["n_group"], c["topk_group"], bias, c["scale"],
                                        c["renorm"])
    assert weights.shape == ids.shape == (c["tokens"], c["k"])
    assert weights.dtype == torch.float32 and ids.dtype == torch.int64
    for t, (want, _) in enumerate(refs):
        assert_route_equal(as_dict(weights, ids, t), want)


@pytest.mark.parametrize("renorm", [True, False])
def test_routed_scaling_multiplies_weights_only(renorm):
    logits = rand_logits(4, 12, 16)
    bias = torch.randn(16, generator=torch.Generator().manual_seed(5)) * 0.2
    w1, ids1 = sigmoid_grouped_topk(logits, 4, 4, 2, bias, 1.0, renorm)
    w25, ids25 = sigmoid_grouped_topk(logits, 4, 4, 2, bias, 2.5, renorm)
    assert torch.equal(ids1, ids25)
    torch.testing.assert_close(w25, 2.5 * w1, rtol=1e-6, atol=0)  # one fp32 multiply
    if renorm:
        torch.testing.assert_close(w25.sum(-1), torch.full((12,), 2.5), rtol=1e-6, atol=0)
    else:  # raw sigmoid scores of the chosen experts, scaled
        torch.testing.assert_close(w1, torch.sigmoid(logits).gather(1, ids1), rtol=1e-6, atol=0)


@pytest.mark.parametrize("n_group", [2, 4, 8])
def test_one_group_equals_all_groups_kept(n_group):
    logits = rand_logits(6 + n_group, 20, 32)
    bias = torch.randn(32, generator=torch.Generator().manual_seed(n_group)) * 0.3
    w1, ids1 = sigmoid_grouped_topk(logits, 6, 1, 1, bias, 2.5, True)
    wg, idsg = sigmoid_grouped_topk(logits, 6, n_group, n_group, bias, 2.5, True)
    assert torch.equal(ids1.sort(-1).values, idsg.sort(-1).values)
    torch.testing.assert_close(w1.gather(1, ids1.argsort(-1)), wg.gather(1, idsg.argsort(-1)), rtol=0, atol=0)


def test_group_restriction_changes_the_choice():
    """With fewer groups kept the choice must differ for some token (else grouping is a no-op)."""
    logits = rand_logits(9, 32, 32)
    _, all_ids = sigmoid_grouped_topk(logits, 4, 8, 8)
    _, ids = sigmoid_grouped_topk(logits, 4, 8, 2)
    assert not torch.equal(all_ids.sort(-1).values, ids.sort(-1).values)
    # Every chosen expert lies in at most 2 groups of 4.
    assert all(len(set((row // 4).tolist())) <= 2 for row in ids)


def test_bias_shifts_choice_but_not_weights():
    logits = rand_logits(10, 24, 16)
    favoured = 13
    bias = torch.randn(16, generator=torch.Generator().manual_seed(11)) * 0.05
    bias[favoured] = 5.0  # larger than any sigmoid gap: always chosen
    w0, ids0 = sigmoid_grouped_topk(logits, 3, 4, 2, None, 1.0, False)
    w, ids = sigmoid_grouped_topk(logits, 3, 4, 2, bias, 1.0, False)
    assert (ids == favoured).any(-1).all()
    assert not torch.equal(ids0.sort(-1).values, ids.sort(-1).values)
    # The weight of every chosen expert is its unbiased score, never score + bias.
    torch.testing.assert_close(w, torch.sigmoid(logits).gather(1, ids), rtol=1e-6, atol=0)
    assert (w < 1).all()


def test_constant_bias_changes_nothing():
    logits = rand_logits(12, 16, 16)
    w0, ids0 = sigmoid_grouped_topk(logits, 4, 4, 2, None, 2.5, True)
    w, ids = sigmoid_grouped_topk(logits, 4, 4, 2, torch.full((16,), 0.375), 2.5, True)
    assert torch.equal(ids0.sort(-1).values, ids.sort(-1).values)
    torch.testing.assert_close(w.gather(1, ids.argsort(-1)), w0.gather(1, ids0.argsort(-1)), rtol=1e-6, atol=0)


def test_grouped_low_precision_logits_give_fp32_weights():
    logits = rand_logits(14, 8, 16).to(torch.float16)
    bias = torch.randn(16, generator=torch.Generator().manual_seed(15)) * 0.1
    weights, ids = sigmoid_grouped_topk(logits, 4, 4, 2, bias, 2.5)
    ref_w, ref_ids = sigmoid_grouped_topk(logits.float(), 4, 4, 2, bias, 2.5)
    assert weights.dtype == torch.float32
    assert torch.equal(ids, ref_ids) and torch.equal(weights, ref_w)


# --------------------------------------------------------------------------- input errors


@pytest.mark.parametrize("fn", [lambda l, k: softmax_topk(l, k, True), lambda l, k: sigmoid_grouped_topk(l, k)],
                         ids=["softmax", "sigmoid_grouped"])
def test_bad_logits_and_top_k(fn):
    logits = rand_logits(16, 4, 8)
    for bad in (logits[0], logits[None]):
        with pytest.raises(ValueError, match=r"must be \[tokens, experts\]"):
            fn(bad, 2)
    with pytest.raises(TypeError, match="floating point"):
        fn(torch.randint(0, 5, (4, 8)), 2)
    for k in (0, -1, 9):
        with pytest.raises(ValueError, match=rf"top_k must be in \[1, 8\].*got {k}"):
            fn(logits, k)


def test_grouped_bad_bias_shape():
    logits = rand_logits(17, 4, 8)
    for shape in ((7,), (1, 8), (9,)):
        with pytest.raises(ValueError, match=r"bias must have shape \(8,\)"):
            sigmoid_grouped_topk(logits, 2, 2, 1, torch.randn(shape))


@pytest.mark.parametrize("n_group,topk_group", [(3, 1), (5, 2), (2, 0), (2, 3), (4, 5), (0, 1)])
def test_grouped_bad_groups(n_group, topk_group):
    with pytest.raises(ValueError, match=rf"8 experts cannot form {n_group} groups with topk_group={topk_group}"):
        sigmoid_grouped_topk(rand_logits(18, 4, 8), 2, n_group, topk_group)


def test_grouped_top_k_beyond_the_kept_groups():
    """4 groups of 2, keep 1: only 2 experts are eligible, so top_k=3 must be refused rather
    than silently returning an expert from a group that was excluded."""
    with pytest.raises(ValueError, match=r"top_k \(3\) exceeds the 2 experts"):
        sigmoid_grouped_topk(rand_logits(19, 4, 8), 3, 4, 1)
    weights, ids = sigmoid_grouped_topk(rand_logits(19, 4, 8), 2, 4, 1)  # the boundary is allowed
    assert (ids // 2 == ids[:, :1] // 2).all()
