"""The per-request serving loop, batch 1: prefill, then plain decode or MTP verify steps until a
stop string, EOS or the token budget; one record of serving metrics per request.

Steps: each row runs its own runner (impl.decode_runner: persistent buffers as large as the
model's context, the decode step captured once, every request prefilled into those buffers and
replaying the same graph, a speculative row's first verify step included), so no request
captures anything.

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
they had moved a row's mean by up to 1% between runs); the runner reseeds what its steps draw
from (impl.decode_runner's module docstring: sampling).
"""

from __future__ import annotations

import time
import zlib
from collections import deque
from typing import Callable

import torch

from impl import backends
from impl.decode_runner import PlainRunner, Reader, SpecRunner, cache_key, events
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
    """A row served by this engine, as the ladder runner interleaves it (impl.serve.ladder): it
    owns what serving the row builds, its step buffers and captured graphs (built by `prepare` or
    the first request) and the provenance of what ran, so the row itself stays configuration."""

    def __init__(self, built) -> None:
        self.built = built
        self.name = built.name
        self._runner = self._reader = self._cache_key = None
        self.provenance: RowProvenance | None = None

    def _ready(self):
        built, model = self.built, self.built.model
        model.setup_caches(1, model.config.max_seq_len)
        runner = self._runner
        if runner is None or self._cache_key != cache_key(model):
            # First request, or someone reallocated the model's caches, which the graphs read: capture again.
            self._runner = runner = (SpecRunner(built.decoder) if built.decoder is not None
                                     else PlainRunner(model, built.config.sampling)).capture()
            # Reads pending at once: the steps queued ahead and the one waited for.
            self._reader = Reader(built.device, runner.width, LOOKAHEAD + 1)
            self._cache_key = cache_key(model)
        if self.provenance is None:
            from impl.serve.built_row import expert_format
            self.provenance = RowProvenance(built.name, built.device.type, expert_format(model), graphs=runner.graphs)
        return runner

    def prepare(self) -> None:
        """Allocate the row's buffers and capture its step now (the first request does it otherwise)."""
        self.built.activate()
        self._ready()

    def check(self) -> None:
        """ProvenanceError unless what ran is what the row's name and configuration say."""
        check_provenance(self.name, self.built.config, self.provenance)

    def release(self) -> None:
        """Let go of the buffers and graphs (a row dropped for want of device memory); its MoE
        backend's converted weights too (`Backend.release`)."""
        self._runner = self._reader = self._cache_key = self.provenance = None
        release = backends.get("moe", self.built.config.moe).release
        if release is not None:
            release()

    def suspend(self) -> None:
        """Nothing to take down: the row's model is shared with the other rows and stays loaded."""

    def resume(self) -> None:
        """Nothing to bring back (see suspend)."""

    def entry(self) -> RowEntry:
        """The row as the report shows it (impl.serve.result.RowEntry)."""
        built, prov, c = self.built, self.provenance, self.built.config
        common = {"name": built.name, "config": c.spec_text(), "speculative": c.speculative, "greedy": c.sampling.greedy,
                  "head": "bf16" if c.head == "bf16" else f"fp8:{c.head_backend}:{c.head_scales}",
                  "assumed": c.assumed_accept is not None, "runs_as": built.runs_as()}
        if prov is None:
            return RowEntry(**common, provenance_error="the row served no request")
        shown = prov.as_dict()
        shown["draft_shares_head"] = all(prov.draft_head_is_target_head) if prov.speculative else None
        shown["drafts_per_step"] = max(prov.drafts_per_step, default=0)
        return RowEntry(**common, provenance=shown,
                        provenance_error="; ".join(provenance_problems(built.name, c, prov)) or None)

    def serve(self, request, on_text: Callable[[str], bool] | None = None) -> ServedRequest:
        """Serve `request` (request_id, prompt_ids, max_tokens, stop, ignore_eos) on the row: what
        came out and how long it took. `on_text(delta)`, if given, receives the text as it is
        committed (what may still turn into a stop string held back), the rest once the request
        ends; its returning False ends the request there ("abort": a streaming client went away),
        its acceptance counting only the verify steps whose text the client was sent."""
        built = self.built
        built.activate()
        runner = self._ready()
        prompt = torch.as_tensor(list(request.prompt_ids), dtype=torch.long)
        t = prompt.shape[0]
        if t < 1:
            raise ValueError(f"request {request.request_id!r}: empty prompt")
        if not isinstance(request.max_tokens, int) or request.max_tokens < 1:
            raise ValueError(f"request {request.request_id!r}: max_tokens must be an int >= 1, got {request.max_tokens!r}")
        room = runner.max_tokens_for(t)
        if request.max_tokens > room:
            extra = f" + k ({runner.k})" if built.decoder is not None else ""
            raise ValueError(f"request {request.request_id!r}: prompt ({t}) + max_tokens ({request.max_tokens}){extra} "
                             f"exceeds the model's context of {runner.capacity} tokens (at most {room} new tokens fit)")
        sampling = built.config.sampling
        if not sampling.greedy or (built.decoder is not None and built.decoder.assumed is not None):
            runner.seed(request_seed(built.config.seed, request.request_id))
        spec = built.decoder is not None
        lengths: list[int] = []  # tokens committed per verify step
        out = _Output(built.tokenizer, request)
        reader = self._reader
        lookahead = min(LOOKAHEAD, reader.slots - 3) if built.device.type == "cuda" else 0
        _sync(built.device)
        with torch.inference_mode(), backends.record_provenance() as prov:
            start = time.perf_counter()
            pending = deque([(True, reader.read(runner.begin(prompt, request.max_tokens)))])
            runner.after_first()
            known = in_flight = sent = delivered = 0  # delivered: verify steps whose text on_text took
            ttft = None
            while True:
                while len(pending) <= lookahead and known + in_flight * runner.per_step < request.max_tokens:
                    pending.append((False, reader.read(runner.step())))
                    in_flight += 1
                first, wait = pending.popleft()
                values = wait()
                if first:
                    ttft = time.perf_counter() - start
                    new = values
                else:
                    in_flight -= 1
                    new = runner.committed(values, lengths)
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
        _sync(built.device)  # a step queued ahead finishes outside the request's time
        if on_text is not None and out.reason != "abort" and len(out.text) > sent:
            on_text(out.text[sent:])
        acceptance = Acceptance.from_lengths(lengths, built.decoder.k) if spec else None
        target, draft = events(prov) | runner.target_seen, set(runner.draft_seen)
        steps = acceptance.verify_steps if spec else 0
        if runner.graphs and (steps if spec else out.count > 1):
            target |= runner.graph_target
            draft |= runner.graph_draft
        self.provenance.observe(built, target, draft, steps)
        n = out.count
        return ServedRequest(built.name, request.request_id, t, n, ttft, latency, out.text,
                             tuple(out.ids[:n]),  # what the rows' outputs are compared by (the text may decode alike)
                             out.reason, acceptance)
