"""GLM-4.7-Flash (`glm4_moe_lite`: DeepSeek-V3's MLA on every layer, GLM-4.5's MoE) end to end
against transformers' Glm4MoeLiteForCausalLM, float64 on CPU: a tiny random checkpoint written by
save_pretrained with a NEXTN layer added in GLM's names loads through impl.model.build; its logits
match at prefill and at every decode step, the NEXTN layer's match a reference from transformers'
modules, speculative decoding equals greedy, and the serving ladder runs on it unchanged.

The tiny config keeps what sets GLM-4.7-Flash's widths apart: a nope width of no power of two
(192 there, 24 here) and a value head wider than it (256 there, 32 here), a query LoRA, one expert
group, dense layers named by `mlp_layer_types`.
"""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("transformers.models.glm4_moe_lite")
from transformers import Glm4MoeLiteConfig, Glm4MoeLiteForCausalLM, Glm4MoeLiteModel  # noqa: E402

from impl.model.build import build_model  # noqa: E402
from impl.model.loading import CheckpointError, read_config  # noqa: E402
from tests.decode_parity import (assert_decode_matches, assert_nextn_matches,  # noqa: E402
                                 assert_speculative_equals_greedy, check_ladder_runs_unchanged, write_mla_checkpoint)

LAYERS, T, PROMPT, H = 3, 40, 8, 32
# The bar the other families' parity holds (tests/test_deepseek_parity.py): float64 on both sides
# but the rope tables, MLA absorbed at decode against transformers' expanded heads.
REL_TOL = 1e-5


def hf_config(layers: int, **overrides) -> Glm4MoeLiteConfig:
    kw = dict(vocab_size=128, hidden_size=H, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=layers,
              num_attention_heads=2, num_key_value_heads=2, q_lora_rank=24, kv_lora_rank=16, qk_nope_head_dim=24,
              qk_rope_head_dim=8, v_head_dim=32, n_routed_experts=8, num_experts_per_tok=2, n_group=1, topk_group=1,
              n_shared_experts=1, routed_scaling_factor=1.8, max_position_embeddings=64,
              rope_parameters=dict(rope_type="default", rope_theta=1_000_000.0),
              mlp_layer_types=["dense"] + ["sparse"] * (layers - 1), pad_token_id=None, eos_token_id=None)
    kw.update(overrides)
    cfg = Glm4MoeLiteConfig(**kw)
    cfg._attn_implementation = "eager"
    return cfg


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_mla_checkpoint(tmp_path_factory.mktemp("glm4-lite-tiny"), Glm4MoeLiteForCausalLM, Glm4MoeLiteModel,
                                hf_config, LAYERS, H, seed=7, moe_layer=dict(mlp_layer_types=["sparse"]))


@pytest.fixture(scope="module")
def ours(checkpoint):
    return build_model(str(checkpoint[0]), dtype=torch.float64)


@pytest.fixture(scope="module")
def tokens():
    return torch.randint(0, 64, (1, T), generator=torch.Generator().manual_seed(9))


def test_config_reads_the_architecture(checkpoint):
    c = read_config(checkpoint[0])
    assert c.attention_types == ("mla",) * LAYERS and c.mtp_attention == "mla" and not c.mla_output_gate
    assert (c.dense_layers, c.num_experts, c.top_k, c.n_group, c.num_mtp_layers) == ((0,), 8, 2, 1, 1)
    assert (c.q_lora_rank, c.kv_lora_rank, c.qk_nope_head_dim, c.v_head_dim, c.rotary_dim) == (24, 16, 24, 32, 8)
    assert c.mtp_normed_hidden and c.routed_scaling_factor == 1.8 and c.rope_theta == 1_000_000.0


def test_prefill_then_decode_logits_match_transformers(checkpoint, ours, tokens):
    assert_decode_matches(ours, checkpoint[1], tokens, PROMPT, REL_TOL)


def test_nextn_logits_match_a_reference_from_transformers_modules(checkpoint, ours, tokens):
    assert_nextn_matches(ours, checkpoint, tokens, REL_TOL)


def test_dense_layers_follow_mlp_layer_types(checkpoint, tmp_path):
    """A layer named dense past the first is dense here too; a list of the wrong length or an
    unknown kind is refused, naming the file."""
    raw = json.loads((checkpoint[0] / "config.json").read_text())
    for types, want in ((["dense", "sparse", "dense"], (0, 2)), (["dense", "sparse"], None), (["dense", "moe", "sparse"], None)):
        (tmp_path / "config.json").write_text(json.dumps({**raw, "mlp_layer_types": types}))
        if want is None:
            with pytest.raises(CheckpointError, match=r"config\.json: mlp_layer_types must name"):
                read_config(tmp_path)
        else:
            assert read_config(tmp_path).dense_layers == want


def test_speculative_with_rejections_equals_greedy(ours, tokens):
    assert_speculative_equals_greedy(ours, tokens[0, :PROMPT], 24)


def test_the_ladder_runs_on_the_checkpoint_unchanged(checkpoint):
    check_ladder_runs_unchanged(build_model(str(checkpoint[0])), ["Q: 7 + 5 =", "GLM's MLA"], 16)
