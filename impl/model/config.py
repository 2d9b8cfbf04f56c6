"""Model configuration: one dataclass and named presets as overrides over it.

Presets fix the shapes the kernels and suites are specialized to. Where a preset cannot
reproduce a real model exactly (hybrid linear attention, MLA), `approximations` says what
differs, so that a figure measured on it is never mistaken for the real model's.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Literal

RouterKind = Literal["softmax", "sigmoid_grouped"]
ROUTERS: tuple[str, ...] = ("softmax", "sigmoid_grouped")


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
    qk_norm: bool = False
    attention_bias: bool = False  # on q, k, v
    attention_out_bias: bool = False  # on o (Qwen3 ties it to attention_bias; GLM-4.5 never has it)
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    max_seq_len: int = 4096
    num_mtp_layers: int = 0
    approximations: tuple[str, ...] = field(default=())

    def __post_init__(self) -> None:
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
        bad = [i for i in self.dense_layers if not 0 <= i < self.num_layers]
        if bad:
            raise ValueError(f"dense_layers {bad} outside [0, {self.num_layers})")

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def shared_intermediate_size(self) -> int:
        return self.moe_intermediate_size * self.num_shared_experts

    def is_moe_layer(self, layer: int) -> bool:
        return layer not in self.dense_layers

    def num_parameters(self) -> int:
        """Parameter count (norms and MTP layers included), without building the model."""
        h, d, v = self.hidden_size, self.head_dim, self.vocab_size
        q, kv = self.num_heads * d, self.num_kv_heads * d
        attn = h * (q + 2 * kv) + q * h + (q + 2 * kv) * self.attention_bias + h * self.attention_out_bias
        attn += 2 * d * self.qk_norm + 2 * h
        dense = 3 * h * self.intermediate_size
        moe = (3 * h * self.moe_intermediate_size * self.num_experts + self.num_experts * h
               + 3 * h * self.shared_intermediate_size)
        n_dense = len(self.dense_layers)
        layers = self.num_layers * attn + n_dense * dense + (self.num_layers - n_dense) * moe
        # An MTP layer: enorm, hnorm, eh_proj (2H -> H), one MoE decoder layer, its own final norm;
        # it shares the embedding and the head.
        layers += self.num_mtp_layers * (3 * h + 2 * h * h + attn + moe)
        return layers + v * h * (1 if self.tie_word_embeddings else 2) + h

    def replace(self, **overrides) -> "ModelConfig":
        return dataclasses.replace(self, **overrides)


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
    # MoE and head shapes from transformers' bailing_hybrid defaults (Ling-3.0-flash).
    "ling-3.0-flash": dict(
        vocab_size=157184, hidden_size=2560, num_layers=42, num_heads=32, num_kv_heads=32,
        head_dim=128, intermediate_size=6144, dense_layers=(0, 1), num_experts=512, top_k=8,
        moe_intermediate_size=768, num_shared_experts=1, router="sigmoid_grouped", n_group=8,
        topk_group=4, norm_topk_prob=True, routed_scaling_factor=2.5, rope_theta=6000000.0,
        num_mtp_layers=1,
        approximations=(
            "attention: every layer is softmax MHA (32 heads x 128) instead of 35 KDA linear-"
            "attention and 7 MLA layers; projection bytes match the KDA q/k/v/o, state does not",
        ),
    ),
}


def get_config(name: str, **overrides) -> ModelConfig:
    """The preset `name` with `overrides` applied."""
    try:
        preset = PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown model preset {name!r}; known presets: {sorted(PRESETS)}") from None
    return ModelConfig(name=name, **{**preset, **overrides})
