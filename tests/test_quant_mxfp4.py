"""Tests for impl.quant.mxfp4: exhaustive code tables, rounding, round trips, edge cases, errors."""

from __future__ import annotations

import dataclasses
import math
from fractions import Fraction

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from impl.quant import (
    E2M1_VALUES,
    MXFP4Tensor,
    decode_e2m1,
    decode_e8m0,
    dequantize_mxfp4,
    encode_e2m1,
    pack_nibbles,
    quantize_mxfp4,
    unpack_nibbles,
)

NAN = float("nan")
INF = float("inf")


def e2m1_from_bits(code: int) -> float:
    """Independent E2M1 decode: sign bit 3, exponent bits 2..1 (bias 1), mantissa bit 0."""
    sign = -1.0 if code >> 3 else 1.0
    exp, man = (code >> 1) & 0b11, code & 1
    if exp == 0:  # subnormal: 0.m * 2**(1 - bias)
        return sign * (man / 2)
    return sign * (1 + man / 2) * 2.0 ** (exp - 1)


MAGNITUDES = [Fraction(e2m1_from_bits(c)) for c in range(8)]


def brute_force_code(x: float) -> int:
    """Nearest E2M1 magnitude by exhaustive search (ties -> even code), sign copied."""
    mag = abs(Fraction(x)) if math.isfinite(x) else Fraction(10**9)
    best = min(range(8), key=lambda c: (abs(mag - MAGNITUDES[c]), c & 1))
    return best | (8 if math.copysign(1.0, x) < 0 else 0)


def ref_block_exponent(amax: float) -> int:
    """floor(log2(amax)) - 2 clamped to [-127, 127] via math.frexp (0 -> -127)."""
    if amax == 0:
        return -127
    return max(-127, min(127, math.frexp(amax)[1] - 1 - 2))


def random_weights(gen: torch.Generator, shape: tuple[int, ...], dtype=torch.float32) -> torch.Tensor:
    """Gaussian values with per-block magnitudes spread over ~2**-40 .. 2**40."""
    x = torch.randn(shape, generator=gen, dtype=torch.float64)
    blocks = x.reshape(*shape[:-1], shape[-1] // 32, 32)
    mags = torch.exp2(torch.randint(-40, 41, blocks.shape[:-1], generator=gen).double())
    return (blocks * mags.unsqueeze(-1)).reshape(shape).to(dtype)


def element_bound(v: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Worst-case |dequant - v| for one element, given its block scale 2**exp.

    With y = v / 2**exp, rounding to the nearest grid point errs by at most half the
    grid step around |y|: steps are 0.5 on [0, 2], 1 on [2, 4], 2 on [4, 6], so the
    bound is 0.25, 0.5, 1 there. Above 6 (only for |y| in (6, 8), or further for
    clamped float64 exponents) the value saturates to 6, erring by |y| - 6. The
    dequantized product E2M1 * 2**exp is exact in float64, so nothing else adds.
    """
    y = (v / scale).abs()
    half_step = torch.where(y <= 2, 0.25, torch.where(y <= 4, 0.5, 1.0))
    return scale * torch.where(y <= 6, half_step, y - 6)


# ---------------------------------------------------------------- exhaustive tables


def test_e2m1_table_matches_bit_formula() -> None:
    codes = torch.arange(16, dtype=torch.uint8)
    decoded = decode_e2m1(codes)
    assert decoded.dtype == torch.float32
    for c in range(16):
        expected = e2m1_from_bits(c)
        for got in (float(E2M1_VALUES[c]), float(decoded[c])):
            assert got == expected and math.copysign(1, got) == math.copysign(1, expected), c


def test_e2m1_encode_decode_all_codes_roundtrip() -> None:
    codes = torch.arange(16, dtype=torch.uint8)
    # Includes code 8 (-0.0), which must keep its sign bit rather than collapse to code 0.
    assert torch.equal(encode_e2m1(decode_e2m1(codes)), codes)


def test_e8m0_all_codes() -> None:
    codes = torch.arange(256, dtype=torch.uint8)
    for dtype in (torch.float32, torch.float64):
        decoded = decode_e8m0(codes, dtype)
        assert decoded.dtype == dtype
        assert math.isnan(float(decoded[255]))
        for c in range(255):
            assert float(decoded[c]) == math.ldexp(1.0, c - 127), (dtype, c)


def test_pack_nibbles_order_and_inverse() -> None:
    # Element 2i goes to the low nibble, element 2i+1 to the high nibble.
    codes = torch.tensor([[0x1, 0x2, 0xF, 0x0]], dtype=torch.uint8)
    assert pack_nibbles(codes).tolist() == [[0x21, 0x0F]]
    all_bytes = torch.arange(256, dtype=torch.uint8).reshape(8, 32)
    assert torch.equal(pack_nibbles(unpack_nibbles(all_bytes)), all_bytes)
    unpacked = unpack_nibbles(all_bytes)
    assert torch.equal(unpacked[..., 0::2], all_bytes & 0xF)
    assert torch.equal(unpacked[..., 1::2], all_bytes >> 4)


# ---------------------------------------------------------------- rounding


def test_encode_e2m1_matches_brute_force() -> None:
    gen = torch.Generator().manual_seed(1)
    mids = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0]
    specials = torch.tensor(mids + [float(v) for v in E2M1_VALUES] + [6.5, 7.99, 8.0, 1e6, INF, 0.0])
    # One fp32 ulp either side of every tie, to catch off-by-one tie handling.
    near_ties = torch.cat([torch.nextafter(specials, torch.tensor(INF)), torch.nextafter(specials, torch.tensor(-INF))])
    random = torch.empty(2000).uniform_(-8, 8, generator=gen)
    x = torch.cat([specials, -specials, near_ties, -near_ties, random])
    got = encode_e2m1(x).tolist()
    expected = [brute_force_code(v) for v in x.tolist()]
    assert got == expected


@settings(max_examples=max(300, settings.default.max_examples), deadline=None, database=None)
@given(st.floats(allow_nan=False, width=32))
def test_encode_e2m1_any_float32(x: float) -> None:
    assert int(encode_e2m1(torch.tensor([x]))[0]) == brute_force_code(x)


def test_encode_ties_go_to_even_mantissa() -> None:
    ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
    assert decode_e2m1(encode_e2m1(ties)).tolist() == [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0]


def test_quantize_matches_reference_per_block() -> None:
    gen = torch.Generator().manual_seed(2)
    w = random_weights(gen, (6, 128))
    q = quantize_mxfp4(w)
    codes = unpack_nibbles(q.packed).tolist()
    for r in range(w.shape[0]):
        for b in range(w.shape[1] // 32):
            block = w[r, 32 * b : 32 * (b + 1)].tolist()
            exp = ref_block_exponent(max(abs(v) for v in block))
            assert int(q.scales[r, b]) == exp + 127
            expected = [brute_force_code(math.ldexp(v, -exp)) for v in block]
            assert codes[r][32 * b : 32 * (b + 1)] == expected


def test_saturation_at_six_times_scale() -> None:
    # amax 7.9 -> exponent floor(log2 7.9) - 2 = 0, so 7.9 and 5.5 both saturate to 6.
    w = torch.zeros(32)
    w[:4] = torch.tensor([7.9, -7.9, 5.5, 5.0])
    q = quantize_mxfp4(w)
    assert int(q.scales[0]) == 127
    assert q.dequantize()[:4].tolist() == [6.0, -6.0, 6.0, 4.0]


# ---------------------------------------------------------------- round trips and error bounds


@pytest.mark.parametrize("shape", [(32,), (3, 64), (2, 3, 96), (5, 1024)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_requantize_is_bit_exact(shape: tuple[int, ...], dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(sum(shape))
    w = random_weights(gen, shape, torch.float64)
    if dtype == torch.float16:  # keep inside fp16 range
        w = w.clamp(-6e4, 6e4)
    q = quantize_mxfp4(w.to(dtype))
    assert q.shape == shape
    q2 = quantize_mxfp4(q.dequantize(torch.float64 if dtype == torch.float64 else torch.float32))
    assert torch.equal(q2.packed, q.packed)
    assert torch.equal(q2.scales, q.scales)


def test_requantize_canonical_random_codes_is_bit_exact() -> None:
    # Random bytes, with one element per block forced to magnitude 4 or 6: that makes
    # the block canonical (it is what quantize would pick for the dequantized values).
    gen = torch.Generator().manual_seed(3)
    packed = torch.randint(0, 256, (64, 64), generator=gen, dtype=torch.uint8)
    codes = unpack_nibbles(packed)
    big = torch.randint(6, 8, (64, 4), generator=gen, dtype=torch.uint8) | (
        torch.randint(0, 2, (64, 4), generator=gen, dtype=torch.uint8) << 3
    )
    codes[:, ::32] = big
    # Codes up to 252 keep 6 * 2**(code - 127) inside fp32 (fp32 inputs never exceed 252 either).
    scales = torch.randint(0, 253, (64, 4), generator=gen, dtype=torch.uint8)
    q = MXFP4Tensor(pack_nibbles(codes), scales)
    q2 = quantize_mxfp4(q.dequantize())
    assert torch.equal(q2.packed, q.packed)
    assert torch.equal(q2.scales, q.scales)


@pytest.mark.parametrize("shape", [(4, 256), (7, 3, 64)])
def test_error_within_per_element_bound(shape: tuple[int, ...]) -> None:
    gen = torch.Generator().manual_seed(4)
    w = random_weights(gen, shape).double()
    q = quantize_mxfp4(w)
    deq = q.dequantize(torch.float64)
    scale = decode_e8m0(q.scales, torch.float64).repeat_interleave(32, dim=-1)
    err = (deq - w).abs()
    bound = element_bound(w, scale)
    assert bool((err <= bound).all()), float((err - bound).max())
    # The bound is attained: some element must use a good part of it (guards against a vacuous bound).
    assert float((err / bound.clamp(min=1e-300)).max()) > 0.9
    # In relative terms: 1 mantissa bit -> at most 2**-2 relative error for |y| in [1, 6].
    y = (w / scale).abs()
    mid = (y >= 1) & (y <= 6)
    assert bool((err[mid] <= 0.25 * w.abs()[mid]).all())


# ---------------------------------------------------------------- edge cases


def test_zero_block_is_exact_with_scale_code_zero() -> None:
    w = torch.randn(2, 64)
    w[0, 32:] = 0.0
    q = quantize_mxfp4(w)
    assert int(q.scales[0, 1]) == 0
    assert not bool(q.packed[0, 16:].any())
    deq = q.dequantize()
    assert torch.equal(deq[0, 32:], torch.zeros(32))
    assert not bool(torch.signbit(deq[0, 32:]).any())


def test_negative_zero_keeps_its_sign() -> None:
    w = torch.full((32,), -0.0)
    w[1] = 0.0
    q = quantize_mxfp4(w)
    assert unpack_nibbles(q.packed)[:2].tolist() == [8, 0]
    deq = q.dequantize()
    assert torch.equal(deq, torch.zeros(32))
    assert torch.signbit(deq).tolist() == [True, False] + [True] * 30


@pytest.mark.parametrize("bad", [NAN, INF, -INF])
def test_non_finite_element_poisons_only_its_block(bad: float) -> None:
    w = torch.randn(2, 96, generator=torch.Generator().manual_seed(5))
    w[1, 40] = bad
    q = quantize_mxfp4(w)
    assert int(q.scales[1, 1]) == 255
    assert not bool(q.packed[1, 16:32].any())
    deq = q.dequantize()
    assert bool(torch.isnan(deq[1, 32:64]).all())
    assert not bool(torch.isnan(deq[1, :32]).any() or torch.isnan(deq[1, 64:]).any() or torch.isnan(deq[0]).any())
    # The other blocks are exactly what quantizing them alone gives.
    assert torch.equal(deq[1, :32], quantize_mxfp4(w[1, :32]).dequantize())


@pytest.mark.parametrize("magnitude", [1e-30, 1e30, 1e-38])
def test_tiny_and_huge_fp32_magnitudes(magnitude: float) -> None:
    gen = torch.Generator().manual_seed(6)
    w = torch.randn(3, 64, generator=gen) * magnitude
    q = quantize_mxfp4(w)
    amax = w.abs().reshape(3, 2, 32).amax(-1)
    expected = [[ref_block_exponent(v) + 127 for v in row] for row in amax.tolist()]
    assert q.scales.tolist() == expected
    deq = q.dequantize(torch.float64)
    scale = decode_e8m0(q.scales, torch.float64).repeat_interleave(32, dim=-1)
    assert bool(((deq - w.double()).abs() <= element_bound(w.double(), scale)).all())
    assert bool(torch.isfinite(deq).all())


def test_subnormal_block_clamps_exponent_and_flushes() -> None:
    # amax 2**-130 would want exponent -132; it clamps to -127 (code 0), so y = 2**-3 -> 0.
    w = torch.zeros(64)
    w[0], w[1] = 2.0**-130, -(2.0**-149)
    w[32] = 2.0**-126 * 3  # amax 3 * 2**-126 -> exponent -127, y = 6 exactly representable
    q = quantize_mxfp4(w)
    assert q.scales.tolist() == [0, 0]
    deq = q.dequantize()
    assert deq[0].item() == 0.0 and torch.signbit(deq[1]).item()
    assert deq[32].item() == 2.0**-126 * 3


def test_fp32_max_stays_finite() -> None:
    # floor(log2(fp32 max)) = 127 -> exponent 125, code 252; 7.99... saturates to 6 * 2**125.
    w = torch.full((32,), torch.finfo(torch.float32).max)
    q = quantize_mxfp4(w)
    assert int(q.scales[0]) == 252
    assert torch.equal(q.dequantize(), torch.full((32,), 6 * 2.0**125))


def test_huge_float64_clamps_exponent_and_saturates() -> None:
    w = torch.zeros(32, dtype=torch.float64)
    w[0], w[1] = 1e300, -(2.0**129)
    q = quantize_mxfp4(w)
    assert int(q.scales[0]) == 254  # exponent clamped at 127
    deq = q.dequantize(torch.float64)
    assert deq[:2].tolist() == [6 * 2.0**127, -4 * 2.0**127]


def test_input_dtypes_agree_with_fp32_upcast() -> None:
    gen = torch.Generator().manual_seed(7)
    w = torch.randn(4, 128, generator=gen) * 100
    for dtype in (torch.bfloat16, torch.float16, torch.float64):
        narrow = w.to(dtype)
        q, q32 = quantize_mxfp4(narrow), quantize_mxfp4(narrow.float())
        assert torch.equal(q.packed, q32.packed) and torch.equal(q.scales, q32.scales), dtype


def test_output_dtypes() -> None:
    q = quantize_mxfp4(torch.randn(2, 64, generator=torch.Generator().manual_seed(8)))
    ref = q.dequantize(torch.float64)
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        out = q.dequantize(dtype)
        assert out.dtype == dtype
        # E2M1 * 2**e has 2 significant bits: exact in every float format within range.
        assert torch.equal(out.double(), ref), dtype


def test_non_contiguous_input() -> None:
    gen = torch.Generator().manual_seed(9)
    base = torch.randn(64, 96, generator=gen)
    w = base.t()  # [96, 64], non-contiguous
    assert not w.is_contiguous()
    q, qc = quantize_mxfp4(w), quantize_mxfp4(w.contiguous())
    assert torch.equal(q.packed, qc.packed) and torch.equal(q.scales, qc.scales)
    strided = base[:, ::3]  # [64, 32]
    q = quantize_mxfp4(strided)
    assert torch.equal(q.dequantize(), quantize_mxfp4(strided.contiguous()).dequantize())


# ---------------------------------------------------------------- container and errors


def test_mxfp4_tensor_container() -> None:
    q = quantize_mxfp4(torch.randn(2, 3, 64))
    assert q.shape == torch.Size((2, 3, 64))
    assert q.packed.shape == (2, 3, 32) and q.scales.shape == (2, 3, 2)
    moved = q.to("cpu")
    assert isinstance(moved, MXFP4Tensor) and torch.equal(moved.packed, q.packed)
    assert torch.equal(q.dequantize(), dequantize_mxfp4(q.packed, q.scales))
    with pytest.raises(dataclasses.FrozenInstanceError):
        q.packed = q.packed  # type: ignore[misc]


def test_quantize_errors() -> None:
    with pytest.raises(ValueError, match=r"multiple of 32, got shape \(4, 40\)"):
        quantize_mxfp4(torch.zeros(4, 40))
    with pytest.raises(ValueError, match=r"multiple of 32, got shape \(\)"):
        quantize_mxfp4(torch.tensor(1.0))
    with pytest.raises(TypeError, match="MXFP4 input must be float16.*got torch.int32"):
        quantize_mxfp4(torch.zeros(32, dtype=torch.int32))
    with pytest.raises(TypeError, match="must be a torch.Tensor, got list"):
        quantize_mxfp4([0.0] * 32)  # type: ignore[arg-type]


def test_dequantize_and_container_errors() -> None:
    packed, scales = torch.zeros(4, 32, dtype=torch.uint8), torch.zeros(4, 2, dtype=torch.uint8)
    with pytest.raises(TypeError, match="MXFP4 packed must be uint8, got torch.int8"):
        dequantize_mxfp4(packed.to(torch.int8), scales)
    with pytest.raises(TypeError, match="MXFP4 scales must be uint8, got torch.float32"):
        MXFP4Tensor(packed, scales.float())
    with pytest.raises(ValueError, match=r"scales shape \(4, 3\) does not match packed shape \(4, 32\)"):
        dequantize_mxfp4(packed, torch.zeros(4, 3, dtype=torch.uint8))
    with pytest.raises(ValueError, match=r"scales shape \(3, 2\) does not match"):
        MXFP4Tensor(packed, torch.zeros(3, 2, dtype=torch.uint8))
    with pytest.raises(ValueError, match=r"does not match packed shape \(4, 20\)"):
        MXFP4Tensor(torch.zeros(4, 20, dtype=torch.uint8), torch.zeros(4, 1, dtype=torch.uint8))
    with pytest.raises(TypeError, match="output dtype must be .*got torch.int32"):
        dequantize_mxfp4(packed, scales, torch.int32)


def test_helper_errors() -> None:
    with pytest.raises(ValueError, match="encode_e2m1 got NaN"):
        encode_e2m1(torch.tensor([1.0, NAN]))
    with pytest.raises(TypeError, match="encode_e2m1 input must be .*got torch.int64"):
        encode_e2m1(torch.tensor([1]))
    with pytest.raises(ValueError, match="E2M1 codes must be in 0..15, got 16"):
        decode_e2m1(torch.tensor([3, 16], dtype=torch.uint8))
    with pytest.raises(ValueError, match=r"even last dimension, got shape \(3,\)"):
        pack_nibbles(torch.zeros(3, dtype=torch.uint8))
    with pytest.raises(ValueError, match="nibble codes must be in 0..15, got 200"):
        pack_nibbles(torch.tensor([1, 200], dtype=torch.uint8))
    with pytest.raises(TypeError, match="E8M0 codes must be uint8, got torch.int64"):
        decode_e8m0(torch.tensor([127]))
