"""The shared expert's weights as the MoE backends receive them."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SharedExpert:
    """gate [Is, H], up [Is, H], down [H, Is], in the activation dtype."""

    gate: torch.Tensor
    up: torch.Tensor
    down: torch.Tensor
