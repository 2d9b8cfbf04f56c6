"""Speculative decoding, batch 1: the model's MTP layer drafts k tokens, the target verifies them
in one forward pass of k+1 positions, and the accepted prefix plus one token is committed.

Positions (n tokens committed; the target's KV cache holds 0..n-2; h_j is the target's pre-norm
last hidden state at j):
  * draft step 1 runs the MTP layer over a span of positions ending at n-2 with the target's
    hidden states and the committed tokens after them; this (re)writes the draft's KV cache with
    true target states and yields draft token n. Steps 2..k chain: one position each, fed the
    draft's own output hidden state and its previous token.
  * verify feeds [x_{n-1}, d_n .. d_{n+k-1}] at positions n-1..n+k-1.
  * after accepting m drafts, n' = n + m + 1. Rolling both caches back is only moving the
    position pointer: entries written past it are overwritten before any query can attend to
    them, because every write at position j precedes every read with a query at j or later.
    The next draft step 1 spans the k+1 verified positions (static shape) and reads its output
    at index m, so the draft's cache is rebuilt from the target's hidden states.

The token loop reads one number per verify step back to the host (the accepted count, which
decides where the next step starts and when to stop); drafting and verifying are sync-free.

Head sharing is a checked contract: the draft must call the very head module the target calls
(`draft.head is target.lm_head`). An FP8 head's weight is e4m3 data plus fp32 scales, only
meaningful through the module: a draft holding a copy, the weight tensor alone, or a module of
another dtype drafts from a different distribution and quietly collapses the accept length.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import nn

from impl import backends
from impl.generate import SamplingConfig, filtered_probs
from impl.spec.sampling import MAX_K, greedy_verify, rejection_verify


class HeadSharingError(ValueError):
    pass


def _describe(head: object) -> str:
    if not isinstance(head, nn.Module):
        return f"a {type(head).__name__} (not a module)"
    params = [*head.parameters(), *head.buffers()]
    dtypes = sorted({str(t.dtype) for t in params})
    return f"{type(head).__name__} object {id(head):#x} ({', '.join(dtypes) or 'no tensors'})"


def _tensors(obj: object) -> list[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, nn.Module):
        return [*obj.parameters(), *obj.buffers()]
    return []


def check_head_sharing(target: nn.Module, draft: nn.Module) -> None:
    """Refuse a draft that does not hold the target's own head module object."""
    head, ours = getattr(draft, "head", None), target.lm_head
    if head is ours:
        return
    shared = {t.data_ptr() for t in _tensors(head)} & {t.data_ptr() for t in _tensors(ours)}
    what = "shares only a weight tensor with it" if shared else "is a different module (a copy?)"
    raise HeadSharingError(
        f"head sharing violated: the draft's head is {_describe(head)}, not the target's head module "
        f"{_describe(ours)}; it {what}. The draft must hold the target's head module itself "
        f"(draft.head is target.lm_head): an FP8 head's e4m3 data is meaningless without its scales "
        f"and its kernel, and any other head drafts from a different distribution")


@dataclass
class SpecStats:
    """Counters over the verify steps of one or more generations."""

    k: int
    steps: int = 0
    drafted: int = 0
    accepted: int = 0
    accept_lengths: list[int] = field(default_factory=list)  # tokens committed per verify step
    reached: list[int] = field(default_factory=list)  # [k] steps whose draft i was judged
    kept: list[int] = field(default_factory=list)  # [k] steps whose draft i was accepted
    draft_head_backends: set[str] = field(default_factory=set)
    verify_head_backends: set[str] = field(default_factory=set)

    def __post_init__(self) -> None:
        self.reached = self.reached or [0] * self.k
        self.kept = self.kept or [0] * self.k

    def merge(self, other: "SpecStats") -> None:
        """Add another generation's counters (same k) to these."""
        if other.k != self.k:
            raise ValueError(f"cannot merge stats of k={other.k} into k={self.k}")
        self.steps += other.steps
        self.drafted += other.drafted
        self.accepted += other.accepted
        self.accept_lengths += other.accept_lengths
        self.reached = [a + b for a, b in zip(self.reached, other.reached)]
        self.kept = [a + b for a, b in zip(self.kept, other.kept)]
        self.draft_head_backends |= other.draft_head_backends
        self.verify_head_backends |= other.verify_head_backends

    def record(self, accepted: int, draft_prov: backends.Provenance, verify_prov: backends.Provenance) -> None:
        self.steps += 1
        self.drafted += self.k
        self.accepted += accepted
        self.accept_lengths.append(accepted + 1)
        for i in range(min(accepted + 1, self.k)):
            self.reached[i] += 1
        for i in range(accepted):
            self.kept[i] += 1
        self.draft_head_backends |= draft_prov.backends("head")
        self.verify_head_backends |= verify_prov.backends("head")

    @property
    def mean_accept_length(self) -> float:
        return sum(self.accept_lengths) / self.steps if self.steps else float("nan")

    @property
    def per_position(self) -> list[float]:
        """P(draft i accepted), over all steps: non-increasing in i by construction."""
        return [c / self.steps if self.steps else float("nan") for c in self.kept]

    @property
    def per_position_conditional(self) -> list[float]:
        """P(draft i accepted | drafts before it accepted)."""
        return [c / r if r else float("nan") for c, r in zip(self.kept, self.reached)]


@dataclass
class SpecResult:
    tokens: torch.Tensor  # [1, prompt + new]
    prompt_len: int
    stats: SpecStats
    seconds: float

    @property
    def new_tokens(self) -> torch.Tensor:
        return self.tokens[:, self.prompt_len:]


class SpeculativeDecoder:
    """Greedy or sampled speculative decoding of `target` with draft `draft` (default: its first
    MTP layer). `require_shared_head=False` exists only for negative controls that demonstrate
    what a violated head-sharing contract does to the accept length."""

    def __init__(self, target: nn.Module, k: int, sampling: SamplingConfig = SamplingConfig(),
                 draft: nn.Module | None = None, require_shared_head: bool = True) -> None:
        if not isinstance(k, int) or not 1 <= k <= MAX_K:
            raise ValueError(f"k (draft tokens per step) must be an int in [1, {MAX_K}], got {k!r}")
        if not isinstance(sampling, SamplingConfig):
            raise TypeError(f"sampling must be a SamplingConfig, got {type(sampling).__name__}")
        if draft is None:
            mtp = getattr(target, "mtp", None)
            if not mtp:
                raise ValueError(f"model {target.config.name!r} has no MTP (NEXTN) layer to draft with: its "
                                 "config has num_mtp_layers=0 or its checkpoint holds no layer with eh_proj; "
                                 "speculative decoding needs one")
            draft = mtp[0]
        if require_shared_head:
            check_head_sharing(target, draft)
        self.target, self.draft, self.k, self.sampling = target, draft, k, sampling

    def _positions(self, t: int, start: torch.Tensor) -> torch.Tensor:
        return start + torch.arange(t, device=start.device)

    def _draft_span(self, hidden: torch.Tensor, next_ids: torch.Tensor, pos: torch.Tensor):
        """MTP over positions `pos` -> (logits [1, t, V], output hidden [1, t, H])."""
        cos, sin, mask = self.target.positions(next_ids.shape[1], pos)
        out = self.draft.hidden(hidden, next_ids, cos, sin, pos, mask)
        return self.draft.logits(out), out

    def _pick(self, logits: torch.Tensor, generator: torch.Generator | None):
        """(token [1], its distribution [1, V] or None when greedy)."""
        if self.sampling.greedy:
            return logits.argmax(-1), None
        q = filtered_probs(logits, self.sampling)
        return torch.multinomial(q, 1, generator=generator).squeeze(1), q

    @torch.inference_mode()
    def generate(self, prompt: torch.Tensor, max_new_tokens: int, generator: torch.Generator | None = None,
                 stop: Callable[[torch.Tensor], bool] | None = None) -> SpecResult:
        """Prefill `prompt` ([T] or [1, T]), then decode up to `max_new_tokens` tokens; `stop`, if
        given, is called on the new tokens after each step and ends generation when True (the
        tokens committed by that step are kept)."""
        target, k = self.target, self.k
        if prompt.dim() == 1:
            prompt = prompt.unsqueeze(0)
        if prompt.dim() != 2 or prompt.shape[0] != 1 or prompt.shape[1] == 0:
            raise ValueError(f"prompt must be a non-empty [T] or [1, T] tensor (batch 1), got {tuple(prompt.shape)}")
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        vocab, cache = target.config.vocab_size, target.config.max_seq_len
        if int(prompt.min()) < 0 or int(prompt.max()) >= vocab:
            raise ValueError(f"prompt token ids must be in [0, {vocab})")
        t = prompt.shape[1]
        # The last verify step may write k positions past the final committed token.
        if t + max_new_tokens + k > cache:
            raise ValueError(f"prompt ({t}) + max_new_tokens ({max_new_tokens}) + k ({k}) = "
                             f"{t + max_new_tokens + k} exceeds the cache length {cache}")
        device = target.embed_tokens.weight.device
        target.setup_caches(1, cache)
        total = t + max_new_tokens
        tokens = torch.zeros(1, total + k + 1, dtype=torch.long, device=device)
        tokens[:, :t] = prompt.to(device)
        stats = SpecStats(k)
        start = time.perf_counter()

        logits, hidden = target.forward_with_hidden(tokens[:, :t], torch.arange(t, device=device))
        tokens[:, t] = self._pick(logits[:, -1], generator)[0]
        n = t + 1
        # Draft step 1 inputs: target hidden states at span_pos and the tokens after them.
        span_hidden, span_ids, span_pos = hidden, tokens[:, 1:t + 1], torch.arange(t, device=device)
        span_index = torch.tensor([t - 1], device=device)
        while n < total:
            with backends.record_provenance() as draft_prov:
                d_logits, d_hidden = self._draft_span(span_hidden, span_ids, span_pos)
                g = d_hidden.index_select(1, span_index)
                tok, q = self._pick(d_logits.index_select(1, span_index)[:, 0], generator)
                drafts, qs = [tok], [q]
                for j in range(1, k):
                    d_logits, g = self._draft_span(g, tok[:, None], torch.tensor([n - 2 + j], device=device))
                    tok, q = self._pick(d_logits[:, 0], generator)
                    drafts.append(tok)
                    qs.append(q)
            draft = torch.stack(drafts, dim=1)  # [1, k]
            with backends.record_provenance() as verify_prov:
                verify_ids = torch.cat((tokens[:, n - 1:n], draft), dim=1)
                verify_pos = torch.arange(n - 1, n + k, device=device)
                v_logits, v_hidden = target.forward_with_hidden(verify_ids, verify_pos)
            if self.sampling.greedy:
                accepted, nxt = greedy_verify(draft, v_logits)
            else:
                accepted, nxt = rejection_verify(draft, torch.stack(qs, dim=1),
                                                 filtered_probs(v_logits, self.sampling), generator)
            m = int(accepted)  # the one host sync per step
            tokens[:, n:n + m] = draft[:, :m]
            tokens[:, n + m] = nxt
            stats.record(m, draft_prov, verify_prov)
            # Next draft step 1 spans the verified positions with the committed tokens after them.
            span_hidden, span_pos = v_hidden, verify_pos
            span_ids = torch.cat((draft, nxt[:, None]), dim=1)
            span_ids[:, m] = nxt
            span_index = torch.tensor([m], device=device)
            n += m + 1
            if stop is not None and stop(tokens[0, t:min(n, total)]):
                break
        n = min(n, total)
        return SpecResult(tokens[:, :n].clone(), t, stats, time.perf_counter() - start)
