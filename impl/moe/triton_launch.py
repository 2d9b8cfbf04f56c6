"""Launch planning of the Triton expert kernels, as data: which product path a call takes, the
tiles, look-ahead and masks of each kernel, and the grids. `expert_launch` is what
`impl.moe.triton_backend` launches and what tests/test_moe_gpu_compile.py builds for sm_90 from
the committed configs without a GPU.
"""

from __future__ import annotations

from dataclasses import dataclass

from impl.moe.moe_launch_config import M_PAD, MoELaunchConfig, lookup
from impl.quant.mxfp4 import MXFP4Tensor
from impl.triton_env import FP32_MATH, triton


@dataclass(frozen=True)
class Plan:
    """How one call of at most M_PAD tokens runs: its launch config, the routed experts' format,
    and the register path's rows (0: tensor cores)."""

    config: MoELaunchConfig
    format: str  # "mxfp4" or "bf16" (plain tensors of any float dtype)
    gemv_rows: int

    @property
    def dp4a(self) -> bool:
        """MXFP4 on the register path: x and the routed activations as int8 splits."""
        return self.format == "mxfp4" and self.gemv_rows > 0

    @property
    def product(self) -> str:
        """The products' path, as provenance records it."""
        if self.gemv_rows:
            return "gemv-dp4a" if self.dp4a else "gemv-plain"
        return "dot-bits" if self.format == "mxfp4" else "dot-plain"


def gemv_rows(cfg: MoELaunchConfig, tokens: int) -> int:
    """Rows of the register path for `tokens` tokens under `cfg` (0: tensor cores, tokens padded
    to M_PAD rows)."""
    return triton.next_power_of_2(tokens) if tokens <= cfg.gemv_max_tokens else 0


def plan(tokens: int, top_k: int, w_gate_up, w_down, device, config: MoELaunchConfig | None = None) -> Plan:
    """The plan for `tokens` tokens: `config`, else the committed config of the shape's M bucket."""
    mxfp4 = isinstance(w_gate_up, MXFP4Tensor)
    if mxfp4 != isinstance(w_down, MXFP4Tensor):
        raise TypeError("gate_up and down weights must both be MXFP4 or both be plain tensors")
    experts, _, hidden = w_gate_up.shape
    fmt = "mxfp4" if mxfp4 else "bf16"
    cfg = config or lookup(experts, hidden, w_down.shape[-1], top_k, tokens, fmt, device)
    return Plan(cfg, fmt, gemv_rows(cfg, tokens))


def shared_block_k(cfg: MoELaunchConfig, rows: int) -> tuple[int, int]:
    """The shared expert's K tiles in the (gate_up, down) kernels: `shared_block_k` on the
    register path, else (tensor-core tiles) the routed experts' K tiles."""
    if rows and cfg.shared_block_k:
        return cfg.shared_block_k, cfg.shared_block_k
    return cfg.gate_up_block_k, cfg.down_block_k


def shared_chunk(i_shared: int, split: int) -> int:
    """The down kernel's share of the shared expert's K a program: whole blocks of 32 columns."""
    return -(-i_shared // (32 * split)) * 32


def even_tiles(cfg: MoELaunchConfig, hidden: int, inter: int, i_shared: int, split: int,
               shared_k: tuple[int, int]) -> tuple[bool, bool]:
    """(gate_up, down): whether every tile of that kernel, routed and shared, lies whole inside
    its weight, so the kernel may load without masks (the presets' shapes; odd ones keep them)."""
    gate_up = inter % cfg.gate_up_block_n == 0 and hidden % cfg.gate_up_block_k == 0
    down = hidden % cfg.down_block_n == 0 and inter % cfg.down_block_k == 0
    if i_shared:
        gate_up = gate_up and i_shared % (cfg.gate_up_block_n // split) == 0 and hidden % shared_k[0] == 0
        chunk = shared_chunk(i_shared, split)
        down = down and all(min(chunk, i_shared - lo) % shared_k[1] == 0 for lo in range(0, i_shared, chunk))
    return gate_up, down


@dataclass(frozen=True)
class KernelLaunch:
    """One kernel's grid and compile-time parameters (constexprs, warps, pipeline stages)."""

    grid: tuple[int, int]
    consts: dict
    num_warps: int
    num_stages: int


@dataclass(frozen=True)
class ExpertLaunch:
    """The two expert kernels of one call."""

    gate_up: KernelLaunch
    down: KernelLaunch
    shared_chunk: int  # the down kernel's share of the shared expert's K a program


def expert_launch(cfg: MoELaunchConfig, *, tokens: int, num_slots: int, hidden: int, inter: int, i_shared: int,
                  mxfp4: bool, pdl: bool, clip: bool = False) -> ExpertLaunch:
    """The launches for `tokens` tokens grouped in `num_slots` slots, weights [E, 2 * inter,
    hidden] and [E, hidden, inter] (MXFP4 or plain), a shared expert of width `i_shared` (0:
    none), with programmatic dependent launch or not, with SwiGLU clipping (`clip`) or not."""
    rows = gemv_rows(cfg, tokens)
    # The shared expert's share of programs (register path only: a tensor-core tile needs 16 rows).
    split = (cfg.shared_split if rows else 1) if i_shared else 1
    shared_slots = split if i_shared else 0
    shared_k = shared_block_k(cfg, rows)
    even_a, even_b = even_tiles(cfg, hidden, inter, i_shared, split, shared_k)
    common = dict(M_PAD=M_PAD, MXFP4=mxfp4, HAS_SHARED=i_shared > 0, GEMV_ROWS=rows, FP32_MATH=FP32_MATH,
                  SHARED_SPLIT=split, PDL=pdl)

    def ahead(lookahead: int) -> int:  # look-ahead is a register-path strategy
        return lookahead if rows else 0

    gate_up = KernelLaunch(
        (num_slots + shared_slots, triton.cdiv(max(inter, i_shared), cfg.gate_up_block_n)),
        dict(common, BLOCK_N=cfg.gate_up_block_n, BLOCK_K=cfg.gate_up_block_k, SHARED_BLOCK_K=shared_k[0],
             EVEN=even_a, AHEAD=ahead(cfg.gate_up_lookahead), SHARED_AHEAD=ahead(cfg.shared_lookahead), CLIP=clip),
        cfg.gate_up_warps, cfg.gate_up_stages)
    down = KernelLaunch(
        (triton.cdiv(hidden, cfg.down_block_n), num_slots + shared_slots),
        dict(common, BLOCK_N=cfg.down_block_n, BLOCK_K=cfg.down_block_k, SHARED_BLOCK_K=shared_k[1], EVEN=even_b,
             AHEAD=ahead(cfg.down_lookahead), SHARED_AHEAD=0,  # see MoELaunchConfig.shared_lookahead
             L2_PREFETCH=pdl and cfg.l2_prefetch),
        cfg.down_warps, cfg.down_stages)
    return ExpertLaunch(gate_up, down, shared_chunk(i_shared, split))


def resident_programs(regs: int, num_warps: int, shared: int, regs_per_sm: int = 65536, threads_per_sm: int = 2048,
                      shared_per_sm: int = 227 * 1024, programs_per_sm: int = 32) -> int:
    """Programs of a kernel one SM holds at once (registers are given out 256 a warp at a time);
    the defaults are an H100/H200 SM's."""
    regs_a_warp = -(-regs * 32 // 256) * 256
    return min(regs_per_sm // (regs_a_warp * num_warps), threads_per_sm // (32 * num_warps), programs_per_sm,
               shared_per_sm // shared if shared else programs_per_sm)
