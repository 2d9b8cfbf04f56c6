"""Grade-school arithmetic word problems in the GSM8K format, seeded.

A problem is a question and a worked answer: one line per arithmetic step ("a op b = c"), then
the final line `#### N`. Steps are 1-digit multiplies and 2-digit adds and subtracts, 1 to 3 of
them, and every intermediate value stays non-negative.

Splits are disjoint by construction, not by luck of the seeds: a problem belongs to the held-out
split exactly when a hash of its question text falls in the held-out bucket, and each split's
generator draws until it gets a problem of its own split.
"""

from __future__ import annotations

import hashlib
import random
import re
from dataclasses import dataclass
from typing import Iterator, Literal

Split = Literal["train", "heldout"]
SPLITS: tuple[str, ...] = ("train", "heldout")
HELDOUT_BUCKETS = 20  # 1 in 20 questions is held out
PROMPT_SUFFIX = "\nAnswer: "  # what a prompt ends with; the model writes the answer after it
END = "\n"  # the final `#### N` line ends the sample

NAMES = ("Ava", "Ben", "Cara", "Dan", "Eli", "Fay", "Gus", "Hana", "Ivy", "Jon", "Kai", "Lea", "Max",
         "Nia", "Omar", "Pia", "Raj", "Sam", "Tara", "Uma", "Vic", "Wes", "Yara", "Zoe")
ITEMS = ("apples", "pens", "stickers", "marbles", "books", "cards", "shells", "coins", "stamps",
         "cookies", "beads", "rocks")
CONTAINERS = ("boxes", "bags", "jars", "packs", "baskets", "crates")
_FINAL = re.compile(r"####\s*(-?\d[\d,]*)")


@dataclass(frozen=True)
class Problem:
    question: str
    answer: str  # worked steps, then "#### N"
    result: int
    steps: int

    @property
    def prompt(self) -> str:
        return f"Question: {self.question}{PROMPT_SUFFIX}"

    @property
    def text(self) -> str:
        """The full training sample: prompt, answer, end marker."""
        return f"{self.prompt}{self.answer}{END}"


def split_of(question: str) -> Split:
    bucket = int.from_bytes(hashlib.sha1(question.encode()).digest()[:4], "big") % HELDOUT_BUCKETS
    return "heldout" if bucket == 0 else "train"


def text_of(tokens) -> str:
    """Byte-level token ids (a 1-D tensor or list) as text."""
    ids = tokens.tolist() if hasattr(tokens, "tolist") else tokens
    return bytes(ids).decode("ascii", "replace")


def writes_answers(model) -> bool:
    """Whether `model` is a trained checkpoint of this byte vocabulary (not a random-weight preset
    of the same vocabulary): its prompts are these problems and it closes each answer with END."""
    from impl.model.config import PRESETS
    return model.config.vocab_size == 128 and model.config.name not in PRESETS


def answer_length(text: str) -> int | None:
    """Characters of `text` up to and including the END that closes its `#### N` line (where a
    reader, or a serving loop with END as its stop sequence, stops), or None while it is open."""
    i = text.find("#### ")
    end = text.find(END, i) if i >= 0 else -1
    return None if end < 0 else end + len(END)


def extract_answer(text: str) -> int | None:
    """The number after `#### ` (commas allowed, as in GSM8K), or None when there is none."""
    m = _FINAL.search(text)
    return int(m.group(1).replace(",", "")) if m else None


def _draw(rng: random.Random) -> Problem:
    name, item = rng.choice(NAMES), rng.choice(ITEMS)
    sentences: list[str] = []
    lines: list[str] = []
    if rng.random() < 0.5:
        value = rng.randint(10, 99)
        sentences.append(f"{name} has {value} {item}.")
    else:
        n, per, box = rng.randint(2, 9), rng.randint(2, 9), rng.choice(CONTAINERS)
        value = n * per
        sentences.append(f"{name} has {n} {box} with {per} {item} in each.")
        lines.append(f"{name} has {n} * {per} = {value} {item}.")
    target = rng.randint(1, 3)
    while len(lines) < target:
        op = rng.choice(("add", "sub", "packs") if target - len(lines) >= 2 else ("add", "sub"))
        if op == "sub" and value < 10:
            op = "add"
        if op == "add":
            x = rng.randint(10, 99)
            sentences.append(f"Then {name} {rng.choice(('finds', 'buys', 'gets'))} {x} more.")
            lines.append(f"{value} + {x} = {value + x} {item}.")
            value += x
        elif op == "sub":
            x = rng.randint(10, min(99, value))
            sentences.append(f"Then {name} {rng.choice(('gives away', 'loses', 'sells'))} {x}.")
            lines.append(f"{value} - {x} = {value - x} {item}.")
            value -= x
        else:
            n, per, box = rng.randint(2, 9), rng.randint(2, 9), rng.choice(CONTAINERS)
            sentences.append(f"Then {name} buys {n} {box} with {per} {item} in each.")
            lines.append(f"The {box} hold {n} * {per} = {n * per} {item}.")
            lines.append(f"{value} + {n * per} = {value + n * per} {item}.")
            value += n * per
    sentences.append(f"How many {item} does {name} have now?")
    answer = "\n".join(lines) + f"\n#### {value}"
    return Problem(" ".join(sentences), answer, value, len(lines))


def problems(split: Split, seed: int = 0) -> Iterator[Problem]:
    """An endless, reproducible stream of problems of `split` (different seeds, different streams)."""
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; expected one of {SPLITS}")
    rng = random.Random(f"arith/{split}/{seed}")
    while True:
        p = _draw(rng)
        if split_of(p.question) == split:
            yield p


def take(split: Split, n: int, seed: int = 0) -> list[Problem]:
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    stream = problems(split, seed)
    return [next(stream) for _ in range(n)]
