"""impl.model.roofline: bytes per decode token by component, against counts written out by hand
from the config's fields (an independent formula, not the module's parameter walk), and the
reference result's own figure (about 4.67 GB a token for Ling-3.0-flash with MXFP4 experts and FP8
elsewhere, about 17 ms of floor at DGX Spark's 273 GB/s)."""

from __future__ import annotations

import pytest

from impl.model.config import get_config
from impl.model.roofline import (Formats, expected_distinct_experts, floor_ms, kda_verify_state_passes, matrix_bytes,
                                  mtp_bytes, mtp_parts, spec_step_bytes, token_bytes, tpot_floor_s)

BF16 = Formats(experts="bf16", projections="bf16", head="bf16")
REFERENCE = Formats(experts="mxfp4", projections="fp8", head="fp8")


def hand_counts(c, context: int) -> dict[str, float]:
    """bf16 everywhere, from the config: what each component of ling-3.0-tiny reads."""
    h, kinds = c.hidden_size, c.attention_types
    n_kda, n_mla = kinds.count("kda"), kinds.count("mla")
    hd = c.linear_num_heads * c.linear_head_dim
    kda = 2 * (5 * hd * h + c.linear_num_heads * h + hd * h) \
        + 4 * (3 * hd * c.conv_kernel_size + c.linear_num_heads + hd)
    qk = c.qk_nope_head_dim + c.qk_rope_head_dim
    mla = 2 * (h * c.num_heads * qk + h * (c.kv_lora_rank + c.qk_rope_head_dim)
               + c.kv_lora_rank * c.num_heads * (c.qk_nope_head_dim + c.v_head_dim)
               + c.num_heads * c.v_head_dim * h + c.num_heads * h)
    moe_layers = c.num_layers - len(c.dense_layers)
    expert = 3 * h * c.moe_intermediate_size * 2
    norms = 2 * h * (2 * c.num_layers + 1) + 2 * (n_kda * c.linear_head_dim + n_mla * c.kv_lora_rank)
    return {
        "attention kda": n_kda * kda, "attention mla": n_mla * mla,
        "kda state": n_kda * 2 * 4 * (c.linear_num_heads * c.linear_head_dim ** 2 + 3 * hd * (c.conv_kernel_size - 1)),
        "mla cache": n_mla * (context + 2) * (c.kv_lora_rank + c.qk_rope_head_dim) * 2,
        "routed experts": moe_layers * c.top_k * expert,
        "shared expert": moe_layers * c.num_shared_experts * expert,
        "router": moe_layers * 4 * (c.num_experts * h + c.num_experts),
        "dense mlp": len(c.dense_layers) * 3 * h * c.intermediate_size * 2,
        "norms": norms, "head": 2 * c.vocab_size * h, "embedding row": 2 * h,
    }


@pytest.mark.parametrize("context", [0, 100])
def test_components_match_the_hand_count(context):
    c = get_config("ling-3.0-tiny")
    got = token_bytes(c, context, BF16)
    want = hand_counts(c, context)
    assert set(got) == set(want)
    for name, value in want.items():
        assert got[name] == pytest.approx(value, rel=1e-12), name


def test_formats_change_only_their_components():
    c = get_config("ling-3.0-tiny")
    bf16, ref = token_bytes(c, 64, BF16), token_bytes(c, 64, REFERENCE)
    assert ref["routed experts"] == pytest.approx(bf16["routed experts"] * (17 / 32) / 2)
    rows = c.vocab_size
    assert ref["head"] == pytest.approx(bf16["head"] / 2 + 4 * rows)  # e4m3 plus a scale per row
    for name in ("kda state", "mla cache", "router", "norms", "embedding row"):
        assert ref[name] == bf16[name], name


def test_the_reference_results_bytes_per_token():
    """Ling-3.0-flash, MXFP4 experts, FP8 elsewhere: the reference result's about 4.67 GB a token
    (mid-way through its 32k-in / 2k-out requests), so about 17 ms at 273 GB/s. 3%: the reference
    gives the figure to two decimals of a GB and does not say at which context it is taken."""
    total = sum(token_bytes("ling-3.0-flash", 16384, REFERENCE).values())
    assert total == pytest.approx(4.67e9, rel=0.03)
    assert floor_ms(total, 273e9) == pytest.approx(17.1, rel=0.03)


def test_state_grows_with_context_only_for_the_caches():
    a, b = (token_bytes("ling-3.0-tiny", L, BF16) for L in (10, 11))
    c = get_config("ling-3.0-tiny")
    assert b["kda state"] == a["kda state"]
    assert b["mla cache"] - a["mla cache"] == 2 * (c.kv_lora_rank + c.qk_rope_head_dim) * 2  # a row per MLA layer


def test_mtp_layer_is_counted_apart():
    c = get_config("ling-3.0-tiny")
    assert 0 < mtp_bytes(c, 10, BF16) < sum(token_bytes(c, 10, BF16).values())


@pytest.mark.parametrize("tokens", [1, 2, 4, 16])
def test_distinct_experts_match_independent_uniform_routing(tokens):
    """Against draws of top_k distinct experts per token, uniformly and independently (what random
    router weights give, near enough). 4000 draws: the mean's standard error is below 0.1 expert
    at every case here, so 2% (0.6 of Ling-3.0-flash's 31 at 4 tokens) is over 4 of them."""
    import torch
    c = get_config("ling-3.0-flash")
    g = torch.Generator().manual_seed(tokens)
    counts = [len({e for _ in range(tokens) for e in torch.randperm(c.num_experts, generator=g)[:c.top_k].tolist()})
              for _ in range(4000)]
    assert expected_distinct_experts(c, tokens) == pytest.approx(sum(counts) / len(counts), rel=0.02)
    assert c.top_k <= expected_distinct_experts(c, tokens) <= min(c.num_experts, tokens * c.top_k)


def test_spec_step_reads_the_plain_token_plus_its_extra_passes():
    """At distinct experts = top_k a verify pass reads what a plain token does, except the KDA
    states (2 passes a token and 4 more) and the draft: the MTP layer k times, the head k times."""
    c, k, ctx = get_config("ling-3.0-tiny"), 3, 40
    plain = token_bytes(c, ctx + k, BF16)
    spec = spec_step_bytes(c, ctx, k, BF16, distinct_experts=c.top_k)
    assert kda_verify_state_passes(k + 1) == 12
    assert spec["kda state"] == pytest.approx(plain["kda state"] * 6)
    assert spec["draft"] == pytest.approx(k * mtp_bytes(c, ctx, BF16) + k * plain["head"])
    for name in set(plain) - {"kda state"}:
        assert spec[name] == pytest.approx(plain[name]), name


def test_spec_step_reads_more_experts_the_more_distinct_they_are():
    c = get_config("ling-3.0-tiny")
    low = spec_step_bytes(c, 40, 3, BF16, distinct_experts=c.top_k)
    high = spec_step_bytes(c, 40, 3, BF16, distinct_experts=2 * c.top_k)
    routed = mtp_parts(c, 40, BF16)["routed experts"]
    assert high["routed experts"] == pytest.approx(2 * low["routed experts"])
    assert high["draft"] - low["draft"] == pytest.approx(routed)  # only the MTP pass over the k+1 positions
    default = spec_step_bytes(c, 40, 3, BF16)
    assert default["routed experts"] == pytest.approx(
        low["routed experts"] * expected_distinct_experts(c, 4) / c.top_k)


def test_spec_step_rejects_impossible_steps():
    c = get_config("ling-3.0-tiny")
    with pytest.raises(ValueError, match="drafts k >= 1"):
        spec_step_bytes(c, 10, 0)
    with pytest.raises(ValueError, match="distinct experts a layer"):
        spec_step_bytes(c, 10, 3, distinct_experts=c.top_k - 1)
    with pytest.raises(ValueError, match="distinct experts a layer"):
        spec_step_bytes(c, 10, 1, distinct_experts=2 * c.top_k + 1)
    with pytest.raises(ValueError, match="tokens must be >= 1"):
        expected_distinct_experts(c, 0)


def test_bad_formats_and_contexts_are_rejected():
    with pytest.raises(ValueError, match="experts format must be one of"):
        Formats(experts="int4")
    with pytest.raises(ValueError, match="head format must be one of"):
        Formats(head="fp4")
    with pytest.raises(ValueError, match="context must be >= 0"):
        token_bytes("ling-3.0-tiny", -1)
    with pytest.raises(ValueError, match="unknown weight format"):
        matrix_bytes((2, 2), "int8")


def test_a_requests_tpot_floor_is_its_mean_tokens_bytes_at_the_bandwidth():
    """The plain floor: the bytes of the tokens decoded at positions 40..46 (8 output tokens, the
    first from the prompt pass), summed one by one, over 7 tokens, at 1 TB/s; the speculative floor:
    a step's bytes over the tokens it commits."""
    c, bw = get_config("ling-3.0-tiny"), 1e12
    by_token = [sum(token_bytes(c, p, BF16).values()) for p in range(40, 47)]
    got = tpot_floor_s(c, 40, 8, BF16, bw)
    assert got == pytest.approx(sum(by_token) / 7 / bw)
    # Negative control: the prompt's own length is not where the decode tokens read their caches.
    assert got > sum(token_bytes(c, 40, BF16).values()) / bw * (1 + 1e-6)
    assert tpot_floor_s(c, 40, 8, REFERENCE, bw) < got  # MXFP4 experts and FP8 weights read fewer bytes
    steps = [sum(spec_step_bytes(c, p, 3, BF16).values()) for p in range(40, 47)]
    assert tpot_floor_s(c, 40, 8, BF16, bw, drafts=3, committed_per_step=3.5) == pytest.approx(
        sum(steps) / 7 / 3.5 / bw)


def test_a_tpot_floor_refuses_what_cannot_be():
    c = get_config("ling-3.0-tiny")
    with pytest.raises(ValueError, match="output_tokens >= 2"):
        tpot_floor_s(c, 40, 1, BF16, 1e12)
    with pytest.raises(ValueError, match="commits 1 to 4 tokens"):
        tpot_floor_s(c, 40, 8, BF16, 1e12, drafts=3, committed_per_step=4.5)
    with pytest.raises(ValueError, match="a plain decode step commits one token"):
        tpot_floor_s(c, 40, 8, BF16, 1e12, committed_per_step=2.0)
    with pytest.raises(ValueError, match="bytes_per_s must be > 0"):
        tpot_floor_s(c, 40, 8, BF16, 0.0)
