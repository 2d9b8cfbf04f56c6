"""The Triton MoE layer's launch configuration (`MoELaunchConfig`) and its table of tuned ones.

The table (`TABLE`, impl.launch_tables) is keyed by (experts, hidden, intermediate, top_k,
M bucket, weight format, device name); its entries live in `tuned_configs.json` beside this file,
written by `scripts/gpu/bench_moe.py --tune --write-configs` on that device and committed. A shape
nobody tuned gets the defaults of `MoELaunchConfig` (32 x 128 tiles, 4 warps, 3 stages), which ran
correctly everywhere they were tried.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from impl.launch_tables import LaunchTable, check_power_of_two, config_devices, first_entry

M_BUCKETS = (1, 2, 4, 8, 16)
M_PAD = M_BUCKETS[-1]  # tokens per kernel call; larger batches run in chunks of M_PAD


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
    # Up to this many tokens, products are register multiply-adds instead of tensor-core dots
    # (impl/moe/triton_gemv.py; MXFP4 experts through the exact int8 dot products of
    # impl/moe/triton_dp4a.py).
    gemv_max_tokens: int = 0
    # On the register path, programs per block of the shared expert's rows (gate_up) or per hidden
    # block (down, splitting its K): its bf16 rows hold 4x the bytes of MXFP4 ones.
    shared_split: int = 1
    # On the register path, the shared expert's K tile in both kernels (0: the routed experts' K
    # tiles). Its bf16 rows are 4x the bytes of MXFP4 ones: at the routed tiles its loop would set
    # the kernel's register count, i.e. how many programs an SM holds.
    shared_block_k: int = 0
    # On the register path, each K step of the gate_up (down) kernel loads the weights of the step
    # this many steps ahead (0, 1 or 2) into registers before computing on its own: memory round
    # trips in flight while the decode runs (per kernel: the registers a thread can spare differ
    # with the tiles).
    gate_up_lookahead: int = 0
    down_lookahead: int = 0
    # The same for the shared expert's loop in the gate_up kernel: its long one (H / shared_block_k
    # steps over plain bf16 rows, a different loop from the routed experts' MXFP4 words, with other
    # registers to spare). Its loop in the down kernel (a few steps of I_shared / shared_split)
    # looks no step ahead: at the down kernel's tiles its two sets would spill.
    shared_lookahead: int = 0
    # Programmatic dependent launch (impl/moe/triton_pdl.py): each kernel of the layer, router
    # included, starts while the one before it finishes (the shared expert's gate_up meanwhile).
    pdl: bool = False
    # With pdl: while a program waits for the launch before it, it asks for its weights in L2
    # (down kernel: its expert's rows; router: its experts' rows).
    l2_prefetch: bool = False

    def __post_init__(self) -> None:
        shared_k = ("shared_block_k",) if self.shared_block_k else ()  # 0: the routed experts' K tiles
        check_power_of_two(self, ("gate_up_block_k", "down_block_k", *shared_k), least=32, why="one MXFP4 scale block")
        if self.gemv_max_tokens not in (0, 1, 2, 4):
            raise ValueError(f"gemv_max_tokens must be 0, 1, 2 or 4, got {self.gemv_max_tokens}")
        check_power_of_two(self, ("gate_up_block_n", "down_block_n"), least=16, why="tensor-core tile")
        if self.shared_split not in (1, 2, 4, 8):
            raise ValueError(f"shared_split must be 1, 2, 4 or 8, got {self.shared_split}")
        for name in ("pdl", "l2_prefetch"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be a bool, got {getattr(self, name)!r}")
        for name in ("gate_up_lookahead", "down_lookahead", "shared_lookahead"):
            v = getattr(self, name)
            if isinstance(v, bool) or v not in (0, 1, 2):
                raise ValueError(f"{name} must be 0, 1 or 2 (K steps ahead), got {v!r}")
        if self.l2_prefetch and not self.pdl:
            raise ValueError("l2_prefetch needs pdl (it prefetches while waiting for the launch before)")
        if self.gemv_max_tokens and self.gate_up_block_n < 32:
            raise ValueError(f"the register path needs gate_up_block_n >= 32 (with MXFP4 experts the gate_up kernel "
                             f"splits its output for the dp4a products in blocks of 32), got {self.gate_up_block_n}")


def m_bucket(m: int) -> int:
    return next(b for b in M_BUCKETS if m <= b)


TABLE = LaunchTable(Path(__file__).with_name("tuned_configs.json"), MoELaunchConfig,
                    ("experts", "hidden", "intermediate", "top_k", "m_bucket", "format", "device"), "MoE")
TUNED: dict[tuple, MoELaunchConfig] = TABLE.load()


def lookup(experts: int, hidden: int, intermediate: int, top_k: int, m: int, fmt: str,
           device: torch.device) -> MoELaunchConfig:
    """The config of this shape on `device`: its own entry, or a sibling's (config_devices); a
    shape nobody tuned gets the defaults (every shape of the fuzz suite runs with them)."""
    hit = first_entry(TUNED, [(experts, hidden, intermediate, top_k, m_bucket(m), fmt)], config_devices(device))
    return hit[0] if hit else MoELaunchConfig()
