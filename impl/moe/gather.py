"""MoE by gathering the chosen experts' weights and two batched contractions.

No host synchronization and static shapes, so it can be captured in a CUDA graph or compiled;
the baseline the specialized kernels must beat (it copies each chosen expert once per token).
"""

from __future__ import annotations

import torch

from impl.moe.reference import swiglu_act


def moe_gather(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
               w_gate_up: torch.Tensor, w_down: torch.Tensor, swiglu_limit: float | None = None) -> torch.Tensor:
    gate_up = torch.einsum("th,tkjh->tkj", x, w_gate_up[ids].to(x.dtype))
    gate, up = gate_up.chunk(2, dim=-1)
    y = torch.einsum("tki,tkhi->tkh", swiglu_act(gate, up, swiglu_limit), w_down[ids].to(x.dtype))
    return torch.einsum("tkh,tk->th", y, weights.to(x.dtype))
