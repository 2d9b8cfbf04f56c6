"""What an A/B ladder run produces, whoever served it: a `ServedRequest` per (row, request), a
`RowEntry` per row and the `LadderResult` they make up; `LadderStopped` when a row stops the run
part-way, carrying what completed and where it stopped (`Failure`).

The engine's rows (impl.serve.engine) and server rows (OpenAI-compatible endpoints) produce the
same types; the summary, the report, its figures and the gated figures read only these. Every
value is checked where it is made, so a malformed figure is refused naming the row and request.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Mapping

__all__ = ["Acceptance", "Failure", "LadderResult", "LadderStopped", "RowEntry", "ServedRequest", "SCORE_KEYS"]

SCORE_KEYS = ("correct", "strict_correct", "flexible_correct")  # the marks' booleans (None: not scored)


def _positive(value, what: str) -> None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                              or not math.isfinite(value) or value <= 0):
        raise ValueError(f"{what} = {value!r}; it must be a positive finite number or None")


def _counts(values, what: str, least: int = 0) -> None:
    if values is not None and not all(isinstance(x, int) and not isinstance(x, bool) and x >= least for x in values):
        raise ValueError(f"{what} must be integers >= {least}, got {list(values)!r}")


@dataclass(frozen=True)
class Acceptance:
    """A speculative request's counters, by one definition for every engine: a verify step commits
    its accepted drafts plus one token of its own, so accept length = (accepted + verify_steps) /
    verify_steps, between 1 and k + 1. `per_position`: drafts accepted at position j = 0 .. k-1,
    None where the engine does not report them; `lengths`: tokens committed per verify step, where
    known (this project's engine; a server reports totals). `source`: where they were read."""

    verify_steps: int
    accepted: int
    per_position: tuple[int, ...] | None
    lengths: tuple[int, ...] | None = None
    source: str = "engine"

    def __post_init__(self) -> None:
        _counts((self.verify_steps, self.accepted), "verify steps and accepted drafts")
        _counts(self.per_position, "accepted drafts per position")
        _counts(self.lengths, "accept lengths (tokens committed per verify step)", least=1)
        if self.per_position is None:
            return
        if sum(self.per_position) != self.accepted:
            raise ValueError(f"accepted drafts per position {list(self.per_position)} do not add up to {self.accepted}")
        if any(n > self.verify_steps for n in self.per_position):
            raise ValueError(f"more drafts accepted at a position {list(self.per_position)} than verify steps "
                             f"({self.verify_steps})")
        if self.lengths is not None and (len(self.lengths) != self.verify_steps
                                         or sum(self.lengths) != self.accepted + self.verify_steps):
            raise ValueError(f"accept lengths {list(self.lengths)} do not match {self.verify_steps} verify steps "
                             f"with {self.accepted} accepted drafts")

    @property
    def accept_length(self) -> float | None:
        return (self.accepted + self.verify_steps) / self.verify_steps if self.verify_steps else None

    @classmethod
    def from_lengths(cls, lengths, k: int, source: str = "engine") -> "Acceptance":
        """From the tokens committed at each verify step of a k-draft speculator."""
        lengths = tuple(lengths)
        return cls(len(lengths), sum(lengths) - len(lengths),
                   tuple(sum(n - 1 > j for n in lengths) for j in range(k)), lengths, source)


@dataclass(frozen=True)
class ServedRequest:
    """One request as one row served it. Times in seconds from the request's start (TTFT: the
    first token or text out, prefill included; latency: the last); `itl_s` the gaps between a
    server's streamed chunks (a speculative server sends several tokens in one, so they are not
    TPOT). `output_ids` None where a server gives text only. `error`: why the request failed (the
    figures of a failed request are None). `marks`: the workload's scores (SCORE_KEYS and the
    answers it extracted)."""

    row: str
    request_id: object
    prompt_tokens: int | None
    output_tokens: int
    ttft_s: float | None
    latency_s: float | None
    text: str = ""
    output_ids: tuple[int, ...] | None = None
    stop_reason: str | None = None
    acceptance: Acceptance | None = None
    itl_s: tuple[float, ...] = ()
    error: str | None = None
    marks: Mapping = field(default_factory=dict)

    def __post_init__(self) -> None:
        where = f"row {self.row!r} request {self.request_id!r}"
        if not isinstance(self.row, str) or not self.row:
            raise ValueError(f"{where}: the row must be a non-empty name")
        if self.request_id is None:
            raise ValueError(f"{where}: no request id")
        _counts((self.output_tokens,), f"{where}: output tokens")
        _positive(self.ttft_s, f"{where}: ttft_s")
        _positive(self.latency_s, f"{where}: latency_s")
        if self.ttft_s is not None and self.latency_s is not None and self.latency_s < self.ttft_s:
            raise ValueError(f"{where}: latency {self.latency_s} s before its first token at {self.ttft_s} s")
        for key in SCORE_KEYS:
            v = self.marks.get(key)
            if v is not None and not isinstance(v, bool):
                raise ValueError(f"{where}: {key} = {v!r}; it must be True, False or None")

    @property
    def tpot_s(self) -> float | None:
        """(latency - TTFT) / (output tokens - 1), as vLLM's and SGLang's serving benchmarks define it."""
        n = self.output_tokens
        if n < 2 or self.ttft_s is None or self.latency_s is None or self.latency_s <= self.ttft_s:
            return None
        return (self.latency_s - self.ttft_s) / (n - 1)

    @property
    def decode_tokens_per_s(self) -> float | None:
        tpot = self.tpot_s
        return None if tpot is None else 1 / tpot

    def mark(self, key: str) -> bool | None:
        return self.marks.get(key)

    def as_record(self) -> dict:
        """The report's JSON form of the request."""
        a = self.acceptance
        return {"row": self.row, "request_id": self.request_id, "prompt_tokens": self.prompt_tokens,
                "output_tokens": self.output_tokens, "ttft_s": self.ttft_s, "latency_s": self.latency_s,
                "tpot_s": self.tpot_s, "decode_tokens_per_s": self.decode_tokens_per_s,
                "itl_s": list(self.itl_s) or None,
                "accept_lengths": None if a is None or a.lengths is None else list(a.lengths),
                "accepted_per_position": None if a is None or a.per_position is None else list(a.per_position),
                "verify_steps": None if a is None else a.verify_steps,
                "acceptance_source": None if a is None else a.source,
                "text": self.text, "output_ids": None if self.output_ids is None else list(self.output_ids),
                "stop_reason": self.stop_reason, "error": self.error, **self.marks}


@dataclass(frozen=True)
class RowEntry:
    """A row as the report shows it: its spec, what ran (`provenance`, as recorded while it
    served) and what of it contradicts the row's name (`provenance_error`), and what decides whether
    its outputs should be another row's token for token: the code it runs on its device
    (`runs_as`), greedy decoding, its head's arithmetic, acceptance assumed. `server`: for a row
    served over HTTP, the engine, version, model and arguments it reported."""

    name: str
    config: str
    speculative: bool = False
    greedy: bool = True
    head: str | None = None
    assumed: bool = False
    runs_as: str | None = None
    provenance: Mapping = field(default_factory=dict)
    provenance_error: str | None = None
    server: Mapping | None = None


@dataclass(frozen=True)
class Failure:
    """Where a row stopped the ladder: its request (None: while it prepared its steps), "refused"
    (the row cannot run this model or workload: a usage error) or "failed" (its code or its
    server failed), and the error in words."""

    row: str
    request: object
    kind: str
    error: str

    def place(self, markdown: bool = False) -> str:
        """On which request (its id as Python writes it, or as Markdown code), or while preparing."""
        if self.request is None:
            return "preparing its steps"
        return f"request `{self.request}`" if markdown else f"request {self.request!r}"

    def at(self) -> str:
        """"on request 'x'" or "while preparing its steps": where, after the verb."""
        return ("while " if self.request is None else "on ") + self.place()


class LadderStopped(Exception):
    """A row stopped the run part-way; `served` holds every request completed before, `dropped`
    the rows left out of it. The error that stopped it is the `__cause__`."""

    def __init__(self, failure: Failure, served: tuple[ServedRequest, ...], dropped: Mapping[str, str]) -> None:
        super().__init__(f"row {failure.row!r} {failure.kind} {failure.at()}: {failure.error}")
        self.failure, self.served, self.dropped = failure, tuple(served), dict(dropped)


@dataclass(frozen=True)
class LadderResult:
    """One ladder run: its rows in ladder order (the first is the reference), every request each
    served, interleaved; `complete` False for a run stopped part-way (`failure` says where, when a
    row stopped it); `dropped` rows left out ({row: why}); `host` the host's contention while
    serving; `run`, `workload`, `device`, `model` and `prompts` as the report shows them."""

    rows: tuple[RowEntry, ...]
    requests: tuple[ServedRequest, ...]
    workload: Mapping = field(default_factory=dict)
    device: str | None = None
    model: Mapping | None = None
    complete: bool = False
    run: Mapping | None = None
    prompts: tuple = ()
    dropped: Mapping[str, str] = field(default_factory=dict)
    host: Mapping | None = None
    failure: Failure | None = None

    def __post_init__(self) -> None:
        if not self.rows:
            raise ValueError("a ladder result needs at least one row")
        names = [r.name for r in self.rows]
        repeated = [n for n, c in Counter(names).items() if c > 1]
        if repeated:
            raise ValueError(f"row names must be unique; repeated: {', '.join(repeated)}")
        seen = set()
        for r in self.requests:
            if r.row not in names:
                raise ValueError(f"a request names row {r.row!r}, which is not among the rows ({', '.join(names)})")
            if (r.row, r.request_id) in seen:
                raise ValueError(f"row {r.row!r} has two requests with id {r.request_id!r}")
            seen.add((r.row, r.request_id))

    def by_row(self) -> dict[str, dict[object, ServedRequest]]:
        """{row: {request id: what it served}}, rows in ladder order."""
        out: dict[str, dict[object, ServedRequest]] = {r.name: {} for r in self.rows}
        for r in self.requests:
            out[r.row][r.request_id] = r
        return out

    def row(self, name: str) -> RowEntry:
        return next(r for r in self.rows if r.name == name)

    def as_json(self) -> dict:
        """The report's JSON form: every request as `ServedRequest.as_record` writes it."""
        return {"run": self.run, "workload": dict(self.workload), "device": self.device, "model": self.model,
                "rows": [asdict(r) for r in self.rows], "requests": [r.as_record() for r in self.requests],
                "prompts": list(self.prompts), "complete": self.complete, "dropped": dict(self.dropped),
                "host": self.host, "failure": None if self.failure is None else asdict(self.failure)}
