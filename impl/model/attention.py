"""The attention module of a decoder layer, by the kind its config names (`ModelConfig.attention_kind`):
GQA softmax attention (`layers.Attention`), KDA linear attention (`kda.KDAAttention`) or MLA
(`mla.MLAAttention`). Every kind takes `forward(x, cos, sin, input_pos, mask)` and allocates its
own decode state with `setup_cache(batch, max_seq_len, dtype, device)`: a KV cache, a recurrent
state (whose size does not depend on max_seq_len), or a compressed latent cache.
"""

from __future__ import annotations

from torch import nn

from impl.model.config import ModelConfig
from impl.model.kda import KDAAttention
from impl.model.layers import Attention
from impl.model.mla import MLAAttention, MLAConfig


def mla_config(config: ModelConfig) -> MLAConfig:
    scale = None
    if config.rope_parameters:  # YaRN's mscale_all_dim scales the softmax too (transformers' DeepseekV3Attention)
        from transformers.modeling_rope_utils import yarn_apply_mscale
        qk = config.qk_nope_head_dim + config.qk_rope_head_dim
        scale = yarn_apply_mscale(dict(config.rope_parameters), qk ** -0.5)
    return MLAConfig(hidden_size=config.hidden_size, num_heads=config.num_heads, kv_lora_rank=config.kv_lora_rank,
                     qk_nope_head_dim=config.qk_nope_head_dim, qk_rope_head_dim=config.qk_rope_head_dim,
                     v_head_dim=config.v_head_dim, q_lora_rank=config.q_lora_rank, rope_theta=config.rope_theta,
                     attention_bias=config.attention_bias, output_gate=config.mla_output_gate, softmax_scale=scale)


def make_attention(config: ModelConfig, layer: int) -> nn.Module:
    kind = config.attention_kind(layer)
    if kind == "kda":
        return KDAAttention(config.hidden_size, config.linear_num_heads, config.linear_head_dim,
                            config.conv_kernel_size, config.rms_norm_eps, config.kda_safe_gate,
                            config.kda_lower_bound)
    if kind == "mla":
        return MLAAttention(mla_config(config))
    return Attention(config)
