"""The gsm8k workload: lm-evaluation-harness's prompts and both of its answer filters, on the real
GSM8K files in ../shared/data/gsm8k, end to end with a checkpoint that brings its own tokenizer,
and the context check on the byte-level tiny model."""

from __future__ import annotations

import json
import random
import re
import tracemalloc

import pytest
import torch

from impl.data import gsm8k
from impl.data.text import ByteTokenizer, HFTokenizer, tokenizer_for
from impl.data.workloads import ContextError, WorkloadError, load_workload
from impl.generate import check_prompt, generate
from impl.model import build_model
from tests.gsm8k_checkpoint import CONTEXT, GSM8K_DIR, build_checkpoint

if not (GSM8K_DIR / "test.jsonl").is_file():
    pytest.skip(f"GSM8K data not found at {GSM8K_DIR}", allow_module_level=True)

WIDE = ByteTokenizer(256)  # any text encodes; one token per UTF-8 byte
BIG = 10**6  # a context nothing exceeds, where the check is not under test


def rows(split: str) -> list[dict]:
    with (GSM8K_DIR / f"{split}.jsonl").open(encoding="utf-8") as f:
        return [json.loads(line) for line in f]


@pytest.fixture(scope="module")
def test_rows():
    return rows("test")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return build_checkpoint(tmp_path_factory.mktemp("gsm8k-ckpt"))


# --------------------------------------------------------------------------- prompts


def test_prompts_follow_the_harness_format(test_rows):
    """Examples drawn as the harness's default sampler draws them: random.Random(1234).sample over
    the training list, one generator for the whole run; each example `Question: q\\nAnswer: a`
    and a blank line; then the question with `Answer:` and nothing after it."""
    train = rows("train")
    rnd = random.Random(1234)
    w = load_workload("gsm8k", WIDE, BIG, n=4)
    assert len(w) == 4 and w.shots == 5
    for i, r in enumerate(w):
        shots = rnd.sample(train, 5)
        want = "".join(f"Question: {s['question']}\nAnswer: {s['answer']}\n\n" for s in shots)
        want += f"Question: {test_rows[i]['question']}\nAnswer:"
        assert r.prompt == want
        assert r.request_id == f"gsm8k/{i}" and r.answer == test_rows[i]["answer"].split("#### ")[-1]
        assert r.stop == ("Question:", "</s>", "<|im_end|>") and r.max_tokens == 256 and not r.ignore_eos
        assert r.prompt.count("Question: ") == 6 and r.prompt.count("\n#### ") == 5
    zero = next(iter(load_workload("gsm8k", WIDE, BIG, n=1, shots=0)))
    assert zero.prompt == f"Question: {test_rows[0]['question']}\nAnswer:"
    # Iterating again starts the draw again: the same prompts.
    assert [r.prompt for r in w] == [r.prompt for r in w]


def test_prompts_match_lm_eval_where_installed(test_rows):
    """Where lm-evaluation-harness is installed: its gsm8k task builds the same prompts."""
    yaml = pytest.importorskip("yaml")
    pytest.importorskip("lm_eval")
    from importlib.resources import files

    from lm_eval.api.task import ConfigurableTask
    config = yaml.safe_load((files("lm_eval") / "tasks" / "gsm8k" / "gsm8k.yaml").read_text())
    config.update(dataset_path="json", dataset_kwargs={"data_files": {
        split: str(GSM8K_DIR / f"{split}.jsonl") for split in ("test", "train")}})
    config.pop("dataset_name", None)
    task = ConfigurableTask(config=config)
    task.set_fewshot_seed(1234)
    assert list(task.config.generation_kwargs["until"]) == list(gsm8k.STOP)
    for r, doc in zip(load_workload("gsm8k", WIDE, BIG, n=10), task.eval_docs):
        assert r.prompt == task.fewshot_context(doc, 5)


def test_lazy_over_the_whole_test_split():
    """All 1,319 questions, 5-shot, made one at a time: Python memory stays far below what the
    prompts and their ids would take if they were held (about 1,319 x 4 KB of text and 4 K ids)."""
    w = load_workload("gsm8k", WIDE, BIG)
    assert len(w) == 1319
    tracemalloc.start()
    try:
        count, longest = 0, 0
        for r in w:
            count += 1
            longest = max(longest, len(r.prompt_ids))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert count == 1319 and longest > 4000
    assert peak < 8 * 2**20, f"peak {peak / 2**20:.1f} MiB while iterating"


# --------------------------------------------------------------------------- scoring


def test_gold_answers_score_correct_under_both_filters(test_rows):
    w = load_workload("gsm8k", WIDE, BIG)
    for r, row in zip(w, test_rows[:200]):
        got = w.score(r, row["answer"])
        assert got["correct"] and got["strict_correct"] and got["flexible_correct"], row["answer"]
    for row in test_rows:  # the stored final answer means the same as the whole worked answer
        assert gsm8k.normalize(gsm8k.gold_answer(row["answer"])) == gsm8k.normalize(row["answer"])
        assert gsm8k.score_text(gsm8k.gold_answer(row["answer"]), row["answer"])["strict_correct"]


def test_last_number_without_marker_is_flexible_only(test_rows):
    w = load_workload("gsm8k", WIDE, BIG, n=1)
    r = next(iter(w))
    gold = test_rows[0]["answer"]  # Janet's ducks: "... = $<<9*2=18>>18 every day ...\n#### 18"
    assert r.answer == "18"
    reasoning = gold.rsplit("\n#### ", 1)[0]
    got = w.score(r, reasoning)
    assert got["flexible_correct"] and not got["strict_correct"] and not got["correct"]
    assert got["flexible_answer"] == "18" and got["strict_answer"] is None
    wrong = reasoning.replace("18", "19") + "\n#### 19"
    got = w.score(r, wrong)
    assert not got["strict_correct"] and not got["flexible_correct"] and not got["correct"]
    assert (got["strict_answer"], got["flexible_answer"]) == ("19", "19")


@pytest.mark.parametrize("text,strict,flexible", [
    ("#### 1,234", True, True),            # commas are ignored
    ("#### 1234.", True, True),            # one trailing period is ignored
    ("The answer is $1,234.", False, True),
    ("#### 1234\n#### 5", True, False),     # strict takes the first match, flexible the last
    ("1234 then 7", False, False),          # single digits count for flexible: 7 is last
    ("#### -1234", False, False),
    ("####1234", False, True),              # strict needs the space after ####
    ("#### 1234.0", False, False),          # no numeric equality: text after normalization
    ("#### 1234\n\nQuestion: x #### 9", True, True),  # generation ends at the stop string
    ("", False, False),
])
def test_filters_on_edge_cases(text, strict, flexible):
    w = load_workload("gsm8k", WIDE, BIG, n=1)
    r = next(iter(w))
    r = type(r)(r.request_id, r.prompt, r.prompt_ids, "1234", r.max_tokens, r.stop)
    got = w.score(r, text)
    assert (got["strict_correct"], got["flexible_correct"]) == (strict, flexible)


# --------------------------------------------------------------------------- end to end


def test_five_shot_on_a_checkpoint_with_its_own_tokenizer(checkpoint):
    model = build_model(str(checkpoint))
    tok = tokenizer_for(str(checkpoint), model.config.vocab_size)
    assert isinstance(tok, HFTokenizer) and tok.vocab_size <= model.config.vocab_size
    assert tok.eos_id == json.loads((checkpoint / "config.json").read_text())["eos_token_id"]
    assert model.config.max_seq_len == CONTEXT
    w = load_workload("gsm8k", tok, model.config.max_seq_len, n=3)
    reqs = list(w)
    assert len(reqs) == 3
    for r in reqs:
        assert r.prompt.count("Question: ") == 6
        assert tok.decode(r.prompt_ids) == r.prompt  # byte-level BPE: exact round trip
        assert len(r.prompt_ids) < len(r.prompt) / 2  # real subword tokens, not bytes
        check_prompt(model, torch.tensor(r.prompt_ids), r.max_tokens)  # ids in the vocabulary, fits the cache
    out = generate(model, torch.tensor(reqs[0].prompt_ids), 2)
    text = tok.decode(out.new_tokens[0])
    assert isinstance(w.score(reqs[0], text)["strict_correct"], bool)
    # The same questions no longer fit a shorter context; the error says what to change.
    need = len(reqs[0].prompt_ids) + reqs[0].max_tokens
    with pytest.raises(ContextError, match=rf"gsm8k/0 needs {len(reqs[0].prompt_ids)} prompt tokens \+ max_tokens "
                                           rf"256 = {need} tokens, more than the model's context of {need - 1}; "
                                           r"use fewer shots \(now 5; 0-shot, this question takes \d+ prompt"):
        load_workload("gsm8k", tok, need - 1, n=3)
    assert len(load_workload("gsm8k", tok, need - 1, n=3, shots=1)) == 3


def test_tiny_model_cannot_hold_five_shots(test_rows):
    tok = tokenizer_for("tiny-gsm")
    with pytest.raises(ContextError) as e:
        load_workload("gsm8k", tok, 384)
    prompt = next(iter(load_workload("gsm8k", WIDE, BIG, n=1))).prompt
    err = e.value
    assert (err.prompt_tokens, err.max_tokens, err.context, err.shots) == (len(prompt.encode()), 256, 384, 5)
    alone = len(f"Question: {test_rows[0]['question']}\nAnswer:".encode())
    assert re.search(rf"gsm8k/0 needs {err.prompt_tokens} prompt tokens \+ max_tokens 256 = {err.prompt_tokens + 256} "
                     rf"tokens, more than the model's context of 384; fewer shots would not help \(now 5\): this "
                     rf"question alone takes {alone} prompt tokens", str(err)), str(err)


# --------------------------------------------------------------------------- bad input


def test_bad_sources_and_counts(tmp_path):
    with pytest.raises(gsm8k.GSM8KError, match=r"GSM8K folder .*nowhere does not exist"):
        load_workload(f"gsm8k:{tmp_path / 'nowhere'}", WIDE, BIG)
    (tmp_path / "test.jsonl").write_text('{"question": "q", "answer": "#### 1"}\n')
    with pytest.raises(gsm8k.GSM8KError, match=r"lacks train\.jsonl; expected test\.jsonl and train\.jsonl"):
        load_workload(f"gsm8k:{tmp_path}", WIDE, BIG)
    with pytest.raises(WorkloadError, match=r"n=1320 but it holds only 1319 prompts"):
        load_workload("gsm8k", WIDE, BIG, n=1320)
    with pytest.raises(WorkloadError, match=r"shots must be a whole number >= 0, got -1"):
        load_workload("gsm8k", WIDE, BIG, shots=-1)


def test_a_small_local_folder(tmp_path):
    (tmp_path / "test.jsonl").write_text('{"question": "One plus one?", "answer": "1+1=2\\n#### 2"}\n')
    (tmp_path / "train.jsonl").write_text("".join(
        json.dumps({"question": f"q{i}", "answer": f"#### {i}"}) + "\n" for i in range(3)))
    w = load_workload(f"gsm8k:{tmp_path}", WIDE, BIG, shots=2)
    (r,) = list(w)
    assert r.answer == "2" and r.prompt.endswith("Question: One plus one?\nAnswer:")
    assert re.fullmatch(r"(Question: q\d\nAnswer: #### \d\n\n){2}Question: One plus one\?\nAnswer:", r.prompt)
    with pytest.raises(gsm8k.GSM8KError, match=r"shots=4 exceeds the 3 training examples"):
        load_workload(f"gsm8k:{tmp_path}", WIDE, BIG, shots=4)
