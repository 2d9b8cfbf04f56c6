"""The per-request serving loop, batch 1: prefill, then plain decode or MTP verify steps until a
stop string, EOS or the token budget; one record of serving metrics per request.

Steps. Each arm keeps persistent device buffers as large as the model's context and captures its
decode step (plain: `impl.generate.decode_step`; speculative: `SpeculativeDecoder.step`) once, as
a `impl.graphs.StepGraph`: a CUDA graph replay on a GPU, a plain call on a CPU. Every request then
prefills into those buffers (`impl.generate.prefill` / `SpeculativeDecoder.start`, eager: prompt
lengths differ) and replays the same graph, so no request captures anything.

Speculation without an eager step: the first verify step's draft pass would span the whole prompt
(a shape that changes per request). Instead, right after the first token is queued, the draft's
layer runs once over the prompt positions before the last k+1 (writing its KV cache as that pass
would), and the step's span is set to the last k+1 prompt positions with the chain continuing
from the last one: the shape every later step has, so every verify step replays the captured
graph. Prompts shorter than k+1 tokens run their first step eagerly instead. That prompt pass is
itself launch-bound on a small draft (about 2 ms of launches for the embedded model's one layer
on the H200, 40% of its TTFT), so on CUDA it replays one graph per prompt-length bucket
(`_DraftPrompt`).

Host reads and stops. The host must look at tokens to stop (stop strings, EOS), and nowhere else:
a step never syncs. After each step the committed tokens (plain: the new token; speculative:
accepted count and the k+1 committed slots, written by the captured step into a small buffer) are
copied into pinned host memory behind the step, with an event. On CUDA the loop runs one step
ahead (LOOKAHEAD): step i+1 is queued before the host waits for step i's tokens, so the device
never idles while the host decodes text and checks stops; the price is at most one surplus step
per request, whose tokens are discarded and whose time is not part of the request (the device is
drained after the request's end time is taken). A step is queued ahead only while the tokens
committed so far, plus k+1 per step in flight, stay under max_tokens, so nothing is written past
the request's budget and cache. On a CPU every step is synchronous anyway, so the loop checks
after each step with no lookahead and no surplus.

Stops follow vLLM: output_tokens counts the token that ends the request (EOS, or the one that
completes a stop string); `text` excludes EOS and stops before the stop string. Where the request
has `stop_index(text, start)` (impl.data.workloads.Request: it also honours `stop_from`, after
which alone stop strings count, as the arithmetic workload's END after `#### N`), that method
decides where a stop string starts; otherwise the first of `stop` found in the text does. `stop_reason` is
"eos", "stop" or "length" (earliest token wins; at the same token EOS, then stop, then length).

Times: host `time.perf_counter` after a device sync at the request's start; TTFT when the host
holds the first token (prefill included; for a speculative row also the draft layer's pass over
the prompt, queued behind the first token: vLLM and SGLang run their draft's prefill inside the
prefill step too, so their MTP TTFT includes it); latency when the host holds the token that
ends the request. TPOT = (latency - TTFT) / (output_tokens - 1) (None for one token); decode tokens/s =
(output_tokens - 1) / (latency - TTFT).

Sampling, and an assumed-acceptance row's accept lengths (impl.speculative.assumed): each request draws
from its own seed (`request_seed`: the row's seed and the request id), the same in every row, so
a request's accept lengths are the same in every run (drawn from wherever the generator stood,
they had moved a row's mean by up to 1% between runs). On CUDA the captured steps draw from the
device's default generator (CUDA graphs replay it safely; a private generator would need
registering with each graph), which is reseeded per request; on a CPU each arm has its own
torch.Generator.
"""

from __future__ import annotations

import time
import zlib
from collections import deque
from typing import Callable

import torch

from impl import backends
from impl.generate import DecodeState, decode_step, prefill
from impl.graphs import StepGraph
from impl.serve.provenance import RowProvenance, check_provenance, provenance_problems
from impl.serve.result import Acceptance, RowEntry, ServedRequest

__all__ = ["LOOKAHEAD", "EngineRow", "request_seed"]

LOOKAHEAD = 1  # steps queued ahead of the host's stop check, on CUDA (0 on CPU)


def request_seed(seed: int, request_id) -> int:
    """The sampling seed of one request: the same for every row of a ladder, different per request."""
    return zlib.crc32(f"{seed}/{request_id}".encode())


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _events(prov: backends.Provenance) -> set:
    return {(e.kind, e.backend, e.kernel) for e in prov.events}


class _Reader:
    """Copies small device tensors to the host behind the queued work; `read(src)()` waits for that
    copy only (CUDA: pinned buffers and events) and returns the values as a list."""

    def __init__(self, device: torch.device, width: int) -> None:
        self.cuda = device.type == "cuda"
        if self.cuda:
            # More slots than reads can be pending at once (LOOKAHEAD + 1), so a slot is written
            # again only after its values were read.
            self.slots = LOOKAHEAD + 3
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


def _cache_key(model) -> tuple:
    """What the captured graphs read besides the arm's own buffers: the model's caches, which
    every allocation replaces."""
    return (model.cache_batch_size, model.cache_seq_len, model.cache_generation)


class _PlainLoop:
    """Persistent buffers and the captured plain decode step of one arm."""

    per_step = 1  # tokens a step commits, at most

    def __init__(self, arm) -> None:
        model, self.model = arm.model, arm.model
        self.device = arm.device
        self.sampling = arm.config.sampling
        self.generator = None if self.device.type == "cuda" else torch.Generator()
        self.capacity = model.config.max_seq_len
        self.reader = _Reader(self.device, 1)
        with torch.inference_mode():
            self.state = DecodeState(torch.zeros(1, self.capacity, dtype=torch.long, device=self.device),
                                     torch.zeros(1, dtype=torch.long, device=self.device))
        with torch.inference_mode(), backends.record_provenance() as prov:
            # A valid state to capture from (a one-token prompt); every request prefills it again.
            prefill(model, torch.zeros(1, dtype=torch.long), self.capacity - 1, self.sampling, self.generator,
                    state=self.state)
            self.graph = StepGraph(lambda: decode_step(model, self.state, self.sampling, self.generator), self.device)
        self.graphs = self.graph.graph is not None
        self.graph_target = _events(prov) if self.graphs else set()
        self.graph_draft: set = set()
        self.cache_key = _cache_key(model)

    def max_tokens_for(self, prompt_len: int) -> int:
        return self.capacity - prompt_len

    def begin(self, prompt: torch.Tensor, max_tokens: int) -> torch.Tensor:
        self.t, self.steps = prompt.shape[0], 0
        self.draft_seen: set = set()
        self.target_seen: set = set()
        prefill(self.model, prompt, self.capacity - self.t, self.sampling, self.generator, state=self.state)
        return self.state.tokens[0, self.t:self.t + 1]

    def after_first(self) -> None:
        pass

    def step(self) -> torch.Tensor:
        self.graph()
        self.steps += 1
        return self.state.tokens[0, self.t + self.steps:self.t + self.steps + 1]

    def committed(self, values: list[int], lengths: list[int]) -> list[int]:
        return values


class _DraftPrompt:
    """The draft layer's pass over prompt positions 0..s-1 (`_SpecLoop.after_first`).

    On CUDA a prompt of s <= GRAPHED_PROMPT positions replays the graph of the smallest bucket
    S >= s, a pass over positions 0..S-1 reading persistent buffers whose first s rows hold the
    target's hidden states and tokens; rows past s hold whatever an earlier request left. What
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
            self.graphs[size] = (graph, _events(prov))

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
            return _events(prov)
        graph, events = self.graphs[bucket]
        self.hidden[:, :s].copy_(hidden[:, :s])
        self.ids[:, :s].copy_(ids[:, :s])
        graph()
        return events


class _SpecLoop:
    """Persistent buffers and the captured speculative step (draft k, verify k+1) of one arm."""

    def __init__(self, arm) -> None:
        from impl.speculative import Span, SpecState
        model, self.model = arm.model, arm.model
        dec = self.decoder = arm.decoder
        self.device, k = arm.device, dec.k
        self.k, self.per_step = k, k + 1
        self.generator = None if self.device.type == "cuda" else torch.Generator()
        self.capacity = model.config.max_seq_len
        self.reader = _Reader(self.device, k + 2)
        d = self.device
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
        self.draft_seen: set = set()
        self.target_seen: set = set()
        with torch.inference_mode():
            self.draft_prompt = _DraftPrompt(model, dec.draft, d, self.capacity)
        with torch.inference_mode(), backends.record_provenance() as prov:
            # A valid state to capture from: a prompt of k+2 tokens, room for the capture's steps.
            self.begin(torch.zeros(k + 2, dtype=torch.long), 3 * (k + 1))
            self.after_first()
            self.graph = StepGraph(self._step, d)
        self.graphs = self.graph.graph is not None
        self.graph_target = (_events(prov) | self.target_seen) if self.graphs else set()
        self.graph_draft = set(self.draft_seen) if self.graphs else set()
        self.cache_key = _cache_key(model)

    def max_tokens_for(self, prompt_len: int) -> int:
        return self.capacity - prompt_len - self.k  # the last verify step writes k positions ahead

    def _step(self) -> None:
        dec, state = self.decoder, self.state
        dec.step(state, self.generator)
        self.span.copy_(state.span)
        state.span = self.span
        self.out[:1].copy_(state.accepted)
        self.out[1:].copy_(self.span.ids[0])
        # Runs in Python on CPU and while capturing, not on a graph replay.
        self.draft_seen |= _events(dec.draft_prov)
        self.target_seen |= _events(dec.verify_prov)

    def begin(self, prompt: torch.Tensor, max_tokens: int) -> torch.Tensor:
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
        if self.eager_first:
            self.eager_first = False
            self._step()
        else:
            self.graph()
        return self.out

    def committed(self, values: list[int], lengths: list[int]) -> list[int]:
        accepted = values[0]
        lengths.append(accepted + 1)
        return values[1:accepted + 2]


class _Output:
    """The tokens of one request so far, and where it ends (module docstring: stops)."""

    # Characters re-searched before the text already checked: a stop string may straddle the
    # boundary, and a multi-byte character completed by a later token can shift it.
    MARGIN = 8

    def __init__(self, tokenizer, request) -> None:
        self.tok = tokenizer
        self.max_tokens = request.max_tokens
        self.stop = tuple(s for s in (getattr(request, "stop", None) or ()) if s)
        self.stop_from = getattr(request, "stop_from", None)
        self.stop_index = getattr(request, "stop_index", None) or self._stop_index
        self.eos = None if getattr(request, "ignore_eos", False) else tokenizer.eos_id
        self.longest = max((len(s) for s in self.stop), default=0)
        self.ids: list[int] = []
        self.checked = 0  # characters of the text searched for stops without a hit
        self.count = self.reason = self.text = None

    def add(self, new: list[int]) -> bool:
        """Append `new`; True when the request has ended (count, reason and text set)."""
        start = len(self.ids)
        self.ids.extend(new)
        ends = []  # (token count, precedence, reason, text or None)
        if self.eos is not None:
            for i in range(start, len(self.ids)):
                if self.ids[i] == self.eos:
                    ends.append((i + 1, 0, "eos", None))
                    break
        if self.stop:
            limit = ends[0][0] - 1 if ends else len(self.ids)  # EOS is not text
            hit = self._find_stop(start, limit)
            if hit is not None:
                ends.append((hit[0], 1, "stop", hit[1]))
        if len(self.ids) >= self.max_tokens:
            ends.append((self.max_tokens, 2, "length", None))
        if not ends:
            return False
        self.count, _, self.reason, text = min(ends, key=lambda e: e[:2])
        if text is None:  # a tokenizer without text (random-weight presets) gives ids only
            text = (self.tok.decode(self.ids[:self.count - (self.reason == "eos")])
                    if getattr(self.tok, "has_text", True) else "")
        self.text = text
        return True

    def abort(self) -> None:
        """End the request where it stands (its client went away)."""
        self.count, self.reason = len(self.ids), "abort"
        self.text = self.tok.decode(self.ids) if getattr(self.tok, "has_text", True) else ""

    def visible(self) -> str:
        """The text so far less its last characters that may yet become a stop string: what a
        stream may send before the request ends."""
        if not getattr(self.tok, "has_text", True):
            return ""
        text = self.tok.decode(self.ids)  # a whole stop string in it would have ended the request
        return text[:len(text) - self.longest + 1] if self.longest > 1 else text

    def _stop_index(self, text: str, start: int = 0) -> int | None:
        """Where the first stop string starts in `text` (searched from `start`, and from the first
        `stop_from` on when set), or None."""
        if self.stop_from:
            marker = text.find(self.stop_from)
            if marker < 0:
                return None
            start = max(start, marker)
        hits = [i for i in (text.find(s, start) for s in self.stop) if i >= 0]
        return min(hits) if hits else None

    def _find_stop(self, start: int, limit: int):
        """(token count that completes the first stop string, text before it), or None."""
        text = self.tok.decode(self.ids[:limit])
        lo = max(0, self.checked - self.longest - self.MARGIN)
        if self.stop_index(text, lo) is None:
            self.checked = len(text)
            return None
        for count in range(max(start, 1), limit + 1):  # the fewest tokens whose text holds a stop
            prefix = self.tok.decode(self.ids[:count])
            i = self.stop_index(prefix, lo)
            if i is not None:
                return count, prefix[:i]
        raise AssertionError("a stop string found in the whole text but in none of its prefixes")


class EngineRow:
    """An arm served by this engine, as the ladder runner interleaves it (impl.serve.runner): it
    owns what serving the arm builds, its step buffers and captured graphs (built by `prepare` or
    the first request) and the provenance of what ran, so the arm itself stays configuration."""

    def __init__(self, arm) -> None:
        self.arm = arm
        self.name = arm.name
        self._loop = None
        self.provenance: RowProvenance | None = None

    def _ready(self):
        arm, model = self.arm, self.arm.model
        model.setup_caches(1, model.config.max_seq_len)
        loop = self._loop
        if loop is None or loop.cache_key != _cache_key(model):
            # First request, or someone reallocated the model's caches, which the graphs read: capture again.
            self._loop = loop = (_SpecLoop if arm.decoder is not None else _PlainLoop)(arm)
        if self.provenance is None:
            from impl.serve.arm import expert_format
            self.provenance = RowProvenance(arm.name, arm.device.type, expert_format(model), graphs=loop.graphs)
        return loop

    def prepare(self) -> None:
        """Allocate the arm's buffers and capture its step now (the first request does it otherwise)."""
        self.arm.activate()
        self._ready()

    def check(self) -> None:
        """ProvenanceError unless what ran is what the row's name and configuration say."""
        check_provenance(self.name, self.arm.config, self.provenance)

    def release(self) -> None:
        """Let go of the buffers and graphs (a row dropped for want of device memory); its MoE
        backend's converted weights too (`Backend.release`)."""
        self._loop = self.provenance = None
        release = backends.get("moe", self.arm.config.moe).release
        if release is not None:
            release()

    def suspend(self) -> None:
        """Nothing to take down: the arm's model is shared with the other rows and stays loaded."""

    def resume(self) -> None:
        """Nothing to bring back (see suspend)."""

    def entry(self) -> RowEntry:
        """The row as the report shows it (impl.serve.result.RowEntry)."""
        arm, prov, c = self.arm, self.provenance, self.arm.config
        common = {"name": arm.name, "config": c.spec_text(), "speculative": c.speculative, "greedy": c.sampling.greedy,
                  "head": "bf16" if c.head == "bf16" else f"fp8:{c.head_backend}:{c.head_scales}",
                  "assumed": c.assumed_accept is not None, "runs_as": arm.runs_as()}
        if prov is None:
            return RowEntry(**common, provenance_error="the row served no request")
        shown = prov.as_dict()
        shown["draft_shares_head"] = all(prov.draft_head_is_target_head) if prov.speculative else None
        shown["drafts_per_step"] = max(prov.drafts_per_step, default=0)
        return RowEntry(**common, provenance=shown,
                        provenance_error="; ".join(provenance_problems(arm.name, c, prov)) or None)

    def serve(self, request, on_text: Callable[[str], bool] | None = None) -> ServedRequest:
        """Serve `request` (request_id, prompt_ids, max_tokens, stop, ignore_eos) on the arm: what
        came out and how long it took. `on_text(delta)`, if given, receives the text as it is
        committed (what may still turn into a stop string held back), the rest once the request
        ends; its returning False ends the request there ("abort": a streaming client went away),
        its acceptance counting only the verify steps whose text the client was sent."""
        arm = self.arm
        arm.activate()
        loop = self._ready()
        prompt = torch.as_tensor(list(request.prompt_ids), dtype=torch.long)
        t = prompt.shape[0]
        if t < 1:
            raise ValueError(f"request {request.request_id!r}: empty prompt")
        if not isinstance(request.max_tokens, int) or request.max_tokens < 1:
            raise ValueError(f"request {request.request_id!r}: max_tokens must be an int >= 1, got {request.max_tokens!r}")
        room = loop.max_tokens_for(t)
        if request.max_tokens > room:
            extra = f" + k ({loop.k})" if arm.decoder is not None else ""
            raise ValueError(f"request {request.request_id!r}: prompt ({t}) + max_tokens ({request.max_tokens}){extra} "
                             f"exceeds the model's context of {loop.capacity} tokens (at most {room} new tokens fit)")
        sampling = arm.config.sampling
        if not sampling.greedy or (arm.decoder is not None and arm.decoder.assumed is not None):
            seed = request_seed(arm.config.seed, request.request_id)
            if loop.generator is not None:
                loop.generator.manual_seed(seed)
            else:
                with torch.cuda.device(arm.device):
                    torch.cuda.manual_seed(seed)
        spec = arm.decoder is not None
        lengths: list[int] = []  # tokens committed per verify step
        out = _Output(arm.tokenizer, request)
        lookahead = min(LOOKAHEAD, loop.reader.slots - 3) if arm.device.type == "cuda" else 0
        _sync(arm.device)
        with torch.inference_mode(), backends.record_provenance() as prov:
            start = time.perf_counter()
            pending = deque([(True, loop.reader.read(loop.begin(prompt, request.max_tokens)))])
            loop.after_first()
            known = in_flight = sent = delivered = 0  # delivered: verify steps whose text on_text took
            ttft = None
            while True:
                while len(pending) <= lookahead and known + in_flight * loop.per_step < request.max_tokens:
                    pending.append((False, loop.reader.read(loop.step())))
                    in_flight += 1
                first, wait = pending.popleft()
                values = wait()
                if first:
                    ttft = time.perf_counter() - start
                    new = values
                else:
                    in_flight -= 1
                    new = loop.committed(values, lengths)
                known += len(new)
                if out.add(new):
                    break
                if on_text is not None:
                    visible = out.visible()
                    if len(visible) > sent:
                        if on_text(visible[sent:]) is False:
                            # The client went away: the steps since its last text reached it are
                            # not its request's, and their acceptance is not counted.
                            out.abort()
                            del lengths[delivered:]
                            break
                        sent, delivered = len(visible), len(lengths)
            latency = time.perf_counter() - start
        _sync(arm.device)  # a step queued ahead finishes outside the request's time
        if on_text is not None and out.reason != "abort" and len(out.text) > sent:
            on_text(out.text[sent:])
        acceptance = Acceptance.from_lengths(lengths, arm.decoder.k) if spec else None
        target, draft = _events(prov) | loop.target_seen, set(loop.draft_seen)
        steps = acceptance.verify_steps if spec else 0
        if loop.graphs and (steps if spec else out.count > 1):
            target |= loop.graph_target
            draft |= loop.graph_draft
        self.provenance.observe(arm, target, draft, steps)
        n = out.count
        return ServedRequest(arm.name, request.request_id, t, n, ttft, latency, out.text,
                             tuple(out.ids[:n]),  # what the rows' outputs are compared by (the text may decode alike)
                             out.reason, acceptance)
