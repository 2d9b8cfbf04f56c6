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
    at index m, so the draft's cache is rebuilt from the target's hidden states. A target with
    recurrent layers (KDA) cannot roll back by position: `target.keep_verified(m + 1)` sets each
    such layer's state to the one after the first m+1 verified tokens, kept by the verify pass.

`SpeculativeDecoder.step` (draft, verify, accept, commit) keeps every position and count on the
device, so it can be replayed from a CUDA graph (impl.decode_runner.SpecRunner); it is the
registered `decoder:mtp` backend. `generate` reads one number per step back to the host: the
accepted count, which decides when to stop.

Head sharing is a checked contract: the draft must call the very head module the target calls
(`draft.head is target.lm_head`). An FP8 head's weight is e4m3 data plus fp32 scales, only
meaningful through the module: a draft holding a copy, the weight tensor alone, or a module of
another dtype drafts from a different distribution and quietly collapses the accept length.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable

import torch
from torch import nn

from impl import backends
from impl.generate import SamplingConfig, check_prompt, filtered_probs
from impl.speculative.commit import commit, commit_greedy
from impl.speculative.sampling import MAX_K, rejection_verify

if TYPE_CHECKING:
    from impl.speculative.assumed import AcceptanceProfile


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


@dataclass
class Span:
    """What draft step 1 reads: target hidden states [1, t, H] at positions `pos` [t], the committed
    tokens after them `ids` [1, t], and which position's output continues the chain (`index` [1])."""

    hidden: torch.Tensor
    ids: torch.Tensor
    pos: torch.Tensor
    index: torch.Tensor

    def copy_(self, other: "Span") -> None:
        for a, b in ((self.hidden, other.hidden), (self.ids, other.ids), (self.pos, other.pos),
                     (self.index, other.index)):
            a.copy_(b)


@dataclass
class SpecState:
    """One generation's device state; `SpeculativeDecoder.step` updates it in place, without
    reading anything back to the host, so a step can be replayed from a CUDA graph."""

    tokens: torch.Tensor  # [1, capacity]: committed tokens; positions >= n are scratch
    n: torch.Tensor  # [1] int64: tokens committed (prompt included)
    span: Span
    accepted: torch.Tensor  # [1]: drafts accepted by the last verify step
    prompt_len: int


class SpeculativeDecoder:
    """Greedy or sampled speculative decoding of `target` with draft `draft` (default: its first
    MTP layer). `require_shared_head=False` exists only for negative controls that demonstrate
    what a violated head-sharing contract does to the accept length."""

    def __init__(self, target: nn.Module, k: int, sampling: SamplingConfig = SamplingConfig(),
                 draft: nn.Module | None = None, require_shared_head: bool = True,
                 assume: AcceptanceProfile | None = None) -> None:
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
        # impl.speculative.assumed: acceptance drawn from a stated profile instead of judged (greedy only).
        self.assumed = None
        if assume is not None:
            from impl.speculative.assumed import AssumedAcceptance
            if assume.k != k or not sampling.greedy:
                raise ValueError(f"an assumed acceptance profile needs greedy sampling and one probability per "
                                 f"draft (k={k}), got {assume.k} with {sampling}")
            self.assumed = AssumedAcceptance(assume, target.config.vocab_size, target.embed_tokens.weight.device)
        self.draft_prov = self.verify_prov = backends.Provenance()
        self._offsets: dict[torch.device, torch.Tensor] = {}  # -1 .. k-1, one tensor per device

    def _draft_span(self, hidden: torch.Tensor, next_ids: torch.Tensor, pos: torch.Tensor,
                    rope: tuple | None = None, at: torch.Tensor | None = None):
        """MTP over positions `pos` -> (logits [1, t, V], output hidden [1, t, H]); `rope`: their
        `positions` when already looked up; `at` [1]: logits of that span index only ([1, 1, V]).
        """
        cos, sin, mask = rope or self.target.positions(next_ids.shape[1], pos)
        out = self.draft.hidden(hidden, next_ids, cos, sin, pos, mask)
        return self.draft.logits(out if at is None else out.index_select(1, at)), out

    def _verify_positions(self, n: torch.Tensor):
        """Positions n-1 .. n+k-1 of a verify pass and their (cos, sin, mask): looked up once per
        step, for the verify pass and for the chained draft passes (at n-1 .. n+k-3), since every
        lookup is a kernel in a launch-bound step."""
        offsets = self._offsets.get(n.device)
        if offsets is None:
            offsets = self._offsets[n.device] = torch.arange(-1, self.k, device=n.device)
        pos = n + offsets
        return pos, self.target.positions(self.k + 1, pos)

    def _pick(self, logits: torch.Tensor, generator: torch.Generator | None):
        """(token [1], its distribution [1, V] or None when greedy)."""
        if self.sampling.greedy:
            return logits.argmax(-1), None
        q = filtered_probs(logits, self.sampling)
        return torch.multinomial(q, 1, generator=generator).squeeze(1), q

    @torch.inference_mode()
    def start(self, prompt: torch.Tensor, max_new_tokens: int, generator: torch.Generator | None = None,
              state: SpecState | None = None) -> SpecState:
        """Prefill `prompt` ([T] or [1, T]) and pick the first new token. `state`, if given, is
        reused in place (a captured step keeps reading the same buffers) and must be large enough."""
        target, k = self.target, self.k
        prompt = check_prompt(target, prompt, max_new_tokens, reserve=k)  # the last verify writes k ahead
        if prompt.shape[0] != 1:
            raise ValueError(f"speculative decoding runs batch 1, got a prompt of shape {tuple(prompt.shape)}")
        t = prompt.shape[1]
        device = target.embed_tokens.weight.device
        target.setup_caches(1, target.config.max_seq_len)
        capacity = t + max_new_tokens + k + 1
        if state is not None and state.tokens.shape[1] < capacity:
            # A captured step reads the given buffers: replacing them would go unnoticed there.
            raise ValueError(f"the given SpecState holds {state.tokens.shape[1]} token positions, this "
                             f"generation needs {capacity}")
        if state is None:
            state = SpecState(torch.zeros(1, capacity, dtype=torch.long, device=device),
                              torch.zeros(1, dtype=torch.long, device=device), None,
                              torch.zeros(1, dtype=torch.long, device=device), t)
        state.tokens[:, :t] = prompt.to(device)
        state.prompt_len = t
        logits, hidden = target.forward_with_hidden(state.tokens[:, :t], torch.arange(t, device=device),
                                                    last_logits=True)
        state.tokens[:, t] = self._pick(logits[:, -1], generator)[0]
        state.n.fill_(t + 1)
        # Draft step 1 of the first verify step spans the whole prompt.
        state.span = Span(hidden, state.tokens[:, 1:t + 1].clone(), torch.arange(t, device=device),
                          torch.tensor([t - 1], device=device))
        return state

    def draft_tokens(self, state: SpecState, generator: torch.Generator | None = None, verify_at=None):
        """Draft k tokens from the state's span: (draft [1, k], their distributions or Nones).
        `verify_at`: this step's `_verify_positions`, if already looked up."""
        k, span = self.k, state.span
        pos, (cos, sin, mask) = verify_at or self._verify_positions(state.n)
        with backends.record_provenance() as self.draft_prov:
            d_logits, d_hidden = self._draft_span(span.hidden, span.ids, span.pos, at=span.index)
            g = d_hidden.index_select(1, span.index)
            tok, q = self._pick(d_logits[:, 0], generator)
            drafts, qs = [tok], [q]
            for j in range(1, k):  # chained pass j at position n + j - 2, i.e. verify position j - 1
                rope = (cos[j - 1:j], sin[j - 1:j], None if mask is None else mask[j - 1:j])
                d_logits, g = self._draft_span(g, tok[:, None], pos[j - 1:j], rope)
                tok, q = self._pick(d_logits[:, 0], generator)
                drafts.append(tok)
                qs.append(q)
        return torch.stack(drafts, dim=1), qs

    def verify_pass(self, state: SpecState, draft: torch.Tensor, verify_at=None):
        """The target over [last committed token, drafts] at positions n-1 .. n+k-1:
        (positions [k+1], logits [1, k+1, V], pre-norm hidden states [1, k+1, H])."""
        pos, rope = verify_at or self._verify_positions(state.n)
        with backends.record_provenance() as self.verify_prov:
            ids = torch.cat((state.tokens.index_select(1, pos[:1]), draft), dim=1)
            logits, hidden = self.target.forward_with_hidden(ids, pos, rope)
        return pos, logits, hidden

    def step(self, state: SpecState, generator: torch.Generator | None = None) -> None:
        """Draft k tokens, verify them in one target pass, commit the accepted prefix and the next
        token, and leave the verified span for the next step: all on the device, no host sync."""
        verify_at = self._verify_positions(state.n)
        draft, qs = self.draft_tokens(state, generator, verify_at)
        pos, v_logits, v_hidden = self.verify_pass(state, draft, verify_at)
        if self.sampling.greedy:
            choice = v_logits.argmax(dim=-1)
            if self.assumed is not None:
                draft = self.assumed.force(choice, generator)
            committed = commit_greedy(state, pos, draft, choice)
        else:
            accepted, nxt = rejection_verify(draft, torch.stack(qs, dim=1),
                                             filtered_probs(v_logits, self.sampling), generator)
            committed = commit(state, pos, draft, accepted, nxt)
        # Recurrent layers keep the state after the accepted drafts and the token before them.
        self.target.keep_verified(state.accepted + 1)
        # The next draft step 1 spans the verified positions with the committed tokens after them.
        state.span = Span(v_hidden, committed, pos, state.accepted)

    @torch.inference_mode()
    def generate(self, prompt: torch.Tensor, max_new_tokens: int, generator: torch.Generator | None = None,
                 stop: Callable[[torch.Tensor], bool] | None = None) -> SpecResult:
        """Prefill `prompt` ([T] or [1, T]), then decode up to `max_new_tokens` tokens; `stop`, if
        given, is called on the new tokens after each step and ends generation when True (the
        tokens committed by that step are kept). Reads the accepted count back once per step."""
        begin = time.perf_counter()
        state = self.start(prompt, max_new_tokens, generator)
        t = state.prompt_len
        total = t + max_new_tokens
        stats = SpecStats(self.k)
        n = t + 1
        while n < total:
            self.step(state, generator)
            m = int(state.accepted)  # the one host sync per step
            stats.record(m, self.draft_prov, self.verify_prov)
            n += m + 1
            if stop is not None and stop(state.tokens[0, t:min(n, total)]):
                break
        n = min(n, total)
        return SpecResult(state.tokens[:, :n].clone(), t, stats, time.perf_counter() - begin)


backends.register(backends.Backend(
    "decoder", "mtp", SpeculativeDecoder.step, "one MTP speculative step: k draft passes, a verify pass over k+1 "
    "positions, acceptance and commit"))
