"""The prompts of an end-to-end A/B comparison, and how their answers are scored.

A workload is a lazy sequence of `Request`s (one prompt each, tokenized for the model under
test) and a scorer. Kinds, by their spec text (`parse_workload`):

- `arith`: held-out problems of `impl.data.arith` (the split the embedded `tiny-gsm` model never
  saw), 0-shot, prompted and scored as `scripts/eval_tiny.py` does: the prompt is
  `Problem.prompt`, generation stops at the END that closes the `#### N` line, the answer is
  right when `arith.extract_answer` gives the problem's result.
- `gsm8k[:FOLDER|HUB_ID]`: the GSM8K test split as lm-evaluation-harness's `gsm8k` task prompts
  and scores it (`impl.data.gsm8k`), `shots` examples (default 5).
- `synthetic[:IN:OUT]`: random prompt ids of IN tokens (seeded), OUT generated tokens with EOS
  ignored, no answers. IN and OUT are token counts or percentages of the model's context
  (`synthetic:90%:10%`); bare `synthetic` is the 32k-in / 2k-out shape of the reference result,
  scaled down to the context when it does not fit.
- `jsonl:FILE` or `FILE.jsonl`: the user's prompts, one JSON object a line with `prompt` and
  optional `answer` (a string), `max_tokens` and `stop` (a list of strings).

Stopping: a request ends at EOS (unless `ignore_eos`), after `max_tokens`, or at the first of its
`stop` strings in the generated text; `stop_from`, when set, makes stop strings count only from
its first occurrence on (arith's END is a stop only once `#### ` has been written). The text
before the stop string is the answer (`Request.truncate`); the scorer truncates the same way, so
it can be handed the raw generation.
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass, replace
from itertools import islice
from pathlib import Path
from typing import Callable, Iterator

from impl.data import arith, gsm8k
from impl.data.text import Tokenizer, VocabularyError
from impl.digests import content_digest

KINDS = ("arith", "gsm8k", "synthetic", "jsonl")
USAGE = ("arith | gsm8k | gsm8k:FOLDER | gsm8k:HUB_ID | synthetic | synthetic:IN:OUT (IN, OUT: tokens, "
         "or N% of the model's context) | jsonl:FILE | FILE.jsonl")
ARITH_N = 500  # scripts/eval_tiny.py's default number of held-out problems
ARITH_MAX_TOKENS = 160  # scripts/eval_tiny.py's MAX_NEW_TOKENS
ARITH_STOP_FROM = "#### "  # arith.answer_length: the END after the `#### N` line closes the answer
SYNTHETIC_N = 10
SYNTHETIC_SHAPE = (32768, 2048)  # the reference result's synthetic decode: 32k in, 2k out
JSONL_FIELDS = ("prompt", "answer", "max_tokens", "stop")
JSONL_MAX_TOKENS = gsm8k.MAX_TOKENS  # the harness's default generation budget
NO_SCORE = {"correct": None, "strict_correct": None, "flexible_correct": None,
            "strict_answer": None, "flexible_answer": None}


class WorkloadError(ValueError):
    pass


FEWER_SHOTS = "use fewer shots"  # the advice of a GSM8K prompt that fits with fewer (a caller names its option)


class ContextError(WorkloadError):
    """A request does not fit the model's context; the numbers are attributes too, so a caller
    (the plugin) can add its own option names to the advice."""

    def __init__(self, message: str, *, request_id: str, prompt_tokens: int, max_tokens: int,
                 context: int, shots: int | None = None):
        super().__init__(message)
        self.request_id, self.prompt_tokens, self.max_tokens = request_id, prompt_tokens, max_tokens
        self.context, self.shots = context, shots


@dataclass(frozen=True)
class Request:
    request_id: str
    prompt: str  # "" for synthetic requests (random ids have no text)
    prompt_ids: list[int]
    answer: str | None  # the gold final answer; None when the workload has none
    max_tokens: int
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    stop_from: str | None = None

    def stop_index(self, text: str, start: int = 0) -> int | None:
        """Where the answer in generated `text` ends (the stop string starts there), or None
        while no stop string has been generated. `start`: search from this character on (a
        decode loop that already searched the text before it, less the longest stop string)."""
        if self.stop_from:
            marker = text.find(self.stop_from)
            if marker < 0:
                return None
            start = max(start, marker)
        hits = [i for i in (text.find(s, start) for s in self.stop if s) if i >= 0]
        return min(hits) if hits else None

    def finished(self, text: str) -> bool:
        """Whether generated `text` has reached a stop string (a decode loop's stop test)."""
        return self.stop_index(text) is not None

    def truncate(self, text: str) -> str:
        """Generated `text` up to its first stop string (all of it when there is none)."""
        i = self.stop_index(text)
        return text if i is None else text[:i]


@dataclass(frozen=True)
class Length:
    """A synthetic length: `tokens`, or `percent` of the model's context."""
    tokens: int | None = None
    percent: float | None = None

    def resolve(self, context: int) -> int:
        return self.tokens if self.tokens is not None else int(context * self.percent / 100)

    def __str__(self) -> str:
        return str(self.tokens) if self.tokens is not None else f"{self.percent:g}%"


@dataclass(frozen=True)
class WorkloadSpec:
    kind: str  # one of KINDS
    source: str | None = None  # gsm8k: folder or hub id (None: the default source); jsonl: file
    input_len: Length | None = None  # synthetic only; None: SYNTHETIC_SHAPE scaled to fit
    output_len: Length | None = None

    def __str__(self) -> str:
        if self.kind == "synthetic" and self.input_len is not None:
            return f"synthetic:{self.input_len}:{self.output_len}"
        return self.kind if self.source is None else f"{self.kind}:{self.source}"


def _bad(text: str, why: str) -> WorkloadError:
    return WorkloadError(f"workload {text!r}: {why}; accepted forms: {USAGE}")


def _length(text: str, part: str, what: str) -> Length:
    part = part.strip()
    try:
        if part.endswith("%"):
            pct = float(part[:-1])
            if not 0 < pct < 100 or not math.isfinite(pct):
                raise ValueError
            return Length(percent=pct)
        tokens = int(part)
        if tokens < 1:
            raise ValueError
        return Length(tokens=tokens)
    except ValueError:
        raise _bad(text, f"{what} {part!r} is neither a positive token count nor a percentage "
                         "of the context between 0% and 100%") from None


def parse_workload(text: str) -> WorkloadSpec:
    """The spec of a workload named on the command line or in an ini file."""
    if not isinstance(text, str) or not text.strip():
        raise _bad(str(text), "empty workload name")
    raw = text
    text = text.strip()
    kind, sep, rest = text.partition(":")
    kind = kind.strip().lower()
    if kind not in KINDS:
        if text.lower().endswith(".jsonl"):
            return WorkloadSpec("jsonl", text)
        raise _bad(raw, f"unknown workload {kind!r} (known: {', '.join(KINDS)}; or a path ending .jsonl)")
    if kind == "arith":
        if sep:
            raise _bad(raw, "arith takes no argument")
        return WorkloadSpec("arith")
    if kind == "gsm8k":
        if sep and not rest.strip():
            raise _bad(raw, "gsm8k: needs a folder or hub id after the colon")
        return WorkloadSpec("gsm8k", rest.strip() or None)
    if kind == "jsonl":
        if not rest.strip():
            raise _bad(raw, "jsonl needs a file: jsonl:FILE")
        return WorkloadSpec("jsonl", rest.strip())
    if not sep:
        return WorkloadSpec("synthetic")
    parts = rest.split(":")
    if len(parts) != 2:
        raise _bad(raw, f"synthetic takes two lengths, IN and OUT, got {len(parts)} part(s) {rest!r}")
    return WorkloadSpec("synthetic", input_len=_length(raw, parts[0], "input length"),
                        output_len=_length(raw, parts[1], "output length"))


def check_source(spec: WorkloadSpec) -> None:
    """Fail before any model is built on a workload whose local source cannot be read: a prompts
    file (its every record, naming file and line) or a GSM8K folder. A hub id is checked when loaded."""
    if spec.kind == "jsonl":
        read_jsonl(spec.source)
    elif spec.kind == "gsm8k":
        gsm8k.check_source(spec.source)


# --------------------------------------------------------------------------- the workload


class Workload:
    """`len()` requests, made lazily on each iteration. Text prompts are encoded here, and each
    request is checked against the context as it is made (the first one already by
    `load_workload`; `check()` walks them all)."""

    def __init__(self, spec: WorkloadSpec, description: str, size: int, tokenizer: Tokenizer,
                 context_length: int, make: Callable[[], Iterator[Request]],
                 scorer: Callable[[Request, str], dict] | None,
                 advice: Callable[[Request], str] | None = None, shots: int | None = None,
                 digest: str | None = None):
        self.spec, self.name, self.description = spec, spec.kind, description
        self.tokenizer, self.context_length, self.shots = tokenizer, context_length, shots
        # A prompts file by its contents (impl.digests): edited at the same path it is another
        # workload. None for the built-in workloads, which the code defines.
        self.digest = digest
        self._size, self._make, self._scorer, self._advice = size, make, scorer, advice

    def __len__(self) -> int:
        return self._size

    def __iter__(self) -> Iterator[Request]:
        for request in self._make():
            if request.prompt_ids is None:  # a text prompt, not yet encoded
                request = replace(request, prompt_ids=self._encode(request))
            yield self.fit(request)

    def __repr__(self) -> str:
        return f"Workload({self.description})"

    @property
    def has_answers(self) -> bool:
        return self._scorer is not None

    def count_tokens(self, text: str) -> int:
        """Tokens `text` takes, also for text a byte vocabulary cannot hold."""
        try:
            return len(self.tokenizer.encode(text))
        except VocabularyError as e:
            return e.n_tokens

    def _encode(self, request: Request) -> list[int]:
        try:
            return self.tokenizer.encode(request.prompt)
        except VocabularyError as e:
            # A prompt that could not fit anyway gets the context error: it is the one to act on.
            self._check_length(request, e.n_tokens)
            raise VocabularyError(f"{self.description}: request {request.request_id}: {e}", e.n_tokens) from e

    def _check_length(self, request: Request, p: int) -> None:
        m, c = request.max_tokens, self.context_length
        if p == 0:
            raise WorkloadError(f"{self.description}: request {request.request_id} has a prompt of no tokens")
        if p + m > c:
            advice = self._advice(request) if self._advice else ""
            raise ContextError(
                f"{self.description}: request {request.request_id} needs {p} prompt tokens + max_tokens {m} "
                f"= {p + m} tokens, more than the model's context of {c}" + (f"; {advice}" if advice else ""),
                request_id=request.request_id, prompt_tokens=p, max_tokens=m, context=c, shots=self.shots)

    def fit(self, request: Request) -> Request:
        """`request`, or a ContextError when its prompt plus max_tokens exceed the context."""
        self._check_length(request, len(request.prompt_ids))
        return request

    def check(self) -> int:
        """Make every request (each checked as it is made); the most tokens one needs."""
        return max(len(r.prompt_ids) + r.max_tokens for r in self)

    def score(self, request: Request, generated_text: str) -> dict:
        """correct / strict_correct / flexible_correct (bools; None without answers) and the two
        extracted answers. `correct` is the workload's headline: eval_tiny's rule for arith,
        strict-match for gsm8k, flexible-extract for the user's prompts."""
        if self._scorer is None or request.answer is None:
            return dict(NO_SCORE)
        return self._scorer(request, request.truncate(generated_text))


def _numeric_scores(request: Request, text: str) -> dict:
    return gsm8k.score_text(request.answer, text)


def _score_arith(request: Request, text: str) -> dict:
    out = _numeric_scores(request, text)
    got = arith.extract_answer(text)
    out["strict_answer"] = None if got is None else str(got)
    out["strict_correct"] = out["correct"] = got == int(request.answer)
    return out


def _score_gsm8k(request: Request, text: str) -> dict:
    out = _numeric_scores(request, text)
    out["correct"] = out["strict_correct"]
    return out


def _score_jsonl(request: Request, text: str) -> dict:
    out = _numeric_scores(request, text)
    out["correct"] = out["flexible_correct"]
    return out


@dataclass(frozen=True)
class AtMost:
    """A request count for `load_workload`'s `n`: this many, or all of a smaller file or split."""
    n: int


def _count(n: int | AtMost | None, default: int, available: int | None, what: str) -> int:
    if n is None:
        n = default if available is None else available
    elif isinstance(n, AtMost):
        n = n.n if available is None else min(n.n, available)
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise WorkloadError(f"{what}: n must be a positive number of requests, got {n!r}")
    if available is not None and n > available:
        raise WorkloadError(f"{what}: n={n} but it holds only {available} prompts")
    return n


def _arith(spec, tok: Tokenizer, context: int, n, seed: int) -> Workload:
    n = _count(n, ARITH_N, None, "arith")

    def make():
        for i, p in enumerate(islice(arith.problems("heldout", seed), n)):
            yield Request(f"arith/{i}", p.prompt, None, str(p.result), ARITH_MAX_TOKENS,
                          stop=(arith.END,), stop_from=ARITH_STOP_FROM)

    return Workload(spec, f"arith: {n} held-out problems (seed {seed}), 0-shot", n, tok, context, make,
                    _score_arith,
                    advice=lambda r: "arith problems are short; this model's context is too small for them")


def _gsm8k(spec, tok: Tokenizer, context: int, n, shots) -> Workload:
    shots = gsm8k.DEFAULT_SHOTS if shots is None else shots
    if not isinstance(shots, int) or isinstance(shots, bool) or shots < 0:
        raise WorkloadError(f"gsm8k: shots must be a whole number >= 0, got {shots!r}")
    source = spec.source or gsm8k.default_source()
    test, train = gsm8k.load_splits(source)
    n = _count(n, len(test), len(test), f"gsm8k test split of {source}")

    def make():
        for item in gsm8k.items(test, train, shots=shots, n=n):
            yield Request(f"gsm8k/{item.index}", item.prompt, None, item.answer, gsm8k.MAX_TOKENS,
                          stop=gsm8k.STOP)

    def advice(request: Request) -> str:
        question = test[int(request.request_id.split("/")[1])]["question"]
        alone = workload.count_tokens(gsm8k.question_text(question))
        if alone + request.max_tokens > context:
            return ((f"fewer shots would not help (now {shots}): " if shots else "")
                    + f"this question alone takes {alone} prompt tokens + max_tokens {request.max_tokens}; "
                    "use a model with a longer context")
        return f"{FEWER_SHOTS} (now {shots}; 0-shot, this question takes {alone} prompt tokens)"

    workload = Workload(spec, f"gsm8k: {n} test questions from {source}, {shots}-shot", n, tok, context, make,
                        _score_gsm8k, advice=advice, shots=shots)
    return workload


def synthetic_lengths(spec: WorkloadSpec, context: int) -> tuple[int, int]:
    """(input, output) tokens of a synthetic spec for a model of `context` tokens."""
    if spec.input_len is None:
        inp, out = SYNTHETIC_SHAPE
        if inp + out > context:
            scale = context / (inp + out)
            inp, out = max(1, int(inp * scale)), max(1, int(out * scale))
        return inp, out
    inp, out = spec.input_len.resolve(context), spec.output_len.resolve(context)
    if inp < 1 or out < 1:
        raise WorkloadError(f"workload {spec}: {spec.input_len} and {spec.output_len} of a context of {context} "
                            f"give {inp} input and {out} output tokens; each needs at least 1")
    return inp, out


def _synthetic(spec, tok: Tokenizer, context: int, n, seed: int) -> Workload:
    n = _count(n, SYNTHETIC_N, None, "synthetic")
    inp, out = synthetic_lengths(spec, context)
    vocab = tok.vocab_size

    def make():
        for i in range(n):
            rng = random.Random(f"synthetic/{seed}/{i}")  # request i's ids do not depend on n
            ids = rng.choices(range(vocab), k=inp)
            yield Request(f"synthetic/{i}", "", ids, None, out, ignore_eos=True)

    return Workload(spec, f"synthetic: {n} requests of {inp} random tokens in, {out} out (seed {seed})", n,
                    tok, context, make, None, advice=lambda r: "ask for shorter lengths (synthetic:IN:OUT, or "
                                                           "percentages of the context such as synthetic:90%:10%)")


def read_jsonl(path: str | Path) -> list[int]:
    """Validate a prompts file line by line, naming file and line of the first fault; the line
    numbers (1-based) of its records."""
    path = Path(path).expanduser()
    if not path.exists():
        raise WorkloadError(f"workload file {path} does not exist")
    if not path.is_file():
        raise WorkloadError(f"workload file {path} is not a file")
    lines = []
    with path.open("rb") as f:
        for lineno, raw in enumerate(f, 1):
            where = f"{path}:{lineno}"
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise WorkloadError(f"{where}: not UTF-8 text ({e.reason} at byte {e.start})") from None
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise WorkloadError(f"{where}: not valid JSON ({e.msg} at column {e.colno})") from None
            _check_record(record, where)
            lines.append(lineno)
    if not lines:
        raise WorkloadError(f"workload file {path} holds no prompts (it is empty or only blank lines)")
    return lines


def _check_record(record, where: str) -> None:
    if not isinstance(record, dict):
        raise WorkloadError(f"{where}: expected a JSON object with a \"prompt\", got {type(record).__name__}")
    unknown = sorted(set(record) - set(JSONL_FIELDS))
    if unknown:
        raise WorkloadError(f"{where}: unknown field {unknown[0]!r}" + (f" (and {unknown[1:]})" if unknown[1:] else "")
                            + f"; allowed fields: {', '.join(JSONL_FIELDS)}")
    if "prompt" not in record:
        raise WorkloadError(f"{where}: missing the required field 'prompt'")

    def kind(v) -> str:
        return "null" if v is None else type(v).__name__

    prompt = record["prompt"]
    if not isinstance(prompt, str):
        raise WorkloadError(f"{where}: field 'prompt' must be a string, got {kind(prompt)}")
    if not prompt:
        raise WorkloadError(f"{where}: field 'prompt' is empty")
    answer = record.get("answer")
    if answer is not None and not isinstance(answer, str):
        raise WorkloadError(f"{where}: field 'answer' must be a string (write \"{answer}\"), got {kind(answer)}")
    if answer is not None and not gsm8k.scorable(answer):
        raise WorkloadError(f"{where}: field 'answer' {answer!r} is not a number: answers are scored as GSM8K's "
                            "are, by the number the output ends with (or gives after '#### '), so only a number "
                            "can ever match; leave 'answer' out for prompts scored by eye")
    mt = record.get("max_tokens")
    if mt is not None and (not isinstance(mt, int) or isinstance(mt, bool) or mt < 1):
        raise WorkloadError(f"{where}: field 'max_tokens' must be a positive integer, got {mt!r}")
    stop = record.get("stop")
    if stop is not None and (not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop)):
        raise WorkloadError(f"{where}: field 'stop' must be a list of non-empty strings, got {stop!r}")


def _jsonl(spec, tok: Tokenizer, context: int, n) -> Workload:
    path = Path(spec.source).expanduser()
    lines = read_jsonl(path)
    n = _count(n, len(lines), len(lines), f"workload file {path}")
    try:
        import datasets
    except ImportError:
        raise WorkloadError("jsonl workloads are read with the `datasets` package, which is not installed: "
                            "pip install 'pytest-moeperf[data]' (or datasets)") from None
    features = datasets.Features({"prompt": datasets.Value("string"), "answer": datasets.Value("string"),
                                  "max_tokens": datasets.Value("int64"),
                                  "stop": datasets.List(datasets.Value("string"))})
    try:
        rows = datasets.load_dataset("json", data_files=str(path), split="train", features=features)
    except Exception as e:  # every line passed the checks above, so this is unexpected: say where
        raise WorkloadError(f"workload file {path}: datasets could not read it: {e}") from e
    if len(rows) != len(lines):
        raise WorkloadError(f"workload file {path}: {len(lines)} records validated but datasets read {len(rows)}")

    def make():
        for i in range(n):
            row = rows[i]
            yield Request(f"jsonl/{lines[i]}", row["prompt"], None, row["answer"],
                          row["max_tokens"] or JSONL_MAX_TOKENS, stop=tuple(row["stop"] or ()))

    def advice(request: Request) -> str:
        line = request.request_id.split("/", 1)[1]
        return f"shorten the prompt on {path}:{line} or lower its max_tokens"

    has_answers = any(a is not None for a in rows["answer"])
    return Workload(spec, f"jsonl: {n} prompts from {path}", n, tok, context, make,
                    _score_jsonl if has_answers else None, advice=advice, digest=content_digest([path]))


def load_workload(spec: str | WorkloadSpec, tokenizer: Tokenizer, context_length: int, n: int | None = None,
                  shots: int | None = None, seed: int = 0) -> Workload:
    """The workload `spec` for a model with `tokenizer` (impl.data.text.tokenizer_for) and a context
    of `context_length` tokens (`model.config.max_seq_len`).

    `n`: how many requests (default: all of gsm8k and of a file, ARITH_N arith problems,
    SYNTHETIC_N synthetic requests; `AtMost(k)`: k, or all of a smaller file or split); `shots`:
    gsm8k's few-shot examples (default 5; other kinds take none); `seed`: the stream of generated
    workloads (arith problems, synthetic ids; 0 is eval_tiny's problems). GSM8K's few-shot draw always uses the harness's seed 1234, so its
    prompts are the harness's. The first request is made and checked here, so a prompt that
    cannot fit, a missing tokenizer or bad data fail now, not at the first timed request."""
    if isinstance(spec, str):
        spec = parse_workload(spec)
    if not isinstance(context_length, int) or context_length < 2:
        raise WorkloadError(f"context_length must be an integer >= 2, got {context_length!r}")
    if shots is not None and spec.kind != "gsm8k":
        raise WorkloadError(f"workload {spec}: shots={shots} applies to gsm8k only ({spec.kind} takes no "
                            "few-shot examples)")
    if spec.kind == "arith":
        workload = _arith(spec, tokenizer, context_length, n, seed)
    elif spec.kind == "gsm8k":
        workload = _gsm8k(spec, tokenizer, context_length, n, shots)
    elif spec.kind == "synthetic":
        workload = _synthetic(spec, tokenizer, context_length, n, seed)
    elif spec.kind == "jsonl":
        workload = _jsonl(spec, tokenizer, context_length, n)
    else:
        raise WorkloadError(f"unknown workload kind {spec.kind!r}; known: {KINDS}")
    next(iter(workload))
    return workload
