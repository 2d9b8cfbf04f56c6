"""Assumed acceptance: speculation's cost measured, its acceptance stated rather than observed.

A model with random weights never accepts a draft, so its speculative rows would only show the
cost of drafting. With an `AcceptanceProfile` the draft and verify passes and the commit all run
as usual, but the drafts are overwritten before the commit by the target's own choices for the
first m positions and a mismatch at m, m drawn on the device from the profile: the greedy commit
then accepts exactly m, commits the target's tokens and moves the caches as after a real step.
Every figure from such a run is labelled "acceptance assumed": its speed follows from the profile,
its tokens are not the model's greedy output (each verify position saw a random draft before it).

A profile gives P(draft j accepted | drafts before it accepted) per position, so P(m = j) =
p_1 ... p_j (1 - p_{j+1}) and the mean accept length (tokens per verify step, bonus included, as
vLLM counts it) is 1 + p_1 + p_1 p_2 + ... ; `from_mean` finds the one constant p that gives a
stated mean (the reference result's 3.90 at k = 3: p = 0.984).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class AcceptanceProfile:
    conditional: tuple[float, ...]  # per draft position, P(accepted | the drafts before it were)

    def __post_init__(self) -> None:
        if not self.conditional or not all(0.0 <= p <= 1.0 for p in self.conditional):
            raise ValueError(f"an acceptance profile needs probabilities in [0, 1] per draft position, "
                             f"got {self.conditional!r}")

    @property
    def k(self) -> int:
        return len(self.conditional)

    def distribution(self) -> list[float]:
        """P(m accepted) for m = 0 .. k."""
        out, reach = [], 1.0
        for p in self.conditional:
            out.append(reach * (1.0 - p))
            reach *= p
        return out + [reach]

    @property
    def mean_accept_length(self) -> float:
        return 1.0 + sum(m * q for m, q in enumerate(self.distribution()))

    @classmethod
    def from_mean(cls, mean: float, k: int) -> "AcceptanceProfile":
        """The constant per-position profile whose mean accept length is `mean` (1 <= mean <= k + 1)."""
        if not 1.0 <= mean <= k + 1:
            raise ValueError(f"a mean accept length with k={k} drafts lies in [1, {k + 1}], got {mean}")
        lo, hi = 0.0, 1.0
        for _ in range(60):  # bisection: the mean grows with p
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if cls((mid,) * k).mean_accept_length < mean else (lo, mid)
        return cls(((lo + hi) / 2,) * k)


class AssumedAcceptance:
    """Draws m per step on the device (no host sync; CUDA-graph safe: an exponential race, as a
    captured sampler draws) and forces the drafts to it."""

    def __init__(self, profile: AcceptanceProfile, vocab_size: int, device: torch.device) -> None:
        self.profile, self.vocab_size = profile, vocab_size
        self.log_probs = torch.tensor(profile.distribution(), dtype=torch.float32, device=device).log()
        self.offsets = torch.arange(profile.k, device=device)
        self.noise = torch.empty_like(self.log_probs)

    def force(self, choice: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
        """Drafts [1, k] for the target's choices `choice` [1, k+1]: its own tokens before m and
        another token from m on (the next id: a real token, since what follows the accepted
        drafts is scratch the next step still embeds), so the greedy commit accepts exactly m."""
        m = (self.log_probs - self.noise.exponential_(generator=generator).log()).argmax()
        own = choice[:, :-1]
        return torch.where(self.offsets < m, own, (own + 1) % self.vocab_size)
