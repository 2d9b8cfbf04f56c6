"""impl.speculative.assumed: speculation with a stated acceptance profile (for random-weight models,
whose drafts are never accepted). The profile's arithmetic; a profile of 0 reproduces plain greedy
token for token (every step commits the target's own next token); a profile of 1 accepts all k
drafts every step; a stated mean is what the run's accept lengths come out at, within the
binomial error of its steps; and a profile only takes greedy decoding with one value per draft."""

from __future__ import annotations

import math

import pytest
import torch

from impl.generate import SamplingConfig, generate
from impl.model import build_model
from impl.speculative import SpeculativeDecoder
from impl.speculative.assumed import AcceptanceProfile


@pytest.fixture(scope="module")
def model():
    return build_model("tiny", seed=3)


def prompt(seed: int) -> torch.Tensor:
    return torch.randint(0, 128, (10,), generator=torch.Generator().manual_seed(seed))


def test_profile_arithmetic():
    p = AcceptanceProfile.from_mean(3.90, 3)
    assert p.mean_accept_length == pytest.approx(3.90, abs=1e-9)
    assert p.conditional[0] == pytest.approx(0.984, abs=1e-3)
    assert sum(p.distribution()) == pytest.approx(1.0)
    assert AcceptanceProfile((0.5, 0.5)).distribution() == [0.5, 0.25, 0.25]
    with pytest.raises(ValueError, match="lies in \\[1, 4\\]"):
        AcceptanceProfile.from_mean(4.5, 3)
    with pytest.raises(ValueError, match="probabilities in \\[0, 1\\]"):
        AcceptanceProfile((1.2,))


def test_no_acceptance_is_plain_greedy(model):
    p = prompt(0)
    res = SpeculativeDecoder(model, 3, assume=AcceptanceProfile((0.0,) * 3)).generate(p, 30)
    assert torch.equal(res.tokens, generate(model, p, 30).tokens)
    assert set(res.stats.accept_lengths) == {1}


def test_full_acceptance_accepts_every_draft(model):
    res = SpeculativeDecoder(model, 3, assume=AcceptanceProfile((1.0,) * 3)).generate(prompt(1), 40)
    assert set(res.stats.accept_lengths) == {4}


def test_a_stated_mean_is_what_the_run_accepts(model):
    """2.5 at k = 3 (p = 0.69): over n steps the mean's standard error is sd / sqrt(n); 4 of them."""
    profile = AcceptanceProfile.from_mean(2.5, 3)
    dec = SpeculativeDecoder(model, 3, assume=profile)
    torch.manual_seed(0)
    lengths = []
    for seed in range(6):
        lengths += dec.generate(prompt(seed), 120).stats.accept_lengths
    dist = profile.distribution()
    sd = math.sqrt(sum(q * (m + 1 - 2.5) ** 2 for m, q in enumerate(dist)))
    assert abs(sum(lengths) / len(lengths) - 2.5) <= 4 * sd / math.sqrt(len(lengths))
    assert len(set(lengths)) == 4  # every count 0..3 occurs


def test_a_profile_needs_greedy_and_one_value_per_draft(model):
    with pytest.raises(ValueError, match="one probability per draft \\(k=3\\), got 2"):
        SpeculativeDecoder(model, 3, assume=AcceptanceProfile((0.5, 0.5)))
    with pytest.raises(ValueError, match="needs greedy sampling"):
        SpeculativeDecoder(model, 2, SamplingConfig(temperature=1.0), assume=AcceptanceProfile((0.5, 0.5)))
