"""Launch configurations of the Triton MoE, as data keyed by problem shape and device.

Keys are (experts, hidden, intermediate, top_k, M bucket, weight format, device name); the
values live in `tuned_configs.json` beside this file, written by
`scripts/gpu/bench_moe.py --tune --write-configs` on that device and committed. A shape nobody
tuned gets the defaults of `MoELaunchConfig` (32 x 128 tiles, 4 warps, 3 stages), which ran
correctly everywhere they were tried.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from impl.triton_env import device_name

M_BUCKETS = (1, 2, 4, 8, 16)
# How MXFP4 weights meet the activations on the tensor-core path (more tokens than gemv_max_tokens):
# "bits" decodes E2M1 by integer ops in registers and calls tl.dot; "scaled" hands the packed codes
# and E8M0 scales to tl.dot_scaled, whose upcast is Triton's own lowering for the target.
MXFP4_PRODUCTS = ("bits", "scaled")
# How MXFP4 weights are decoded on the register path (at most gemv_max_tokens tokens): "bits16"
# builds bf16 per byte nibble by int16 ops; "word32" loads 32-bit words (8 codes each), builds the
# fp32 bits of each code by a shift and a mask, and scales once per word instead of per code;
# "word32x2" builds two codes' bits at once as the bf16 halves of a word, then widens each;
# "dp4a" looks codes up as int8 (2 x E2M1) by byte permutes and multiplies them with the
# activations split into int8 terms by exact integer dot products (impl/moe/triton_dp4a.py).
# The word decodes by the value the kernels' WORD32 constexpr takes for them (0: not a word decode).
WORD_DECODES = {"word32": 1, "word32x2": 2, "dp4a": 3}
GEMV_DECODES = ("bits16", *WORD_DECODES)


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
    # Up to this many tokens, products are register multiply-adds instead of tensor-core dots.
    gemv_max_tokens: int = 0
    mxfp4_product: str = "bits"  # one of MXFP4_PRODUCTS
    gemv_decode: str = "bits16"  # one of GEMV_DECODES
    # On the register path, programs per block of the shared expert's rows (gate_up) or per hidden
    # block (down, splitting its K): its bf16 rows hold 4x the bytes of MXFP4 ones.
    shared_split: int = 1
    # On the register path, the shared expert's K tile in both kernels (0: the routed experts' K
    # tiles). Its bf16 rows are 4x the bytes of MXFP4 ones: at the routed tiles its loop would set
    # the kernel's register count, i.e. how many programs an SM holds.
    shared_block_k: int = 0
    # On the register path (dp4a and plain weights), each K step of the gate_up (down) kernel loads
    # the weights of the step this many steps ahead (0, 1 or 2) before computing on its own:
    # memory round trips in flight while the decode runs, each held in registers (per kernel: the
    # registers a thread can spare differ with the tiles).
    gate_up_prefetch: int = 0
    down_prefetch: int = 0
    # The same for the shared expert's loop in the gate_up kernel: its long one (H / shared_block_k
    # steps over plain bf16 rows, a different loop from the routed experts' MXFP4 words, with other
    # registers to spare). Its loop in the down kernel (a few steps of I_shared / shared_split)
    # loads no step ahead: at the down kernel's tiles its two sets would spill.
    shared_prefetch: int = 0
    # On the register path (dp4a and plain weights), Triton's software pipeline of this many stages
    # for the K loops (0: none): asynchronous copies into shared memory, so that more bytes are in
    # flight than registers could hold. Exclusive with the prefetches above.
    gemv_stages: int = 0
    # Programmatic dependent launch (impl/moe/triton_pdl.py): each kernel of the layer, router
    # included, starts while the one before it finishes (the shared expert's gate_up meanwhile).
    pdl: bool = False
    # With pdl: while a program waits for the launch before it, it asks for its weights in L2
    # (down kernel: its expert's rows; router: its experts' rows).
    pdl_prefetch: bool = False
    # The layer's routing in one launch (logits, then top-k by the last program to finish) instead
    # of two: one launch boundary less on the critical path.
    router_fused: bool = False
    # At one token (a decode step): the router stops at its logits and each expert kernel program
    # does the top-k itself (impl/moe/triton_topk.py), so the step's critical path has no top-k
    # launch between the logits and the experts' first loads. Ignored for more tokens.
    topk_in_experts: bool = False
    # The whole layer in one persistent launch (impl/moe/triton_layer.py) for at most 4 tokens:
    # routing, experts, shared expert and combine between two grid-wide barriers. Its products
    # take the register path's tiles and prefetches above (gate_up_*, down_*, shared_block_k,
    # shared_prefetch; MXFP4 through the dp4a decode), its programs gate_up_warps warps each.
    one_launch: bool = False
    # Programs of the one launch: 0, one an SM (all resident at once: its barriers need that).
    layer_programs: int = 0
    # Weights asked for in L2 as soon as a one-launch program knows them: 0 never; 1 its down
    # rows while it waits at the second barrier; 2 also its router, shared and routed gate_up rows.
    l2_prefetch: int = 0
    # 3: the one launch's phases as three launches with no grid-wide barriers (for a GPU whose
    # SMs other work may hold, so that not every program would be resident; and to time each
    # phase alone); 1: one launch.
    layer_launches: int = 1

    def __post_init__(self) -> None:
        for name in ("gate_up_block_k", "down_block_k", "shared_block_k"):
            v = getattr(self, name)
            if name == "shared_block_k" and v == 0:
                continue
            if v < 32 or v & (v - 1):
                raise ValueError(f"{name} must be a power of two >= 32 (one MXFP4 scale block), got {v}")
        if self.gemv_max_tokens not in (0, 1, 2, 4):
            raise ValueError(f"gemv_max_tokens must be 0, 1, 2 or 4, got {self.gemv_max_tokens}")
        if self.mxfp4_product not in MXFP4_PRODUCTS:
            raise ValueError(f"mxfp4_product must be one of {MXFP4_PRODUCTS}, got {self.mxfp4_product!r}")
        if self.gemv_decode not in GEMV_DECODES:
            raise ValueError(f"gemv_decode must be one of {GEMV_DECODES}, got {self.gemv_decode!r}")
        for name in ("gate_up_block_n", "down_block_n"):
            v = getattr(self, name)
            if v < 16 or v & (v - 1):
                raise ValueError(f"{name} must be a power of two >= 16 (tensor-core tile), got {v}")
        if self.shared_split not in (1, 2, 4, 8):
            raise ValueError(f"shared_split must be 1, 2, 4 or 8, got {self.shared_split}")
        for name in ("pdl", "pdl_prefetch", "router_fused", "topk_in_experts", "one_launch"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be a bool, got {getattr(self, name)!r}")
        for name in ("gate_up_prefetch", "down_prefetch", "shared_prefetch"):
            v = getattr(self, name)
            if isinstance(v, bool) or v not in (0, 1, 2):
                raise ValueError(f"{name} must be 0, 1 or 2 (K steps ahead), got {v!r}")
        if self.gemv_stages not in (0, 2, 3, 4):
            raise ValueError(f"gemv_stages must be 0, 2, 3 or 4, got {self.gemv_stages}")
        if self.gemv_stages and (self.gate_up_prefetch or self.down_prefetch or self.shared_prefetch):
            raise ValueError("gemv_stages and the prefetches are two ways to keep loads in flight: choose one")
        if self.router_fused and self.topk_in_experts:
            raise ValueError("router_fused and topk_in_experts are two places for the top-k: choose one")
        if self.pdl_prefetch and not self.pdl:
            raise ValueError("pdl_prefetch needs pdl (it prefetches while waiting for the launch before)")
        if isinstance(self.layer_programs, bool) or not isinstance(self.layer_programs, int) or self.layer_programs < 0:
            raise ValueError(f"layer_programs must be an int >= 0 (0: one an SM), got {self.layer_programs!r}")
        if self.layer_launches not in (1, 3):
            raise ValueError(f"layer_launches must be 1 or 3, got {self.layer_launches!r}")
        if self.l2_prefetch not in (0, 1, 2):
            raise ValueError(f"l2_prefetch must be 0, 1 or 2, got {self.l2_prefetch!r}")
        layer_only = {f: getattr(self, f) for f in ("layer_programs", "l2_prefetch", "layer_launches")
                      if getattr(self, f) != MoELaunchConfig.__dataclass_fields__[f].default}
        if layer_only and not self.one_launch:
            raise ValueError(f"{', '.join(f'{k}={v}' for k, v in layer_only.items())} apply to the one launch only: "
                             f"set one_launch=True, or leave them at their defaults")
        if self.gemv_decode == "dp4a" and self.gate_up_block_n < 32:
            raise ValueError(f"gemv_decode 'dp4a' needs gate_up_block_n >= 32 (the gate_up kernel splits its output "
                             f"in blocks of 32), got {self.gate_up_block_n}")


def m_bucket(m: int) -> int:
    return next(b for b in M_BUCKETS if m <= b)


TUNED_PATH = Path(__file__).with_name("tuned_configs.json")
KEY_FIELDS = ("experts", "hidden", "intermediate", "top_k", "m_bucket", "format", "device")


def load_tuned(path: Path = TUNED_PATH) -> dict[tuple, MoELaunchConfig]:
    """{key tuple: config} from the JSON list of {"key": {...}, "config": {...}} entries."""
    if not path.exists():
        return {}
    try:
        entries = json.loads(path.read_text())
        return {tuple(e["key"][f] for f in KEY_FIELDS): MoELaunchConfig(**e["config"]) for e in entries}
    except (ValueError, KeyError, TypeError) as e:
        raise ValueError(f"{path}: malformed tuned MoE configs ({e})") from None


def save_tuned(tuned: dict[tuple, MoELaunchConfig], path: Path = TUNED_PATH) -> None:
    merged = {**load_tuned(path), **tuned}
    entries = [{"key": dict(zip(KEY_FIELDS, k)), "config": dataclasses.asdict(c)} for k, c in sorted(merged.items())]
    # Atomically: a tuning cut short mid-write must not leave a truncated file.
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(entries, indent=1) + "\n")
    os.replace(tmp, path)


TUNED: dict[tuple, MoELaunchConfig] = load_tuned()


def fallback(hidden: int, intermediate: int) -> MoELaunchConfig:
    """For shapes nobody tuned: the defaults (every shape of the fuzz suite runs with them)."""
    return MoELaunchConfig()


def lookup(experts: int, hidden: int, intermediate: int, top_k: int, m: int, fmt: str,
           device: torch.device) -> MoELaunchConfig:
    key = (experts, hidden, intermediate, top_k, m_bucket(m), fmt, device_name(device))
    return TUNED.get(key) or fallback(hidden, intermediate)
