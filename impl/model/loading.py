"""Read transformers-format checkpoints (config.json + safetensors) of supported MoE families.

Supported: Qwen3-MoE (`qwen3_moe`) and GLM-4.5-MoE (`glm4_moe`). Experts may be stored one
tensor per expert (as transformers' `save_pretrained` and the hub checkpoints do) or fused as
[E, 2I, H] / [E, H, I]; both land in the model's fused layout. MTP (NEXTN) layers, stored as
extra decoder layers `num_hidden_layers + j` (DeepSeek-V3 / GLM-4.5 layout: `enorm`, `hnorm`,
`eh_proj`, `shared_head.norm`, a decoder block, and copies of the shared embedding and head),
load into `model.mtp[j]`; a layer past num_hidden_layers without `eh_proj` is not an MTP layer
and is skipped, and a model whose checkpoint holds no MTP layer drops its (untrained) ones.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from safetensors import safe_open

from impl.model.config import ModelConfig

SUPPORTED_ARCHITECTURES = ("qwen3_moe", "glm4_moe")
# transformers' defaults for keys a config.json may omit, where they differ between the families
# or from the fallbacks below (Qwen3MoeConfig / Glm4MoeConfig).
_FAMILY_DEFAULTS = {
    "qwen3_moe": dict(norm_topk_prob=False, rms_norm_eps=1e-6),
    "glm4_moe": dict(norm_topk_prob=True, rms_norm_eps=1e-5, partial_rotary_factor=0.5,
                     first_k_dense_replace=1, n_shared_experts=1),
}
DEFAULT_MAX_SEQ_LEN = 8192  # caps the rope tables and the largest KV cache a loaded model allows


class CheckpointError(ValueError):
    pass


def _rope(raw: dict, folder: Path) -> tuple[float, float]:
    rope = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind != "default":
        raise CheckpointError(f"{folder}: rope type {kind!r} is not supported (only 'default')")
    theta = rope.get("rope_theta", raw.get("rope_theta", 10000.0))
    return float(theta), float(rope.get("partial_rotary_factor", raw.get("partial_rotary_factor", 1.0)))


def read_config(folder: str | Path, max_seq_len: int | None = None) -> ModelConfig:
    folder = Path(folder)
    path = folder / "config.json"
    if not path.is_file():
        raise CheckpointError(f"{folder} has no config.json; expected a transformers-format checkpoint folder")
    try:
        raw = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{path} is not valid JSON: {e}") from None
    arch = raw.get("model_type")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise CheckpointError(f"{path}: architecture {arch!r} is not supported; supported: "
                              f"{list(SUPPORTED_ARCHITECTURES)}")
    raw = {**_FAMILY_DEFAULTS[arch], **raw}
    if raw.get("hidden_act", "silu") != "silu":
        raise CheckpointError(f"{path}: activation {raw['hidden_act']!r} is not supported (only silu)")
    theta, partial = _rope(raw, folder)
    layers = raw["num_hidden_layers"]
    common = dict(
        name=folder.name, vocab_size=raw["vocab_size"], hidden_size=raw["hidden_size"], num_layers=layers,
        num_heads=raw["num_attention_heads"], num_kv_heads=raw["num_key_value_heads"],
        head_dim=raw.get("head_dim") or raw["hidden_size"] // raw["num_attention_heads"],
        intermediate_size=raw["intermediate_size"], top_k=raw["num_experts_per_tok"],
        moe_intermediate_size=raw["moe_intermediate_size"], norm_topk_prob=raw.get("norm_topk_prob", True),
        rope_theta=theta, partial_rotary_factor=partial, rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
        tie_word_embeddings=raw.get("tie_word_embeddings", False),
        max_seq_len=min(raw.get("max_position_embeddings", DEFAULT_MAX_SEQ_LEN), max_seq_len or DEFAULT_MAX_SEQ_LEN),
    )
    if arch == "qwen3_moe":
        if raw.get("use_sliding_window"):
            raise CheckpointError(f"{path}: sliding-window attention is not supported")
        step, only = raw.get("decoder_sparse_step", 1), set(raw.get("mlp_only_layers") or [])
        experts = raw.get("num_experts", raw.get("num_local_experts"))
        return ModelConfig(
            **common, num_experts=experts, router="softmax", qk_norm=True,
            attention_bias=raw.get("attention_bias", False), attention_out_bias=raw.get("attention_bias", False),
            dense_layers=tuple(i for i in range(layers) if i in only or experts == 0 or (i + 1) % step),
        )
    return ModelConfig(
        **common, num_experts=raw.get("n_routed_experts", raw.get("num_local_experts")),
        router="sigmoid_grouped", n_group=raw.get("n_group", 1), topk_group=raw.get("topk_group", 1),
        routed_scaling_factor=raw.get("routed_scaling_factor", 1.0),
        num_shared_experts=raw.get("n_shared_experts", 0), qk_norm=raw.get("use_qk_norm", False),
        attention_bias=raw.get("attention_bias", False),
        dense_layers=tuple(range(min(raw.get("first_k_dense_replace", 0), layers))),
        num_mtp_layers=raw.get("num_nextn_predict_layers", 0),
    )


def _read_tensors(folder: Path) -> dict[str, torch.Tensor]:
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    else:
        files = sorted(p.name for p in folder.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{folder} holds no .safetensors files")
    tensors = {}
    for name in files:
        with safe_open(folder / name, framework="pt") as f:
            for key in f.keys():
                tensors[key] = f.get_tensor(key)
    return tensors


_EXPERT = re.compile(r"^(.*\.mlp\.experts)\.(\d+)\.(gate|up|down)_proj\.weight$")
_LAYER = re.compile(r"^layers\.(\d+)\.(.*)$")
# NEXTN tensors that are copies of the target's own modules: the model shares those instead.
_MTP_SHARED = ("embed_tokens.weight", "shared_head.head.weight")
_MTP_OWN = {"enorm.": "enorm.", "hnorm.": "hnorm.", "eh_proj.": "eh_proj.", "shared_head.norm.": "final_norm."}


def mtp_layers_in(tensors: dict[str, torch.Tensor], config: ModelConfig) -> int:
    """How many consecutive NEXTN layers (with an `eh_proj`) follow the decoder layers."""
    n = 0
    while f"model.layers.{config.num_layers + n}.eh_proj.weight" in tensors:
        n += 1
    return n


def _mtp_name(index: int, rest: str) -> str | None:
    """Our name for tensor `rest` of NEXTN layer `index`, or None for a shared copy."""
    if rest in _MTP_SHARED:
        return None
    for theirs, ours in _MTP_OWN.items():
        if rest.startswith(theirs):
            return f"mtp.{index}.{ours}{rest.removeprefix(theirs)}"
    return f"mtp.{index}.block.{rest}"


def _to_model_names(tensors: dict[str, torch.Tensor], config: ModelConfig,
                    num_mtp: int = 0) -> dict[str, torch.Tensor]:
    """Rename to the model's parameter names and fuse per-expert tensors; the first `num_mtp`
    layers past the decoder layers go to `mtp.{j}`, any others are skipped."""
    out: dict[str, torch.Tensor] = {}
    per_expert: dict[str, dict[str, dict[int, torch.Tensor]]] = {}
    for key, t in tensors.items():
        name = key.removeprefix("model.")
        layer = _LAYER.match(name)
        if layer and int(layer.group(1)) >= config.num_layers:
            j = int(layer.group(1)) - config.num_layers
            if j >= num_mtp:
                continue  # not an MTP layer the model holds
            name = _mtp_name(j, layer.group(2))
            if name is None:
                continue
        m = _EXPERT.match(name)
        if m:
            per_expert.setdefault(m.group(1), {}).setdefault(m.group(3), {})[int(m.group(2))] = t
        else:
            out[name] = t
    for prefix, parts in per_expert.items():
        ids = sorted(parts.get("gate", {}))
        if ids != list(range(config.num_experts)) or any(sorted(parts.get(p, {})) != ids for p in ("up", "down")):
            raise CheckpointError(f"{prefix}: expected gate/up/down for experts 0..{config.num_experts - 1}, "
                                  f"found {ids}")
        gate, up, down = (torch.stack([parts[p][i] for i in ids]) for p in ("gate", "up", "down"))
        out[f"{prefix}.gate_up_proj"] = torch.cat((gate, up), dim=1)
        out[f"{prefix}.down_proj"] = down
    if config.tie_word_embeddings:
        out.pop("lm_head.weight", None)
    return out


def load_weights(model: torch.nn.Module, folder: str | Path) -> None:
    """Copy a checkpoint's tensors into `model` (strict: every parameter, no leftovers)."""
    folder = Path(folder)
    tensors = _read_tensors(folder)
    stored = mtp_layers_in(tensors, model.config)
    if stored < len(model.mtp):
        # Untrained NEXTN layers would draft noise; without them speculation refuses clearly.
        model.mtp = model.mtp[:stored]
        model.config = model.config.replace(num_mtp_layers=stored)
    state = _to_model_names(tensors, model.config, len(model.mtp))
    expected = model.state_dict()
    if model.config.tie_word_embeddings:
        expected.pop("lm_head.weight", None)
    missing, unexpected = sorted(set(expected) - set(state)), sorted(set(state) - set(expected))
    if missing or unexpected:
        raise CheckpointError(f"{folder}: tensors do not match the model; missing {missing[:8]}, "
                              f"unexpected {unexpected[:8]}")
    with torch.no_grad():
        for name, t in state.items():
            if t.shape != expected[name].shape:
                raise CheckpointError(f"{folder}: {name} has shape {tuple(t.shape)}, the config implies "
                                      f"{tuple(expected[name].shape)}")
            expected[name].copy_(t)
