"""Model configuration: one dataclass and named presets as overrides over it.

Presets fix the shapes the kernels and suites are specialized to. Where a preset cannot
reproduce a real model exactly, `approximations` says what differs, so that a figure measured on
it is never mistaken for the real model's.

Attention is chosen per layer (`attention_types`): "mha" (softmax GQA with a KV cache, the
default for every layer), "kda" (Kimi Delta Attention, linear attention with a constant-size
recurrent state) or "mla" (multi-head latent attention over a compressed cache). Ling 3.0
(`bailing_hybrid`) puts MLA on every `layer_group_size`-th layer and KDA on the others; its NEXTN
layer's block is MLA (`mtp_attention`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

RouterKind = Literal["softmax", "sigmoid_grouped"]
ROUTERS: tuple[str, ...] = ("softmax", "sigmoid_grouped")
ATTENTION_KINDS: tuple[str, ...] = ("mha", "kda", "mla")
# Scaled ropes whose tables do not depend on the sequence length (dynamic NTK and LongRoPE do).
SCALED_ROPES: tuple[str, ...] = ("linear", "yarn", "llama3")


def hybrid_attention_types(num_layers: int, group: int) -> tuple[str, ...]:
    """Ling 3.0's layout: the last layer of every `group` consecutive layers is MLA, the rest KDA."""
    return tuple("mla" if (i + 1) % group == 0 else "kda" for i in range(num_layers))


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    # Dense SwiGLU width, used by the layers listed in `dense_layers`.
    intermediate_size: int
    num_experts: int
    top_k: int
    moe_intermediate_size: int
    name: str = "custom"
    dense_layers: tuple[int, ...] = ()
    # Shared expert: one SwiGLU of width moe_intermediate_size * num_shared_experts.
    num_shared_experts: int = 0
    router: RouterKind = "softmax"
    norm_topk_prob: bool = True
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    rope_theta: float = 10000.0
    partial_rotary_factor: float = 1.0
    # A scaled rope as transformers' `rope_parameters` give it (sorted items, rope_type first among
    # them: "linear", "yarn" or "llama3"), computed by transformers' own rope functions; empty for
    # the default rope.
    rope_parameters: tuple[tuple[str, object], ...] = ()
    qk_norm: bool = False
    attention_bias: bool = False  # on q, k, v
    attention_out_bias: bool = False  # on o (Qwen3 ties it to attention_bias; GLM-4.5 never has it)
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    max_seq_len: int = 4096
    num_mtp_layers: int = 0
    # Whether NEXTN layers take the target's hidden states after its final norm (what the published
    # DeepSeek-V3, GLM-4.5 and Ling checkpoints were trained on, as vLLM and SGLang feed them; every
    # loaded family but a checkpoint this project wrote) rather than before it (the presets, and
    # tiny-gsm, trained so).
    mtp_normed_hidden: bool = False
    # Per-layer attention kind (ATTENTION_KINDS); empty means "mha" everywhere.
    attention_types: tuple[str, ...] = ()
    mtp_attention: str = "mha"
    # KDA layers: heads x head dim of q, k, v; the short depthwise convolution; the forget gate.
    linear_num_heads: int = 0
    linear_head_dim: int = 0
    conv_kernel_size: int = 4
    kda_safe_gate: bool = True
    kda_lower_bound: float = -5.0
    # MLA layers (num_heads heads): latent rank, the query's low-rank path (None: one projection),
    # per-head query/key dims without and with rotation, value dim.
    kv_lora_rank: int = 0
    q_lora_rank: int | None = None
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    # Ling 3.0's head-wise output gate sigmoid(g_proj(x)) on each MLA head; DeepSeek-V3 has none.
    mla_output_gate: bool = True
    # The routed experts' format a build takes by default (build_model(experts="auto")): "mxfp4"
    # where the model ships so and its bf16 experts would not fit one GPU.
    expert_format: str = "dense"
    # SwiGLU clipping per decoder layer, routed and shared experts (transformers' bailing_hybrid
    # form: silu(gate) capped at the limit, up clamped to +-limit); 0 is none, as are NEXTN layers
    # and dense MLPs. Empty: no layer clips.
    swiglu_limits: tuple[float, ...] = ()
    shared_swiglu_limits: tuple[float, ...] = ()
    approximations: tuple[str, ...] = field(default=())

    def __post_init__(self) -> None:
        if self.expert_format not in ("dense", "mxfp4"):
            raise ValueError(f"ModelConfig.expert_format must be 'dense' or 'mxfp4', got {self.expert_format!r}")
        positive = ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads",
                    "head_dim", "intermediate_size", "num_experts", "top_k",
                    "moe_intermediate_size", "max_seq_len")
        for name in positive:
            if getattr(self, name) <= 0:
                raise ValueError(f"ModelConfig.{name} must be positive, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads ({self.num_heads}) must be a multiple of "
                             f"num_kv_heads ({self.num_kv_heads})")
        if not 1 <= self.top_k <= self.num_experts:
            raise ValueError(f"top_k must be in [1, num_experts={self.num_experts}], got {self.top_k}")
        if self.router not in ROUTERS:
            raise ValueError(f"unknown router {self.router!r}; expected one of {ROUTERS}")
        if self.n_group < 1 or self.num_experts % self.n_group or not 1 <= self.topk_group <= self.n_group:
            raise ValueError(f"grouped routing needs num_experts ({self.num_experts}) divisible by "
                             f"n_group ({self.n_group}) and 1 <= topk_group ({self.topk_group}) <= n_group")
        if self.router == "sigmoid_grouped" and self.top_k > self.topk_group * self.num_experts // self.n_group:
            raise ValueError(f"top_k ({self.top_k}) exceeds the experts in the {self.topk_group} "
                             f"selected groups of {self.num_experts // self.n_group}")
        rotary = self.head_dim * self.partial_rotary_factor
        if rotary != int(rotary) or int(rotary) % 2:
            raise ValueError(f"head_dim * partial_rotary_factor must be an even integer, got {rotary}")
        rope = dict(self.rope_parameters)
        if rope and rope.get("rope_type") not in SCALED_ROPES:
            raise ValueError(f"rope_parameters: rope_type {rope.get('rope_type')!r} is not supported; supported: "
                             f"{list(SCALED_ROPES)} (or the default rope, no rope_parameters)")
        needed = ("factor",) + (("original_max_position_embeddings",) if rope.get("rope_type") != "linear" else ())
        missing = [k for k in needed if rope and not isinstance(rope.get(k), (int, float))]
        if missing:
            raise ValueError(f"rope_parameters of a {rope['rope_type']} rope need numeric {missing} (resolved from the "
                             f"checkpoint's config), got {rope}")
        bad = [i for i in self.dense_layers if not 0 <= i < self.num_layers]
        if bad:
            raise ValueError(f"dense_layers {bad} outside [0, {self.num_layers})")
        for name in ("swiglu_limits", "shared_swiglu_limits"):
            limits = getattr(self, name)
            if limits and len(limits) != self.num_layers:
                raise ValueError(f"{name} has {len(limits)} entries for {self.num_layers} layers")
            if any(not isinstance(v, (int, float)) or isinstance(v, bool) or not 0 <= v < float("inf") for v in limits):
                raise ValueError(f"{name} must be finite numbers >= 0 (0: no clipping), got {list(limits)}")
        self._check_attention()

    def _check_attention(self) -> None:
        types = self.attention_types
        if types and len(types) != self.num_layers:
            raise ValueError(f"attention_types has {len(types)} entries for {self.num_layers} layers")
        kinds = set(types or ("mha",)) | ({self.mtp_attention} if self.num_mtp_layers else set())
        unknown = sorted(kinds - set(ATTENTION_KINDS))
        if unknown:
            raise ValueError(f"unknown attention kind(s) {unknown}; expected one of {ATTENTION_KINDS}")
        if "mha" in kinds and "mla" in kinds:
            # One rope table serves the model: MHA rotates head_dim * partial_rotary_factor channels,
            # MLA qk_rope_head_dim ones.
            raise ValueError("a model mixing mha and mla layers is not supported")
        if "kda" in kinds:
            for name in ("linear_num_heads", "linear_head_dim", "conv_kernel_size"):
                if getattr(self, name) <= 0:
                    raise ValueError(f"kda layers need ModelConfig.{name} > 0, got {getattr(self, name)}")
        if "mla" in kinds:
            for name in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
                if getattr(self, name) <= 0:
                    raise ValueError(f"mla layers need ModelConfig.{name} > 0, got {getattr(self, name)}")
            if self.qk_rope_head_dim % 2:
                raise ValueError(f"qk_rope_head_dim must be even (rotary pairs), got {self.qk_rope_head_dim}")
            if self.num_kv_heads != self.num_heads:
                raise ValueError(f"mla layers need num_kv_heads == num_heads, got {self.num_kv_heads} "
                                 f"and {self.num_heads}")

    def attention_kind(self, layer: int) -> str:
        """The attention of decoder layer `layer`; indices past num_layers are NEXTN layers."""
        if layer >= self.num_layers:
            return self.mtp_attention
        return self.attention_types[layer] if self.attention_types else "mha"

    @property
    def uses_mla(self) -> bool:
        return "mla" in self.attention_types or (self.num_mtp_layers > 0 and self.mtp_attention == "mla")

    @property
    def rotary_dim(self) -> int:
        """Channels the model's rope tables rotate: MLA's rope part, or MHA's partial head."""
        if self.uses_mla:
            return self.qk_rope_head_dim
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def shared_intermediate_size(self) -> int:
        return self.moe_intermediate_size * self.num_shared_experts

    def is_moe_layer(self, layer: int) -> bool:
        return layer not in self.dense_layers

    def swiglu_limit(self, layer: int, shared: bool = False) -> float | None:
        """Layer `layer`'s SwiGLU clipping limit for its routed (or `shared`) experts; None: none."""
        limits = self.shared_swiglu_limits if shared else self.swiglu_limits
        return float(limits[layer]) if 0 <= layer < len(limits) and limits[layer] else None

    @property
    def clips_swiglu(self) -> bool:
        return any(self.swiglu_limits) or any(self.shared_swiglu_limits)

    def attention_parameters(self, kind: str) -> int:
        """Parameters of one attention module of `kind`, with the layer's two norms."""
        h = self.hidden_size
        if kind == "kda":
            qkv = self.linear_num_heads * self.linear_head_dim
            # q, k, v, g, f projections, o; the conv over q|k|v; b_proj; A_log, dt_bias; o_norm.
            return (5 * h * qkv + qkv * h + 3 * qkv * self.conv_kernel_size + h * self.linear_num_heads
                    + self.linear_num_heads + qkv + self.linear_head_dim + 2 * h)
        if kind == "mla":
            nh, qk = self.num_heads, self.qk_nope_head_dim + self.qk_rope_head_dim
            r, bias = self.kv_lora_rank, self.attention_bias
            q = (h * nh * qk if self.q_lora_rank is None
                 else h * self.q_lora_rank + self.q_lora_rank * bias + self.q_lora_rank
                 + self.q_lora_rank * nh * qk)
            kv_a = h * (r + self.qk_rope_head_dim) + (r + self.qk_rope_head_dim) * bias
            kv_b = r * nh * (self.qk_nope_head_dim + self.v_head_dim)
            o = nh * self.v_head_dim * h + h * bias
            return q + kv_a + r + kv_b + o + h * nh * self.mla_output_gate + 2 * h
        d = self.head_dim
        q, kv = self.num_heads * d, self.num_kv_heads * d
        attn = h * (q + 2 * kv) + q * h + (q + 2 * kv) * self.attention_bias + h * self.attention_out_bias
        return attn + 2 * d * self.qk_norm + 2 * h

    def moe_parameters(self) -> int:
        h = self.hidden_size
        return (3 * h * self.moe_intermediate_size * self.num_experts + self.num_experts * h
                + 3 * h * self.shared_intermediate_size)

    def num_parameters(self) -> int:
        """Parameter count (norms and MTP layers included), without building the model."""
        h, v = self.hidden_size, self.vocab_size
        dense = 3 * h * self.intermediate_size
        layers = sum(self.attention_parameters(self.attention_kind(i))
                     + (self.moe_parameters() if self.is_moe_layer(i) else dense) for i in range(self.num_layers))
        # An MTP layer: enorm, hnorm, eh_proj (2H -> H), one MoE decoder layer, its own final norm;
        # it shares the embedding and the head.
        mtp = 3 * h + 2 * h * h + self.attention_parameters(self.mtp_attention) + self.moe_parameters()
        return layers + self.num_mtp_layers * mtp + v * h * (1 if self.tie_word_embeddings else 2) + h

    def expert_parameters(self) -> int:
        """Routed experts' parameters over all MoE layers (NEXTN layers included): the part a
        build can hold in MXFP4 from the start."""
        per_layer = 3 * self.hidden_size * self.moe_intermediate_size * self.num_experts
        return per_layer * (self.num_layers - len(self.dense_layers) + self.num_mtp_layers)

    def replace(self, **overrides) -> "ModelConfig":
        return dataclasses.replace(self, **overrides)


# Trained checkpoints committed with the repository, by name (scripts/train_tiny.py made tiny-gsm).
EMBEDDED = {"tiny-gsm": Path(__file__).resolve().parents[2] / "checkpoints" / "tiny-gsm"}
HEADS = ("bf16", "fp8")  # LM heads a model is built with: as stored, or FP8 quantized online at load

PRESETS: dict[str, dict] = {
    # Byte-level vocabulary; every dimension a multiple of 32 so Triton blocks tile it.
    "tiny": dict(
        vocab_size=128, hidden_size=128, num_layers=4, num_heads=4, num_kv_heads=2, head_dim=32,
        intermediate_size=256, num_experts=8, top_k=2, moe_intermediate_size=128,
        num_shared_experts=1, router="sigmoid_grouped", n_group=1, topk_group=1,
        norm_topk_prob=True, routed_scaling_factor=1.0, rope_theta=10000.0, qk_norm=False,
        max_seq_len=384, num_mtp_layers=1,
    ),
    # MoE and head shapes from inclusionAI/Ling-flash-2.0; attention is its GQA 32/4 x 128.
    "ling-flash-2.0": dict(
        vocab_size=157184, hidden_size=4096, num_layers=32, num_heads=32, num_kv_heads=4,
        head_dim=128, intermediate_size=9216, dense_layers=(0,), num_experts=256, top_k=8,
        moe_intermediate_size=1024, num_shared_experts=1, router="sigmoid_grouped", n_group=8,
        topk_group=4, norm_topk_prob=True, routed_scaling_factor=2.5, rope_theta=600000.0,
        partial_rotary_factor=0.5, qk_norm=True, num_mtp_layers=1,
        approximations=("dense intermediate size 9216 taken from the public config, not verified",),
    ),
    # Ling-3.0-flash as transformers' bailing_hybrid defaults give it: 42 layers, MLA on every 6th
    # (7) and KDA on the others (35), the first 2 dense; its NEXTN layer is MLA + MoE and takes the
    # normed hidden states. max_seq_len covers the reference shape (32k in, 2k out) with room.
    "ling-3.0-flash": dict(
        vocab_size=157184, hidden_size=2560, num_layers=42, num_heads=32, num_kv_heads=32,
        head_dim=128, intermediate_size=6144, dense_layers=(0, 1), num_experts=512, top_k=8,
        moe_intermediate_size=768, num_shared_experts=1, router="sigmoid_grouped", n_group=8,
        topk_group=4, norm_topk_prob=True, routed_scaling_factor=2.5, rope_theta=6000000.0,
        num_mtp_layers=1, mtp_normed_hidden=True, max_seq_len=36864,
        attention_types=hybrid_attention_types(42, 6), mtp_attention="mla",
        linear_num_heads=32, linear_head_dim=128, conv_kernel_size=4, kda_safe_gate=True, kda_lower_bound=-5.0,
        kv_lora_rank=512, q_lora_rank=None, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
        expert_format="mxfp4",  # 248 GB in bf16; the MXFP4 checkpoint's 64 GB of experts fit an H200
    ),
    # The same architecture at CPU-test size (6 layers: 4 KDA, 2 MLA, the first dense); every
    # dimension a multiple of 32 (16 for the rope part) so Triton blocks tile it.
    "ling-3.0-tiny": dict(
        vocab_size=128, hidden_size=128, num_layers=6, num_heads=4, num_kv_heads=4, head_dim=32,
        intermediate_size=256, dense_layers=(0,), num_experts=8, top_k=2, moe_intermediate_size=64,
        num_shared_experts=1, router="sigmoid_grouped", n_group=2, topk_group=1, norm_topk_prob=True,
        routed_scaling_factor=2.5, rope_theta=6000000.0, num_mtp_layers=1, mtp_normed_hidden=True,
        max_seq_len=384, attention_types=hybrid_attention_types(6, 3), mtp_attention="mla",
        linear_num_heads=4, linear_head_dim=32, conv_kernel_size=4, kv_lora_rank=64, qk_nope_head_dim=32,
        qk_rope_head_dim=16, v_head_dim=32,
    ),
}


def get_config(name: str, **overrides) -> ModelConfig:
    """The preset `name` with `overrides` applied."""
    try:
        preset = PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown model preset {name!r}; known presets: {sorted(PRESETS)}") from None
    return ModelConfig(name=name, **{**preset, **overrides})
