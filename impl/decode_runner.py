"""The captured-step runner every decode measurement uses: the A/B ladder's serving loop
(impl.serve.engine), the decode and MTP bench suites, and the GPU profiling scripts.

The shape is gpt-fast's: static decode shapes, one captured hot step (impl.graphs.StepGraph: a
CUDA graph replay on a GPU, a plain call on a CPU), no host synchronization in the token loop.
A runner keeps persistent device buffers as long as its capacity and captures its step once
(`capture`); every prompt is then prefilled eagerly into those buffers (`begin`: prompt lengths
differ) and the same step is replayed (`step`), so no prompt captures anything. The decoder steps
are looked up in the backend registry (`decoder:plain`, impl.generate.next_token; `decoder:mtp`,
SpeculativeDecoder.step) when a runner is built, so a planted slowdown (impl.plant) reaches them.

* `PlainRunner`: plain decoding; `held_step(pos)` is its step at one position, replayable without
  limit (the decode bench and the profiling scripts time it).
* `SpecRunner`: speculative decoding (draft k, verify k+1), the normal prefill and then the same
  captured step every time, the first verify step included (below).
* `DraftPrompt`: the draft layer's pass over a prompt, replayed from one graph per length bucket.
* `Reader`: copies of a step's tokens to pinned host memory behind the queued steps.
* `Run`: a fixed number of steps after one prompt, reset untimed, as the bench suites time them.

Speculation without an eager step: the first verify step's draft pass would span the whole prompt
(a shape that changes per prompt). Instead, right after the first token is queued, the draft's
layer runs once over the prompt positions before the last k+1 (writing its KV cache as that pass
would), and the step's span is set to the last k+1 prompt positions with the chain continuing
from the last one: the shape every later step has, so every verify step replays the captured
graph. Prompts shorter than k+1 tokens run their first step eagerly instead. That prompt pass is
itself launch-bound on a small draft (about 2 ms of launches for the embedded model's one layer
on the H200, 40% of its TTFT), so on CUDA it replays one graph per prompt-length bucket.

Sampling: on CUDA the captured steps draw from the device's default generator (CUDA graphs replay
it safely; a private generator would need registering with each graph), which `seed` reseeds; on
a CPU each runner has its own torch.Generator.
"""

from __future__ import annotations

import torch

from impl import backends
from impl.generate import DecodeState, SamplingConfig, decode_step, prefill
from impl.graphs import StepGraph

__all__ = ["DraftPrompt", "PlainRunner", "Reader", "Run", "SpecRunner", "cache_key", "events"]


def events(prov: backends.Provenance) -> set:
    """The (kind, backend, kernel) triples a provenance recorded."""
    return {(e.kind, e.backend, e.kernel) for e in prov.events}


def cache_key(model) -> tuple:
    """What the captured graphs read besides a runner's own buffers: the model's caches, which
    every allocation replaces."""
    return (model.cache_batch_size, model.cache_seq_len, model.cache_generation)


class Reader:
    """Copies small device tensors to the host behind the queued work; `read(src)()` waits for that
    copy only (CUDA: pinned buffers and events) and returns the values as a list. `pending`: the
    most reads waiting at once."""

    def __init__(self, device: torch.device, width: int, pending: int) -> None:
        self.cuda = device.type == "cuda"
        # More slots than reads can be pending at once, so a slot is written again only after its
        # values were read.
        self.slots = pending + 2
        if self.cuda:
            self.buf = torch.empty(self.slots, width, dtype=torch.long, pin_memory=True)
            self.done = [torch.cuda.Event() for _ in range(self.slots)]
            self.i = 0

    def read(self, src: torch.Tensor):
        if not self.cuda:
            values = src.tolist()
            return lambda: values
        slot, n = self.i % self.slots, src.numel()
        self.i += 1
        host = self.buf[slot, :n]
        host.copy_(src, non_blocking=True)
        self.done[slot].record()
        event = self.done[slot]

        def wait() -> list[int]:
            event.synchronize()
            return host.tolist()
        return wait


class _Runner:
    """What both runners share: device, generator, capacity, what the captured step ran."""

    def __init__(self, model, capacity: int) -> None:
        self.model = model
        self.device = model.embed_tokens.weight.device
        self.generator = None if self.device.type == "cuda" else torch.Generator()
        self.capacity = capacity
        self.graph: StepGraph | None = None
        self.graphs = self.device.type == "cuda"  # whether `step` replays a CUDA graph
        # Provenance of the captured step (recorded at capture: a replay runs no Python).
        self.graph_target: set = set()
        self.graph_draft: set = set()
        # Provenance of steps run eagerly since `begin` (a CPU's steps, an eager first step).
        self.target_seen: set = set()
        self.draft_seen: set = set()
        self.t = 0  # the prompt's length

    def seed(self, seed: int) -> None:
        """Reseed what the steps sample from (module docstring: sampling)."""
        if self.generator is not None:
            self.generator.manual_seed(seed)
        else:
            with torch.cuda.device(self.device):
                torch.cuda.manual_seed(seed)


class PlainRunner(_Runner):
    """Persistent buffers and the captured plain decode step. `capacity`: the cache length (default
    the model's context)."""

    per_step = 1  # tokens a step commits, at most
    width = 1  # values a step's read holds

    def __init__(self, model, sampling: SamplingConfig = SamplingConfig(), capacity: int | None = None) -> None:
        super().__init__(model, capacity or model.config.max_seq_len)
        self.sampling = sampling
        self.decode = backends.get("decoder", "plain").fn
        self.steps = 0
        model.setup_caches(1, self.capacity)
        with torch.inference_mode():
            self.state = DecodeState(torch.zeros(1, self.capacity, dtype=torch.long, device=self.device),
                                     torch.zeros(1, dtype=torch.long, device=self.device))

    def _step(self) -> None:
        decode_step(self.model, self.state, self.sampling, self.generator, self.decode)

    def capture(self) -> "PlainRunner":
        """Capture the step (once); its state must then be reset by `begin`."""
        if self.graph is None:
            with torch.inference_mode(), backends.record_provenance() as prov:
                # A valid state to capture from (a one-token prompt); every prompt prefills it again.
                self.begin(torch.zeros(1, dtype=torch.long), self.capacity - 1)
                self.graph = StepGraph(self._step, self.device)
            self.graph_target = events(prov) if self.graphs else set()
        return self

    def max_tokens_for(self, prompt_len: int) -> int:
        return self.capacity - prompt_len

    def begin(self, prompt: torch.Tensor, max_tokens: int) -> torch.Tensor:
        """Prefill `prompt` [T]; the first new token (a device view)."""
        self.t, self.steps = prompt.shape[0], 0
        self.draft_seen, self.target_seen = set(), set()
        prefill(self.model, prompt, self.capacity - self.t, self.sampling, self.generator, state=self.state)
        return self.state.tokens[0, self.t:self.t + 1]

    def after_first(self) -> None:
        """Nothing to prime (SpecRunner.after_first)."""

    def step(self) -> torch.Tensor:
        """One captured step; the token it commits (a device view)."""
        self.graph()
        self.steps += 1
        return self.state.tokens[0, self.t + self.steps:self.t + self.steps + 1]

    def committed(self, values: list[int], lengths: list[int]) -> list[int]:
        """The tokens of a step's read values."""
        return values

    def new_tokens(self) -> torch.Tensor:
        """The tokens committed since `begin` (the prefill's first): one host read."""
        return self.state.tokens[0, self.t:self.t + self.steps + 1].cpu()

    def held_step(self, pos: int):
        """The decode step at position `pos` as a callable replayable without limit: every call reads
        the token slot at `pos` and writes the next token back into it, rewriting the same cache
        entry (its cost is that of any position: attention reads the whole masked static cache).
        The cache holds whatever was written before (a prefill, or nothing when only the time
        matters)."""
        if not 0 <= pos < self.capacity:
            raise ValueError(f"pos must be in [0, {self.capacity}) (the runner's capacity), got {pos}")
        token = self.state.tokens[:, pos:pos + 1]
        at = torch.tensor([pos], device=self.device)

        def step() -> None:
            token.copy_(self.decode(self.model, token, at, self.sampling, self.generator)[:, None])
        return step


class DraftPrompt:
    """The draft layer's pass over prompt positions 0..s-1 (`SpecRunner.after_first`).

    On CUDA a prompt of s <= GRAPHED_PROMPT positions replays the graph of the smallest bucket
    S >= s, a pass over positions 0..S-1 reading persistent buffers whose first s rows hold the
    target's hidden states and tokens; rows past s hold whatever an earlier prompt left. What
    they write into the draft's KV cache at positions s..S-1 is rewritten before any query reads
    it: every later draft pass writes a position before a query at it or later attends to it
    (impl.speculative.decoder's module docstring). Longer prompts run eagerly: compute, not launches,
    dominates there, and a graph per bucket up to the context would hold its activations."""

    GRAPHED_PROMPT = 2048
    SMALLEST_BUCKET = 16

    def __init__(self, model, draft, device: torch.device, capacity: int) -> None:
        self.model, self.draft = model, draft
        self.graphs: dict[int, tuple[StepGraph, set]] = {}
        if device.type != "cuda":
            return
        top = min(capacity, self.GRAPHED_PROMPT)
        buckets, b = [], self.SMALLEST_BUCKET
        while b < top:
            buckets.append(b)
            b *= 2
        buckets.append(top)
        w = model.embed_tokens.weight
        self.hidden = torch.zeros(1, top, model.config.hidden_size, dtype=w.dtype, device=device)
        self.ids = torch.zeros(1, top, dtype=torch.long, device=device)
        self.pos = torch.arange(top, device=device)
        # One memory pool for all buckets (one replays at a time): their intermediates take the
        # largest bucket's memory, not the sum (graph pools held 6.5 GiB in the full-depth
        # Ling-3.0-flash ladder, where Humming's copy of the experts leaves little room).
        pool = torch.cuda.graph_pool_handle()
        for size in buckets:
            with backends.record_provenance() as prov:
                graph = StepGraph(lambda size=size: self._pass(self.hidden, self.ids, size), device, pool)
            self.graphs[size] = (graph, events(prov))

    def _pass(self, hidden: torch.Tensor, ids: torch.Tensor, s: int) -> None:
        # A graphed bucket's positions are persistent; a longer prompt (eager) takes its own.
        pos = self.pos[:s] if self.graphs and s <= self.pos.shape[0] else torch.arange(s, device=hidden.device)
        cos, sin, mask = self.model.positions(s, pos)
        self.draft.hidden(hidden[:, :s], ids[:, :s], cos, sin, pos, mask)

    def __call__(self, hidden: torch.Tensor, ids: torch.Tensor, s: int) -> set:
        """Run the pass over the first `s` positions of `hidden` [1, >=s, H] and `ids` [1, >=s];
        returns the provenance events of what ran (recorded at capture for a replayed graph)."""
        bucket = next((b for b in self.graphs if b >= s), None)
        if bucket is None:
            with backends.record_provenance() as prov:
                self._pass(hidden, ids, s)
            return events(prov)
        graph, seen = self.graphs[bucket]
        self.hidden[:, :s].copy_(hidden[:, :s])
        self.ids[:, :s].copy_(ids[:, :s])
        graph()
        return seen


class SpecRunner(_Runner):
    """Persistent buffers and the captured speculative step (draft k, verify k+1) of `decoder`
    (an impl.speculative.SpeculativeDecoder), at the model's context."""

    def __init__(self, decoder) -> None:
        from impl.speculative import Span, SpecState
        model = decoder.target
        super().__init__(model, model.config.max_seq_len)
        self.decoder, k, d = decoder, decoder.k, self.device
        self.k, self.per_step, self.width = k, k + 1, k + 2
        self.spec_step = backends.get("decoder", "mtp").fn
        self.eager_first = False
        with torch.inference_mode():
            # SpeculativeDecoder.start needs prompt + max_new + k + 1 token slots.
            self.state = SpecState(torch.zeros(1, self.capacity + 1, dtype=torch.long, device=d),
                                   torch.zeros(1, dtype=torch.long, device=d), None,
                                   torch.zeros(1, dtype=torch.long, device=d), 0)
            hidden = torch.zeros(1, k + 1, model.config.hidden_size, dtype=model.embed_tokens.weight.dtype, device=d)
            self.span = Span(hidden, torch.zeros(1, k + 1, dtype=torch.long, device=d),
                             torch.zeros(k + 1, dtype=torch.long, device=d), torch.zeros(1, dtype=torch.long, device=d))
            self.chain_index = torch.tensor([k], device=d)
            self.out = torch.zeros(k + 2, dtype=torch.long, device=d)  # accepted, then the k+1 committed slots
        self.draft_prompt: DraftPrompt | None = None

    def capture(self) -> "SpecRunner":
        """Capture the step and the draft's prompt passes (once); the state must then be reset by `begin`."""
        if self.graph is None:
            model, k = self.model, self.k
            model.setup_caches(1, self.capacity)
            with torch.inference_mode():
                self.draft_prompt = DraftPrompt(model, self.decoder.draft, self.device, self.capacity)
            with torch.inference_mode(), backends.record_provenance() as prov:
                # A valid state to capture from: a prompt of k+2 tokens, room for the capture's steps.
                self.begin(torch.zeros(k + 2, dtype=torch.long), 3 * (k + 1))
                self.after_first()
                self.graph = StepGraph(self._step, self.device)
            self.graph_target = (events(prov) | self.target_seen) if self.graphs else set()
            self.graph_draft = set(self.draft_seen) if self.graphs else set()
        return self

    def max_tokens_for(self, prompt_len: int) -> int:
        return self.capacity - prompt_len - self.k  # the last verify step writes k positions ahead

    def _step(self) -> None:
        dec, state = self.decoder, self.state
        self.spec_step(dec, state, self.generator)
        self.span.copy_(state.span)
        state.span = self.span
        self.out[:1].copy_(state.accepted)
        self.out[1:].copy_(self.span.ids[0])
        # Runs in Python on CPU and while capturing, not on a graph replay.
        self.draft_seen |= events(dec.draft_prov)
        self.target_seen |= events(dec.verify_prov)

    def begin(self, prompt: torch.Tensor, max_tokens: int) -> torch.Tensor:
        """Prefill `prompt` [T]; the first new token (a device view)."""
        self.draft_seen, self.target_seen = set(), set()
        state = self.decoder.start(prompt, max_tokens, self.generator, state=self.state)
        self.t = state.prompt_len
        return state.tokens[0, self.t:self.t + 1]

    def after_first(self) -> None:
        """Prime the draft so that the first verify step has the captured step's span (module
        docstring); prompts shorter than k+1 keep the prompt-wide span for one eager step."""
        state, k, t = self.state, self.k, self.t
        self.eager_first = t < k + 1
        if self.eager_first:
            return
        span, s = state.span, t - k - 1
        if s:
            self.draft_seen |= self.draft_prompt(span.hidden, span.ids, s)
        self.span.hidden.copy_(span.hidden[:, s:])
        self.span.ids.copy_(span.ids[:, s:])
        self.span.pos.copy_(span.pos[s:])
        self.span.index.copy_(self.chain_index)
        state.span = self.span

    def step(self) -> torch.Tensor:
        """One verify step (captured, or eager for a prompt shorter than k+1); a device tensor of
        the accepted count and the k+1 committed slots."""
        if self.eager_first:
            self.eager_first = False
            with torch.inference_mode():
                self._step()
        else:
            self.graph()
        return self.out

    def committed(self, values: list[int], lengths: list[int]) -> list[int]:
        """The tokens of a step's read values; appends its accept length to `lengths`."""
        accepted = values[0]
        lengths.append(accepted + 1)
        return values[1:accepted + 2]

    def new_tokens(self) -> torch.Tensor:
        """The tokens committed since `begin` (the prefill's first): one host read."""
        return self.state.tokens[0, self.t:int(self.state.n)].cpu()

    def parts(self) -> dict[str, StepGraph]:
        """The step's two big parts as separately replayable steps, to explain its cost: the k
        draft passes, and the target's verify pass over k+1 positions. Each rewrites the same
        cache entries and leaves the committed state alone, so replaying them changes nothing.
        Needs a primed state (`begin`, `after_first`)."""
        dec, state = self.decoder, self.state
        with torch.inference_mode():
            draft = dec.draft_tokens(state)[0]
        return {"draft (k passes)": StepGraph(lambda: dec.draft_tokens(state), self.device),
                "verify (k+1 positions)": StepGraph(lambda: dec.verify_pass(state, draft), self.device)}


class Run:
    """`steps` steps of `runner` after `prompt`, the way the bench suites time decoding: `reset()`
    (untimed: the prefill, and for speculation the draft's prompt pass) restores the state the run
    starts from, `run()` replays the steps. Runs of several prompts may share one runner: each
    reads the runner's state, which its own `reset` sets."""

    def __init__(self, runner: PlainRunner | SpecRunner, prompt: torch.Tensor, steps: int) -> None:
        self.runner, self.prompt, self.steps = runner.capture(), prompt, steps
        self.max_tokens = steps * runner.per_step + 1
        room = runner.max_tokens_for(prompt.shape[-1])
        if self.max_tokens > room:
            raise ValueError(f"{steps} steps of up to {runner.per_step} tokens after a prompt of {prompt.shape[-1]} "
                             f"do not fit the runner's capacity of {runner.capacity} ({room} new tokens)")

    def reset(self) -> None:
        with torch.inference_mode():
            self.runner.begin(self.prompt, self.max_tokens)
            self.runner.after_first()

    def run(self, steps: int | None = None) -> None:
        """Replay `steps` (at most the run's length; default all of them) steps."""
        if steps is None:
            steps = self.steps
        if not 0 <= steps <= self.steps:
            raise ValueError(f"steps must be in [0, {self.steps}] (the run's length), got {steps}")
        for _ in range(steps):
            self.runner.step()

    def new_tokens(self) -> torch.Tensor:
        """Every token committed after the prompt: the prefill's, then the replayed steps'."""
        return self.runner.new_tokens()
