"""impl.serve.engine on the embedded tiny model (CPU, fp32): greedy parity with impl.generate,
serving metrics, stops (stop strings, EOS, length), sampled rows' seeds.

The requests are tests.helpers.Request, a minimal stand-in of impl.data's (same fields, no stop
logic); the tokenizer is impl's byte tokenizer: the tiny model is byte-level, a token id is the
byte of the text. `model` (tiny-gsm, one torch thread) is tests/conftest.py's."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from impl.data.arith import take, text_of
from impl.generate import generate
from impl.serve.built_row import build_row
from impl.serve.rows import parse_serve_config, resolve_preset
from impl.serve.engine import _Output
from tests.helpers import MAX_TOKENS, Request, byte_tokenizer, request, serve

@pytest.fixture(scope="module")
def prompts() -> list[str]:
    return [p.prompt for p in take("heldout", 2, seed=5)]


def built_row_of(model, spec: str, tokenizer=None, name: str | None = None):
    return build_row(model, parse_serve_config(spec, "cpu"), tokenizer=tokenizer or byte_tokenizer(), name=name)


def reference_text(model, head_row, prompt: str, n: int) -> str:
    """impl.generate.generate's greedy continuation with the model switched to `head_row`."""
    head_row.activate()
    return text_of(generate(model, torch.tensor(list(prompt.encode("ascii"))), n).new_tokens[0])


@pytest.mark.parametrize("head", ["bf16", "fp8"])
def test_greedy_rows_equal_plain_generate(model, prompts, head):
    plain = built_row_of(model, f"moe=gather,head={head}")
    mtp = built_row_of(model, f"moe=gather,head={head},spec=mtp:3")
    short = "Q: 1"  # shorter than k+1 = 4: its first verify step runs eagerly
    for prompt in [*prompts, short]:
        ref = reference_text(model, plain, prompt, MAX_TOKENS)
        for built in (plain, mtp, plain):  # interleaved: each request switches the model back
            rec = serve(built, request(prompt, ignore_eos=True))
            assert rec.text == ref, f"{built.name} on {prompt[-30:]!r}"
            assert rec.output_tokens == MAX_TOKENS and rec.stop_reason == "length"
    rec = serve(mtp, request(prompts[0], ignore_eos=True))
    assert rec.acceptance.verify_steps == len(rec.acceptance.lengths) >= 1
    # Tokens committed per verify step: the first token comes from the prefill, the last step may
    # run past max_tokens (its surplus is discarded).
    assert MAX_TOKENS - 1 <= sum(rec.acceptance.lengths) <= MAX_TOKENS - 1 + 3
    assert all(1 <= a <= 4 for a in rec.acceptance.lengths)
    per_pos = rec.acceptance.per_position
    assert len(per_pos) == 3 and list(per_pos) == sorted(per_pos, reverse=True)
    assert sum(per_pos) == sum(a - 1 for a in rec.acceptance.lengths)
    # The trained checkpoint accepts most drafts (3.88 tokens per step at k=3 on its eval).
    assert sum(rec.acceptance.lengths) / rec.acceptance.verify_steps > 2.5


def test_the_fp8_head_changes_logits_not_only_flags(model, prompts):
    # A check that the fp8 rows above are not the bf16 head under another name: its logits differ.
    bf16, fp8 = built_row_of(model, "moe=gather,head=bf16"), built_row_of(model, "moe=gather,head=fp8")
    x = torch.randn(3, model.config.hidden_size, generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        a, b = bf16.head(x), fp8.head(x)
    rel = float((a - b).norm() / a.norm())
    assert 1e-4 < rel < 0.1, f"relative error of the FP8 head's logits {rel:.3g}"


def test_metrics_are_consistent(model, prompts):
    for spec in ("moe=gather", "+mtp"):
        built = built_row_of(model, spec)
        rec = serve(built, request(prompts[0], 24, ignore_eos=True))
        assert rec.row == built.name and rec.prompt_tokens == len(prompts[0])
        assert 0 < rec.ttft_s <= rec.latency_s
        n = rec.output_tokens
        assert rec.tpot_s == pytest.approx((rec.latency_s - rec.ttft_s) / (n - 1))
        assert rec.decode_tokens_per_s == pytest.approx((n - 1) / (rec.latency_s - rec.ttft_s))
        one = serve(built, request(prompts[0], 1))
        assert one.output_tokens == 1 and one.tpot_s is None and one.decode_tokens_per_s is None
        assert one.latency_s == pytest.approx(one.ttft_s, abs=0.05) and one.stop_reason == "length"
        if built.decoder is not None:
            assert one.acceptance.verify_steps == 0 and one.acceptance.lengths == ()
        else:
            assert one.acceptance is None


@pytest.mark.parametrize("spec", ["moe=gather", "moe=gather,head=fp8,spec=mtp:3"])
def test_stop_string_and_eos(model, prompts, spec):
    built = built_row_of(model, spec)
    ref = reference_text(model, built, prompts[1], MAX_TOKENS)
    # A stop string from the middle of the continuation: the output ends with the token that
    # completes it (byte-level: its last byte), the text stops before it.
    stop = ref[12:15]
    at = ref.find(stop)
    rec = serve(built, request(prompts[1], stop=("never there", stop)))
    assert (rec.stop_reason, rec.text, rec.output_tokens) == ("stop", ref[:at], at + len(stop))
    # EOS: the first newline of the continuation, counted as an output token, not in the text.
    eos_row = built_row_of(model, spec, byte_tokenizer(eos_id=ord("\n")))
    nl = ref.index("\n")
    rec = serve(eos_row, request(prompts[1]))
    assert (rec.stop_reason, rec.text, rec.output_tokens) == ("eos", ref[:nl], nl + 1)
    rec = serve(eos_row, request(prompts[1], ignore_eos=True))
    assert (rec.stop_reason, rec.text, rec.output_tokens) == ("length", ref, MAX_TOKENS)
    # A stop string that completes before the EOS wins; one only after it does not.
    rec = serve(eos_row, request(prompts[1], stop=(ref[:2],)))
    assert (rec.stop_reason, rec.output_tokens) == ("stop", 2)
    later = next(ref[j:j + 3] for j in range(nl + 1, len(ref) - 3) if ref.find(ref[j:j + 3]) == j)
    rec = serve(eos_row, request(prompts[1], stop=(later,)))
    assert (rec.stop_reason, rec.output_tokens) == ("eos", nl + 1)


def test_arith_requests_stop_where_their_answer_ends(model, prompts):
    # The data workloads' Request: END stops only after "#### " (its stop_from), as the arithmetic
    # checkpoint's answers end; the newlines inside the worked answer must not stop it.
    from impl.data.arith import END, answer_length
    from impl.data.workloads import ARITH_STOP_FROM, Request as WorkloadRequest
    for spec in ("moe=gather", "+mtp"):
        built = built_row_of(model, spec)
        ref = reference_text(model, built, prompts[0], 120)
        n = answer_length(ref)
        assert n is not None and ref.index(END) < n - 1  # a newline before the answer's end
        req = WorkloadRequest("a", prompts[0], list(prompts[0].encode("ascii")), None, 120, stop=(END,),
                              stop_from=ARITH_STOP_FROM)
        rec = serve(built, req)
        assert (rec.stop_reason, rec.output_tokens, rec.text) == ("stop", n, ref[:n - len(END)])
        # The stand-in request (no stop_index method) gets the same from its stop_from field.
        rec = serve(built, StopFromRequest("b", prompts[0], list(prompts[0].encode("ascii")), None, 120,
                                               stop=(END,), stop_from=ARITH_STOP_FROM))
        assert (rec.stop_reason, rec.output_tokens) == ("stop", n)


@dataclass(frozen=True)
class StopFromRequest(Request):
    stop_from: str | None = None


class WordTokenizer:
    """Multi-character tokens, to check stops that straddle tokens."""

    eos_id = 0
    words = ["<eos>", "ab", "cd", "ef", "g"]

    def decode(self, ids) -> str:
        return "".join(self.words[i] for i in ids if i != self.eos_id)


def test_stops_across_token_boundaries():
    def end(new_batches, stop=(), max_tokens=10, ignore_eos=False):
        out = _Output(WordTokenizer(), request("x", max_tokens, stop=stop, ignore_eos=ignore_eos))
        for new in new_batches:
            if out.add(new):
                return out.count, out.reason, out.text
        return None

    assert end([[1], [2, 3]], stop=("bc",)) == (2, "stop", "a")
    assert end([[1, 2], [3]], stop=("de", "cd")) == (2, "stop", "ab")  # the earlier stop in the text
    assert end([[1], [2], [3, 4]], stop=("fg",)) == (4, "stop", "abcde")
    assert end([[1, 2, 0, 3]]) == (3, "eos", "abcd")
    assert end([[1, 2, 0, 3]], ignore_eos=True, max_tokens=4) == (4, "length", "abcdef")
    assert end([[1, 2, 3]], max_tokens=2) == (2, "length", "abcd")
    assert end([[1, 2, 3]], stop=("ef",), max_tokens=2) == (2, "length", "abcd")  # the stop lies past the budget
    assert end([[1], [2]], stop=("zz",)) is None
    out = _Output(WordTokenizer(), StopFromRequest("x", "x", [1], None, 10, stop=("ab", "g"), stop_from="e"))
    assert not out.add([1, 2]) and not out.add([3]) and out.add([4])  # "ab" before the marker "e" does not stop
    assert (out.count, out.reason, out.text) == (4, "stop", "abcdef")


def test_sampled_rows_follow_their_seed(model, prompts):
    spec = "moe=gather,temperature=3.0,top_k=20,top_p=0.95,seed=7"  # flat enough to vary
    built, mtp = built_row_of(model, spec), built_row_of(model, spec + ",spec=mtp:3")
    texts = {}
    for a in (built, mtp):
        for rid in ("r1", "r2"):
            texts[a.name, rid] = [serve(a, request(prompts[0], 48, rid=rid, ignore_eos=True)).text
                                  for _ in range(2)]
    for key, (first, again) in texts.items():
        assert first == again, f"{key}: the same request and seed sampled different text"
    # Different requests draw from different streams; a different seed too.
    assert texts[built.name, "r1"][0] != texts[built.name, "r2"][0]
    other = built_row_of(model, spec.replace("seed=7", "seed=8"))
    assert serve(other, request(prompts[0], 48, rid="r1", ignore_eos=True)).text != texts[built.name, "r1"][0]


def test_request_errors_name_the_request(model, prompts):
    built = built_row_of(model, "+mtp")
    with pytest.raises(ValueError, match=r"request 'big'.*context of 384"):
        serve(built, request(prompts[0], 384, rid="big"))
    with pytest.raises(ValueError, match="max_tokens must be an int >= 1"):
        serve(built, request(prompts[0], 0, rid="zero"))


def test_rows_refuse_what_the_model_cannot_run(model):
    with pytest.raises(ValueError, match="experts: the row expects bf16 experts but the model holds fp32"):
        built_row_of(model, "moe=gather,experts=bf16")
    with pytest.raises(TypeError, match="tokenizer"):
        build_row(model, resolve_preset("baseline", "cpu"), tokenizer=object())


def test_an_assumed_acceptance_row_serves_at_its_stated_mean():
    """A random-weight model accepts no draft; at accept=1 (nothing accepted) and accept=4 (all 3)
    its speculative row commits exactly 1 and 4 tokens a verify step, the serving loop unchanged."""
    from impl.model.build import build_model
    model = build_model("tiny", seed=3)
    for accept, length in (("1", 1), ("4", 4)):
        built = built_row_of(model, f"+mtp,accept={accept}")
        rec = serve(built, request("12+30=", 33, ignore_eos=True))
        assert set(rec.acceptance.lengths[:-1]) == {length}, accept  # the last step may be cut by the length


def test_assumed_acceptance_draws_follow_the_request_seed():
    """An assumed-acceptance row's accept lengths come from the request's seed, not from wherever
    the generator stood: the same request gives the same lengths after other requests ran, and
    another request id other lengths (at a mean of 2.5 of 4 every step's length varies)."""
    from impl.model.build import build_model
    model = build_model("tiny", seed=3)
    built = built_row_of(model, "+mtp,accept=2.5,seed=11")

    def lengths(rid):
        return serve(built, request("12+30=", 60, rid=rid, ignore_eos=True)).acceptance.lengths

    first = lengths("a")
    other = lengths("b")
    assert lengths("a") == first and lengths("b") == other
    assert first != other


def test_a_model_without_a_tokenizer_serves_ids_with_no_text():
    """Random-weight presets without a tokenizer (NoTokenizer) serve synthetic requests: their
    records hold the output ids' count and an empty text, not a TokenizerError."""
    from impl.data.text import NoTokenizer
    from impl.model.build import build_model
    model = build_model("tiny", seed=3)
    built = built_row_of(model, "+mtp,accept=3.9", tokenizer=NoTokenizer(model.config.vocab_size, "tiny"))
    rec = serve(built, request("12+30=", 20, ignore_eos=True))
    assert rec.text == "" and rec.output_tokens == 20


def test_a_prompt_past_the_graphed_buckets_takes_its_own_positions(model):
    """The draft's prompt pass: prompts up to the largest graphed bucket replay a graph over
    persistent positions; a longer one runs eagerly over positions of its own length (it once took
    the bucket's 2048 positions for a prompt of 8188: a ValueError at full depth on the H200). On a
    CPU nothing is captured, so the buckets are stood in for here."""
    from impl.decode_runner import DraftPrompt
    draft = model.mtp[0]
    prompt = DraftPrompt(model, draft, torch.device("cpu"), model.config.max_seq_len)
    prompt.pos, prompt.graphs = torch.arange(16), {16: None}  # a 16-position bucket, never replayed here
    model.setup_caches(1, model.config.max_seq_len)
    s = 40
    hidden = torch.randn(1, s, model.config.hidden_size)
    ids = torch.randint(0, model.config.vocab_size, (1, s))
    with torch.inference_mode():
        prompt(hidden, ids, s)  # eager: past the bucket
        got = draft.block.self_attn.kv_cache.k[0, :, :s].clone()
        cos, sin, mask = model.positions(s, torch.arange(s))
        draft.hidden(hidden, ids, cos, sin, torch.arange(s), mask)
    assert torch.equal(got, draft.block.self_attn.kv_cache.k[0, :, :s])
