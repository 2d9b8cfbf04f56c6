"""A 16-bit GEMV for one decode token, split over K, in Triton: out[n] = sum_k x[k] * w[n, k].

For the attention layers' projections at batch 1. cuBLAS reads a [2560, 4096] bf16 o_proj at
about a third of the H200's bandwidth (15.3 us for 21 MB, notes/runs/2026-12-03-attention-h200-parts.log):
2560 output rows give too few row blocks to fill 132 SMs. Here programs take BLOCK_N rows times
one of SPLIT_K slices of K, so even a short N fills the GPU; each writes an fp32 partial sum and a
second kernel adds the SPLIT_K partials and rounds to the output dtype. The products are formed
in fp32 on CUDA cores (M = 1: there is nothing for a tensor core to share).

Launch configs are data (`GemvConfig`, `TUNED` by (N, K, device name)); a shape without an entry
goes to torch (cuBLAS): `linear` is a drop-in for F.linear that takes the kernel
(impl.model.gemv_kernel, imported only then) where a sweep measured it faster
(scripts/gpu/bench_attention.py --kinds parts).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from impl import backends


@dataclass(frozen=True)
class GemvConfig:
    block_n: int
    block_k: int
    split_k: int
    num_warps: int = 4
    num_stages: int = 3

    def __post_init__(self) -> None:
        for name in ("block_n", "block_k", "split_k"):
            v = getattr(self, name)
            if v < 1 or v & (v - 1):
                raise ValueError(f"GemvConfig.{name} must be a power of two, got {v}")


# (N, K, device name) -> config; empty until a sweep on the device finds the kernel faster.
TUNED: dict[tuple[int, int, str], GemvConfig] = {}
INTERPRETER = GemvConfig(block_n=16, block_k=32, split_k=2, num_warps=4, num_stages=1)


def launch_config(n: int, k: int, device: torch.device) -> GemvConfig | None:
    """The tuned config for a [N, K] weight on a CUDA `device`, or None (torch's GEMV)."""
    if device.type != "cuda":
        return None
    from impl.triton_env import device_name  # imports Triton: only on the CUDA path
    return TUNED.get((n, k, device_name(device)))


def linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """F.linear(x, w) without bias; one-token calls on a device with a tuned config for w's shape
    take the split-K kernel (noted as provenance "gemv"/"triton")."""
    cfg = None
    if x.numel() == x.shape[-1] and x.device.type == "cuda" and w.stride(-1) == 1 and x.dtype == w.dtype:
        cfg = launch_config(w.shape[0], w.shape[1], x.device)
    if cfg is None:
        return F.linear(x, w)
    from impl.model.gemv_kernel import gemv
    backends.note("gemv", "triton", "gemv_split_kernel", n=w.shape[0], k=w.shape[1], split_k=cfg.split_k)
    return gemv(x, w, cfg)


def apply(lin: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """lin(x), through `linear` when lin has no bias."""
    return linear(x, lin.weight) if lin.bias is None else lin(x)


__all__ = ["GemvConfig", "INTERPRETER", "TUNED", "apply", "launch_config", "linear"]
