"""GSM8K prompted and scored as lm-evaluation-harness's `gsm8k` task (task version 3) does.

Facts of that task this module reproduces:

- Test questions from the `test` split in file order; few-shot examples from `train`.
- A question reads `Question: {question}\\nAnswer:`; a few-shot example is that text, the target
  delimiter " " and the worked answer, followed by the few-shot delimiter "\\n\\n". The prompt is
  the examples, then the question (0 shots: the question alone). No description, no chat template.
- The default sampler draws each question's examples with `random.Random(1234).sample(train, k)`,
  one generator advanced question by question in test order; since `sample` picks positions
  only, drawing positions from `range(len(train))` picks the same examples.
- Generation is greedy and stops at "Question:", "</s>" or "<|im_end|>" (plus the model's EOS);
  the harness's default generation budget is 256 tokens.
- strict-match: the first match of `#### (\\-?[0-9\\.\\,]+)`; flexible-extract: the last match of
  `(-?[$0-9.,]{2,})|(-?[0-9]+)` (its non-empty group). Then exact match against the gold answer
  after removing, in order, ",", "$", everything up to and including the last "#### ", and one
  trailing "."; case-insensitive. A response with no match scores wrong.

The data is read through `datasets` (memory-mapped Arrow, nothing held in Python lists) from a
local folder holding test.jsonl and train.jsonl (default: ../shared/data/gsm8k beside the
repository checkout) or from a hub id such as `openai/gsm8k` where a network exists.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

FEWSHOT_SEED = 1234
DEFAULT_SHOTS = 5
TARGET_DELIMITER = " "
FEWSHOT_DELIMITER = "\n\n"
STOP = ("Question:", "</s>", "<|im_end|>")
MAX_TOKENS = 256
HUB_ID = "openai/gsm8k"
HUB_CONFIG = "main"
SPLIT_FILES = {"test": "test.jsonl", "train": "train.jsonl"}

STRICT = re.compile(r"#### (\-?[0-9\.\,]+)")
FLEXIBLE = re.compile(r"(-?[$0-9.,]{2,})|(-?[0-9]+)")
_IGNORED = tuple(re.compile(p) for p in (r",", r"\$", r"(?s).*#### ", r"\.$"))


class GSM8KError(ValueError):
    pass


def default_source() -> str:
    """The shared data folder beside the repository checkout when it exists, else the hub id."""
    folder = Path(__file__).resolve().parents[2].parent / "shared" / "data" / "gsm8k"
    return str(folder) if folder.is_dir() else HUB_ID


def _datasets():
    try:
        import datasets
    except ImportError:
        raise GSM8KError("the gsm8k workload reads its data with the `datasets` package, which is not "
                         "installed: pip install 'pytest-moeperf[data]' (or datasets)") from None
    return datasets


def _looks_like_path(source: str) -> bool:
    return source.startswith(("/", "./", "../", "~")) or Path(source).exists()


def check_folder(source: str) -> Path:
    """The folder `source` names, if it holds both splits' files; GSM8KError saying what is missing."""
    folder = Path(source).expanduser()
    if not folder.is_dir():
        raise GSM8KError(f"GSM8K folder {folder} does not exist (expected a folder holding "
                         f"{' and '.join(SPLIT_FILES.values())})")
    missing = [f for f in SPLIT_FILES.values() if not (folder / f).is_file()]
    if missing:
        raise GSM8KError(f"GSM8K folder {folder} lacks {', '.join(missing)}; expected "
                         f"{' and '.join(SPLIT_FILES.values())} (one JSON object a line: question, answer)")
    return folder


def check_source(source: str | None) -> None:
    """Fail early on a local source that cannot be read (a hub id is only checked when loaded:
    that needs the network)."""
    source = source or default_source()
    if _looks_like_path(source):
        check_folder(source)


def load_splits(source: str | None = None):
    """(test, train) as `datasets.Dataset`s with `question` and `answer` columns."""
    source = source or default_source()
    datasets = _datasets()
    if _looks_like_path(source):
        folder = check_folder(source)
        files = {split: str(folder / name) for split, name in SPLIT_FILES.items()}
        ds = datasets.load_dataset("json", data_files=files)
    else:
        try:
            ds = datasets.load_dataset(source, HUB_CONFIG)
        except Exception as e:  # offline, unknown id, ...: say what was tried and the way out
            raise GSM8KError(f"could not load GSM8K from the hub id {source!r} (config {HUB_CONFIG!r}): {e}; "
                             "pass a local folder holding test.jsonl and train.jsonl instead") from e
    for split in SPLIT_FILES:
        if split not in ds:
            raise GSM8KError(f"GSM8K source {source} has no {split!r} split (it has {sorted(ds)})")
        cols = set(ds[split].column_names)
        if not {"question", "answer"} <= cols:
            raise GSM8KError(f"GSM8K source {source}, split {split!r}: expected columns question and "
                             f"answer, found {sorted(cols)}")
    return ds["test"], ds["train"]


def question_text(question: str) -> str:
    return f"Question: {question}\nAnswer:"


def example_text(question: str, answer: str) -> str:
    """One solved few-shot example, its delimiter included."""
    return f"{question_text(question)}{TARGET_DELIMITER}{answer}{FEWSHOT_DELIMITER}"


def prompt_text(question: str, examples: list[tuple[str, str]]) -> str:
    return "".join(example_text(q, a) for q, a in examples) + question_text(question)


def gold_answer(answer: str) -> str:
    """The final answer of a worked GSM8K answer: the text after its last `####`."""
    if "####" not in answer:
        raise GSM8KError(f"GSM8K answer has no '#### N' line: {answer[-80:]!r}")
    return answer.rsplit("####", 1)[1].strip()


def normalize(text: str) -> str:
    """The task's exact-match normalization (applied to the gold answer and the extraction alike)."""
    for pattern in _IGNORED:
        text = pattern.sub("", text)
    return text.lower()


def scorable(answer: str) -> bool:
    """Whether a gold answer can ever be matched: it is one number, as the flexible extraction
    reads numbers (text such as "6 apples" or "Paris" is never what an extraction returns)."""
    got = extract_flexible(answer)
    return got is not None and normalize(got) == normalize(answer) and any(c.isdigit() for c in answer)


def extract_strict(text: str) -> str | None:
    m = STRICT.search(text)
    return m.group(1).strip() if m else None


def extract_flexible(text: str) -> str | None:
    matches = FLEXIBLE.findall(text)
    if not matches:
        return None
    return next(g for g in matches[-1] if g).strip()


def score_text(gold: str, text: str) -> dict:
    """Both filters of the task on an (already stop-truncated) generation: whether each matches
    the gold answer, and what each extracted, normalized as compared (None: no match)."""
    want = normalize(gold)
    strict, flexible = extract_strict(text), extract_flexible(text)
    strict = None if strict is None else normalize(strict)
    flexible = None if flexible is None else normalize(flexible)
    return {"strict_correct": strict == want, "flexible_correct": flexible == want,
            "strict_answer": strict, "flexible_answer": flexible}


@dataclass(frozen=True)
class Item:
    index: int  # position in the test split
    question: str
    prompt: str
    answer: str  # the gold final answer


def items(test, train, shots: int = DEFAULT_SHOTS, n: int | None = None,
          seed: int = FEWSHOT_SEED) -> Iterator[Item]:
    """The first `n` test questions (all by default) with their `shots`-shot prompts, lazily."""
    if shots < 0:
        raise GSM8KError(f"shots must be >= 0, got {shots}")
    if shots > len(train):
        raise GSM8KError(f"shots={shots} exceeds the {len(train)} training examples")
    total = len(test) if n is None else n
    if not 0 < total <= len(test):
        raise GSM8KError(f"n={n}: the GSM8K test split has {len(test)} questions (ask for 1 to {len(test)})")
    rng = random.Random(seed)
    population = range(len(train))
    for i in range(total):
        row = test[i]
        examples = [(train[j]["question"], train[j]["answer"]) for j in rng.sample(population, shots)]
        yield Item(i, row["question"], prompt_text(row["question"], examples), gold_answer(row["answer"]))
