"""Verification rules of speculative decoding, on synthetic distributions.

Rejection sampling must leave the committed tokens distributed exactly as the target's
(temperature, top-k and top-p applied alike to both sides). Over N = 200,000 chains drawn at
once on a vocabulary of 8, a chi-square test must not reject at p = 0.001 and the total-variation
distance must stay under TV_BOUND = 0.01: the empirical TV of 200,000 exact draws on 8 outcomes
is about 0.002-0.003, so 0.01 is ~4x the noise, while the negative control (accepting whenever
q > 0, which commits the draft's law) sits at TV(p, q) >= 0.15 by construction.
"""

from __future__ import annotations

import pytest
import torch
from scipy.stats import chisquare

from impl.generate import SamplingConfig, filtered_probs
from impl.speculative import greedy_verify, rejection_verify

N = 200_000
V = 8
K = 3
TV_BOUND = 0.01
P_REJECT = 1e-3


def wrong_rule(p_tok: torch.Tensor, q_tok: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    return q_tok > 0  # "the draft proposed it, so keep it": commits the draft's law


def laws(sampling: SamplingConfig, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Target p [K+1, V] and draft q [K, V] after the same filtering, far apart."""
    g = torch.Generator().manual_seed(seed)
    target_logits = torch.randn(K + 1, V, generator=g) * 1.5
    draft_logits = target_logits[:K] + torch.randn(K, V, generator=g) * 2.0
    p, q = filtered_probs(target_logits, sampling), filtered_probs(draft_logits, sampling)
    assert ((p[:K] - q).abs().sum(-1) / 2 >= 0.15).all(), "the control needs p and q far apart"
    return p, q


def committed(sampling: SamplingConfig, seed: int, rule=None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """N independent chains (context-free laws): (first token [N], second token [N], mask of
    chains whose first draft was accepted, for which the second token is committed this step)."""
    p, q = laws(sampling, seed)
    g = torch.Generator().manual_seed(seed + 1)
    draft = torch.stack([torch.multinomial(q[i], N, replacement=True, generator=g) for i in range(K)], dim=1)
    kwargs = {} if rule is None else {"rule": rule}
    accepted, nxt = rejection_verify(draft, q.expand(N, K, V), p.expand(N, K + 1, V), g, **kwargs)
    assert ((0 <= accepted) & (accepted <= K)).all()
    first = torch.where(accepted >= 1, draft[:, 0], nxt)
    second = torch.where(accepted >= 2, draft[:, 1], nxt)
    return first, second, accepted >= 1


def law_violations(samples: torch.Tensor, law: torch.Tensor) -> list[str]:
    """Why `samples` are not draws from `law` (empty when they pass): a committed token outside
    the law's support, a chi-square rejection at P_REJECT over the allowed outcomes, or a TV
    distance of TV_BOUND or more."""
    counts = torch.bincount(samples, minlength=V).double()
    out = []
    if counts[law == 0].sum() > 0:
        out.append(f"{int(counts[law == 0].sum())} tokens outside the filtered support")
    allowed = law > 0
    expected = law.double()[allowed]
    expected = expected / expected.sum() * counts[allowed].sum()  # fp32 law: renormalize for scipy
    pvalue = chisquare(counts[allowed].numpy(), expected.numpy()).pvalue
    if not pvalue > P_REJECT:
        out.append(f"chi-square p = {pvalue:.3g}")
    tv = 0.5 * (counts / counts.sum() - law.double()).abs().sum().item()
    if not tv < TV_BOUND:
        out.append(f"TV = {tv:.4f}")
    return out


SAMPLINGS = [SamplingConfig(temperature=1.0), SamplingConfig(temperature=0.7),
             SamplingConfig(temperature=1.3, top_k=5), SamplingConfig(temperature=1.0, top_p=0.8),
             SamplingConfig(temperature=0.9, top_k=6, top_p=0.9)]


@pytest.mark.parametrize("sampling", SAMPLINGS, ids=str)
def test_rejection_sampling_keeps_the_target_law(sampling):
    p, _ = laws(sampling, seed=7)
    first, second, both = committed(sampling, seed=7)
    assert law_violations(first, p[0]) == []
    # Given the first draft was kept, the second committed token follows the target's next law.
    assert law_violations(second[both], p[1]) == []


@pytest.mark.parametrize("sampling", SAMPLINGS[:3], ids=str)
def test_negative_control_wrong_rule_is_caught(sampling):
    p, _ = laws(sampling, seed=7)
    first, _, _ = committed(sampling, seed=7, rule=wrong_rule)
    problems = law_violations(first, p[0])
    assert any(v.startswith("chi-square") for v in problems) and any(v.startswith("TV") for v in problems)


def test_identical_laws_accept_everything():
    p = torch.softmax(torch.randn(K + 1, V, generator=torch.Generator().manual_seed(0)), -1)
    draft = torch.multinomial(p[:K], 1000, replacement=True).T
    accepted, _ = rejection_verify(draft, p[:K].expand(1000, K, V), p.expand(1000, K + 1, V))
    assert (accepted == K).all()


def test_greedy_verify_longest_matching_prefix():
    logits = torch.full((4, K + 1, V), -1.0)
    best = torch.tensor([[1, 2, 3, 4], [1, 2, 3, 4], [1, 2, 3, 4], [5, 6, 7, 0]])
    logits.scatter_(2, best[..., None], 1.0)
    draft = torch.tensor([[1, 2, 3], [1, 0, 3], [0, 2, 3], [5, 6, 7]])
    accepted, nxt = greedy_verify(draft, logits)
    assert accepted.tolist() == [3, 1, 0, 3]
    assert nxt.tolist() == [4, 2, 1, 0]
