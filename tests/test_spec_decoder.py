"""The speculative decoder on random-weight tiny models in fp32 on CPU: greedy output equal to
plain greedy token for token, accept lengths within [1, k+1], counters that add up, head
provenance, head sharing refused when violated, and clear errors on bad input.

Random MTP weights almost never guess the target, which would leave the accept path untested;
the "echo" draft (eh_proj passes the target's hidden state through, the block is zeroed to an
identity) re-predicts the target's current next token, so it is accepted exactly where the
target repeats itself, giving a mix of accepted and rejected drafts.
"""

from __future__ import annotations

import copy

import pytest
import torch

from impl.generate import SamplingConfig, generate
from impl.head import BF16Head
from impl.model import build_model, get_config
from impl.speculative import HeadSharingError, SpeculativeDecoder
from tests.helpers import echo_draft_

PROMPT_LEN, NEW = 10, 40


@pytest.fixture(scope="module")
def models():
    return {"random": build_model("tiny", seed=3), "echo": echo_draft_(build_model("tiny", seed=3))}


def prompt(seed: int) -> torch.Tensor:
    return torch.randint(0, 128, (PROMPT_LEN,), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("draft", ["random", "echo"])
@pytest.mark.parametrize("k", [1, 2, 3, 5, 8])
def test_greedy_speculative_equals_greedy(models, draft, k):
    model = models[draft]
    lengths = []
    for seed in range(4):
        p = prompt(seed)
        ref = generate(model, p, NEW).tokens
        res = SpeculativeDecoder(model, k).generate(p, NEW)
        assert torch.equal(res.tokens, ref), f"prompt {seed}: first divergence at " \
            f"{int((res.tokens != ref).int().argmax())}"
        s = res.stats
        assert all(1 <= a <= k + 1 for a in s.accept_lengths)
        assert s.drafted == k * s.steps and s.accepted == sum(s.accept_lengths) - s.steps
        # Every new token but the prefill's comes from a verify step (the last may overshoot).
        assert sum(s.accept_lengths) >= NEW - 1 > sum(s.accept_lengths[:-1])
        assert s.per_position == sorted(s.per_position, reverse=True)
        assert s.draft_head_backends == s.verify_head_backends == {"bf16"}
        lengths += s.accept_lengths
    if draft == "echo" and k > 1:
        assert max(lengths) > 2 and min(lengths) == 1, "the echo draft should be accepted only sometimes"


@pytest.mark.parametrize("k", [1, 4])
def test_sampled_speculation_is_seeded_and_bounded(models, k):
    sampling = SamplingConfig(temperature=0.8, top_k=20, top_p=0.9)
    decoder = SpeculativeDecoder(models["echo"], k, sampling)
    a = decoder.generate(prompt(0), NEW, torch.Generator().manual_seed(5))
    b = decoder.generate(prompt(0), NEW, torch.Generator().manual_seed(5))
    assert torch.equal(a.tokens, b.tokens) and a.tokens.shape == (1, PROMPT_LEN + NEW)
    assert all(1 <= n <= k + 1 for n in a.stats.accept_lengths)


def test_stop_predicate_ends_generation(models):
    res = SpeculativeDecoder(models["random"], 3).generate(prompt(1), NEW, stop=lambda new: len(new) >= 5)
    assert 5 <= res.new_tokens.shape[1] <= 5 + 3


def test_fp8_head_provenance_for_draft_and_verify():
    model = build_model("tiny", seed=3, head="fp8", head_backend="dequant")
    assert model.mtp[0].head is model.lm_head
    res = SpeculativeDecoder(model, 2).generate(prompt(0), 12)
    assert res.stats.draft_head_backends == res.stats.verify_head_backends == {"fp8-dequant"}
    assert torch.equal(res.tokens, generate(model, prompt(0), 12).tokens)


# --------------------------------------------------------------------------- head sharing


def with_draft_head(model, head):
    draft = copy.copy(model.mtp[0])  # a shallow copy: same block and norms, its own `head` slot
    draft.share(model.embed_tokens, head)
    return draft


def test_head_sharing_copy_is_refused(models):
    model = models["random"]
    with pytest.raises(HeadSharingError, match=r"head sharing violated.*different module \(a copy\?\)"):
        SpeculativeDecoder(model, 3, draft=with_draft_head(model, copy.deepcopy(model.lm_head)))


def test_head_sharing_weight_tensor_only_is_refused(models):
    model = models["random"]
    head = BF16Head(model.config.hidden_size, model.config.vocab_size)
    head.weight = model.lm_head.weight
    with pytest.raises(HeadSharingError, match="head sharing violated.*shares only a weight tensor"):
        SpeculativeDecoder(model, 3, draft=with_draft_head(model, head))
    with pytest.raises(HeadSharingError, match="head sharing"):
        SpeculativeDecoder(model, 3, draft=with_draft_head(model, model.lm_head.weight))


def test_head_sharing_other_dtype_is_refused(models):
    model = models["random"]
    other = copy.deepcopy(model.lm_head).to(torch.bfloat16)
    with pytest.raises(HeadSharingError, match=r"head sharing violated.*torch\.bfloat16"):
        SpeculativeDecoder(model, 3, draft=with_draft_head(model, other))


def test_head_sharing_fp8_bytes_without_scales_are_refused():
    model = build_model("tiny", seed=3, head="fp8", head_backend="dequant")
    fp8 = model.lm_head.fp8_weight
    head = BF16Head(model.config.hidden_size, model.config.vocab_size)
    with torch.no_grad():
        head.weight.copy_(fp8.data.to(torch.float32))  # e4m3 values, scales dropped
    with pytest.raises(HeadSharingError, match="head sharing violated.*BF16Head.*FP8Head"):
        SpeculativeDecoder(model, 3, draft=with_draft_head(model, head))


def test_quantize_head_repoints_the_draft():
    model = build_model("tiny", seed=3)
    old = model.lm_head
    model.quantize_head(backend="dequant")
    assert model.mtp[0].head is model.lm_head is not old
    SpeculativeDecoder(model, 2)


def test_swapping_the_head_back_repoints_the_draft():
    """A quantized trial undone (as the FP8 head parity suite does on the shared model) leaves the
    draft on the restored head: a later speculative suite in the same process must not find the
    draft still holding the FP8 head (it did, under xdist, when only `lm_head` was restored)."""
    model = build_model("tiny", seed=3)
    original = model.lm_head
    model.quantize_head(backend="dequant")
    assert model.set_head(original) is original
    assert model.mtp[0].head is model.lm_head is original
    SpeculativeDecoder(model, 2)


# --------------------------------------------------------------------------- bad input


@pytest.mark.parametrize("k", [0, 9, -1, 2.0])
def test_k_out_of_range(models, k):
    with pytest.raises(ValueError, match=r"k \(draft tokens per step\) must be an int in \[1, 8\]"):
        SpeculativeDecoder(models["random"], k)


@pytest.mark.parametrize("kwargs,match", [
    (dict(temperature=-0.1), "temperature must be >= 0"),
    (dict(temperature=1.0, top_p=0.0), r"top_p must be in \(0, 1\]"),
    (dict(temperature=1.0, top_p=1.5), r"top_p must be in \(0, 1\]"),
])
def test_bad_sampling(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingConfig(**kwargs)


def test_prompt_longer_than_cache(models):
    model = models["random"]
    long = torch.zeros(model.config.max_seq_len + 1, dtype=torch.long)
    with pytest.raises(ValueError, match="exceeds the cache length 384"):
        SpeculativeDecoder(model, 3).generate(long, 1)
    with pytest.raises(ValueError, match=r"prompt \(380\) \+ max_new_tokens \(2\) \+ k \(3\) = 385 exceeds"):
        SpeculativeDecoder(model, 3).generate(long[:380], 2)


def test_bad_prompt_and_length(models):
    decoder = SpeculativeDecoder(models["random"], 2)
    with pytest.raises(ValueError, match="batch 1"):
        decoder.generate(torch.zeros(2, 4, dtype=torch.long), 4)
    with pytest.raises(ValueError, match="max_new_tokens must be >= 1"):
        decoder.generate(prompt(0), 0)
    with pytest.raises(ValueError, match=r"token ids must be in \[0, 128\)"):
        decoder.generate(torch.tensor([1, 200]), 4)


def test_model_without_mtp_layer():
    model = build_model(get_config("tiny", num_mtp_layers=0))
    with pytest.raises(ValueError, match="has no MTP .*NEXTN.* layer to draft with"):
        SpeculativeDecoder(model, 3)
