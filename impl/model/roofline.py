"""The bytes one batch-1 decode token reads, by component, and the time per output token they
imply at a bandwidth: the byte floor a decode step is measured against.

Weights come from the model's own parameters (a model built on the meta device costs no
memory), each in the format a deployment holds it: routed experts in MXFP4 (4-bit values, one
8-bit scale per 32: 17/32 B an element) or bf16, read for the top-k experts a token is routed to
(batch 1: top_k distinct experts a layer); attention, shared-expert and dense-MLP projections in
bf16 or FP8 (e4m3, one fp32 scale per row); the LM head likewise; one embedding row; the router
and the parameters the reference keeps in fp32 (KDA's convolution and forget-gate constants) at
4 B; norm weights at 2 B. The MTP layer is not part of a plain decode step (its own component,
read once per draft pass); `spec_step_bytes` counts a whole speculative step: its draft passes,
and the verify pass reading every distinct expert its k+1 tokens route to.

Per-token state at context L (positions 0..L-1 cached, the token at L): an MLA layer reads L + 1
cache rows of (kv_lora_rank + rope) bf16 values and writes one; a softmax (MHA/GQA) layer reads
and writes K and V rows likewise; a KDA layer reads and writes its fp32 recurrent state
[heads, D, D] and convolution inputs [3 * heads * D, kernel - 1], whatever L is.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from impl.model.config import ModelConfig, get_config

WEIGHT_FORMATS = ("bf16", "fp8")
EXPERT_FORMATS = ("mxfp4", "bf16")
MXFP4_BYTES = 17 / 32  # per element: half a byte of value, one 8-bit scale per 32 elements
FP32_PARAMS = ("conv1d.weight", "forget_gate.A_log", "forget_gate.dt_bias")


@dataclass(frozen=True)
class Formats:
    """How a deployment holds its weights (the reference result: MXFP4 experts, FP8 elsewhere)."""
    experts: str = "mxfp4"
    projections: str = "bf16"  # attention, shared expert, dense MLPs
    head: str = "bf16"

    def __post_init__(self) -> None:
        if self.experts not in EXPERT_FORMATS:
            raise ValueError(f"experts format must be one of {EXPERT_FORMATS}, got {self.experts!r}")
        for name in ("projections", "head"):
            if getattr(self, name) not in WEIGHT_FORMATS:
                raise ValueError(f"{name} format must be one of {WEIGHT_FORMATS}, got {getattr(self, name)!r}")


def matrix_bytes(shape: tuple[int, ...], fmt: str) -> float:
    """A weight matrix [..., rows, cols] in `fmt`: bf16 2 B an element; fp8 1 B plus a 4-byte scale
    per row; mxfp4 17/32 B."""
    n = 1
    for d in shape:
        n *= d
    if fmt == "bf16":
        return 2.0 * n
    if fmt == "fp8":
        return n + 4.0 * (n // shape[-1])
    if fmt == "mxfp4":
        return n * MXFP4_BYTES
    raise ValueError(f"unknown weight format {fmt!r}")


def meta_model(config: ModelConfig | str):
    """The model's modules on the meta device: shapes without memory."""
    from impl.model.causal_lm import MoECausalLM
    config = get_config(config) if isinstance(config, str) else config
    with torch.device("meta"):
        return MoECausalLM(config)


def _param_component(name: str, kind: str, dense: bool) -> str:
    """The component a decoder layer's parameter (name within the layer) belongs to."""
    if name.startswith("self_attn."):
        return f"attention {kind}"
    if ".experts." in f".{name}":
        return "routed experts"
    if "shared_experts." in name:
        return "shared expert"
    if name.startswith("mlp.gate."):
        return "router"
    if name.startswith("mlp."):
        return "dense mlp" if dense else "router"
    return "norms"


def _param_bytes(name: str, shape: tuple[int, ...], component: str, config: ModelConfig, f: Formats) -> float:
    n = 1
    for d in shape:
        n *= d
    if component == "routed experts":  # [E, ...]: the top_k experts a token is routed to
        return matrix_bytes(shape, f.experts) * config.top_k / config.num_experts
    if component == "router" or name.endswith(FP32_PARAMS):
        return 4.0 * n
    if len(shape) == 1:
        return 2.0 * n  # norm weights
    return matrix_bytes(shape, f.projections)


def _layer_bytes(layer, kind: str, dense: bool, config: ModelConfig, f: Formats, into: dict) -> None:
    for name, p in layer.named_parameters():
        comp = _param_component(name, kind, dense)
        if comp.startswith("attention") and len(p.shape) == 1 and "norm" in name:
            comp = "norms"
        into[comp] = into.get(comp, 0.0) + _param_bytes(name, tuple(p.shape), comp, config, f)
    for name, b in layer.named_buffers():
        if name.endswith("e_score_correction_bias"):
            into["router"] = into.get("router", 0.0) + 4.0 * b.numel()


def state_bytes(config: ModelConfig, kind: str, context: int) -> float:
    """Cache or state bytes one layer of `kind` reads and writes for the token at position `context`."""
    if kind == "kda":
        h, d, kern = config.linear_num_heads, config.linear_head_dim, config.conv_kernel_size
        return 2 * 4.0 * (h * d * d + 3 * h * d * (kern - 1))
    if kind == "mla":
        return (context + 2) * (config.kv_lora_rank + config.qk_rope_head_dim) * 2.0
    return (context + 2) * 2 * config.num_kv_heads * config.head_dim * 2.0


STATE_COMPONENT = {"kda": "kda state", "mla": "mla cache", "mha": "kv cache"}


def token_bytes(config: ModelConfig | str, context: int, formats: Formats = Formats(), model=None) -> dict[str, float]:
    """Bytes by component that one plain decode token at position `context` reads (and, for caches
    and states, writes); `model` (a meta model of `config`) saves building one."""
    config = get_config(config) if isinstance(config, str) else config
    if context < 0:
        raise ValueError(f"context must be >= 0, got {context}")
    model = meta_model(config) if model is None else model
    out: dict[str, float] = {}
    for i, layer in enumerate(model.layers):
        kind = config.attention_kind(i)
        _layer_bytes(layer, kind, i in config.dense_layers, config, formats, out)
        comp = STATE_COMPONENT[kind]
        out[comp] = out.get(comp, 0.0) + state_bytes(config, kind, context)
    out["norms"] = out.get("norms", 0.0) + 2.0 * model.norm.weight.numel()
    out["head"] = matrix_bytes(tuple(model.lm_head.weight.shape), formats.head)
    out["embedding row"] = 2.0 * config.hidden_size
    return out


def mtp_parts(config: ModelConfig | str, context: int, formats: Formats = Formats(), model=None) -> dict[str, float]:
    """Bytes by component that one pass of the MTP layer reads for one token (its own weights, its
    attention cache; the head it shares with the target is counted with the target)."""
    config = get_config(config) if isinstance(config, str) else config
    model = meta_model(config) if model is None else model
    parts: dict[str, float] = {}
    for mtp in getattr(model, "mtp", []):
        _layer_bytes(mtp.block, config.mtp_attention, False, config, formats, parts)
        for name, p in mtp.named_parameters():
            if not name.startswith("block."):
                parts["mtp"] = parts.get("mtp", 0.0) + _param_bytes(name, tuple(p.shape), "mtp", config, formats)
        comp = STATE_COMPONENT[config.mtp_attention]
        parts[comp] = parts.get(comp, 0.0) + state_bytes(config, config.mtp_attention, context)
    return parts


def mtp_bytes(config: ModelConfig | str, context: int, formats: Formats = Formats(), model=None) -> float:
    """`mtp_parts` summed: one MTP pass of one token."""
    return sum(mtp_parts(config, context, formats, model).values())


def expected_distinct_experts(config: ModelConfig | str, tokens: int) -> float:
    """Experts one MoE layer reads for `tokens` tokens, each routed to top_k of E experts
    independently and uniformly (as random weights route, near enough): E (1 - (1 - top_k/E)**tokens).
    At Ling-3.0-flash's 8 of 512 and 4 tokens: 31.3 (the MoE gate's seeded inputs read 30.9)."""
    config = get_config(config) if isinstance(config, str) else config
    if tokens < 1:
        raise ValueError(f"tokens must be >= 1, got {tokens}")
    e, k = config.num_experts, config.top_k
    return e * (1.0 - (1.0 - k / e) ** tokens)


def kda_verify_state_passes(tokens: int) -> int:
    """Passes over a KDA layer's recurrent state in a verify pass of `tokens` tokens as impl.model.kda
    runs it: each token reads the state before it and writes its own into the track (2 a token),
    the live state takes the last one (2), keep_verified copies the accepted one back (2)."""
    return 2 * tokens + 4


def spec_step_bytes(config: ModelConfig | str, context: int, k: int, formats: Formats = Formats(), model=None,
                    distinct_experts: float | None = None) -> dict[str, float]:
    """Bytes by component of one speculative step at `context` committed positions, as impl.speculative
    runs it: the MTP layer over the k+1 verified positions, then k-1 chained one-token passes, each
    pass with the shared head's logits ("draft"); the target's verify pass over k+1 tokens, which
    reads every weight once, the routed experts its tokens route to (`distinct_experts` a layer,
    else `expected_distinct_experts`), the head once, and the KDA states `kda_verify_state_passes`
    times. The commit's bytes are a few dozen and not counted."""
    config = get_config(config) if isinstance(config, str) else config
    if k < 1:
        raise ValueError(f"a speculative step drafts k >= 1 tokens, got k={k}")
    model = meta_model(config) if model is None else model
    tokens = k + 1
    d = expected_distinct_experts(config, tokens) if distinct_experts is None else distinct_experts
    if not config.top_k <= d <= min(config.num_experts, tokens * config.top_k):
        raise ValueError(f"{tokens} tokens routed to {config.top_k} experts each read between {config.top_k} and "
                         f"{min(config.num_experts, tokens * config.top_k)} distinct experts a layer, got {d}")
    out = token_bytes(config, context + k, formats, model)
    out["routed experts"] *= d / config.top_k
    if "kda state" in out:
        out["kda state"] *= kda_verify_state_passes(tokens) / 2  # token_bytes counts one read and one write
    span = mtp_parts(config, context, formats, model)
    one_token = sum(span.values())  # each chained draft pass
    span["routed experts"] = span.get("routed experts", 0.0) * d / config.top_k
    out["draft"] = sum(span.values()) + (k - 1) * one_token + k * out["head"]
    return out


def floor_ms(nbytes: float, bytes_per_s: float) -> float:
    return nbytes / bytes_per_s * 1e3


def decode_positions(prompt_tokens: int, output_tokens: int) -> tuple[int, int]:
    """The first and last positions a request decodes at: its first output token comes from the
    prompt pass, the other output_tokens - 1 are decoded at positions prompt_tokens ..
    prompt_tokens + output_tokens - 2."""
    if prompt_tokens < 1 or output_tokens < 2:
        raise ValueError(f"a request decodes with prompt_tokens >= 1 and output_tokens >= 2, got {prompt_tokens} "
                         f"and {output_tokens}")
    return prompt_tokens, prompt_tokens + output_tokens - 2


def tpot_floor_s(config: ModelConfig | str, prompt_tokens: int, output_tokens: int, formats: Formats,
                 bytes_per_s: float, drafts: int = 0, committed_per_step: float = 1.0, model=None) -> float:
    """The byte floor of a request's time per output token at `bytes_per_s`: the mean bytes of a
    plain decode token over the request's `decode_positions`, or with `drafts` > 0 of a
    speculative step (`spec_step_bytes`) over the tokens each step commits on average. Caches
    grow linearly with the position, so the mean is that of the first and last positions."""
    config = get_config(config) if isinstance(config, str) else config
    if not bytes_per_s > 0:
        raise ValueError(f"bytes_per_s must be > 0, got {bytes_per_s}")
    if drafts == 0 and committed_per_step != 1.0:
        raise ValueError(f"a plain decode step commits one token, got committed_per_step={committed_per_step}")
    if drafts and not 1.0 <= committed_per_step <= drafts + 1:
        raise ValueError(f"a speculative step of {drafts} drafts commits 1 to {drafts + 1} tokens, got "
                         f"committed_per_step={committed_per_step}")
    model = meta_model(config) if model is None else model

    def step_bytes(position: int) -> float:
        parts = (spec_step_bytes(config, position, drafts, formats, model) if drafts
                 else token_bytes(config, position, formats, model))
        return sum(parts.values())

    first, last = decode_positions(prompt_tokens, output_tokens)
    return (step_bytes(first) + step_bytes(last)) / 2 / committed_per_step / bytes_per_s


__all__ = ["EXPERT_FORMATS", "Formats", "MXFP4_BYTES", "WEIGHT_FORMATS", "expected_distinct_experts", "floor_ms",
           "kda_verify_state_passes", "matrix_bytes", "decode_positions", "meta_model", "mtp_bytes", "mtp_parts",
           "spec_step_bytes", "state_bytes", "token_bytes", "tpot_floor_s"]
