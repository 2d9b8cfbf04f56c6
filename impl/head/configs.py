"""Launch configurations of `fp8_gemv_kernel`, as data, keyed by (N, K, M bucket, device name).

A configuration fixes the tile (BLOCK_N weight rows x BLOCK_K hidden elements per loop step), the
inner-product path (see impl.head.fp8_gemv: "split", FP8 tensor cores on the e4m3 weight as stored,
activations split exactly into e4m3 terms; "dot", the weight upcast to the activations' dtype for
16-bit tensor cores; "fma", fp32 multiply-accumulate on CUDA cores for at most `block_m` rows), and
`num_warps` / `num_stages`. Entries come from `scripts/gpu/bench_head.py`'s sweep on the named device.

Lookup (`lookup`), first match wins; the rule that matched is returned with the configuration
so provenance can say whether a tuned entry was used:
  1. "exact":   (N, K, bucket, device) in TUNED;
  2. "hidden":  (ANY_N, K, bucket, device) in TUNED: the vocabulary changes the grid size only,
                while the tile that streams a row of K bytes best depends on K;
  3. "device":  (bucket, device) in DEVICE_DEFAULTS;
  4. "generic": GENERIC[bucket] for any CUDA device (the "split" path needs FP8 tensor cores,
                compute capability 8.9+; `fp8_gemv` takes the "dot" path on older GPUs);
  under Triton's interpreter (CPU) the rule is "interpreter": INTERPRETER, a tile sized for few
  Python-level steps (the interpreter runs a block as numpy arrays; a block above 2**20
  elements fails there).
M buckets: 1, 2, 4, 8, 16; M above 16 runs in programs of 16 rows each (bucket 16).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

__all__ = ["ANY_N", "DEVICE_DEFAULTS", "DOT_ROWS", "GENERIC", "INTERPRETER", "M_BUCKETS", "PATHS", "TUNED",
           "GemvConfig", "lookup", "m_bucket"]

M_BUCKETS = (1, 2, 4, 8, 16)
PATHS = ("split", "dot", "fma")
ANY_N = -1
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
        for name in ("block_n", "block_k", "block_m"):
            v = getattr(self, name)
            if v < 1 or v & (v - 1):
                raise ValueError(f"GemvConfig.{name} must be a power of two, got {v}")
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


_H200 = "NVIDIA H200"
# scripts/gpu/bench_head.py on the H200 (2026-11-30, torch 2.11+cu130, triton 3.6; medians under
# CUDA graphs; per-row scales; byte floor at the 4.28 TB/s copy bandwidth measured in the same run):
#   157184 x 2560: M=1 97.4 us (96.5% of the floor), M=4 98.7 us; M=16 (block_m 16) 116.9 us
#   157184 x 4096: M=1 150.4 us (100%),              M=4 152.2 us; M=16 (block_m 16) 184.9 us
# Runners-up at M=1 (2560): 128 x 256 with 8 warps 97.8 us; 128 x 128 x 4 stages 103.4 us;
# 256 x 128 106.0 us; 128 x 512 x 2 stages 142.6 us; the "dot" path 194.6 us; "fma" 131.8 us.
_H200_SMALL_M = GemvConfig(block_n=128, block_k=256, num_warps=4, num_stages=3, path="split", block_m=8)
_H200_M16 = GemvConfig(block_n=128, block_k=128, num_warps=4, num_stages=4, path="split", block_m=16)

# (N, K, M bucket, device name) -> config. Filled from scripts/gpu/bench_head.py's sweep.
TUNED: dict[tuple[int, int, int, str], GemvConfig] = {
    **{(157184, k, b, _H200): _H200_SMALL_M for k in (2560, 4096) for b in (1, 2, 4, 8)},
    **{(157184, k, 16, _H200): _H200_M16 for k in (2560, 4096)},
}

# (M bucket, device name) -> config, for shapes without a tuned entry on a known device.
DEVICE_DEFAULTS: dict[tuple[int, str], GemvConfig] = {
    **{(b, _H200): _H200_SMALL_M for b in (1, 2, 4, 8)},
    (16, _H200): _H200_M16,
}

# Any CUDA device: tiles of 128 x 128 e4m3 (16 KiB) pipelined 4 deep (64 KiB of shared memory,
# within what sm89 offers); a 150k vocabulary gives over a thousand programs.
GENERIC: dict[int, GemvConfig] = {b: GemvConfig(block_n=128, block_k=128, num_warps=4, num_stages=4,
                                                block_m=8 if b <= 8 else 16) for b in M_BUCKETS}

INTERPRETER = GemvConfig(block_n=64, block_k=128, num_warps=4, num_stages=1, path="split", block_m=8)


def lookup(n: int, k: int, m: int, device_names: str | tuple[str, ...],
           interpreter: bool = False) -> tuple[GemvConfig, str]:
    """The configuration for an [m, k] x [n, k]^T call on a device whose tuned configs are those of
    `device_names` in order (impl.triton_env.config_devices: its own, then a sibling's), and the
    rule that chose it (naming the sibling whose entry it took)."""
    if interpreter:
        return INTERPRETER, "interpreter"
    names = (device_names,) if isinstance(device_names, str) else device_names
    b = m_bucket(m)
    for i, name in enumerate(names):
        on = "" if i == 0 else f" (tuned on {name})"
        if (n, k, b, name) in TUNED:
            return TUNED[(n, k, b, name)], "exact" + on
        if (ANY_N, k, b, name) in TUNED:
            return TUNED[(ANY_N, k, b, name)], "hidden" + on
        if (b, name) in DEVICE_DEFAULTS:
            return DEVICE_DEFAULTS[(b, name)], "device" + on
    return GENERIC[b], "generic"
