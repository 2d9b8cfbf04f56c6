"""Decoder building blocks: RMSNorm, rotary embedding, GQA attention with a static KV cache,
SwiGLU MLP, router and MoE block.

Parameter names follow transformers' Qwen3-MoE / GLM-4.5 layout, so a checkpoint maps onto
them with little renaming. Expert weights are stored fused: gate_up [E, 2I, H] (gate rows
first) and down [E, H, I].
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from impl import backends
from impl.model.add_rms_norm import add_rms_norm
from impl.model.config import ModelConfig
from impl.moe.reference import swiglu_act
from impl.moe.shared import SharedExpert
from impl.quant.mxfp4 import BLOCK_SIZE, MXFP4Tensor, quantize_mxfp4
from impl.routing import sigmoid_grouped_topk, softmax_topk


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # One fused kernel on CUDA (seven small ones spelled out), statistics in fp32 whatever the
        # dtype; in bf16 it rounds once, after the weight, where the spelled-out form rounded twice.
        return F.rms_norm(x, (x.shape[-1],), self.weight.to(x.dtype), self.eps)


def scaled_rope(parameters: dict, rope_theta: float, rotary_dim: int, device=None) -> tuple[torch.Tensor, float]:
    """(inverse frequencies [rotary_dim / 2], the factor on cos and sin) of a scaled rope
    (ModelConfig.rope_parameters: YaRN, linear, Llama 3) by transformers' own rope functions, so
    that a loaded model rotates as its reference does."""
    from transformers import PreTrainedConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    shim = PreTrainedConfig()  # what the rope functions read: the rope's parameters and its width
    shim.rope_parameters = {**parameters, "rope_theta": rope_theta, "partial_rotary_factor": 1.0}
    shim.head_dim, shim.hidden_size, shim.num_attention_heads = rotary_dim, rotary_dim, 1
    # Read only where the parameters lack the original length or the factor, which ModelConfig requires.
    shim.max_position_embeddings = int(parameters.get("original_max_position_embeddings", 0) * parameters["factor"])
    inv_freq, factor = ROPE_INIT_FUNCTIONS[parameters["rope_type"]](shim, device)
    return inv_freq.float(), float(factor)


def rope_tables(config: ModelConfig, max_seq_len: int, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin, [max_seq_len, rotary_dim] in fp32, in the rotate-half layout; a scaled rope's
    (`rope_parameters`) with its factor on both, as transformers applies it."""
    dim = config.rotary_dim
    scaled = dict(getattr(config, "rope_parameters", ()))
    factor = 1.0
    if scaled:
        inv_freq, factor = scaled_rope(scaled, config.rope_theta, dim, device)
    else:
        inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float, device=device) / dim))
    freqs = torch.outer(torch.arange(max_seq_len, dtype=torch.float, device=device), inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1)
    if factor == 1.0:
        return emb.cos(), emb.sin()
    return emb.cos() * factor, emb.sin() * factor


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, heads, T, D]; cos/sin [T, rotary_dim]; rotates the first rotary_dim channels."""
    rot_dim = cos.shape[-1]
    x_rot, x_pass = x[..., :rot_dim], x[..., rot_dim:]
    x1, x2 = x_rot.chunk(2, dim=-1)
    rotated = torch.cat((-x2, x1), dim=-1)
    x_rot = (x_rot * cos.to(x.dtype)) + (rotated * sin.to(x.dtype))
    return torch.cat((x_rot, x_pass), dim=-1)


class KVCache(nn.Module):
    def __init__(self, batch: int, kv_heads: int, max_seq_len: int, head_dim: int, dtype, device) -> None:
        super().__init__()
        shape = (batch, kv_heads, max_seq_len, head_dim)
        self.register_buffer("k", torch.zeros(shape, dtype=dtype, device=device), persistent=False)
        self.register_buffer("v", torch.zeros(shape, dtype=dtype, device=device), persistent=False)

    def update(self, input_pos: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
        # index_copy_ keeps shapes static and the positions on the device (no host sync).
        # A batch smaller than the cache's uses its first rows.
        b = k.shape[0]
        self.k[:b].index_copy_(2, input_pos, k)
        self.v[:b].index_copy_(2, input_pos, v)
        return self.k[:b], self.v[:b]


class Attention(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        h, d = config.hidden_size, config.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_heads, config.num_kv_heads, d
        self.q_proj = nn.Linear(h, config.num_heads * d, bias=config.attention_bias)
        self.k_proj = nn.Linear(h, config.num_kv_heads * d, bias=config.attention_bias)
        self.v_proj = nn.Linear(h, config.num_kv_heads * d, bias=config.attention_bias)
        self.o_proj = nn.Linear(config.num_heads * d, h, bias=config.attention_out_bias)
        self.q_norm = RMSNorm(d, config.rms_norm_eps) if config.qk_norm else None
        self.k_norm = RMSNorm(d, config.rms_norm_eps) if config.qk_norm else None
        self.kv_cache: KVCache | None = None

    def setup_cache(self, batch: int, max_seq_len: int, dtype=None, device=None) -> KVCache:
        """A zeroed static KV cache in the weights' dtype and device unless told otherwise."""
        w = self.o_proj.weight
        self.kv_cache = KVCache(batch, self.num_kv_heads, max_seq_len, self.head_dim, dtype or w.dtype,
                                device or w.device)
        return self.kv_cache

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                input_pos: torch.Tensor | None, mask: torch.Tensor | None) -> torch.Tensor:
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(b, t, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(b, t, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k, v = (y.transpose(1, 2) for y in (q, k, v))
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if self.kv_cache is not None:
            k, v = self.kv_cache.update(input_pos, k, v)
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
        else:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=t > 1, enable_gqa=True)
        return self.o_proj(y.transpose(1, 2).reshape(b, t, -1))


class MLP(nn.Module):
    """SwiGLU MLP, clipped at `limit` (impl.moe.reference.swiglu_act; None: not clipped)."""

    def __init__(self, hidden: int, intermediate: int, limit: float | None = None) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)
        self.limit = limit

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(swiglu_act(self.gate_proj(x), self.up_proj(x), self.limit))


class Router(nn.Module):
    """Router logits in fp32 whatever the model dtype: top-k choices are sensitive to rounding."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.weight = nn.Parameter(torch.zeros(config.num_experts, config.hidden_size, dtype=torch.float32))
        if config.router == "sigmoid_grouped":
            self.register_buffer("e_score_correction_bias", torch.zeros(config.num_experts, dtype=torch.float32))
        else:
            self.e_score_correction_bias = None

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        c = self.config
        logits = F.linear(x.float(), self.weight.float())
        if c.router == "softmax":
            return softmax_topk(logits, c.top_k, c.norm_topk_prob)
        return sigmoid_grouped_topk(logits, c.top_k, c.n_group, c.topk_group, self.e_score_correction_bias,
                                    c.routed_scaling_factor, c.norm_topk_prob)


EXPERT_FORMATS = ("dense", "mxfp4")
# Elements quantized at a time: the reference quantizer's temporaries take about 30 bytes an
# element (fp32 blocks, int64 codes), so one [512, 1536, 2560] layer at once needed over 115 GiB.
QUANT_CHUNK_ELEMENTS = 2 ** 26


class Experts(nn.Module):
    """Routed experts' weights: dense parameters in the model dtype, or MXFP4 buffers (packed E2M1
    pairs and E8M0 scales) held from construction (`fmt="mxfp4"`) or after `quantize("mxfp4")`.
    Writes go through `set_experts`, a few experts at a time, so a build or a checkpoint load
    never holds more than one layer's unquantized experts."""

    def __init__(self, config: ModelConfig, fmt: str = "dense") -> None:
        super().__init__()
        if fmt not in EXPERT_FORMATS:
            raise ValueError(f"unknown expert weight format {fmt!r}; expected one of {EXPERT_FORMATS}")
        e, h, i = config.num_experts, config.hidden_size, config.moe_intermediate_size
        self.shapes = {"gate_up": (e, 2 * i, h), "down": (e, h, i)}
        self.format = "dense"
        if fmt == "dense":
            self.gate_up_proj = nn.Parameter(torch.empty(e, 2 * i, h))
            self.down_proj = nn.Parameter(torch.empty(e, h, i))
        else:
            self._mxfp4_buffers()

    def _mxfp4_buffers(self) -> None:
        for name, (e, n, k) in self.shapes.items():
            if k % BLOCK_SIZE:
                raise ValueError(f"MXFP4 experts need {name}'s input dim ({k}) to be a multiple of {BLOCK_SIZE}")
            self.register_buffer(f"{name}_packed", torch.zeros(e, n, k // 2, dtype=torch.uint8))
            self.register_buffer(f"{name}_scales", torch.zeros(e, n, k // BLOCK_SIZE, dtype=torch.uint8))
        self.format = "mxfp4"

    def experts_per_chunk(self) -> int:
        e, n, k = self.shapes["gate_up"]
        return max(1, QUANT_CHUNK_ELEMENTS // (n * k))

    @torch.no_grad()
    def set_experts(self, name: str, start: int, w: torch.Tensor) -> None:
        """Write float weights w [n, ...] of experts start..start+n-1 into `name` ("gate_up" or
        "down"), quantizing them in chunks when the experts are MXFP4."""
        shape = self.shapes[name]
        if w.dim() != 3 or tuple(w.shape[1:]) != shape[1:] or not 0 <= start <= shape[0] - w.shape[0]:
            raise ValueError(f"experts {name}: got {tuple(w.shape)} at expert {start}, the layer holds {shape}")
        if self.format == "dense":
            getattr(self, f"{name}_proj")[start:start + w.shape[0]].copy_(w)
            return
        packed, scales = getattr(self, f"{name}_packed"), getattr(self, f"{name}_scales")
        step = self.experts_per_chunk()
        for i in range(0, w.shape[0], step):
            q = quantize_mxfp4(w[i:i + step].to(packed.device))
            packed[start + i:start + i + q.packed.shape[0]].copy_(q.packed)
            scales[start + i:start + i + q.scales.shape[0]].copy_(q.scales)

    @torch.no_grad()
    def set_mxfp4(self, name: str, start: int, q: MXFP4Tensor) -> None:
        """Copy already-quantized experts (a checkpoint's MXFP4) in as they are."""
        if self.format != "mxfp4":
            raise ValueError(f"experts {name}: MXFP4 weights given to dense experts; build with experts='mxfp4' "
                             "or dequantize them first")
        packed, scales = getattr(self, f"{name}_packed"), getattr(self, f"{name}_scales")
        n = q.packed.shape[0]
        if q.packed.shape[1:] != packed.shape[1:] or q.scales.shape[1:] != scales.shape[1:] or start + n > packed.shape[0]:
            raise ValueError(f"experts {name}: MXFP4 packed {tuple(q.packed.shape)} / scales {tuple(q.scales.shape)} "
                             f"at expert {start} do not fit {tuple(packed.shape)} / {tuple(scales.shape)}")
        packed[start:start + n].copy_(q.packed)
        scales[start:start + n].copy_(q.scales)

    @torch.no_grad()
    def init_random(self, generator: torch.Generator | None, std: float, dtype: torch.dtype) -> None:
        """N(0, std) weights drawn a chunk of experts at a time on the generator's device, rounded
        to `dtype`, then stored (quantized when MXFP4)."""
        device = generator.device if generator is not None else torch.device("cpu")
        step = self.experts_per_chunk()
        for name, (e, n, k) in self.shapes.items():
            for start in range(0, e, step):
                m = min(step, e - start)
                w = torch.randn(m, n, k, generator=generator, device=device).mul_(std).to(dtype)
                self.set_experts(name, start, w)

    @torch.no_grad()
    def quantize(self, fmt: str) -> None:
        if fmt != "mxfp4":
            raise ValueError(f"unknown expert weight format {fmt!r}; supported: 'mxfp4'")
        if self.format == "mxfp4":
            return
        dense = {"gate_up": self.gate_up_proj.data, "down": self.down_proj.data}
        del self.gate_up_proj, self.down_proj
        with torch.device(dense["down"].device):
            self._mxfp4_buffers()
        for name, w in dense.items():
            self.set_experts(name, 0, w)

    def weights(self):
        """(gate_up, down) as the MoE backends take them: tensors or MXFP4Tensor."""
        if self.format == "mxfp4":
            return (MXFP4Tensor(self.gate_up_packed, self.gate_up_scales),
                    MXFP4Tensor(self.down_packed, self.down_scales))
        return self.gate_up_proj, self.down_proj


class MoEBlock(nn.Module):
    """Router, routed experts and shared experts of decoder layer `layer` (its SwiGLU clipping
    limits come from the config), computed by the MoE `backend`."""

    def __init__(self, config: ModelConfig, backend: backends.Backend, expert_format: str = "dense",
                 layer: int | None = None) -> None:
        super().__init__()
        self.gate = Router(config)
        self.experts = Experts(config, expert_format)
        self.swiglu_limit = None if layer is None else config.swiglu_limit(layer)
        shared_limit = None if layer is None else config.swiglu_limit(layer, shared=True)
        self.shared_experts = (MLP(config.hidden_size, config.shared_intermediate_size, shared_limit)
                               if config.num_shared_experts else None)
        self.backend = backend

    @property
    def clips(self) -> bool:
        return self.swiglu_limit is not None or (self.shared_experts is not None and self.shared_experts.limit is not None)

    @property
    def backend(self) -> backends.Backend:
        return self._backend

    @backend.setter
    def backend(self, backend: backends.Backend) -> None:
        if self.clips and not backend.clips_swiglu:
            raise backends.Unsupported(
                f"the {backend.name!r} MoE backend does not clip SwiGLU (Backend.clips_swiglu), and this layer does "
                f"(routed experts at {self.swiglu_limit}, shared at {self.shared_experts and self.shared_experts.limit}:"
                " the checkpoint's expert_swiglu_limit_list / share_expert_swiglu_limit_list)")
        self._backend = backend

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        shared = None
        if self.shared_experts is not None:
            s = self.shared_experts
            shared = SharedExpert(s.gate_proj.weight, s.up_proj.weight, s.down_proj.weight, s.limit)
        # Only a clipping layer passes the limit: a backend without clips_swiglu keeps its signature.
        clip = {} if self.swiglu_limit is None else {"swiglu_limit": self.swiglu_limit}
        if self.backend.layer is not None:
            return self.backend.layer(flat, self.gate, *self.experts.weights(), shared, **clip).view_as(x)
        weights, ids = self.gate(flat)
        return self.backend.fn(flat, weights, ids, *self.experts.weights(), shared, **clip).view_as(x)


class DecoderLayer(nn.Module):
    """Pre-norm residual layer: attention (`self_attn`, of the kind the config gives the layer:
    impl.model.attention), then a dense SwiGLU or a MoE block."""

    def __init__(self, config: ModelConfig, layer: int, moe_backend: backends.Backend,
                 attention: nn.Module | None = None, expert_format: str = "dense") -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config) if attention is None else attention
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = (MoEBlock(config, moe_backend, expert_format, layer) if config.is_moe_layer(layer)
                    else MLP(config.hidden_size, config.intermediate_size))

    def streamed(self, delta, residual, cos, sin, input_pos, mask):
        """The layer on a residual stream kept apart from the branch outputs: its input is
        `residual + delta` (`delta` None: `residual` alone). Returns (its MLP output, the stream
        after its attention), whose sum is its output; each add is one launch with the norm after
        it (impl.model.add_rms_norm), the last one left to whoever norms next."""
        h, residual = add_rms_norm(delta, residual, self.input_layernorm)
        h, residual = add_rms_norm(self.self_attn(h, cos, sin, input_pos, mask), residual,
                                   self.post_attention_layernorm)
        return self.mlp(h), residual

    def forward(self, x, cos, sin, input_pos, mask):
        out, residual = self.streamed(None, x, cos, sin, input_pos, mask)
        return residual + out
