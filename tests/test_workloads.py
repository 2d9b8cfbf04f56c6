"""Workloads of the end-to-end A/B comparison: the spec syntax, stop handling, the arith,
synthetic and user-file workloads, the tokenizer adapters and the context check. GSM8K itself
is in tests/test_gsm8k.py."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from impl.data import arith
from impl.data.text import ByteTokenizer, HFTokenizer, NoTokenizer, TokenizerError, VocabularyError, tokenizer_for
from impl.data.workloads import (ARITH_MAX_TOKENS, JSONL_FIELDS, SYNTHETIC_SHAPE, USAGE, ContextError, Length,
                                 Request, WorkloadError, WorkloadSpec, load_workload, parse_workload)
from impl.model.config import get_config

ROOT = Path(__file__).resolve().parents[1]
TINY_CONTEXT = get_config("tiny").max_seq_len  # 384, as the embedded tiny-gsm checkpoint


@pytest.fixture(scope="module")
def eval_tiny():
    """scripts/eval_tiny.py as a module: the arith workload must prompt and score as it does."""
    spec = importlib.util.spec_from_file_location("eval_tiny", ROOT / "scripts" / "eval_tiny.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def tiny_tok():
    return tokenizer_for("tiny-gsm")


# --------------------------------------------------------------------------- spec syntax


@pytest.mark.parametrize("text,spec", [
    ("arith", WorkloadSpec("arith")),
    (" Arith ", WorkloadSpec("arith")),
    ("gsm8k", WorkloadSpec("gsm8k")),
    ("gsm8k:/data/gsm8k", WorkloadSpec("gsm8k", "/data/gsm8k")),
    ("gsm8k:openai/gsm8k", WorkloadSpec("gsm8k", "openai/gsm8k")),
    ("synthetic", WorkloadSpec("synthetic")),
    ("synthetic:1024:128", WorkloadSpec("synthetic", None, Length(tokens=1024), Length(tokens=128))),
    ("synthetic:90%:5%", WorkloadSpec("synthetic", None, Length(percent=90.0), Length(percent=5.0))),
    ("synthetic:12.5%:64", WorkloadSpec("synthetic", None, Length(percent=12.5), Length(tokens=64))),
    ("jsonl:/tmp/my prompts.jsonl", WorkloadSpec("jsonl", "/tmp/my prompts.jsonl")),
    ("jsonl:C:/x/y.txt", WorkloadSpec("jsonl", "C:/x/y.txt")),
    ("prompts/mine.jsonl", WorkloadSpec("jsonl", "prompts/mine.jsonl")),
    ("/abs/Mine.JSONL", WorkloadSpec("jsonl", "/abs/Mine.JSONL")),
])
def test_parse_accepted_forms(text, spec):
    assert parse_workload(text) == spec
    assert parse_workload(str(spec)) == spec  # str() writes the spec back in the same syntax


@pytest.mark.parametrize("text,bad", [
    ("", "empty workload name"),
    ("gsm9k", "unknown workload 'gsm9k'"),
    ("prompts.json", "unknown workload 'prompts.json'"),
    ("arith:5", "arith takes no argument"),
    ("gsm8k:", "needs a folder or hub id"),
    ("jsonl:", "jsonl needs a file"),
    ("synthetic:1024", "two lengths, IN and OUT, got 1 part"),
    ("synthetic:1:2:3", "two lengths, IN and OUT, got 3 part"),
    ("synthetic:abc:128", "input length 'abc'"),
    ("synthetic:1024:0", "output length '0'"),
    ("synthetic:-5:10", "input length '-5'"),
    ("synthetic:150%:10", "input length '150%'"),
    ("synthetic:10:nan%", "output length 'nan%'"),
])
def test_parse_rejects_with_usage(text, bad):
    with pytest.raises(ValueError) as e:
        parse_workload(text)
    assert bad in str(e.value)
    assert f"workload {text!r}" in str(e.value) and USAGE in str(e.value)


# --------------------------------------------------------------------------- stop handling


def _generations():
    """Generated texts around the arith stop rule: complete answers with text after them, open
    answers, a newline before `####`, `####` without its line end."""
    out = []
    for p in arith.take("heldout", 30):
        out += [p.answer + arith.END + "Question: Ava has", p.answer, p.answer.split("\n")[0] + "\n",
                p.answer + " apples" + arith.END, "junk\n\n" + p.answer + arith.END * 2]
    return out + ["", "\n", "#### ", "#### 5", "####5\n", "#### \n", "a\n#### 7\nb\n#### 8\n"]


def test_arith_stop_is_eval_tiny_answer_text(eval_tiny, tiny_tok):
    """Request.truncate / finished of an arith request cut generated text exactly where
    scripts/eval_tiny.py's answer_text / finished do."""
    request = next(iter(load_workload("arith", tiny_tok, TINY_CONTEXT, n=1)))
    for text in _generations():
        ids = tiny_tok.encode(text)
        assert request.truncate(text) == eval_tiny.answer_text(ids), text
        assert request.finished(text) == eval_tiny.finished(ids), text


def test_stop_strings_cut_at_the_earliest():
    r = Request("x", "p", [1], None, 8, stop=("Question:", "</s>"))
    assert r.truncate("18\n</s>more Question: x") == "18\n"
    assert r.truncate("a Question: b </s>") == "a "
    assert r.stop_index("no stop here") is None and r.truncate("no stop here") == "no stop here"
    assert Request("x", "p", [1], None, 8).truncate("Question: a") == "Question: a"  # no stops: all text


def test_stop_from_delays_the_stop_strings():
    r = Request("x", "p", [1], None, 8, stop=("\n",), stop_from="#### ")
    assert r.stop_index("a\nb\n") is None  # newlines before the marker are not stops
    assert r.truncate("a\nb\n#### 3\nQuestion") == "a\nb\n#### 3"
    assert r.stop_index("a\n#### 3\nb\n") == 8 and r.stop_index("a\n#### 3\nb\n", start=9) == 10  # from `start` on
    assert Request("x", "p", [1], None, 8, stop=("\n",)).stop_index("a\nb\n", start=2) == 3


# --------------------------------------------------------------------------- arith


def test_arith_prompts_are_eval_tiny_problems(eval_tiny, tiny_tok):
    w = load_workload("arith", tiny_tok, TINY_CONTEXT, n=40)
    requests = list(w)
    problems = arith.take("heldout", 40)  # eval_tiny's problems: held-out split, seed 0
    assert len(w) == len(requests) == 40
    assert [r.prompt for r in requests] == [p.prompt for p in problems]
    assert [r.prompt_ids for r in requests] == [list(p.prompt.encode("ascii")) for p in problems]
    assert [r.answer for r in requests] == [str(p.result) for p in problems]
    assert {r.max_tokens for r in requests} == {ARITH_MAX_TOKENS} == {eval_tiny.MAX_NEW_TOKENS}
    assert len({r.request_id for r in requests}) == 40
    assert all(arith.split_of(p.question) == "heldout" for p in problems)
    # The default size is eval_tiny's default --n.
    assert len(load_workload("arith", tiny_tok, TINY_CONTEXT)) == 500
    assert [r.prompt for r in load_workload("arith", tiny_tok, TINY_CONTEXT, n=5, seed=1)] != \
        [r.prompt for r in requests[:5]]


def test_arith_scores_like_eval_tiny(eval_tiny, tiny_tok):
    w = load_workload("arith", tiny_tok, TINY_CONTEXT, n=30)
    assert w.has_answers
    for r, p in zip(w, arith.take("heldout", 30)):
        right = p.answer + arith.END + "Question: Zoe has 5 #### 99\n"
        wrong = p.answer.replace(f"#### {p.result}", f"#### {p.result + 1}") + arith.END
        for text, expected in ((right, True), (wrong, False), (p.answer.rsplit("\n", 1)[0], False)):
            ids = tiny_tok.encode(text)
            eval_tiny_says = arith.extract_answer(eval_tiny.answer_text(ids)) == p.result
            got = w.score(r, text)
            assert got["correct"] == got["strict_correct"] == eval_tiny_says == expected, text
    # Flexible reading: the last number, here the step's result without a `####` line.
    r = next(iter(w))
    last_line = r.answer  # e.g. "30"
    got = w.score(r, f"so the total is {last_line}.")
    assert got == dict(correct=False, strict_correct=False, flexible_correct=True, strict_answer=None,
                       flexible_answer=last_line)


# --------------------------------------------------------------------------- synthetic


def test_synthetic_exact_lengths_ids_and_seeds():
    tok = ByteTokenizer(128)
    w = load_workload("synthetic:100:20", tok, TINY_CONTEXT, n=4, seed=3)
    reqs = list(w)
    assert len(w) == len(reqs) == 4 and not w.has_answers
    for r in reqs:
        assert len(r.prompt_ids) == 100 and r.max_tokens == 20
        assert r.ignore_eos and r.answer is None and r.stop == ()
        assert 0 <= min(r.prompt_ids) and max(r.prompt_ids) < 128
        assert w.score(r, "anything") == dict(correct=None, strict_correct=None, flexible_correct=None,
                                              strict_answer=None, flexible_answer=None)
    assert len({tuple(r.prompt_ids) for r in reqs}) == 4
    again = list(load_workload("synthetic:100:20", tok, TINY_CONTEXT, n=2, seed=3))
    assert [r.prompt_ids for r in again] == [r.prompt_ids for r in reqs[:2]]  # request i does not depend on n
    other = next(iter(load_workload("synthetic:100:20", tok, TINY_CONTEXT, n=1, seed=4)))
    assert other.prompt_ids != reqs[0].prompt_ids
    assert len(set(reqs[0].prompt_ids)) > 60  # spread over the vocabulary, not a constant


def test_synthetic_lengths_scaled_to_the_context():
    tok = ByteTokenizer(128)
    r = next(iter(load_workload("synthetic", tok, TINY_CONTEXT, n=1)))
    p, m = len(r.prompt_ids), r.max_tokens
    assert p + m <= TINY_CONTEXT and p + m >= TINY_CONTEXT - 2  # fills the context, rounding down
    assert abs(p / m - SYNTHETIC_SHAPE[0] / SYNTHETIC_SHAPE[1]) < 1  # keeps the 32k:2k shape
    big = NoTokenizer(157184)
    r = next(iter(load_workload("synthetic", big, 65536, n=1)))
    assert (len(r.prompt_ids), r.max_tokens) == SYNTHETIC_SHAPE  # unscaled where it fits
    assert max(r.prompt_ids) < 157184 and max(r.prompt_ids) > 128
    r = next(iter(load_workload("synthetic:50%:25%", tok, TINY_CONTEXT, n=1)))
    assert (len(r.prompt_ids), r.max_tokens) == (192, 96)


def test_synthetic_too_long_names_the_lengths():
    with pytest.raises(ContextError, match=r"needs 300 prompt tokens \+ max_tokens 100 = 400 tokens, more than "
                                           r"the model's context of 384.*shorter lengths") as e:
        load_workload("synthetic:300:100", ByteTokenizer(128), TINY_CONTEXT)
    assert (e.value.prompt_tokens, e.value.max_tokens, e.value.context) == (300, 100, 384)
    with pytest.raises(WorkloadError, match="each needs at least 1"):
        load_workload("synthetic:0.1%:10", ByteTokenizer(128), TINY_CONTEXT)


# --------------------------------------------------------------------------- the user's prompts


def _write(path: Path, *lines) -> Path:
    path.write_text("".join(line if isinstance(line, str) else json.dumps(line) + "\n" for line in lines))
    return path


def test_jsonl_prompts(tmp_path):
    f = _write(tmp_path / "mine.jsonl",
               {"prompt": "What is 6 times 7?", "answer": "42"},
               "\n",
               {"prompt": "Name a prime.", "max_tokens": 7, "stop": ["\n\n", "."]},
               {"prompt": "Sum: 1,000 + 234 = ?", "answer": "1,234", "max_tokens": 5})
    tok = ByteTokenizer(256)
    w = load_workload(str(f), tok, 1024)
    reqs = list(w)
    assert len(w) == 3 and w.has_answers
    assert [r.request_id for r in reqs] == ["jsonl/1", "jsonl/3", "jsonl/4"]  # the file's line numbers
    assert [r.prompt_ids for r in reqs] == [tok.encode(r.prompt) for r in reqs]
    assert [r.answer for r in reqs] == ["42", None, "1,234"]
    assert [r.max_tokens for r in reqs] == [256, 7, 5]
    assert [r.stop for r in reqs] == [(), ("\n\n", "."), ()]
    assert not any(r.ignore_eos for r in reqs)
    assert w.score(reqs[0], "It is 42.")["correct"] is True  # headline: the last number
    assert w.score(reqs[0], "It is 41.")["correct"] is False
    assert w.score(reqs[2], "#### 1234")["strict_correct"] is True
    assert w.score(reqs[1], "7")["correct"] is None  # no answer given
    assert len(load_workload(f"jsonl:{f}", tok, 1024, n=2)) == 2


@pytest.mark.parametrize("lines,message", [
    (['{"prompt": "a"}\n', '{"prompt": "b",}\n'], r"mine\.jsonl:2: not valid JSON \(Expecting property name.* at column 16\)"),
    (['{"prompt": "a"}\n', '\n', '["a"]\n'], r"mine\.jsonl:3: expected a JSON object .* got list"),
    (['{"promt": "a"}\n'], r"mine\.jsonl:1: unknown field 'promt'; allowed fields: " + ", ".join(JSONL_FIELDS)),
    (['{"prompt": "a", "id": 3, "temp": 0}\n'], r":1: unknown field 'id' \(and \['temp'\]\); allowed fields"),
    (['{"answer": "4"}\n'], r"mine\.jsonl:1: missing the required field 'prompt'"),
    (['{"prompt": 5}\n'], r":1: field 'prompt' must be a string, got int"),
    (['{"prompt": ""}\n'], r":1: field 'prompt' is empty"),
    (['{"prompt": "a"}\n', '{"prompt": "b", "answer": 42}\n'],
     r"mine\.jsonl:2: field 'answer' must be a string \(write \"42\"\), got int"),
    (['{"prompt": "a", "answer": "6"}\n', '{"prompt": "b", "answer": "6 apples"}\n'],
     r"mine\.jsonl:2: field 'answer' '6 apples' is not a number: .* leave 'answer' out for prompts scored by eye"),
    (['{"prompt": "a", "answer": "Paris"}\n'], r"mine\.jsonl:1: field 'answer' 'Paris' is not a number"),
    (['{"prompt": "a", "max_tokens": "5"}\n'], r":1: field 'max_tokens' must be a positive integer, got '5'"),
    (['{"prompt": "a", "max_tokens": 0}\n'], r"field 'max_tokens' must be a positive integer, got 0"),
    (['{"prompt": "a", "max_tokens": true}\n'], r"field 'max_tokens' must be a positive integer, got True"),
    (['{"prompt": "a", "stop": "\\n"}\n'], r":1: field 'stop' must be a list of non-empty strings"),
    ([b'{"prompt": "caf\xe9"}\n'], r"mine\.jsonl:1: not UTF-8 text"),
    ([], r"mine\.jsonl holds no prompts \(it is empty or only blank lines\)"),
    (['\n', '   \n'], r"mine\.jsonl holds no prompts"),
])
def test_jsonl_errors_name_file_line_and_field(tmp_path, lines, message):
    f = tmp_path / "mine.jsonl"
    f.write_bytes(b"".join(x if isinstance(x, bytes) else x.encode() for x in lines))
    with pytest.raises(WorkloadError, match=message):
        load_workload(f"jsonl:{f}", ByteTokenizer(256), 1024)


def test_jsonl_missing_file_and_bad_counts(tmp_path):
    with pytest.raises(WorkloadError, match=r"workload file .*nowhere\.jsonl does not exist"):
        load_workload(str(tmp_path / "nowhere.jsonl"), ByteTokenizer(256), 1024)
    with pytest.raises(WorkloadError, match=r"workload file .* is not a file"):
        load_workload(f"jsonl:{tmp_path}", ByteTokenizer(256), 1024)
    f = _write(tmp_path / "two.jsonl", {"prompt": "a"}, {"prompt": "b"})
    with pytest.raises(WorkloadError, match=r"n=3 but it holds only 2 prompts"):
        load_workload(str(f), ByteTokenizer(256), 1024, n=3)
    with pytest.raises(WorkloadError, match=r"n must be a positive number of requests, got 0"):
        load_workload(str(f), ByteTokenizer(256), 1024, n=0)


def test_jsonl_prompt_too_long_names_its_line(tmp_path):
    f = _write(tmp_path / "long.jsonl", {"prompt": "short"}, {"prompt": "x" * 300, "max_tokens": 100})
    w = load_workload(str(f), ByteTokenizer(128), TINY_CONTEXT)  # the first request fits
    with pytest.raises(ContextError, match=r"request jsonl/2 needs 300 prompt tokens \+ max_tokens 100 = 400 "
                                           r"tokens, more than the model's context of 384; shorten the prompt on "
                                           r".*long\.jsonl:2 or lower its max_tokens"):
        w.check()


# --------------------------------------------------------------------------- tokenizers


def test_tokenizer_for_model_specs():
    tok = tokenizer_for("tiny-gsm")
    assert isinstance(tok, ByteTokenizer) and tok.vocab_size == 128 and tok.eos_id is None
    assert isinstance(tokenizer_for("tiny"), ByteTokenizer)  # the random-weight byte preset
    assert isinstance(tokenizer_for(get_config("tiny")), ByteTokenizer)
    big = tokenizer_for("ling-flash-2.0")
    assert isinstance(big, NoTokenizer) and big.vocab_size == 157184
    with pytest.raises(TokenizerError, match=r"'ling-flash-2.0' has no tokenizer .*use a synthetic workload"):
        big.encode("hello")
    with pytest.raises(TokenizerError, match=r"has no tokenizer"):  # at load time, not mid-run
        load_workload("arith", big, 4096)
    with pytest.raises(TokenizerError, match="neither a preset"):
        tokenizer_for("no-such-model")


def test_byte_tokenizer_round_trip_and_vocabulary():
    tok = ByteTokenizer(128)
    p = arith.take("heldout", 1)[0]
    ids = tok.encode(p.text)
    assert ids == list(p.text.encode("ascii")) and tok.decode(ids) == p.text == arith.text_of(ids)
    with pytest.raises(VocabularyError, match=r"character '’' at offset 5 .*byte vocabulary of 128 ids") as e:
        tok.encode("Janet’s ducks")
    assert e.value.n_tokens == len("Janet’s ducks".encode())
    assert ByteTokenizer(256).decode(ByteTokenizer(256).encode("Janet’s ducks")) == "Janet’s ducks"


def test_folder_tokenizer_must_fit_the_model(tmp_path):
    from tests.gsm8k_checkpoint import build_tokenizer
    build_tokenizer(vocab_size=300).save_pretrained(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3_moe"}))  # enough for detection
    assert isinstance(tokenizer_for(tmp_path, vocab_size=512), HFTokenizer)
    with pytest.raises(TokenizerError, match=r"its tokenizer has 300 ids but the model embeds only 256"):
        tokenizer_for(tmp_path, vocab_size=256)


# --------------------------------------------------------------------------- arguments


def test_bad_arguments(tiny_tok):
    with pytest.raises(WorkloadError, match=r"shots=5 applies to gsm8k only \(arith takes no few-shot"):
        load_workload("arith", tiny_tok, TINY_CONTEXT, shots=5)
    with pytest.raises(WorkloadError, match="context_length must be an integer >= 2"):
        load_workload("arith", tiny_tok, 0)
    with pytest.raises(ValueError, match="unknown workload"):
        load_workload("nope", tiny_tok, TINY_CONTEXT)
    with pytest.raises(ContextError, match=r"arith/0 needs \d+ prompt tokens \+ max_tokens 160 = \d+ tokens, more "
                                           r"than the model's context of 200"):
        load_workload("arith", tiny_tok, 200)
