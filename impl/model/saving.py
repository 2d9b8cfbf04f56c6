"""Write a model as a transformers-format GLM-4.5-MoE checkpoint (`glm4_moe`: config.json +
model.safetensors) that impl.model.loading reads back.

GLM-4.5 is the family whose layout matches the model: sigmoid routing with a correction bias,
shared experts, and NEXTN layers stored as extra decoder layers `model.layers.{num_layers + j}`
holding `enorm`, `hnorm`, `eh_proj`, `shared_head.norm`, plus copies of the shared
`embed_tokens` and `shared_head.head` as transformers expects. Experts are written one tensor
per expert, as the hub checkpoints store them.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from impl.model.causal_lm import MoECausalLM
from impl.model.loading import PRENORM_MTP_KEY

_MTP_RENAMES = {"final_norm.": "shared_head.norm."}


def _checkpoint_name(name: str, num_layers: int) -> str:
    if name == "lm_head.weight":
        return name
    if name.startswith("mtp."):
        j, rest = name.removeprefix("mtp.").split(".", 1)
        rest = rest.removeprefix("block.")
        for ours, theirs in _MTP_RENAMES.items():
            if rest.startswith(ours):
                rest = theirs + rest.removeprefix(ours)
        return f"model.layers.{num_layers + int(j)}.{rest}"
    return f"model.{name}"


def checkpoint_tensors(model: MoECausalLM, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """The model's weights under transformers' GLM-4.5 names (`dtype` casts all but the router)."""
    c = model.config
    out: dict[str, torch.Tensor] = {}
    for name, t in model.state_dict().items():
        if c.tie_word_embeddings and name == "lm_head.weight":
            continue
        key = _checkpoint_name(name, c.num_layers)
        t = t.detach().cpu()
        if dtype is not None and ".mlp.gate." not in key:
            t = t.to(dtype)
        if key.endswith("mlp.experts.gate_up_proj"):
            prefix = key.removesuffix("gate_up_proj")
            for e, (gate, up) in enumerate(zip(*t.chunk(2, dim=1))):
                out[f"{prefix}{e}.gate_proj.weight"] = gate.contiguous()
                out[f"{prefix}{e}.up_proj.weight"] = up.contiguous()
        elif key.endswith("mlp.experts.down_proj"):
            prefix = key.removesuffix("down_proj")
            for e, down in enumerate(t):
                out[f"{prefix}{e}.down_proj.weight"] = down.contiguous()
        else:
            out[key] = t.contiguous()
    for j in range(len(model.mtp)):
        prefix = f"model.layers.{c.num_layers + j}."
        out[prefix + "embed_tokens.weight"] = out["model.embed_tokens.weight"].clone()
        if "lm_head.weight" in out:
            out[prefix + "shared_head.head.weight"] = out["lm_head.weight"].clone()
    return out


def config_dict(model: MoECausalLM) -> dict:
    c = model.config
    if c.router != "sigmoid_grouped" or c.attention_out_bias or c.clips_swiglu:
        raise ValueError("only GLM-4.5-style models (sigmoid routing, no o_proj bias, no SwiGLU clipping) can be "
                         "written as glm4_moe")
    return {
        "model_type": "glm4_moe", "architectures": ["Glm4MoeForCausalLM"],
        "vocab_size": c.vocab_size, "hidden_size": c.hidden_size, "num_hidden_layers": c.num_layers,
        "num_attention_heads": c.num_heads, "num_key_value_heads": c.num_kv_heads, "head_dim": c.head_dim,
        "intermediate_size": c.intermediate_size, "moe_intermediate_size": c.moe_intermediate_size,
        "n_routed_experts": c.num_experts, "num_experts_per_tok": c.top_k,
        "n_shared_experts": c.num_shared_experts, "n_group": c.n_group, "topk_group": c.topk_group,
        "routed_scaling_factor": c.routed_scaling_factor, "norm_topk_prob": c.norm_topk_prob,
        "first_k_dense_replace": len(c.dense_layers), "rope_theta": c.rope_theta,
        "partial_rotary_factor": c.partial_rotary_factor, "use_qk_norm": c.qk_norm,
        "attention_bias": c.attention_bias, "rms_norm_eps": c.rms_norm_eps, "hidden_act": "silu",
        "tie_word_embeddings": c.tie_word_embeddings, "max_position_embeddings": c.max_seq_len,
        "num_nextn_predict_layers": len(model.mtp),
        # Read back by impl.model.loading: a GLM-4.5 checkpoint's NEXTN layer otherwise takes the
        # normed hidden states, as the published ones do.
        **({PRENORM_MTP_KEY: True} if model.mtp and not c.mtp_normed_hidden else {}),
    }


def save_checkpoint(model: MoECausalLM, folder: str | Path, dtype: torch.dtype | None = None,
                    metadata: dict | None = None) -> Path:
    """Write config.json and model.safetensors into `folder` (and, for a byte vocabulary, tokenizer
    files other engines can load: impl.data.text.write_byte_tokenizer); returns the safetensors path."""
    c = model.config
    if c.dense_layers != tuple(range(len(c.dense_layers))):
        raise ValueError(f"glm4_moe stores dense layers only as a prefix (first_k_dense_replace), "
                         f"got dense_layers={c.dense_layers}")
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config_dict(model), indent=2) + "\n")
    path = folder / "model.safetensors"
    save_file(checkpoint_tensors(model, dtype), path,
              metadata={k: str(v) for k, v in (metadata or {}).items()} or None)
    if c.vocab_size <= 128:
        from impl.data.text import write_byte_tokenizer
        write_byte_tokenizer(folder, c.vocab_size, c.max_seq_len)
    return path
