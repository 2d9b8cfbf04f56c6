"""OCP Microscaling MXFP4: E2M1 elements packed two per byte, one E8M0 scale per 32.

Reference (plain PyTorch) quantize / dequantize along the last dimension, written
for exactness and clear errors rather than speed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

__all__ = [
    "BLOCK_SIZE",
    "E2M1_VALUES",
    "E8M0_NAN",
    "MXFP4Tensor",
    "decode_e2m1",
    "decode_e8m0",
    "dequantize_mxfp4",
    "encode_e2m1",
    "pack_nibbles",
    "quantize_mxfp4",
    "unpack_nibbles",
]

BLOCK_SIZE = 32
E2M1_EMAX = 2  # exponent of the largest E2M1 binade (6 = 1.5 * 2**2)
E8M0_BIAS = 127
E8M0_NAN = 255
_E8M0_MIN_EXP, _E8M0_MAX_EXP = -127, 127

# Code c: bit 3 = sign, bits 2..1 = exponent (bias 1), bit 0 = mantissa.
E2M1_VALUES = torch.tensor(
    [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0],
    dtype=torch.float32,
)
# Midpoints between consecutive E2M1 magnitudes (codes j and j+1).
_E2M1_MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _check_float_dtype(dtype: torch.dtype, what: str) -> None:
    if dtype not in _FLOAT_DTYPES:
        raise TypeError(f"{what} must be float16, bfloat16, float32 or float64, got {dtype}")


def _check_tensor(x: object, what: str) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{what} must be a torch.Tensor, got {type(x).__name__}")


def _check_uint8(x: object, what: str) -> None:
    _check_tensor(x, what)
    if x.dtype != torch.uint8:
        raise TypeError(f"{what} must be uint8, got {x.dtype}")


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    # float32 holds every fp16/bf16/fp32 value and every E2M1 * E8M0 product that
    # fits fp32 exactly; float64 inputs/outputs keep their own range.
    return torch.float64 if dtype == torch.float64 else torch.float32


def _e8m0_table(dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    # Built from math.ldexp so every power of two (incl. fp32-subnormal 2**-127) is exact.
    values = [math.ldexp(1.0, c - E8M0_BIAS) for c in range(255)] + [math.nan]
    return torch.tensor(values, dtype=dtype, device=device)


def decode_e8m0(codes: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """E8M0 scale codes (uint8) -> 2**(code - 127); code 255 -> NaN."""
    _check_uint8(codes, "E8M0 codes")
    _check_float_dtype(dtype, "E8M0 output dtype")
    return _e8m0_table(_compute_dtype(dtype), codes.device)[codes.long()].to(dtype)


def decode_e2m1(codes: torch.Tensor) -> torch.Tensor:
    """E2M1 codes (uint8 in 0..15) -> float32 values."""
    _check_uint8(codes, "E2M1 codes")
    if codes.numel() and int(codes.max()) > 15:
        raise ValueError(f"E2M1 codes must be in 0..15, got {int(codes.max())}")
    return E2M1_VALUES.to(codes.device)[codes.long()]


def encode_e2m1(x: torch.Tensor) -> torch.Tensor:
    """Round to the nearest E2M1 value (ties to even mantissa), saturating at +-6.

    Returns uint8 codes. The sign bit is taken from the input, so -0.0 and small
    negatives that round to zero give code 8 (-0). +-Inf saturates to +-6; NaN has
    no E2M1 encoding and is rejected.
    """
    _check_tensor(x, "encode_e2m1 input")
    _check_float_dtype(x.dtype, "encode_e2m1 input")
    if torch.isnan(x).any():
        raise ValueError("encode_e2m1 got NaN, which E2M1 cannot represent")
    mag = x.abs().to(_compute_dtype(x.dtype))
    mids = torch.tensor(_E2M1_MIDPOINTS, dtype=mag.dtype, device=x.device)
    # bucketize sends a value equal to midpoint j to code j (the lower neighbour);
    # move it up when j is odd so that ties land on the even-mantissa code.
    code = torch.bucketize(mag, mids)
    at_tie = mag == mids[code.clamp(max=len(_E2M1_MIDPOINTS) - 1)]
    code = code + (at_tie & (code % 2 == 1)).long()
    sign = torch.signbit(x).to(torch.uint8) << 3
    return code.to(torch.uint8) | sign


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """[..., 2n] 4-bit codes -> [..., n] bytes; element 2i low nibble, 2i+1 high nibble."""
    _check_uint8(codes, "nibble codes")
    if codes.ndim == 0 or codes.shape[-1] % 2:
        raise ValueError(f"pack_nibbles needs an even last dimension, got shape {tuple(codes.shape)}")
    if codes.numel() and int(codes.max()) > 15:
        raise ValueError(f"nibble codes must be in 0..15, got {int(codes.max())}")
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """[..., n] bytes -> [..., 2n] 4-bit codes (inverse of pack_nibbles)."""
    _check_uint8(packed, "packed")
    if packed.ndim == 0:
        raise ValueError("unpack_nibbles needs at least 1 dimension, got a 0-d tensor")
    both = torch.stack((packed & 0xF, packed >> 4), dim=-1)
    return both.reshape(*packed.shape[:-1], packed.shape[-1] * 2)


def _check_packed_scales(packed: object, scales: object) -> None:
    _check_uint8(packed, "MXFP4 packed")
    _check_uint8(scales, "MXFP4 scales")
    if packed.ndim == 0:
        raise ValueError("MXFP4 packed needs at least 1 dimension, got a 0-d tensor")
    expected = (*packed.shape[:-1], packed.shape[-1] * 2 // BLOCK_SIZE)
    if packed.shape[-1] % (BLOCK_SIZE // 2) or tuple(scales.shape) != expected:
        raise ValueError(
            f"MXFP4 scales shape {tuple(scales.shape)} does not match packed shape "
            f"{tuple(packed.shape)}: need packed [..., K/2] and scales [..., K/32] "
            f"with K a multiple of {BLOCK_SIZE}"
        )
    if packed.device != scales.device:
        raise ValueError(f"MXFP4 packed is on {packed.device} but scales are on {scales.device}")


@dataclass(frozen=True)
class MXFP4Tensor:
    """MXFP4 tensor: packed uint8 [..., K/2] E2M1 pairs and uint8 [..., K/32] E8M0 scales."""

    packed: torch.Tensor
    scales: torch.Tensor

    def __post_init__(self) -> None:
        _check_packed_scales(self.packed, self.scales)

    @property
    def shape(self) -> torch.Size:
        """Logical (unpacked) shape [..., K]."""
        return torch.Size((*self.packed.shape[:-1], self.packed.shape[-1] * 2))

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return dequantize_mxfp4(self.packed, self.scales, dtype)

    def to(self, device: torch.device | str) -> MXFP4Tensor:
        return MXFP4Tensor(self.packed.to(device), self.scales.to(device))


def quantize_mxfp4(w: torch.Tensor) -> MXFP4Tensor:
    """Quantize a float tensor [..., K] (K a multiple of 32) to MXFP4 along the last dim.

    Per block: exponent = floor(log2(amax)) - 2, clamped to [-127, 127]; elements
    are w / 2**exponent rounded by encode_e2m1. Edge cases:
      * all-zero block: log2(0) = -inf clamps to -127, so scale code 0 and elements
        0 (sign kept, so -0.0 round-trips); this is also what underflowing blocks get.
      * tiny blocks (amax < 2**-125): the exponent clamps at -127, elements at or
        below 0.25 * 2**-127 flush to +-0.
      * huge float64 blocks (amax >= 2**130): the exponent clamps at 127, elements saturate.
      * a block holding NaN or +-Inf gets scale code 255 (NaN) and zero elements, so
        the whole block dequantizes to NaN (the spec's NaN-scale semantics).
    """
    _check_tensor(w, "MXFP4 input")
    _check_float_dtype(w.dtype, "MXFP4 input")
    if w.ndim == 0 or w.shape[-1] % BLOCK_SIZE:
        raise ValueError(
            f"MXFP4 needs the last dimension to be a multiple of {BLOCK_SIZE}, got shape {tuple(w.shape)}"
        )
    compute = _compute_dtype(w.dtype)
    blocks = w.to(compute).reshape(*w.shape[:-1], w.shape[-1] // BLOCK_SIZE, BLOCK_SIZE)
    finite = torch.isfinite(blocks)
    block_ok = finite.all(dim=-1)
    amax = torch.where(finite, blocks.abs(), 0.0).amax(dim=-1)
    # frexp is exact (log2 can round up just below a power of two): amax = m * 2**e,
    # m in [0.5, 1), so floor(log2(amax)) = e - 1.
    _, e = torch.frexp(amax)
    exp = torch.where(amax == 0, _E8M0_MIN_EXP, e.long() - 1 - E2M1_EMAX)
    codes_e8m0 = exp.clamp(_E8M0_MIN_EXP, _E8M0_MAX_EXP) + E8M0_BIAS
    scale = _e8m0_table(compute, w.device)[codes_e8m0]
    # Non-finite blocks are encoded as zeros; their NaN scale carries the meaning.
    scaled = torch.where(block_ok.unsqueeze(-1), blocks / scale.unsqueeze(-1), 0.0)
    codes = encode_e2m1(scaled).reshape(w.shape)
    scales = torch.where(block_ok, codes_e8m0, E8M0_NAN).to(torch.uint8)
    return MXFP4Tensor(pack_nibbles(codes), scales)


def dequantize_mxfp4(
    packed: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """packed uint8 [..., K/2] + E8M0 scales uint8 [..., K/32] -> dtype [..., K].

    Products are exact in float32 (and float64); casting to a narrower dtype or
    values beyond the output range (only reachable from float64 inputs) round or overflow.
    """
    _check_packed_scales(packed, scales)
    _check_float_dtype(dtype, "MXFP4 output dtype")
    compute = _compute_dtype(dtype)
    codes = unpack_nibbles(packed)
    values = E2M1_VALUES.to(device=packed.device, dtype=compute)[codes.long()]
    scale = _e8m0_table(compute, packed.device)[scales.long()]
    blocks = values.reshape(*scales.shape, BLOCK_SIZE) * scale.unsqueeze(-1)
    return blocks.reshape(codes.shape).to(dtype)
