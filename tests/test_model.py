"""Tests for the model itself: presets and their parameter counts, ModelConfig validation,
build_model errors, the KV-cache path against the full forward, input validation, and
provenance of the MoE backend that actually ran."""

from __future__ import annotations

import math
import re

import pytest
import torch

import impl.model.build as build_mod
from impl import backends
from impl.backends import Backend, record_provenance
from impl.model import PRESETS, MoECausalLM, ModelConfig, build_model, get_config
from impl.model.layers import MoEBlock, Router
from impl.moe import moe_reference
from tests.helpers import rel_err

# KV-cache vs full forward in fp32: the same weights, a different attention shape (masked
# attention over the whole cache vs causal over the prompt), so only op order differs: ~1e-7.
# 1e-5 leaves headroom while a wrong position, mask or cache slot gives >= 1e-3.
RTOL = 1e-5

SMALL = dict(vocab_size=64, hidden_size=32, num_layers=3, num_heads=4, num_kv_heads=2, head_dim=8,
             intermediate_size=48, num_experts=8, top_k=2, moe_intermediate_size=16)


def meta_param_count(config: ModelConfig) -> int:
    with torch.device("meta"):
        model = MoECausalLM(config)
    return sum(p.numel() for p in model.parameters())  # parameters() counts tied weights once


def randomize_(model: MoECausalLM, seed: int) -> MoECausalLM:
    """Weights large enough that attention is far from uniform and norms are not all ones, so a
    wrong cache slot, position or mask is visible in the logits (init_weights' std 0.02 is not)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.3 * noise)
            elif name.endswith(".bias"):
                p.copy_(0.3 * noise)
            elif "embed_tokens" in name:
                p.copy_(noise)
            else:
                p.copy_(noise * 1.5 / math.sqrt(p.shape[-1]))
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.3 * torch.randn(b.shape, generator=gen))
    return model


@pytest.fixture(scope="module")
def tiny():
    return randomize_(build_model("tiny"), seed=1)


def random_ids(seed: int, batch: int, seq: int, vocab: int = 128) -> torch.Tensor:
    return torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(seed))


# --------------------------------------------------------------------------- presets


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_every_preset_is_valid_and_counted_exactly(name):
    config = get_config(name)
    assert isinstance(config, ModelConfig) and config.name == name
    assert config.num_parameters() == meta_param_count(config)


@pytest.mark.parametrize("overrides", [
    dict(),
    dict(qk_norm=True, attention_bias=True, attention_out_bias=True),
    dict(tie_word_embeddings=True),
    dict(num_shared_experts=2, dense_layers=(0, 2), router="sigmoid_grouped", n_group=2, topk_group=1),
    dict(num_shared_experts=0, dense_layers=(1,), partial_rotary_factor=0.5),
], ids=["plain", "qknorm-biases", "tied", "shared2-dense2", "dense1"])
def test_num_parameters_matches_meta_model(overrides):
    config = ModelConfig(**SMALL, **overrides)
    assert config.num_parameters() == meta_param_count(config)


@pytest.mark.parametrize("name,experts,top_k,hidden,moe_inter", [
    ("ling-3.0-flash", 512, 8, 2560, 768),
    ("ling-flash-2.0", 256, 8, 4096, 1024),
])
def test_ling_presets_have_the_real_moe_and_head_shapes(name, experts, top_k, hidden, moe_inter):
    """The shapes of the model built from the preset (on meta: no memory), not only the config."""
    config = get_config(name)
    assert (config.num_experts, config.top_k, config.hidden_size, config.moe_intermediate_size,
            config.vocab_size) == (experts, top_k, hidden, moe_inter, 157184)
    with torch.device("meta"):
        model = MoECausalLM(config)
    assert model.lm_head.weight.shape == (157184, hidden)
    assert model.embed_tokens.weight.shape == (157184, hidden)
    moe = [layer.mlp for layer in model.layers if isinstance(layer.mlp, MoEBlock)]
    assert len(moe) == config.num_layers - len(config.dense_layers) > 0
    for block in moe:
        assert block.experts.gate_up_proj.shape == (experts, 2 * moe_inter, hidden)
        assert block.experts.down_proj.shape == (experts, hidden, moe_inter)
        assert block.gate.weight.shape == (experts, hidden)
        assert block.gate.e_score_correction_bias.shape == (experts,)
    assert config.router == "sigmoid_grouped" and config.num_experts % config.n_group == 0


def test_ling_3_flash_preset_is_the_hybrid_architecture():
    """35 KDA and 7 MLA layers (every 6th), 576 cached values a token per MLA layer, no
    approximation left to declare; the model built from it (on meta) has those modules."""
    from impl.model.kda import KDAAttention
    from impl.model.mla import MLAAttention
    config = get_config("ling-3.0-flash")
    assert config.approximations == ()
    assert [i for i, k in enumerate(config.attention_types) if k == "mla"] == [5, 11, 17, 23, 29, 35, 41]
    assert config.kv_lora_rank + config.qk_rope_head_dim == 576
    with torch.device("meta"):
        model = MoECausalLM(config, expert_format="mxfp4")
    kinds = [type(layer.self_attn) for layer in model.layers]
    assert kinds.count(KDAAttention) == 35 and kinds.count(MLAAttention) == 7
    assert isinstance(model.mtp[0].block.self_attn, MLAAttention) and config.mtp_normed_hidden
    assert model.layers[2].mlp.experts.gate_up_packed.shape == (512, 1536, 1280)
    assert sum(p.numel() for p in model.parameters()) + sum(
        b.numel() * 2 for n, b in model.named_buffers() if n.endswith("_packed")) == config.num_parameters()
    # Every approximation a preset declares is a readable sentence, not a placeholder.
    for name in PRESETS:
        assert all(isinstance(n, str) and len(n) > 20 for n in get_config(name).approximations)


def test_get_config_overrides_and_unknown_name():
    config = get_config("tiny", top_k=3, max_seq_len=100)
    assert (config.top_k, config.max_seq_len) == (3, 100)
    assert config.num_experts == PRESETS["tiny"]["num_experts"]
    with pytest.raises(ValueError, match=r"unknown model preset 'nope'.*'tiny'"):
        get_config("nope")


# --------------------------------------------------------------------------- ModelConfig validation


@pytest.mark.parametrize("overrides,message", [
    (dict(num_heads=6, num_kv_heads=4), r"num_heads \(6\) must be a multiple of num_kv_heads \(4\)"),
    (dict(top_k=9), r"top_k must be in \[1, num_experts=8\], got 9"),
    (dict(top_k=0), r"top_k must be positive, got 0"),
    (dict(router="hash"), r"unknown router 'hash'"),
    (dict(head_dim=8, partial_rotary_factor=0.375), r"must be an even integer, got 3"),
    (dict(head_dim=8, partial_rotary_factor=0.3), r"must be an even integer"),
    (dict(dense_layers=(3,)), r"dense_layers \[3\] outside \[0, 3\)"),
    (dict(dense_layers=(0, -1)), r"dense_layers \[-1\] outside \[0, 3\)"),
    (dict(hidden_size=0), r"hidden_size must be positive, got 0"),
    (dict(num_experts=-8), r"num_experts must be positive"),
    (dict(router="sigmoid_grouped", n_group=3), r"divisible by n_group \(3\)"),
    (dict(router="sigmoid_grouped", n_group=0), r"divisible by n_group \(0\)"),
    (dict(router="sigmoid_grouped", n_group=2, topk_group=3), r"topk_group \(3\) <= n_group"),
    (dict(router="sigmoid_grouped", n_group=4, topk_group=1, top_k=3), r"top_k \(3\) exceeds the experts"),
])
def test_model_config_validation(overrides, message):
    with pytest.raises(ValueError, match=message):
        ModelConfig(**{**SMALL, **overrides})


def test_model_config_derived_sizes():
    config = ModelConfig(**SMALL, partial_rotary_factor=0.5, num_shared_experts=3, dense_layers=(1,))
    assert config.rotary_dim == SMALL["head_dim"] // 2
    assert config.shared_intermediate_size == 3 * SMALL["moe_intermediate_size"]
    assert [config.is_moe_layer(i) for i in range(3)] == [True, False, True]


# --------------------------------------------------------------------------- build_model errors


def test_build_unknown_preset():
    with pytest.raises(ValueError, match=r"^model spec 'nope' is neither a preset"):  # no plugin option named
        build_model("nope")


def test_build_cuda_when_unavailable(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match=r"'cuda' requested but CUDA is not available"):
        build_model("tiny", device="cuda")


def test_build_cuda_index_out_of_range(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(ValueError, match=r"'cuda:3' requested but only 1 CUDA device"):
        build_model("tiny", device="cuda:3")


def test_build_unsupported_device():
    for device in ("tpu", "meta", "xpu"):
        with pytest.raises(ValueError, match=rf"unsupported device '{device}'; use cpu, cuda"):
            build_model("tiny", device=device)


@pytest.mark.parametrize("name", ["ling-flash-2.0", "ling-3.0-flash"])
def test_build_ling_on_cpu_runs_out_of_memory(monkeypatch, name):
    """Refused up front, naming the GiB its weights need; free memory pinned to 16 GiB so the
    test never tries a real ~400 GiB allocation on a machine that happens to have it."""
    monkeypatch.setattr(build_mod, "_free_bytes", lambda device: 16 * 2**30)
    for dtype, bytes_per in ((torch.float32, 4), (torch.bfloat16, 2)):
        need = get_config(name).num_parameters() * bytes_per / 2**30
        assert need > 100  # a 100B-parameter model
        with pytest.raises(MemoryError, match=rf"{re.escape(name)}.* needs {need:.1f} GiB .*16\.0 GiB free"):
            build_model(name, dtype=dtype, experts="dense")


def test_build_takes_the_configs_expert_format_by_default(monkeypatch):
    """experts="auto" (the default) is MXFP4 for ling-3.0-flash (its checkpoint's format; bf16
    would not fit) and dense for the others."""
    monkeypatch.setattr(build_mod, "_free_bytes", lambda device: 16 * 2**30)
    with pytest.raises(MemoryError, match="with MXFP4 experts"):
        build_model("ling-3.0-flash", dtype=torch.bfloat16)
    assert build_model("tiny").layers[1].mlp.experts.format == "dense"
    with pytest.raises(ValueError, match="expert_format must be 'dense' or 'mxfp4'"):
        get_config("tiny", expert_format="fp4")


def test_build_unknown_moe_backend():
    with pytest.raises(ValueError, match=r"unknown moe backend 'nope'; available: .*'gather'.*'reference'"):
        build_model("tiny", moe_backend="nope")


def test_build_seed_determines_weights():
    a, b, c = build_model("tiny", seed=3), build_model("tiny", seed=3), build_model("tiny", seed=4)
    for (name, pa), pb, pc in zip(a.named_parameters(), b.parameters(), c.parameters()):
        assert torch.equal(pa, pb), name
        if not name.endswith(("norm.weight", ".bias")):
            assert not torch.equal(pa, pc), name


def test_build_bf16_keeps_router_fp32():
    fp32 = randomize_(build_model("tiny"), seed=2)
    bf16 = build_model("tiny", dtype=torch.bfloat16)
    bf16.load_state_dict(fp32.state_dict())
    routers = [m for m in bf16.modules() if isinstance(m, Router)]
    assert routers and all(r.weight.dtype == torch.float32 for r in routers)
    assert all(r.e_score_correction_bias.dtype == torch.float32 for r in routers)
    assert bf16.embed_tokens.weight.dtype == torch.bfloat16
    ids = random_ids(5, 2, 12)
    with torch.no_grad():
        got, ref = bf16(ids), fp32(ids)
    assert got.dtype == torch.bfloat16
    # bf16 keeps 8 mantissa bits (~4e-3 per rounding) through 4 layers; 5e-2 bounds that, while
    # a model that ignored the weights or mixed up layers would be off by O(1).
    assert rel_err(got, ref) <= 5e-2, rel_err(got, ref)


# --------------------------------------------------------------------------- KV cache


def test_forward_is_lm_head_of_hidden_states(tiny):
    ids = random_ids(6, 2, 9)
    with torch.no_grad():
        h = tiny.hidden_states(ids)
        assert torch.equal(tiny(ids), tiny.lm_head(h))


def test_kv_cache_decode_equals_full_forward():
    model = randomize_(build_model("tiny"), seed=7)
    ids = random_ids(8, 2, 24)
    with torch.no_grad():
        full = model(ids)
        model.setup_caches(max_batch_size=2, max_seq_len=64)
        prefill = 7
        out = [model(ids[:, :prefill], torch.arange(prefill))]
        for t in range(prefill, ids.shape[1]):
            out.append(model(ids[:, t:t + 1], torch.tensor([t])))
    got = torch.cat(out, dim=1)
    assert got.shape == full.shape
    for t in range(ids.shape[1]):  # per position: an error at one step must not hide in the total
        assert rel_err(got[:, t], full[:, t]) <= RTOL, (t, rel_err(got[:, t], full[:, t]))


def test_kv_cache_prompt_in_chunks():
    model = randomize_(build_model("tiny"), seed=9)
    ids = random_ids(10, 2, 30)
    chunks = [5, 1, 8, 3, 13]
    assert sum(chunks) == ids.shape[1]
    with torch.no_grad():
        full = model(ids)
        model.setup_caches(max_batch_size=2, max_seq_len=ids.shape[1])  # exactly full at the end
        out, start = [], 0
        for n in chunks:
            out.append(model(ids[:, start:start + n], torch.arange(start, start + n)))
            start += n
    assert rel_err(torch.cat(out, 1), full) <= RTOL


def test_kv_cache_reused_for_a_new_sequence_and_smaller_batch():
    """A second prompt overwrites the cache from position 0; a batch smaller than the cache's uses
    its first rows. Neither may see the first sequence's keys."""
    model = randomize_(build_model("tiny"), seed=11)
    first, second = random_ids(12, 2, 10), random_ids(13, 1, 10)
    with torch.no_grad():
        model.setup_caches(max_batch_size=2, max_seq_len=16)
        model(first, torch.arange(10))
        model.setup_caches(max_batch_size=2, max_seq_len=16)  # same sizes: the cache is kept
        got = torch.cat([model(second[:, :6], torch.arange(6)),
                         *(model(second[:, t:t + 1], torch.tensor([t])) for t in range(6, 10))], dim=1)
        cached = (model.cache_batch_size, model.cache_seq_len)
        model.cache_batch_size = model.cache_seq_len = 0  # the plain path, same weights
        for layer in model.layers:
            layer.self_attn.kv_cache = None
        full = model(second)
    assert cached == (2, 16)
    assert rel_err(got, full) <= RTOL


def test_gather_and_reference_backends_agree(tiny):
    ids = random_ids(14, 2, 11)
    with torch.no_grad():
        tiny.set_moe_backend("gather")
        a = tiny(ids)
        tiny.set_moe_backend("reference")
        b = tiny(ids)
        tiny.set_moe_backend("gather")
    # Two fp32 contraction orders of the same MoE: ~1e-7.
    assert rel_err(a, b) <= RTOL


# --------------------------------------------------------------------------- input validation


def test_input_validation_without_cache(tiny):
    ids = random_ids(15, 2, 5)
    with pytest.raises(ValueError, match=r"input_ids must be an int tensor \[batch, seq\], got torch.float32"):
        tiny(ids.float())
    with pytest.raises(ValueError, match=r"got torch.int64 \(5,\)"):
        tiny(ids[0])
    too_long = random_ids(16, 1, tiny.config.max_seq_len + 1)
    with pytest.raises(ValueError, match=rf"sequence of {tiny.config.max_seq_len + 1} exceeds max_seq_len"):
        tiny(too_long)


def test_input_validation_with_cache():
    model = build_model("tiny")
    model.setup_caches(max_batch_size=2, max_seq_len=32)
    ids = random_ids(17, 2, 4)
    with pytest.raises(ValueError, match=r"input_pos must be \[seq=4\], got None"):
        model(ids)
    for bad in (torch.arange(3), torch.arange(4)[None], torch.arange(8).view(2, 4)):
        with pytest.raises(ValueError, match=rf"input_pos must be \[seq=4\], got {re.escape(str(tuple(bad.shape)))}"):
            model(ids, bad)
    with pytest.raises(ValueError, match=r"batch 3 exceeds the cache's 2"):
        model(random_ids(18, 3, 4), torch.arange(4))
    with pytest.raises(ValueError, match="must be an int tensor"):
        model(ids.to(torch.float16), torch.arange(4))


@pytest.mark.parametrize("length", [0, 385, 10_000])
def test_cache_length_out_of_range(length):
    model = build_model("tiny")
    assert model.config.max_seq_len == 384
    with pytest.raises(ValueError, match=rf"cache length must be in \[1, 384\].*got {length}"):
        model.setup_caches(max_batch_size=1, max_seq_len=length)
    model.setup_caches(max_batch_size=1, max_seq_len=384)  # the boundary is allowed
    assert model.cache_seq_len == 384


# --------------------------------------------------------------------------- provenance and backends


def n_moe_layers(model: MoECausalLM) -> int:
    return sum(isinstance(layer.mlp, MoEBlock) for layer in model.layers)


def test_provenance_records_the_backend_that_ran():
    model = build_model("tiny", moe_backend="gather")
    ids = random_ids(19, 2, 6)
    with torch.no_grad(), record_provenance() as prov:
        model(ids)
    assert model.moe_backend == "gather"
    assert prov.backends("moe") == {"gather"} and prov.kernels("moe") == {"moe_gather"}
    moe_events = [e for e in prov.events if e.kind == "moe"]
    assert len(moe_events) == n_moe_layers(model) == 4
    assert all(e.config == {"tokens": 12} for e in moe_events)

    model.set_moe_backend("reference")
    with torch.no_grad(), record_provenance() as prov:
        model(ids)
    assert model.moe_backend == "reference"
    assert prov.backends("moe") == {"reference"} and prov.kernels("moe") == {"moe_reference"}
    assert len([e for e in prov.events if e.kind == "moe"]) == 4

    # Outside a recording nothing accumulates in the old one.
    with torch.no_grad():
        model(ids)
    assert len([e for e in prov.events if e.kind == "moe"]) == 4


def test_set_unknown_backend_lists_available():
    model = build_model("tiny")
    with pytest.raises(ValueError, match=r"unknown moe backend 'nope'; available: \[.*'gather'.*'reference'.*\]"):
        model.set_moe_backend("nope")
    assert model.moe_backend == "gather"  # unchanged after the failed switch


@pytest.fixture
def mine_backend():
    calls: list[tuple[int, int]] = []
    state = {"scale": 1.0}

    def fn(x, weights, ids, w_gate_up, w_down, shared=None):
        calls.append((x.shape[0], ids.shape[1]))
        backends.note("moe", "mine", "my_kernel", tokens=x.shape[0])
        return moe_reference(x, weights, ids, w_gate_up, w_down, shared) * state["scale"]

    backends.register(Backend("moe", "mine", fn, "test backend"))
    try:
        yield calls, state
    finally:
        backends._registry.pop(("moe", "mine"))


def test_user_backend_is_used_by_the_model(mine_backend):
    calls, state = mine_backend
    assert "mine" in backends.available("moe")
    model = randomize_(build_model("tiny", moe_backend="reference"), seed=20)
    ids = random_ids(21, 2, 7)
    with torch.no_grad():
        ref = model(ids)
        model.set_moe_backend("mine")
        with record_provenance() as prov:
            same = model(ids)
        state["scale"] = 0.5
        halved = model(ids)
    assert calls == [(14, 2)] * 8  # every MoE layer of both forwards, 14 tokens, top-2
    assert prov.backends("moe") == {"mine"} and prov.kernels("moe") == {"my_kernel"}
    assert torch.equal(same, ref)  # it computes exactly what the reference does...
    assert rel_err(halved, ref) > 1e-2  # ...and its output, not another's, reaches the logits


def test_user_backend_cleanup_leaves_registry_as_before():
    before = backends.available("moe")
    assert "mine" not in before
    with pytest.raises(ValueError, match="unknown moe backend 'mine'"):
        build_model("tiny", moe_backend="mine")


def test_ling_3_flash_with_mxfp4_experts_is_sized_to_fit_one_gpu(monkeypatch):
    """In bf16 it needs about 237 GiB; with MXFP4 experts about 68 GiB (what the H200's 139 GiB
    holds); refused up front when less is free, naming the format."""
    config = get_config("ling-3.0-flash")
    dense, mx = (build_mod.weight_bytes(config, torch.bfloat16, e) / 2**30 for e in ("dense", "mxfp4"))
    assert dense > 200 and 60 < mx < 80, (dense, mx)
    monkeypatch.setattr(build_mod, "_free_bytes", lambda device: 16 * 2**30)
    with pytest.raises(MemoryError, match=rf"needs {mx:.1f} GiB of weights in torch.bfloat16 with MXFP4 experts"):
        build_model("ling-3.0-flash", dtype=torch.bfloat16, experts="mxfp4")
