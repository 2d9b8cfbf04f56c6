"""Committing a verified speculative step: the accepted drafts and the next token go into the
token buffer at positions n .. n+k (what lies past the accepted ones is scratch, overwritten by
later steps), the accepted count is recorded and n advances by accepted + 1.

In torch ops that is a dozen small kernels; in a launch-bound speculative step on a GPU they cost
about as much as a tenth of a decode step, so greedy verification and the commit run there as
one Triton kernel (`greedy_commit_kernel`), tested against the torch ops (`commit`) it replaces.
"""

from __future__ import annotations

import torch

from impl.speculative.sampling import greedy_accept
from impl.triton_env import tl, triton


@triton.jit
def greedy_commit_kernel(draft_ptr, choice_ptr, pos_ptr, tokens_ptr, n_ptr, accepted_ptr, committed_ptr, K,
                         K1: tl.constexpr):
    """One program, batch 1: accept drafts while they equal the target's choice, then commit."""
    offs = tl.arange(0, K1)
    in_span = offs < K + 1
    draft = tl.load(draft_ptr + offs, mask=offs < K, other=-1)
    choice = tl.load(choice_ptr + offs, mask=in_span, other=-1)
    # The first position whose draft misses (K when all k match: the bonus position).
    accepted = tl.min(tl.where((draft != choice) | (offs >= K), offs, K1), axis=0)
    nxt = tl.sum(tl.where(offs == accepted, choice, 0), axis=0)
    committed = tl.where(offs == accepted, nxt, tl.where(offs < K, draft, nxt))  # as `commit` writes it
    pos = tl.load(pos_ptr + offs, mask=in_span, other=0)
    tl.store(tokens_ptr + pos + 1, committed, mask=in_span)
    tl.store(committed_ptr + offs, committed, mask=in_span)
    tl.store(accepted_ptr, accepted)
    tl.store(n_ptr, tl.load(n_ptr) + accepted + 1)


def commit(state, pos: torch.Tensor, draft: torch.Tensor, accepted: torch.Tensor,
           nxt: torch.Tensor) -> torch.Tensor:
    """Commit drafts[:accepted] then `nxt` at positions pos + 1 (pos [k+1]: n-1 .. n+k-1) into
    `state` (an impl.speculative.decoder.SpecState); returns the committed row [1, k+1] (past
    `accepted` + 1: scratch)."""
    committed = torch.cat((draft, nxt[:, None]), dim=1).scatter(1, accepted[:, None], nxt[:, None])
    state.tokens.index_copy_(1, pos + 1, committed)
    state.accepted.copy_(accepted)
    state.n += accepted + 1
    return committed


def commit_greedy(state, pos: torch.Tensor, draft: torch.Tensor, choice: torch.Tensor,
                  kernel: bool | None = None) -> torch.Tensor:
    """Greedy verification of `draft` [1, k] against the target's argmax `choice` [1, k+1], then
    `commit`; as one kernel when `kernel` (default: on a CUDA device)."""
    if not (choice.is_cuda if kernel is None else kernel):
        return commit(state, pos, draft, *greedy_accept(draft, choice))
    if draft.shape[0] != 1 or not (state.tokens.is_contiguous() and draft.is_contiguous() and choice.is_contiguous()):
        raise ValueError(f"the commit kernel takes one contiguous chain, got draft {tuple(draft.shape)}")
    k = draft.shape[1]
    committed = torch.empty_like(choice)
    greedy_commit_kernel[(1,)](draft, choice, pos, state.tokens, state.n, state.accepted, committed, k,
                               K1=triton.next_power_of_2(k + 1), num_warps=1)
    return committed
