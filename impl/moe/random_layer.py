"""A MoE layer of a preset's exact shape with random weights, for parity and timing on a device."""

from __future__ import annotations

import torch

from impl import backends
from impl.model.config import ModelConfig
from impl.model.layers import MoEBlock
from impl.moe.shared import SharedExpert

FORMATS = ("bf16", "mxfp4")


def random_moe_block(config: ModelConfig, fmt: str, device, backend: str = "triton", seed: int = 0,
                     dtype: torch.dtype = torch.bfloat16) -> MoEBlock:
    """Weights N(0, 0.02), correction bias N(0, 0.01); experts in `dtype` or MXFP4; router fp32."""
    if fmt not in FORMATS:
        raise ValueError(f"unknown expert format {fmt!r}; expected one of {FORMATS}")
    gen = torch.Generator(device=device).manual_seed(seed)
    with torch.device(device):
        block = MoEBlock(config, backends.get("moe", backend))
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0, 0.02, generator=gen)
        if block.gate.e_score_correction_bias is not None:
            block.gate.e_score_correction_bias.normal_(0, 0.01, generator=gen)
    block.to(dtype)
    block.gate.float()
    if fmt == "mxfp4":
        block.experts.quantize("mxfp4")
    return block.eval()


# The timing inputs' own seed: a draw from the global generator depends on what ran before, and
# at a few tokens the inputs decide how many distinct experts a call reads (its bytes).
INPUT_SEED = 1234


def random_inputs(config: ModelConfig, tokens: int, calls: int, device, seed: int = INPUT_SEED) -> list[torch.Tensor]:
    """`calls` bf16 inputs [tokens, hidden] N(0, 1), the same for a seed whatever ran before."""
    gen = torch.Generator(device=device).manual_seed(seed)
    return [torch.randn(tokens, config.hidden_size, device=device, generator=gen).to(torch.bfloat16)
            for _ in range(calls)]


def distinct_experts(block: MoEBlock, xs: list[torch.Tensor]) -> float:
    """Mean number of distinct routed experts one call on each of `xs` [tokens, hidden] reads."""
    with torch.no_grad():
        return sum(len(torch.unique(block.gate(x)[1])) for x in xs) / len(xs)


def shared_of(block: MoEBlock) -> SharedExpert | None:
    s = block.shared_experts
    return None if s is None else SharedExpert(s.gate_proj.weight, s.up_proj.weight, s.down_proj.weight, s.limit)


def bytes_per_token(config: ModelConfig, fmt: str, distinct_experts: float) -> dict[str, float]:
    """Bytes one layer call must read: the distinct routed experts, the shared expert (bf16) and
    the fp32 router."""
    h, i = config.hidden_size, config.moe_intermediate_size
    per_expert = 3 * i * h * (0.5 + 1 / 32) if fmt == "mxfp4" else 3 * i * h * 2
    return {"routed": distinct_experts * per_expert, "shared": 3 * config.shared_intermediate_size * h * 2,
            "router": config.num_experts * h * 4}
