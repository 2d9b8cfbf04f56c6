"""The arithmetic word-problem generator: GSM8K format, arithmetic that checks out, operand
ranges as specified, reproducibility, disjoint splits, and the exact-answer extractor."""

from __future__ import annotations

import re

import pytest

from impl.data.arith import END, PROMPT_SUFFIX, answer_length, extract_answer, problems, split_of, take, text_of

STEP = re.compile(r"(\d+) ([-+*]) (\d+) = (\d+)")


@pytest.fixture(scope="module")
def train():
    return take("train", 2000)


def test_gsm8k_format(train):
    for p in train:
        lines = p.answer.split("\n")
        assert lines[-1] == f"#### {p.result}"
        assert 1 <= p.steps <= 3 and len(lines) == p.steps + 1
        assert p.prompt == f"Question: {p.question}{PROMPT_SUFFIX}"
        assert p.text == p.prompt + p.answer + END
        assert p.text.isascii()  # byte-level vocabulary of 128


def test_every_step_is_right_and_in_range(train):
    ops = set()
    for p in train:
        steps = [STEP.search(line) for line in p.answer.split("\n")[:-1]]
        assert all(steps), p.answer
        product = None
        for m in steps:
            a, op, b, c = int(m[1]), m[2], int(m[3]), int(m[4])
            ops.add(op)
            if op == "*":
                assert 2 <= a <= 9 and 2 <= b <= 9 and c == a * b
            elif op == "+":  # a 2-digit number, or the product just computed (packs bought)
                assert (10 <= b <= 99 or b == product) and c == a + b
            else:
                assert 10 <= b <= 99 and c == a - b >= 0
            product = c if op == "*" else None
        assert int(steps[-1][4]) == p.result
    assert ops == {"+", "-", "*"}
    assert {p.steps for p in train} == {1, 2, 3}


def test_reproducible_and_seeded():
    assert take("train", 50, seed=3) == take("train", 50, seed=3)
    assert take("train", 50, seed=3) != take("train", 50, seed=4)


def test_splits_are_disjoint(train):
    heldout = take("heldout", 500)
    assert all(split_of(p.question) == "heldout" for p in heldout)
    assert all(split_of(p.question) == "train" for p in train)
    assert not {p.question for p in heldout} & {p.question for p in train}
    assert len({p.question for p in heldout}) >= 495  # held-out problems barely repeat


def test_unknown_split():
    with pytest.raises(ValueError, match="unknown split 'test'"):
        next(problems("test"))
    with pytest.raises(ValueError, match="n must be >= 0"):
        take("train", -1)


@pytest.mark.parametrize("text,expected", [
    ("a\n#### 42", 42), ("#### 1,234\n", 1234), ("x #### -7 apples", -7), ("####5", 5),
    ("no answer here", None), ("#### ", None),
])
def test_extract_answer(text, expected):
    assert extract_answer(text) == expected


def test_answer_length_ends_after_the_final_line(train):
    p = train[0]
    text = p.answer + END + "Question: next"
    assert answer_length(text) == len(p.answer) + len(END)
    assert answer_length(p.answer) is None  # the `#### N` line is still open
    assert answer_length("no final line" + END) is None
    assert text_of(list(text.encode("ascii"))) == text
