"""FP8 e4m3 (torch.float8_e4m3fn) weight quantization with fp32 scales.

Reference quantize / dequantize for 2-D weights [N, K] with one scale per output
row (or one per tensor), scale = amax / 448.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["E4M3_MAX", "FP8Tensor", "GRANULARITIES", "dequantize_fp8", "quantize_fp8"]

E4M3_MAX = 448.0
GRANULARITIES = ("row", "tensor")

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


def _check_data_scale(data: object, scale: object, granularity: str) -> None:
    _check_2d(data, "FP8 data")
    if data.dtype != torch.float8_e4m3fn:
        raise TypeError(f"FP8 data must be torch.float8_e4m3fn, got {data.dtype}")
    if not isinstance(scale, torch.Tensor):
        raise TypeError(f"FP8 scale must be a torch.Tensor, got {type(scale).__name__}")
    if scale.dtype != torch.float32:
        raise TypeError(f"FP8 scale must be float32, got {scale.dtype}")
    expected = (data.shape[0],) if granularity == "row" else ()
    if tuple(scale.shape) != expected:
        raise ValueError(
            f"FP8 {granularity!r} scale must have shape {expected} for data shape "
            f"{tuple(data.shape)}, got {tuple(scale.shape)}"
        )
    if data.device != scale.device:
        raise ValueError(f"FP8 data is on {data.device} but scale is on {scale.device}")


@dataclass(frozen=True)
class FP8Tensor:
    """FP8 e4m3 weight: data float8_e4m3fn [N, K], fp32 scale [N] ("row") or [] ("tensor")."""

    data: torch.Tensor
    scale: torch.Tensor
    granularity: str = "row"

    def __post_init__(self) -> None:
        _check_granularity(self.granularity)
        _check_data_scale(self.data, self.scale, self.granularity)

    @property
    def shape(self) -> torch.Size:
        return self.data.shape

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return dequantize_fp8(self.data, self.scale, dtype)

    def to(self, device: torch.device | str) -> FP8Tensor:
        return FP8Tensor(self.data.to(device), self.scale.to(device), self.granularity)


def quantize_fp8(w: torch.Tensor, granularity: str = "row") -> FP8Tensor:
    """Quantize a float [N, K] weight to e4m3 with scale = amax / 448 per row or per tensor.

    Computation is in float32 (float64 inputs are narrowed first, so values beyond
    the fp32 range become +-Inf and saturate as below). Edge cases:
      * all-zero row (or tensor): scale 1.0, data exact zeros (sign of -0.0 kept).
      * +-Inf: ignored by amax and saturated to +-448, i.e. dequantizes to +-448 * scale.
      * NaN: ignored by amax, stays NaN in its own element only.
      * amax < 448 * 2**-126 (~5e-36): scale floored at 2**-126 (smallest normal fp32);
        nothing saturates, values below 2**-132 fall into e4m3 subnormals (abs error <= 2**-136).
      * scaled values are clamped to +-448 before the cast so rounding of the scale
        can never push an element past the e4m3 range.
    """
    _check_granularity(granularity)
    _check_2d(w, "FP8 input")
    if w.dtype not in _FLOAT_DTYPES:
        raise TypeError(f"FP8 input must be float16, bfloat16, float32 or float64, got {w.dtype}")
    wf = w.to(torch.float32)
    finite_abs = torch.where(torch.isfinite(wf), wf.abs(), 0.0)
    if granularity == "row":
        # amax of an empty row is 0 (torch.amax refuses empty reductions).
        amax = finite_abs.amax(dim=1) if wf.shape[1] else wf.new_zeros(wf.shape[0])
    else:
        amax = finite_abs.amax() if wf.numel() else wf.new_zeros(())
    scale = torch.where(amax == 0, 1.0, (amax / E4M3_MAX).clamp(min=_MIN_SCALE))
    divisor = scale.unsqueeze(1) if granularity == "row" else scale
    data = (wf / divisor).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return FP8Tensor(data, scale, granularity)


def dequantize_fp8(
    data: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """data float8_e4m3fn [N, K] * scale (fp32 [N] per row or [] per tensor) -> dtype [N, K]."""
    per_tensor = isinstance(scale, torch.Tensor) and scale.ndim == 0
    _check_data_scale(data, scale, "tensor" if per_tensor else "row")
    if dtype not in _FLOAT_DTYPES:
        raise TypeError(f"FP8 output dtype must be float16, bfloat16, float32 or float64, got {dtype}")
    # e4m3 (4 significant bits) * fp32 scale needs 28 bits: exact only in float64.
    compute = torch.float64 if dtype == torch.float64 else torch.float32
    factor = scale.to(compute) if per_tensor else scale.to(compute).unsqueeze(1)
    return (data.to(compute) * factor).to(dtype)
