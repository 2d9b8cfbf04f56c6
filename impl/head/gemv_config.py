"""The launch configuration of `fp8_gemv_kernel` (`GemvConfig`), its table of tuned ones and the
untuned defaults.

A configuration fixes the tile (BLOCK_N weight rows x BLOCK_K hidden elements per loop step), the
inner-product path (see impl.head.fp8_gemv: "split", FP8 tensor cores on the e4m3 weight as stored,
activations split exactly into e4m3 terms; "dot", the weight upcast to the activations' dtype for
16-bit tensor cores; "fma", fp32 multiply-accumulate on CUDA cores for at most `block_m` rows), and
`num_warps` / `num_stages`. The table (`TABLE`, impl.launch_tables) is keyed by
(N, K, M bucket, device name), N or K `ANY` in an entry for any; its entries live in
`fp8_gemv_tuned.json` beside this file, from `scripts/gpu/bench_head.py`'s sweep on the named device.

Lookup (`lookup`), first match wins; the rule that matched is returned with the configuration
so provenance can say whether a tuned entry was used:
  1. "exact":   (N, K, bucket, device) in TUNED;
  2. "hidden":  (ANY, K, bucket, device) in TUNED: the vocabulary changes the grid size only,
                while the tile that streams a row of K bytes best depends on K;
  3. "device":  (ANY, ANY, bucket, device) in TUNED: the device's tile for any shape;
  4. "generic": GENERIC[bucket] for any CUDA device (the "split" path needs FP8 tensor cores,
                compute capability 8.9+; `fp8_gemv` takes the "dot" path on older GPUs);
  rules 1-3 under the device's own name, then under a sibling's (impl.launch_tables.config_devices);
  under Triton's interpreter (CPU) the rule is "interpreter": INTERPRETER, a tile sized for few
  Python-level steps (the interpreter runs a block as numpy arrays; a block above 2**20
  elements fails there).
M buckets: 1, 2, 4, 8, 16; M above 16 runs in programs of 16 rows each (bucket 16).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

from impl.launch_tables import LaunchTable, check_power_of_two, first_entry

__all__ = ["ANY", "DOT_ROWS", "GENERIC", "INTERPRETER", "M_BUCKETS", "PATHS", "TABLE", "TUNED", "GemvConfig", "lookup",
           "m_bucket"]

M_BUCKETS = (1, 2, 4, 8, 16)
PATHS = ("split", "dot", "fma")
ANY = -1  # an entry's N or K that matches any
DOT_ROWS = 16  # tl.dot needs every dimension >= 16: activations are padded to 16 rows


@dataclass(frozen=True)
class GemvConfig:
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    path: str = "split"
    # Rows of activations per program: "split" 8 or 16 (its MMA operand has 2 * block_m columns),
    # "dot" 16 (tl.dot needs 16); "fma": the smallest power of two >= M, capped here (its
    # accumulator holds block_m x block_n x block_k fp32 values).
    block_m: int = DOT_ROWS

    def __post_init__(self) -> None:
        if self.path not in PATHS:
            raise ValueError(f"GemvConfig.path must be one of {PATHS}, got {self.path!r}")
        check_power_of_two(self, ("block_n", "block_k", "block_m"))
        min_m = 8 if self.path == "split" else DOT_ROWS  # "split" puts 2 * block_m columns in the MMA
        if self.path != "fma" and (self.block_m < min_m or self.block_n < 16 or self.block_k < 32):
            raise ValueError(f"path {self.path!r} needs block_m >= {min_m}, block_n >= 16 and block_k >= 32, "
                             f"got {self}")
        if self.num_warps not in (1, 2, 4, 8, 16) or not 1 <= self.num_stages <= 8:
            raise ValueError(f"bad num_warps / num_stages in {self}")

    @property
    def use_dot(self) -> bool:
        return self.path != "fma"

    def rows_per_program(self, m: int) -> int:
        """BLOCK_M for a call with `m` rows."""
        if self.use_dot:
            return self.block_m
        p = 1
        while p < min(m, self.block_m):
            p *= 2
        return p

    def as_dict(self) -> dict:
        return asdict(self)


def m_bucket(m: int) -> int:
    for b in M_BUCKETS:
        if m <= b:
            return b
    return M_BUCKETS[-1]


# The H200's entries: scripts/gpu/bench_head.py (2026-11-30, torch 2.11+cu130, triton 3.6; medians
# under CUDA graphs; per-row scales). Runners-up at M=1 (2560): 128 x 256 with 8 warps 97.8 us;
# 128 x 128 x 4 stages 103.4 us; 256 x 128 106.0 us; 128 x 512 x 2 stages 142.6 us; the "dot" path
# 194.6 us; "fma" 131.8 us.
TABLE = LaunchTable(Path(__file__).with_name("fp8_gemv_tuned.json"), GemvConfig, ("n", "k", "m_bucket", "device"),
                    "FP8 head")
TUNED: dict[tuple[int, int, int, str], GemvConfig] = TABLE.load()
RULES = ("exact", "hidden", "device")  # first_entry's shapes in `lookup`, in order

# Any CUDA device: tiles of 128 x 128 e4m3 (16 KiB) pipelined 4 deep (64 KiB of shared memory,
# within what sm89 offers); a 150k vocabulary gives over a thousand programs.
GENERIC: dict[int, GemvConfig] = {b: GemvConfig(block_n=128, block_k=128, num_warps=4, num_stages=4,
                                                block_m=8 if b <= 8 else 16) for b in M_BUCKETS}

INTERPRETER = GemvConfig(block_n=64, block_k=128, num_warps=4, num_stages=1, path="split", block_m=8)


def lookup(n: int, k: int, m: int, device_names: str | tuple[str, ...],
           interpreter: bool = False) -> tuple[GemvConfig, str]:
    """The configuration for an [m, k] x [n, k]^T call on a device whose tuned configs are those of
    `device_names` in order (impl.launch_tables.config_devices: its own, then a sibling's), and the
    rule that chose it (naming the sibling whose entry it took)."""
    if interpreter:
        return INTERPRETER, "interpreter"
    names = (device_names,) if isinstance(device_names, str) else device_names
    b = m_bucket(m)
    hit = first_entry(TUNED, [(n, k, b), (ANY, k, b), (ANY, ANY, b)], names)
    if hit is None:
        return GENERIC[b], "generic"
    cfg, rule, i = hit
    return cfg, RULES[rule] + ("" if i == 0 else f" (tuned on {names[i]})")
