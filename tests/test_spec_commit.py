"""The speculative step's commit as one Triton kernel (impl.speculative.commit.greedy_commit_kernel, run
here by the interpreter on CPU) against the torch ops it replaces on a GPU: the same tokens
written at the same positions, the same accepted count, n and committed row, for every number
of leading matches from none to all k, and for k from 1 to 8."""

from __future__ import annotations

import pytest
import torch

from impl.speculative.commit import commit_greedy
from impl.speculative.decoder import SpecState

CAPACITY = 64
DEVICE = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


def _state(n: int) -> SpecState:
    g = torch.Generator().manual_seed(n)
    tokens = torch.randint(0, 100, (1, CAPACITY), generator=g).to(DEVICE)
    return SpecState(tokens, torch.tensor([n], device=DEVICE), None, torch.tensor([-7], device=DEVICE), prompt_len=5)


@pytest.mark.parametrize("k", [1, 3, 8])
def test_commit_kernel_matches_torch(k):
    n = 20
    pos = n - 1 + torch.arange(k + 1, device=DEVICE)
    g = torch.Generator().manual_seed(k)
    for matches in range(k + 1):
        draft = torch.randint(0, 100, (1, k), generator=g)
        choice = torch.randint(0, 100, (1, k + 1), generator=g)
        choice[0, :matches] = draft[0, :matches]
        if matches < k:
            choice[0, matches] = (draft[0, matches] + 1) % 100  # the first miss
        results = []
        for kernel in (False, True):
            state = _state(n)
            committed = commit_greedy(state, pos, draft.to(DEVICE), choice.to(DEVICE), kernel=kernel)
            results.append((state.tokens, state.n, state.accepted, committed))
        (tok_t, n_t, acc_t, com_t), (tok_k, n_k, acc_k, com_k) = results
        assert int(acc_t) == matches, "the torch reference itself"
        assert int(acc_k) == matches and int(n_k) == n + matches + 1 and torch.equal(n_k, n_t)
        assert torch.equal(com_k, com_t) and torch.equal(tok_k, tok_t)
        assert tok_k[0, n + matches].item() == choice[0, matches].item()  # the target's next token


def test_commit_kernel_rejects_a_batch():
    state = _state(10)
    with pytest.raises(ValueError, match="one contiguous chain"):
        commit_greedy(state, torch.arange(4, device=DEVICE), torch.zeros(2, 3, dtype=torch.long, device=DEVICE),
                      torch.zeros(2, 4, dtype=torch.long, device=DEVICE), kernel=True)
