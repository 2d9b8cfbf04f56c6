"""A tiny random Ling 3.0 (`bailing_hybrid`) checkpoint written by transformers' save_pretrained, with
its NEXTN layer, and the transformers modules that are its reference (tests/test_ling_parity.py,
tests/test_ling_checkpoints.py).

The tiny config: 6 layers (KDA, KDA, MLA, KDA, KDA, MLA; the first dense), 8 experts top-2 in 2
groups, hidden 32, KDA 2 heads x 16, MLA rank 16 with 8 rope dims, one NEXTN layer (MLA + MoE).
Weights N(0, 0.2); the KDA forget gates are set so the state remembers tens of tokens (with
checkpoint-style init they forget within a few, and a mistake in carrying state would hide); the
routers' correction biases are non-zero.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from transformers import BailingHybridConfig, BailingHybridForCausalLM, BailingHybridModel

from tests.decode_parity import add_nextn_extras

LAYERS = 6
CLIP_KEYS = ("expert_swiglu_limit_list", "share_expert_swiglu_limit_list")


def hf_config(layers: int = LAYERS, **overrides) -> BailingHybridConfig:
    kw = dict(vocab_size=64, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
              num_hidden_layers=layers, num_attention_heads=2, num_key_value_heads=2, head_dim=16,
              kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16, n_group=2, topk_group=1,
              num_experts_per_tok=2, num_local_experts=8, first_k_dense_replace=1, layer_group_size=3,
              pad_token_id=None, eos_token_id=None, num_mtp_layers=1, rope_theta=10000.0)
    kw.update(overrides)
    cfg = BailingHybridConfig(**kw)
    cfg._attn_implementation = "eager"
    return cfg


def randomize(model: torch.nn.Module, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or name.endswith("layernorm.weight"):
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=g))
            elif name.endswith("A_log"):
                p.uniform_(-1.0, 1.0, generator=g)
            elif name.endswith("dt_bias"):
                p.uniform_(-6.0, -3.0, generator=g)
            else:
                p.copy_(0.2 * torch.randn(p.shape, generator=g))
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.05 * torch.randn(b.shape, generator=g))


def write_tiny_ling(folder: Path, **overrides):
    """(folder, transformers model of the main layers, transformers 1-layer model holding the
    NEXTN layer's block with its final norm as `norm`, the NEXTN extras {enorm, hnorm, eh_proj}).

    transformers has no NEXTN module; the checkpoint's layer LAYERS is written by saving a model of
    LAYERS + 1 layers whose last is MLA + MoE, then config.json is cut back to LAYERS layers and
    the layer's enorm, hnorm, eh_proj and final_layernorm are added in Ling's names."""
    types = ["linear_attention" if (i + 1) % 3 else "full_attention" for i in range(LAYERS)] + ["full_attention"]
    big = BailingHybridForCausalLM(hf_config(LAYERS + 1, layer_types=types, mlp_layer_types=["dense"] + ["sparse"] * LAYERS,
                                             **overrides)).eval()
    randomize(big, seed=0)
    big.save_pretrained(folder)
    raw = json.loads((folder / "config.json").read_text())
    raw.update(num_hidden_layers=LAYERS, layer_types=types[:LAYERS], mlp_layer_types=raw["mlp_layer_types"][:LAYERS])
    for key in ("expert_swiglu_limit_list", "share_expert_swiglu_limit_list"):  # per layer since transformers 5.25
        if isinstance(raw.get(key), list):
            raw[key] = raw[key][:LAYERS]
    (folder / "config.json").write_text(json.dumps(raw))
    extras = add_nextn_extras(folder, LAYERS, raw["hidden_size"], "final_layernorm", seed=1)

    ref = BailingHybridForCausalLM.from_pretrained(folder, attn_implementation="eager").eval()
    # The NEXTN layer never clips (SGLang and vLLM read the per-layer limits of decoder layers only).
    plain = {k: v for k, v in overrides.items() if k not in CLIP_KEYS}
    nextn = BailingHybridModel(hf_config(1, layer_types=["full_attention"], mlp_layer_types=["sparse"],
                                         **plain)).eval()
    with torch.no_grad():
        nextn.layers[0].load_state_dict(big.model.layers[LAYERS].state_dict())
        nextn.norm.weight.copy_(extras["final_layernorm"])
    return folder, ref, nextn, extras


