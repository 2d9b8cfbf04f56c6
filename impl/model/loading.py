"""Read transformers-format checkpoints (config.json + safetensors) of supported MoE families.

Supported: Qwen3-MoE (`qwen3_moe`), GLM-4.5-MoE (`glm4_moe`), DeepSeek-V3 (`deepseek_v3`, and
Kimi-K2's `kimi_k2`: MLA on every layer, YaRN rope), GLM-4.7-Flash (`glm4_moe_lite`: DeepSeek-V3's
MLA with GLM-4.5's MoE) and Ling 3.0 (`bailing_hybrid`, in the
names its checkpoints and transformers' save_pretrained write: `word_embeddings`, `attention.*`
with `dense` for the output projection and separate `q/k/v_conv1d`, `mlp.gate.expert_bias`).
Ropes: the default, or a scaled one transformers computes without the sequence length (linear,
YaRN, Llama 3).
Experts may be stored one tensor per expert (as the hub checkpoints do) or fused as
[E, 2I, H] / [E, H, I]; both land in the model's fused layout. MTP (NEXTN) layers, stored as
extra decoder layers `num_hidden_layers + j` (`enorm`, `hnorm`, `eh_proj`, a decoder block, the
final norm as `shared_head.norm` (DeepSeek-V3 / GLM-4.5) or `final_layernorm` (Ling), perhaps
copies of the shared embedding and head), load into `model.mtp[j]`; a layer past
num_hidden_layers without `eh_proj` is not an MTP layer and is skipped, and a model whose
checkpoint holds no MTP layer drops its (untrained) ones.

Loading streams: tensors are read one at a time from their file, experts a few at a time
(quantized to MXFP4 on the way when the model holds MXFP4 experts, or copied when the checkpoint
stores MXFP4), so no more than one layer's unquantized experts are ever in memory. Quantized
weights: impl.model.weight_formats.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from safetensors import safe_open

from impl.model.config import SCALED_ROPES, ModelConfig
from impl.model.weight_formats import (CheckpointError, Quantization, Stored, as_mxfp4, deinterleave_rows,
                                       dequantize, group_keys, is_mxfp4, parse_quantization)
from impl.quant.mxfp4 import MXFP4Tensor

DEEPSEEK_V3 = ("deepseek_v3", "kimi_k2")  # Kimi-K2's config names its own type for DeepSeek-V3's architecture
# MLA on every layer, sigmoid group-limited routing, NEXTN layers: read by `_mla_config`.
MLA_FAMILIES = DEEPSEEK_V3 + ("glm4_moe_lite",)
SUPPORTED_ARCHITECTURES = ("qwen3_moe", "glm4_moe", "bailing_hybrid") + MLA_FAMILIES
# transformers' defaults for keys a config.json may omit, where they differ between the families
# or from the fallbacks below (Qwen3MoeConfig / Glm4MoeConfig).
_FAMILY_DEFAULTS = {
    "qwen3_moe": dict(norm_topk_prob=False, rms_norm_eps=1e-6),
    "glm4_moe": dict(norm_topk_prob=True, rms_norm_eps=1e-5, partial_rotary_factor=0.5,
                     first_k_dense_replace=1, n_shared_experts=1),
}
DEFAULT_MAX_SEQ_LEN = 8192  # caps the rope tables and the largest KV cache a loaded model allows
# config.json key of a checkpoint whose NEXTN layer takes the target's hidden states before the
# final norm (what impl.model.saving writes for such a model: tiny-gsm was trained so); without it
# the layer takes them after the norm, as the published DeepSeek-V3 and GLM-4.5 checkpoints' own
# modeling code gives them (vLLM and SGLang feed them so).
PRENORM_MTP_KEY = "moeperf_mtp_prenorm_hidden"




def scaled_rope_parameters(rope: dict, max_positions: int, where) -> tuple[tuple[str, object], ...]:
    """ModelConfig.rope_parameters of a config's rope dict (`rope_parameters` or the older
    `rope_scaling`): () for the default rope; a scaled one's parameters with what transformers
    fills in resolved (the original length, YaRN's factor); CheckpointError for others."""
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind == "default":
        return ()
    if kind not in SCALED_ROPES:
        raise CheckpointError(f"{where}: rope type {kind!r} is not supported; supported: default, "
                              f"{', '.join(SCALED_ROPES)}")
    params = {k: v for k, v in rope.items() if k not in ("type", "rope_theta", "partial_rotary_factor")}
    params["rope_type"] = kind
    if kind != "linear":
        params.setdefault("original_max_position_embeddings", max_positions)
    if params.get("factor") is None and kind == "yarn":  # transformers' rule for a YaRN rope without one
        params["factor"] = max_positions / params["original_max_position_embeddings"]
    return tuple(sorted(params.items()))


def _rope(raw: dict, folder: Path) -> tuple[float, float, tuple]:
    """(theta, partial rotary factor, ModelConfig.rope_parameters) of a family's raw config."""
    rope = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    theta = rope.get("rope_theta", raw.get("rope_theta", 10000.0))
    scaled = scaled_rope_parameters(rope, raw.get("max_position_embeddings", DEFAULT_MAX_SEQ_LEN), folder)
    return float(theta), float(rope.get("partial_rotary_factor", raw.get("partial_rotary_factor", 1.0))), scaled


def _raw_config(folder: Path) -> tuple[Path, dict]:
    path = folder / "config.json"
    if not path.is_file():
        raise CheckpointError(f"{folder} has no config.json; expected a transformers-format checkpoint folder")
    try:
        raw = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{path} is not valid JSON: {e}") from None
    if not isinstance(raw, dict):
        raise CheckpointError(f"{path}: expected a JSON object of config fields, got a {type(raw).__name__}")
    arch = raw.get("model_type")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise CheckpointError(f"{path}: architecture {arch!r} is not supported; supported: "
                              f"{list(SUPPORTED_ARCHITECTURES)}")
    parse_quantization(raw, path)
    return path, raw


def _bailing_config(raw: dict, path: Path, name: str, max_seq_len: int | None) -> ModelConfig:
    """A `bailing_hybrid` config.json read by transformers' own BailingHybridConfig (its defaults
    and key aliases), then mapped onto ModelConfig."""
    try:
        from transformers import BailingHybridConfig
    except ImportError:
        raise CheckpointError(f"{path}: reading a bailing_hybrid config needs transformers >= 5.24 "
                              "(BailingHybridConfig)") from None
    routed, shared = (_swiglu_limits(raw, path, keys) for keys in SWIGLU_LIMIT_KEYS)
    fields = {k: v for k, v in raw.items() if k not in ("quantization_config", "architectures", "model_type",
                                                        *SWIGLU_LIMIT_KEYS[0], *SWIGLU_LIMIT_KEYS[1])}
    try:
        c = BailingHybridConfig(**fields)
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"{path}: not a valid bailing_hybrid config: {e}") from None
    rope = dict(c.rope_parameters or {})
    if rope.get("rope_type", "default") != "default":
        raise CheckpointError(f"{path}: rope type {rope['rope_type']!r} is not supported (only 'default')")
    if c.hidden_act != "silu":
        raise CheckpointError(f"{path}: activation {c.hidden_act!r} is not supported (only silu)")
    kinds = {"linear_attention": "kda", "full_attention": "mla"}
    unknown = sorted(set(c.layer_types) - set(kinds))
    if unknown:
        raise CheckpointError(f"{path}: layer types {unknown} are not supported; known: {sorted(kinds)}")
    layers = c.num_hidden_layers
    return ModelConfig(
        name=name, vocab_size=c.vocab_size, hidden_size=c.hidden_size, num_layers=layers,
        num_heads=c.num_attention_heads, num_kv_heads=c.num_key_value_heads, head_dim=c.linear_head_dim,
        intermediate_size=c.intermediate_size, num_experts=c.num_experts, top_k=c.num_experts_per_tok,
        moe_intermediate_size=c.moe_intermediate_size, num_shared_experts=c.n_shared_experts,
        dense_layers=tuple(i for i, t in enumerate(c.mlp_layer_types) if t == "dense"),
        router="sigmoid_grouped", n_group=c.n_group, topk_group=c.topk_group, norm_topk_prob=c.norm_topk_prob,
        routed_scaling_factor=c.routed_scaling_factor, rope_theta=float(rope.get("rope_theta", c.rope_theta)),
        rms_norm_eps=c.rms_norm_eps, tie_word_embeddings=c.tie_word_embeddings, attention_bias=c.attention_bias,
        max_seq_len=min(c.max_position_embeddings, max_seq_len or DEFAULT_MAX_SEQ_LEN),
        num_mtp_layers=c.num_mtp_layers, mtp_normed_hidden=True, mtp_attention="mla",
        attention_types=tuple(kinds[t] for t in c.layer_types), linear_num_heads=c.linear_num_heads,
        linear_head_dim=c.linear_head_dim, conv_kernel_size=c.linear_conv_kernel_dim,
        kda_safe_gate=c.kda_safe_gate, kda_lower_bound=c.kda_lower_bound, kv_lora_rank=c.kv_lora_rank,
        q_lora_rank=c.q_lora_rank, qk_nope_head_dim=c.qk_nope_head_dim, qk_rope_head_dim=c.qk_rope_head_dim,
        v_head_dim=c.v_head_dim, swiglu_limits=routed, shared_swiglu_limits=shared,
    )


# Ling 3.0's SwiGLU clipping per decoder layer (its config.json's names, then transformers'
# aliases): routed experts, shared experts.
SWIGLU_LIMIT_KEYS = (("expert_swiglu_limit_list", "swiglu_limits"),
                     ("share_expert_swiglu_limit_list", "swiglu_limits_shared"))


def _swiglu_limits(raw: dict, path: Path, keys: tuple[str, str]) -> tuple[float, ...]:
    """The per-layer limits under the first of `keys` present (absent or null: none), checked as
    transformers checks them: one a decoder layer, each a number >= 0 (0: no clipping)."""
    given = [k for k in keys if raw.get(k) is not None]
    if len(given) > 1 and raw[given[0]] != raw[given[1]]:
        raise CheckpointError(f"{path}: {given[0]} and {given[1]} name the same limits and differ: "
                              f"{raw[given[0]]!r} against {raw[given[1]]!r}")
    key = given[0] if given else None
    if key is None:
        return ()
    limits, layers = raw[key], raw.get("num_hidden_layers")
    if (not isinstance(limits, list) or len(limits) != layers
            or any(isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v < float("inf") for v in limits)):
        raise CheckpointError(f"{path}: {key} must list one finite limit >= 0 a decoder layer ({layers}), got {limits!r}")
    return tuple(float(v) for v in limits) if any(limits) else ()


def _mla_config(raw: dict, path: Path, name: str, max_seq_len: int | None) -> ModelConfig:
    """A DeepSeek-V3 (`deepseek_v3`; Kimi-K2's `kimi_k2` is the same architecture) or GLM-4.7-Flash
    (`glm4_moe_lite`: DeepSeek-V3's attention, GLM-4.5's MoE) config.json read by transformers' own
    config class (its defaults), then mapped onto ModelConfig: MLA on every layer (no output gate;
    YaRN's mscale in the softmax scale), the dense layers the family names (DeepSeek's first
    `first_k_dense_replace`, GLM's `mlp_layer_types`), sigmoid group-limited routing, NEXTN layers
    fed the normed hidden states."""
    arch = raw["model_type"]
    if arch == "glm4_moe_lite":
        try:
            from transformers import Glm4MoeLiteConfig as Config
        except ImportError:
            raise CheckpointError(f"{path}: reading a glm4_moe_lite config needs a transformers with "
                                  "Glm4MoeLiteConfig") from None
    else:
        from transformers import DeepseekV3Config as Config
    for key, want in (("scoring_func", "sigmoid"), ("topk_method", "noaux_tc"), ("moe_layer_freq", 1)):
        if raw.get(key, want) != want:
            raise CheckpointError(f"{path}: {key} = {raw[key]!r} is not supported (only {want!r})")
    fields = {k: v for k, v in raw.items() if k not in ("quantization_config", "architectures", "model_type",
                                                        "auto_map")}
    try:
        c = Config(**fields)
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"{path}: not a valid {arch} config: {e}") from None
    if c.hidden_act != "silu":
        raise CheckpointError(f"{path}: activation {c.hidden_act!r} is not supported (only silu)")
    if not c.rope_interleave:
        raise CheckpointError(f"{path}: rope_interleave = false is not supported (the MLA kernels rotate "
                              "interleaved pairs, as DeepSeek-V3's checkpoints store them)")
    rope = dict(c.rope_parameters or {})
    layers = c.num_hidden_layers
    if getattr(c, "mlp_layer_types", None) is not None:
        unknown = sorted(set(c.mlp_layer_types) - {"dense", "sparse"})
        if unknown or len(c.mlp_layer_types) != layers:
            raise CheckpointError(f"{path}: mlp_layer_types must name 'dense' or 'sparse' for each of the {layers} "
                                  f"layers, got {c.mlp_layer_types}")
        dense = tuple(i for i, t in enumerate(c.mlp_layer_types) if t == "dense")
    else:
        dense = tuple(range(min(c.first_k_dense_replace, layers)))
    return ModelConfig(
        name=name, vocab_size=c.vocab_size, hidden_size=c.hidden_size, num_layers=layers,
        num_heads=c.num_attention_heads, num_kv_heads=c.num_attention_heads, head_dim=c.qk_rope_head_dim,
        intermediate_size=c.intermediate_size, num_experts=c.n_routed_experts, top_k=c.num_experts_per_tok,
        moe_intermediate_size=c.moe_intermediate_size, num_shared_experts=c.n_shared_experts or 0,
        dense_layers=dense, router="sigmoid_grouped",
        n_group=c.n_group, topk_group=c.topk_group, norm_topk_prob=c.norm_topk_prob,
        routed_scaling_factor=c.routed_scaling_factor, rope_theta=float(rope.get("rope_theta", 10000.0)),
        rope_parameters=scaled_rope_parameters(rope, c.max_position_embeddings, path),
        rms_norm_eps=c.rms_norm_eps, tie_word_embeddings=c.tie_word_embeddings, attention_bias=c.attention_bias,
        max_seq_len=min(c.max_position_embeddings, max_seq_len or DEFAULT_MAX_SEQ_LEN),
        num_mtp_layers=raw.get("num_nextn_predict_layers", 0), mtp_normed_hidden=True, mtp_attention="mla",
        attention_types=("mla",) * layers, mla_output_gate=False, kv_lora_rank=c.kv_lora_rank,
        q_lora_rank=c.q_lora_rank, qk_nope_head_dim=c.qk_nope_head_dim, qk_rope_head_dim=c.qk_rope_head_dim,
        v_head_dim=c.v_head_dim,
    )


def read_config(folder: str | Path, max_seq_len: int | None = None) -> ModelConfig:
    """The model's config from a checkpoint folder's config.json; CheckpointError naming the file
    and the problem (missing file or field, unsupported architecture or setting)."""
    return _read(Path(folder), max_seq_len)[1]


def _read(folder: Path, max_seq_len: int | None = None) -> tuple[dict, ModelConfig]:
    """(the raw config.json, the model's config) of `folder` (read_config)."""
    path, raw = _raw_config(folder)
    arch = raw["model_type"]
    try:
        if arch == "bailing_hybrid":
            return raw, _bailing_config(raw, path, folder.name, max_seq_len)
        if arch in MLA_FAMILIES:
            return raw, _mla_config(raw, path, folder.name, max_seq_len)
        return raw, _family_config(raw, path, folder, max_seq_len)
    except CheckpointError:
        raise
    except KeyError as e:
        raise CheckpointError(f"{path}: missing the field {e.args[0]!r} ({arch} needs it)") from None
    except (TypeError, ValueError) as e:  # a field of the wrong type or out of range (ModelConfig's checks)
        raise CheckpointError(f"{path}: {e}") from None


def check_checkpoint(folder: str | Path) -> ModelConfig:
    """read_config, every safetensors file's header read, and the headers' tensors against the
    model the config describes (built on the meta device: shapes, no memory): its names, and the
    shape of every tensor stored unquantized, routed experts included. A folder that cannot load
    fails here, naming the file and the tensor, before anything is built. Returns the config of
    the model it builds (NEXTN layers only as many as the weights hold); CheckpointError otherwise."""
    from impl.model.roofline import meta_model
    folder = Path(folder)
    raw, config = _read(folder)
    store = _Store(folder)
    store.check()
    model = meta_model(config.replace(num_mtp_layers=min(config.num_mtp_layers, mtp_layers_in(store.file_of, config))))
    plan = _Plan(store, model.config, len(model.mtp), raw["model_type"] == "bailing_hybrid")
    expected = _check_names(model, plan, folder)
    for name, stored in plan.plain.items():
        if stored.scale is None and expected[name].dim() > 0:  # quantized weights are checked as they load
            shape = store.shape(stored.data)
            if shape != tuple(expected[name].shape):
                raise CheckpointError(f"{store.where(stored.data)}: {name} has shape {shape}, the config implies "
                                      f"{tuple(expected[name].shape)}")
    c = model.config
    why = f"(num_experts {c.num_experts}, hidden_size {c.hidden_size}, moe_intermediate_size {c.moe_intermediate_size})"
    for prefix, parts in plan.per_expert.items():
        _, two_i, h = model.get_submodule(prefix).shapes["gate_up"]
        want = {"gate": (two_i // 2, h), "up": (two_i // 2, h), "down": (h, two_i // 2)}
        for part, experts in parts.items():
            for stored in experts.values():
                _check_shape(store, stored, want[part], why)
    for prefix, parts in plan.fused.items():
        shapes = model.get_submodule(prefix).shapes
        for part, stored in parts.items():
            _check_shape(store, stored, shapes[part], why)
    return model.config


def _check_shape(store: _Store, stored: Stored, want: tuple, why: str) -> None:
    """A weight stored unquantized has the shape the config implies (a quantized one is checked as it loads)."""
    if stored.scale is not None:
        return
    shape = store.shape(stored.data)
    if shape != tuple(want):
        raise CheckpointError(f"{store.where(stored.data)} has shape {shape}, the config {why} implies {tuple(want)}")


def _family_config(raw: dict, path: Path, folder: Path, max_seq_len: int | None) -> ModelConfig:
    arch = raw["model_type"]
    raw = {**_FAMILY_DEFAULTS[arch], **raw}
    if raw.get("hidden_act", "silu") != "silu":
        raise CheckpointError(f"{path}: activation {raw['hidden_act']!r} is not supported (only silu)")
    if not isinstance(raw.get(PRENORM_MTP_KEY, False), bool):
        raise CheckpointError(f"{path}: {PRENORM_MTP_KEY} must be true or false, got {raw[PRENORM_MTP_KEY]!r}")
    theta, partial, scaled = _rope(raw, folder)
    layers = raw["num_hidden_layers"]
    common = dict(
        name=folder.name, vocab_size=raw["vocab_size"], hidden_size=raw["hidden_size"], num_layers=layers,
        num_heads=raw["num_attention_heads"], num_kv_heads=raw["num_key_value_heads"],
        head_dim=raw.get("head_dim") or raw["hidden_size"] // raw["num_attention_heads"],
        intermediate_size=raw["intermediate_size"], top_k=raw["num_experts_per_tok"],
        moe_intermediate_size=raw["moe_intermediate_size"], norm_topk_prob=raw.get("norm_topk_prob", True),
        rope_theta=theta, partial_rotary_factor=partial, rope_parameters=scaled,
        rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
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
        num_mtp_layers=raw.get("num_nextn_predict_layers", 0), mtp_normed_hidden=not raw.get(PRENORM_MTP_KEY, False),
    )


class _Store:
    """A checkpoint folder's safetensors, read lazily: which file holds each key, one tensor at a time."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        index = folder / "model.safetensors.index.json"
        self._indexed = index.is_file()
        if self._indexed:
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError) as e:
                raise CheckpointError(f"{index}: not a safetensors index ({e})") from None
            absent = sorted({f for f in weight_map.values() if not (folder / f).is_file()})
            if absent:
                raise CheckpointError(f"{index} names files that are not in {folder}: {absent[:4]}")
            self.file_of = dict(weight_map)
        else:
            files = sorted(p.name for p in folder.glob("*.safetensors"))
            if not files:
                raise CheckpointError(f"{folder} holds no .safetensors files")
            self.file_of = {}
            for name in files:
                self.file_of.update(dict.fromkeys(self._keys(name), name))
        self._open: dict[str, object] = {}

    def _keys(self, name: str) -> list[str]:
        """The tensor names in file `name`, from its header; CheckpointError naming the file."""
        try:
            with safe_open(self.folder / name, framework="pt") as f:
                return list(f.keys())
        except Exception as e:  # safetensors raises its own SafetensorError for a damaged header
            raise CheckpointError(f"{self.folder / name}: not a readable safetensors file ({e})") from None

    def check(self) -> None:
        """Every file's header read: the index's files are otherwise opened at their first tensor
        (without an index, __init__ has read them all)."""
        if self._indexed:
            for name in sorted(set(self.file_of.values())):
                self._keys(name)

    def where(self, key: str) -> str:
        return f"{self.folder / self.file_of[key]}: {key}"

    def _handle(self, key: str):
        name = self.file_of[key]
        handle = self._open.get(name)
        if handle is None:
            handle = self._open[name] = safe_open(self.folder / name, framework="pt")
        return handle

    def shape(self, key: str) -> tuple[int, ...]:
        """Tensor `key`'s shape, from its file's header (no data read)."""
        return tuple(self._handle(key).get_slice(key).get_shape())

    def get(self, key: str) -> torch.Tensor:
        handle = self._handle(key)
        try:
            return handle.get_tensor(key)
        except Exception as e:  # safetensors raises its own error types for a key the index lies about
            raise CheckpointError(f"{self.where(key)}: cannot be read ({e})") from None


_EXPERT = re.compile(r"^(.*\.mlp\.experts)\.(\d+)\.(gate|up|down)_proj\.weight$")
_FUSED_EXPERTS = re.compile(r"^(.*\.mlp\.experts)\.(gate_up|down)_proj(?:\.weight)?$")
_LAYER = re.compile(r"^layers\.(\d+)\.(.*)$")
# NEXTN tensors that are copies of the target's own modules: the model shares those instead.
_MTP_SHARED = ("embed_tokens.weight", "word_embeddings.weight", "shared_head.head.weight", "lm_head.weight")
_MTP_OWN = {"enorm.": "enorm.", "hnorm.": "hnorm.", "eh_proj.": "eh_proj.", "shared_head.norm.": "final_norm.",
            "final_layernorm.": "final_norm."}
# Ling's checkpoint names -> the model's (transformers' bailing_hybrid conversion does the same).
_BAILING_RENAMES = ((re.compile(r"^word_embeddings\."), "embed_tokens."), (re.compile(r"\.attention\."), ".self_attn."),
                    (re.compile(r"self_attn\.(f_proj\.|dt_bias|A_log)"), r"self_attn.forget_gate.\1"),
                    (re.compile(r"\.self_attn\.dense\."), ".self_attn.o_proj."),
                    (re.compile(r"\.mlp\.gate\.expert_bias$"), ".mlp.gate.e_score_correction_bias"))
_CONV = re.compile(r"^(.*\.self_attn)\.([qkv])_conv1d\.weight$")


def mtp_layers_in(keys, config: ModelConfig) -> int:
    """How many consecutive NEXTN layers (with an `eh_proj`) follow the decoder layers."""
    keys = set(keys)
    n = 0
    while f"model.layers.{config.num_layers + n}.eh_proj.weight" in keys:
        n += 1
    return n


def _model_name(key: str, config: ModelConfig, num_mtp: int, bailing: bool) -> str | None:
    """The model's name for checkpoint weight `key` (grouped: quantization suffixes stripped), or
    None for what the model does not hold (shared copies, NEXTN layers it has no slot for)."""
    name = key.removeprefix("model.")
    if bailing:
        for pattern, repl in _BAILING_RENAMES:
            name = pattern.sub(repl, name)
    layer = _LAYER.match(name)
    if layer and int(layer.group(1)) >= config.num_layers:
        j, rest = int(layer.group(1)) - config.num_layers, layer.group(2)
        if j >= num_mtp or rest in _MTP_SHARED:
            return None
        for theirs, ours in _MTP_OWN.items():
            if rest.startswith(theirs):
                return f"mtp.{j}.{ours}{rest.removeprefix(theirs)}"
        return f"mtp.{j}.block.{rest}"
    return name


class _Plan:
    """Which stored weights make each model tensor: plain ones, KDA convolutions (q|k|v), experts."""

    def __init__(self, store: _Store, config: ModelConfig, num_mtp: int, bailing: bool) -> None:
        self.store = store
        self.plain: dict[str, Stored] = {}
        self.conv: dict[str, dict[str, Stored]] = {}
        self.per_expert: dict[str, dict[str, dict[int, Stored]]] = {}
        self.fused: dict[str, dict[str, Stored]] = {}
        for key, stored in group_keys(store.file_of).items():
            # Checked before skipping what the model does not hold, so no scale is dropped unread.
            if stored.data is None:
                raise CheckpointError(f"{store.where(stored.scale)}: a scale tensor without the weight {key} "
                                      "it scales")
            name = _model_name(key, config, num_mtp, bailing)
            if name is None:
                continue
            if m := _CONV.match(name):
                self.conv.setdefault(f"{m.group(1)}.conv1d.weight", {})[m.group(2)] = stored
            elif m := _EXPERT.match(name):
                self.per_expert.setdefault(m.group(1), {}).setdefault(m.group(3), {})[int(m.group(2))] = stored
            elif m := _FUSED_EXPERTS.match(name):
                self.fused.setdefault(m.group(1), {})[m.group(2)] = stored
            else:
                self.plain[name] = stored
        for name, parts in self.conv.items():
            if sorted(parts) != ["k", "q", "v"]:
                raise CheckpointError(f"{name}: expected q_conv1d, k_conv1d and v_conv1d, found {sorted(parts)}")

    def names(self) -> set[str]:
        experts = {f"{p}.{w}" for p in (*self.per_expert, *self.fused) for w in ("gate_up_proj", "down_proj")}
        return set(self.plain) | set(self.conv) | experts

    def file_of(self, name: str) -> str:
        """The checkpoint file holding (the first stored part of) model tensor `name` of names()."""
        if name in self.plain:
            stored = self.plain[name]
        elif name in self.conv:
            stored = next(iter(self.conv[name].values()))
        else:
            prefix = name.rsplit(".", 1)[0]
            parts = self.fused.get(prefix) or {p: next(iter(e.values())) for p, e in self.per_expert[prefix].items()}
            stored = next(iter(parts.values()))
        return self.store.file_of[stored.data]


class _Loader:
    def __init__(self, model: torch.nn.Module, store: _Store, quant: Quantization) -> None:
        self.model, self.store, self.quant = model, store, quant

    def read(self, stored: Stored) -> tuple[torch.Tensor, torch.Tensor | None]:
        data = self.store.get(stored.data)
        return data, None if stored.scale is None else self.store.get(stored.scale)

    def floats(self, stored: Stored) -> torch.Tensor:
        return dequantize(*self.read(stored), self.quant, self.store.where(stored.data))

    def copy(self, name: str, target: torch.Tensor, value: torch.Tensor, where: str) -> None:
        if value.shape != target.shape:
            raise CheckpointError(f"{where}: {name} has shape {tuple(value.shape)}, the config implies "
                                  f"{tuple(target.shape)}")
        target.copy_(value)

    def experts(self, prefix: str, plan: _Plan) -> None:
        module = self.model.get_submodule(prefix)
        e = module.shapes["gate_up"][0]
        if prefix in plan.fused:
            self._fused_experts(prefix, module, plan.fused[prefix])
            return
        parts = plan.per_expert[prefix]
        ids = sorted(parts.get("gate", {}))
        if ids != list(range(e)) or any(sorted(parts.get(p, {})) != ids for p in ("up", "down")):
            raise CheckpointError(f"{prefix}: expected gate/up/down for experts 0..{e - 1}, found {ids}")
        step = module.experts_per_chunk()
        for start in range(0, e, step):
            chunk = range(start, min(start + step, e))
            for name, pieces in (("gate_up", ("gate", "up")), ("down", ("down",))):
                stored = [[parts[p][i] for i in chunk] for p in pieces]
                self._set(module, prefix, name, start, stored)

    def _set(self, module, prefix: str, name: str, start: int, stored: list[list[Stored]]) -> None:
        """Experts start.. of `name` from per-expert weights (gate and up rows concatenated)."""
        q = [[self._expert(module, s) for s in row] for row in stored]
        where = self.store.where(stored[0][0].data)
        if all(isinstance(x, MXFP4Tensor) for row in q for x in row):
            packed = torch.cat([torch.stack([x.packed for x in row]) for row in q], dim=1)
            scales = torch.cat([torch.stack([x.scales for x in row]) for row in q], dim=1)
            self._fits(module, prefix, name, packed, scales, where)
            module.set_mxfp4(name, start, MXFP4Tensor(packed, scales))
            return
        dtype = self.model.embed_tokens.weight.dtype
        w = torch.cat([torch.stack([x.dequantize(torch.float32).to(dtype) if isinstance(x, MXFP4Tensor) else x
                                    for x in row]) for row in q], dim=1)
        self._fits(module, prefix, name, w, None, where)
        module.set_experts(name, start, w)

    def _expert(self, module, stored: Stored) -> MXFP4Tensor | torch.Tensor:
        """One expert weight as soon as its data and scale are read: MXFP4 bytes kept when the
        experts are MXFP4 and so is the checkpoint, else floats in the model's dtype."""
        data, scale = self.read(stored)
        where = self.store.where(stored.data)
        if module.format == "mxfp4" and is_mxfp4(data, scale):
            return as_mxfp4(data, scale, where)
        return dequantize(data, scale, self.quant, where).to(self.model.embed_tokens.weight.dtype)

    def _fits(self, module, prefix, name, values, scales, where) -> None:
        e, n, k = module.shapes[name]
        got = (values.shape[1], values.shape[2] * (2 if scales is not None else 1))
        if got != (n, k):
            raise CheckpointError(f"{where}: {prefix}.{name}_proj experts have rows x columns {got}, the config "
                                  f"implies {(n, k)}")

    def _fused_experts(self, prefix: str, module, parts: dict[str, Stored]) -> None:
        if sorted(parts) != ["down", "gate_up"]:
            raise CheckpointError(f"{prefix}: expected fused gate_up_proj and down_proj, found {sorted(parts)}")
        for name, stored in parts.items():
            data, scale = self.read(stored)
            where = self.store.where(stored.data)
            if is_mxfp4(data, scale):
                q = as_mxfp4(data, scale, where)
                packed, scales = q.packed, q.scales
                if name == "gate_up" and self.quant.gpt_oss_experts:
                    packed, scales = deinterleave_rows(packed), deinterleave_rows(scales)
                if module.format == "mxfp4":
                    self._fits(module, prefix, name, packed, scales, where)
                    module.set_mxfp4(name, 0, type(q)(packed.contiguous(), scales.contiguous()))
                    continue
                w = type(q)(packed.contiguous(), scales.contiguous()).dequantize(torch.float32)
            else:
                w = dequantize(data, scale, self.quant, where)
                if name == "gate_up" and self.quant.gpt_oss_experts:
                    w = deinterleave_rows(w)
            self._fits(module, prefix, name, w, None, where)
            module.set_experts(name, 0, w.to(self.model.embed_tokens.weight.dtype))


def _expert_prefixes(expected: dict) -> set[str]:
    return {n.rsplit(".", 1)[0] for n in expected if re.search(r"\.experts\.(gate_up|down)_", n)}


def _check_names(model: torch.nn.Module, plan: _Plan, folder: Path) -> dict[str, torch.Tensor]:
    """The model's state dict as the checkpoint must fill it (a tied head left out, of the plan
    too); CheckpointError naming what is missing and what is unexpected, with its file."""
    expected = model.state_dict()
    if model.config.tie_word_embeddings:
        expected.pop("lm_head.weight", None)
        plan.plain.pop("lm_head.weight", None)
    expert_prefixes = _expert_prefixes(expected)
    wanted = {n for n in expected if n.rsplit(".", 1)[0] not in expert_prefixes}
    wanted |= {f"{p}.{w}" for p in expert_prefixes for w in ("gate_up_proj", "down_proj")}
    have = plan.names()
    missing, unexpected = sorted(wanted - have), sorted(have - wanted)
    if missing or unexpected:
        shown = unexpected[:8]
        files = "; ".join(f"{n} from {plan.file_of(n)}" for n in shown)
        raise CheckpointError(f"{folder}: tensors do not match the model; missing {missing[:8]}, "
                              f"unexpected {shown}" + (f" ({files})" if files else ""))
    return expected


def load_weights(model: torch.nn.Module, folder: str | Path) -> None:
    """Copy a checkpoint's tensors into `model` (strict: every parameter, no leftovers), one
    tensor at a time and experts a few at a time."""
    folder = Path(folder)
    path, raw = _raw_config(folder)
    quant = parse_quantization(raw, path)
    store = _Store(folder)
    stored_mtp = mtp_layers_in(store.file_of, model.config)
    if stored_mtp < len(model.mtp):
        # Untrained NEXTN layers would draft noise; without them speculation refuses clearly.
        model.mtp = model.mtp[:stored_mtp]
        model.config = model.config.replace(num_mtp_layers=stored_mtp)
    plan = _Plan(store, model.config, len(model.mtp), raw["model_type"] == "bailing_hybrid")
    expected = _check_names(model, plan, folder)
    expert_prefixes = _expert_prefixes(expected)
    loader = _Loader(model, store, quant)
    with torch.no_grad():
        for name, stored in plan.plain.items():
            loader.copy(name, expected[name], loader.floats(stored), loader.store.where(stored.data))
        for name, parts in plan.conv.items():
            value = torch.cat([loader.floats(parts[p]) for p in "qkv"])
            loader.copy(name, expected[name], value, loader.store.where(parts["q"].data))
        for prefix in sorted(expert_prefixes):
            loader.experts(prefix, plan)
