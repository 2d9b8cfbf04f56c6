"""The shared expert's weights as the MoE backends receive them."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class SharedExpert:
    """gate [Is, H], up [Is, H], down [H, Is], in the activation dtype; `limit`: its SwiGLU
    clipping (impl.moe.reference.swiglu_act), None for none."""

    gate: torch.Tensor
    up: torch.Tensor
    down: torch.Tensor
    limit: float | None = None


def check_shared_expert(shared: SharedExpert, hidden: int, device: torch.device) -> None:
    """Named errors for a shared expert that does not fit a layer of `hidden` on `device`."""
    i_s = shared.gate.shape[0]
    if shared.gate.shape != (i_s, hidden) or shared.up.shape != (i_s, hidden) or shared.down.shape != (hidden, i_s):
        raise ValueError(f"shared expert must be [Is, {hidden}], [Is, {hidden}], [{hidden}, Is]; got "
                         f"{tuple(shared.gate.shape)}, {tuple(shared.up.shape)}, {tuple(shared.down.shape)}")
    if any(not t.is_contiguous() or t.device != device for t in (shared.gate, shared.up, shared.down)):
        raise ValueError("shared expert weights must be contiguous and on the device of x")


def clip_note(swiglu_limit: float | None, shared: SharedExpert | None) -> dict:
    """The SwiGLU clipping a MoE call ran, for its provenance note: both limits where either is
    set (a layer that clips), nothing otherwise."""
    shared_limit = shared.limit if shared is not None else None
    if swiglu_limit is None and shared_limit is None:
        return {}
    return {"swiglu_limit": swiglu_limit, "shared_limit": shared_limit}


def shared_expert(x: torch.Tensor, shared: SharedExpert) -> torch.Tensor:
    """The shared expert's SwiGLU MLP on x [T, H], in x's dtype (torch ops)."""
    from impl.moe.reference import swiglu_act
    return F.linear(swiglu_act(F.linear(x, shared.gate), F.linear(x, shared.up), shared.limit), shared.down)
