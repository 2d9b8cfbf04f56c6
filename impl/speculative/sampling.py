"""Verification of a drafted chain: greedy (exact match) and rejection sampling.

Both work on any number of independent chains at once (leading dimension N), so one decode step
(N = 1) and a 100,000-draw distribution test use the same code. Shapes: `draft` [N, k] token
ids; `q` [N, k, V] the draft's distributions the tokens were drawn from; `p` [N, k+1, V] the
target's distributions at the k drafted positions and the bonus position. Returns
(accepted [N] in 0..k, next token [N]): the first `accepted` drafts are kept and `next` follows
them (a correction on rejection, the bonus token when all k were accepted). No host syncs.
"""

from __future__ import annotations

from typing import Callable

import torch

MAX_K = 8
AcceptRule = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def _leading_accepts(ok: torch.Tensor) -> torch.Tensor:
    """Length of the all-True prefix of each row of `ok` [N, k]."""
    return ok.long().cumprod(dim=-1).sum(dim=-1)


def greedy_verify(draft: torch.Tensor, target_logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Accept drafts while they equal the target's argmax; `next` is the argmax after them."""
    return greedy_accept(draft, target_logits.argmax(dim=-1))


def greedy_accept(draft: torch.Tensor, choice: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`greedy_verify` from the target's argmax tokens `choice` [N, k+1]."""
    accepted = _leading_accepts(draft == choice[:, :-1])
    return accepted, choice.gather(1, accepted[:, None]).squeeze(1)


def ratio_rule(p_tok: torch.Tensor, q_tok: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Accept with probability min(1, p/q) (u uniform in [0, 1)): this keeps the target's law."""
    return u * q_tok < p_tok


def rejection_verify(draft: torch.Tensor, q: torch.Tensor, p: torch.Tensor,
                     generator: torch.Generator | None = None,
                     rule: AcceptRule = ratio_rule) -> tuple[torch.Tensor, torch.Tensor]:
    """Speculative sampling (Leviathan et al. 2023 / Chen et al. 2023): keep draft i with
    probability min(1, p_i/q_i); at the first rejection sample from norm(max(0, p - q)); when all
    k are kept, sample the bonus token from the target's last distribution. `rule` exists so a
    test can show that a wrong rule is caught."""
    n, k = draft.shape
    p_tok = p[:, :k].gather(2, draft[..., None]).squeeze(2)
    q_tok = q.gather(2, draft[..., None]).squeeze(2)
    u = torch.rand(n, k, generator=generator, device=p.device)
    accepted = _leading_accepts(rule(p_tok, q_tok, u))
    rows = torch.arange(n, device=p.device)
    p_next = p[rows, accepted]  # [N, V]
    # q at the rejected position; zeros where everything was accepted (then the law is p itself).
    q_pad = torch.cat((q, torch.zeros_like(q[:, :1])), dim=1)
    residual = (p_next - q_pad[rows, accepted]).clamp_min(0)
    mass = residual.sum(-1, keepdim=True)
    # A residual of zero mass happens only when p == q there, and then no rejection can occur:
    # falling back to p keeps the code total without changing the law.
    dist = torch.where(mass > 0, residual / mass.clamp_min(torch.finfo(mass.dtype).tiny), p_next)
    return accepted, torch.multinomial(dist, 1, generator=generator).squeeze(1)
