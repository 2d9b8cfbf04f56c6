"""Launch configurations of the Triton MoE, as data keyed by problem shape and device.

Keys are (experts, hidden, intermediate, top_k, M bucket, weight format, device name); the
values come from `scripts/gpu/tune_moe.py` run on that device and are committed here. A shape
nobody tuned gets `fallback()`: blocks that keep every program's tile at a few KB of weights
and enough programs to cover the GPU at M = 1.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

M_BUCKETS = (1, 2, 4, 8, 16)


@dataclass(frozen=True)
class MoELaunchConfig:
    gate_up_block_n: int = 32
    gate_up_block_k: int = 128
    gate_up_warps: int = 4
    gate_up_stages: int = 3
    down_block_n: int = 32
    down_block_k: int = 128
    down_warps: int = 4
    down_stages: int = 3

    def __post_init__(self) -> None:
        for name in ("gate_up_block_k", "down_block_k"):
            v = getattr(self, name)
            if v < 32 or v & (v - 1):
                raise ValueError(f"{name} must be a power of two >= 32 (one MXFP4 scale block), got {v}")
        for name in ("gate_up_block_n", "down_block_n"):
            v = getattr(self, name)
            if v < 16 or v & (v - 1):
                raise ValueError(f"{name} must be a power of two >= 16 (tensor-core tile), got {v}")


def m_bucket(m: int) -> int:
    return next(b for b in M_BUCKETS if m <= b)


# (experts, hidden, intermediate, top_k, m_bucket, format, device name) -> config. Filled by tuning.
TUNED: dict[tuple, MoELaunchConfig] = {}


def fallback(hidden: int, intermediate: int) -> MoELaunchConfig:
    return MoELaunchConfig()


def device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def lookup(experts: int, hidden: int, intermediate: int, top_k: int, m: int, fmt: str,
           device: torch.device) -> MoELaunchConfig:
    key = (experts, hidden, intermediate, top_k, m_bucket(m), fmt, device_name(device))
    return TUNED.get(key) or fallback(hidden, intermediate)
