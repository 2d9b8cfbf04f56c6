"""FP8 e4m3 (torch.float8_e4m3fn) weight quantization with fp32 scales.

Reference quantize / dequantize for 2-D weights [N, K] with one scale per output row ("row"), one
per tensor ("tensor"), or one per block of bn x bk weights ("block": scale [ceil(N/bn), ceil(K/bk)],
the layout of DeepSeek-V3-style checkpoints, Ling-3.0's among them, with blocks of 128 x 128);
scale = amax / 448 of what it covers.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["DEFAULT_BLOCK", "E4M3_MAX", "FP8Tensor", "GRANULARITIES", "block_scale_shape", "check_block", "dequantize_fp8",
           "quantize_fp8"]

E4M3_MAX = 448.0
GRANULARITIES = ("row", "tensor", "block")
DEFAULT_BLOCK = (128, 128)  # weight_block_size of the FP8 checkpoints this project reads

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
# Scales are kept >= the smallest normal fp32: a subnormal amax / 448 would lose precision
# (or be 0) and could round down far enough that amax / scale overflows 448.
_MIN_SCALE = torch.finfo(torch.float32).smallest_normal


def _check_granularity(granularity: object) -> None:
    if granularity not in GRANULARITIES:
        allowed = ", ".join(repr(g) for g in GRANULARITIES)
        raise ValueError(f"unknown FP8 granularity {granularity!r}; allowed: {allowed}")


def _check_2d(x: object, what: str) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{what} must be a torch.Tensor, got {type(x).__name__}")
    if x.ndim != 2:
        raise ValueError(f"{what} must be 2-D [N, K], got shape {tuple(x.shape)}")


def block_scale_shape(shape: tuple[int, int], block: tuple[int, int]) -> tuple[int, int]:
    """The scale of a [N, K] weight in blocks of bn x bk: [ceil(N / bn), ceil(K / bk)]."""
    return (-(-shape[0] // block[0]), -(-shape[1] // block[1]))


def check_block(block: object) -> tuple[int, int]:
    if (not isinstance(block, (tuple, list)) or len(block) != 2
            or not all(isinstance(b, int) and not isinstance(b, bool) and b >= 1 for b in block)):
        raise ValueError(f"an FP8 block must be two positive whole numbers (rows, columns), got {block!r}")
    return tuple(block)


def _check_data_scale(data: object, scale: object, granularity: str, block: tuple[int, int] | None = None) -> None:
    _check_2d(data, "FP8 data")
    if data.dtype != torch.float8_e4m3fn:
        raise TypeError(f"FP8 data must be torch.float8_e4m3fn, got {data.dtype}")
    if not isinstance(scale, torch.Tensor):
        raise TypeError(f"FP8 scale must be a torch.Tensor, got {type(scale).__name__}")
    if scale.dtype != torch.float32:
        raise TypeError(f"FP8 scale must be float32, got {scale.dtype}")
    expected = {"row": (data.shape[0],), "tensor": (),
                "block": block_scale_shape(tuple(data.shape), block) if block else None}[granularity]
    if tuple(scale.shape) != expected:
        raise ValueError(
            f"FP8 {granularity!r} scale must have shape {expected} for data shape "
            f"{tuple(data.shape)}, got {tuple(scale.shape)}"
        )
    if data.device != scale.device:
        raise ValueError(f"FP8 data is on {data.device} but scale is on {scale.device}")


@dataclass(frozen=True)
class FP8Tensor:
    """FP8 e4m3 weight: data float8_e4m3fn [N, K], fp32 scale [N] ("row"), [] ("tensor") or
    [ceil(N/bn), ceil(K/bk)] ("block", `block` = (bn, bk))."""

    data: torch.Tensor
    scale: torch.Tensor
    granularity: str = "row"
    block: tuple[int, int] | None = None

    def __post_init__(self) -> None:
        _check_granularity(self.granularity)
        if (self.granularity == "block") != (self.block is not None):
            raise ValueError(f"an FP8 block size goes with granularity 'block' only, got {self.granularity!r} "
                             f"and block {self.block!r}")
        if self.block is not None:
            object.__setattr__(self, "block", check_block(self.block))
        _check_data_scale(self.data, self.scale, self.granularity, self.block)

    @property
    def shape(self) -> torch.Size:
        return self.data.shape

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return dequantize_fp8(self.data, self.scale, dtype, block=self.block)

    def to(self, device: torch.device | str) -> FP8Tensor:
        return FP8Tensor(self.data.to(device), self.scale.to(device), self.granularity, self.block)


def _blocks(t: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """[N, K] -> [ceil(N/bn), ceil(K/bk), bn, bk], the tails padded with zeros."""
    (n, k), (bn, bk) = t.shape, block
    gn, gk = block_scale_shape((n, k), block)
    padded = t.new_zeros(gn * bn, gk * bk)
    padded[:n, :k] = t
    return padded.reshape(gn, bn, gk, bk).transpose(1, 2)


def _per_element(scale: torch.Tensor, shape: tuple[int, int], block: tuple[int, int]) -> torch.Tensor:
    """A block scale [ceil(N/bn), ceil(K/bk)] spread over the [N, K] weight it scales."""
    return scale.repeat_interleave(block[0], 0)[:shape[0]].repeat_interleave(block[1], 1)[:, :shape[1]]


def quantize_fp8(w: torch.Tensor, granularity: str = "row", block: tuple[int, int] | None = None) -> FP8Tensor:
    """Quantize a float [N, K] weight to e4m3 with scale = amax / 448 per row, per tensor, or per
    block (`block` = (bn, bk), default DEFAULT_BLOCK).

    Computation is in float32 (float64 inputs are narrowed first, so values beyond
    the fp32 range become +-Inf and saturate as below). Edge cases:
      * all-zero row (tensor, block): scale 1.0, data exact zeros (sign of -0.0 kept).
      * +-Inf: ignored by amax and saturated to +-448, i.e. dequantizes to +-448 * scale.
      * NaN: ignored by amax, stays NaN in its own element only.
      * amax < 448 * 2**-126 (~5e-36): scale floored at 2**-126 (smallest normal fp32);
        nothing saturates, values below 2**-132 fall into e4m3 subnormals (abs error <= 2**-136).
      * scaled values are clamped to +-448 before the cast so rounding of the scale
        can never push an element past the e4m3 range.
    """
    _check_granularity(granularity)
    if block is not None and granularity != "block":
        raise ValueError(f"an FP8 block size goes with granularity 'block' only, got {granularity!r}")
    block = check_block(block or DEFAULT_BLOCK) if granularity == "block" else None
    _check_2d(w, "FP8 input")
    if w.dtype not in _FLOAT_DTYPES:
        raise TypeError(f"FP8 input must be float16, bfloat16, float32 or float64, got {w.dtype}")
    wf = w.to(torch.float32)
    finite_abs = torch.where(torch.isfinite(wf), wf.abs(), 0.0)
    if granularity == "row":
        # amax of an empty row is 0 (torch.amax refuses empty reductions).
        amax = finite_abs.amax(dim=1) if wf.shape[1] else wf.new_zeros(wf.shape[0])
    elif granularity == "block":
        amax = _blocks(finite_abs, block).amax(dim=(2, 3)) if wf.numel() else wf.new_zeros(
            block_scale_shape(tuple(wf.shape), block))
    else:
        amax = finite_abs.amax() if wf.numel() else wf.new_zeros(())
    scale = torch.where(amax == 0, 1.0, (amax / E4M3_MAX).clamp(min=_MIN_SCALE))
    divisor = {"row": lambda: scale.unsqueeze(1), "tensor": lambda: scale,
               "block": lambda: _per_element(scale, tuple(wf.shape), block)}[granularity]()
    data = (wf / divisor).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return FP8Tensor(data, scale, granularity, block)


def dequantize_fp8(
    data: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32,
    block: tuple[int, int] | None = None,
) -> torch.Tensor:
    """data float8_e4m3fn [N, K] * scale (fp32 [N] per row, [] per tensor, or per block of
    `block` = (bn, bk): [ceil(N/bn), ceil(K/bk)]) -> dtype [N, K]."""
    per_tensor = isinstance(scale, torch.Tensor) and scale.ndim == 0
    granularity = "block" if block is not None else "tensor" if per_tensor else "row"
    block = check_block(block) if block is not None else None
    _check_data_scale(data, scale, granularity, block)
    if dtype not in _FLOAT_DTYPES:
        raise TypeError(f"FP8 output dtype must be float16, bfloat16, float32 or float64, got {dtype}")
    # e4m3 (4 significant bits) * fp32 scale needs 28 bits: exact only in float64.
    compute = torch.float64 if dtype == torch.float64 else torch.float32
    factor = (_per_element(scale.to(compute), tuple(data.shape), block) if block is not None
              else scale.to(compute) if per_tensor else scale.to(compute).unsqueeze(1))
    return (data.to(compute) * factor).to(dtype)
