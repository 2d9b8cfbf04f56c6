"""Tests for impl.quant.fp8: exhaustive e4m3fn table, round trips, error bounds, edge cases, errors."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from impl.quant import E4M3_MAX, FP8Tensor, dequantize_fp8, quantize_fp8

NAN = float("nan")
INF = float("inf")
SMALLEST_NORMAL_FP32 = 2.0**-126


def e4m3fn_from_bits(b: int) -> float:
    """Independent e4m3fn decode: 1 sign, 4 exponent (bias 7), 3 mantissa bits.

    S.1111.111 is NaN; there is no Inf (S.1111.000-110 are ordinary values up to 448).
    """
    sign = -1.0 if b >> 7 else 1.0
    exp, man = (b >> 3) & 0xF, b & 0x7
    if exp == 0xF and man == 0x7:
        return NAN
    if exp == 0:  # subnormal: 0.m * 2**(1 - 7)
        return sign * man / 8 * 2.0**-6
    return sign * (1 + man / 8) * 2.0 ** (exp - 7)


ALL_BITS = torch.arange(256, dtype=torch.uint8)
ALL_VALUES = ALL_BITS.view(torch.float8_e4m3fn).float()


def same_float(a: float, b: float) -> bool:
    """Equal including the sign of zero, with NaN == NaN."""
    if math.isnan(a) or math.isnan(b):
        return math.isnan(a) and math.isnan(b)
    return a == b and math.copysign(1, a) == math.copysign(1, b)


def error_bound(v: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Worst-case |dequant_fp64 - v| per element.

    y = v / scale is rounded once to fp32 (relative 2**-24), clamped to 448 (never
    by more than that rounding, since scale is a normal fp32 >= amax / 448 rounded),
    then rounded to e4m3. With 3 mantissa bits a normal e4m3 (|y| >= 2**-6) is off
    by at most half an ulp = 2**-4 relative; below that the subnormal spacing is
    2**-9, so the error is at most 2**-10 absolute. Dequantizing in float64 is exact.
    Hence |err| <= 2**-4 |v| + 2**-10 scale, plus 2**-20 |v| for the fp32 roundings.
    """
    return (2.0**-4 + 2.0**-20) * v.abs() + 2.0**-10 * scale


def random_rows(gen: torch.Generator, n: int, k: int) -> torch.Tensor:
    """Gaussian rows with magnitudes spread over 2**-40 .. 2**40, some entries much smaller
    than their row max so e4m3 subnormals are exercised."""
    x = torch.randn(n, k, generator=gen, dtype=torch.float64)
    x = x * torch.exp2(torch.randint(-40, 41, (n, 1), generator=gen).double())
    tiny = torch.rand(n, k, generator=gen) < 0.2
    x = torch.where(tiny, x * 2.0**-12, x)
    return x.float()


# ---------------------------------------------------------------- exhaustive table


def test_all_256_bit_patterns_decode() -> None:
    for b in range(256):
        assert same_float(float(ALL_VALUES[b]), e4m3fn_from_bits(b)), hex(b)
    nan_bits = [b for b in range(256) if math.isnan(e4m3fn_from_bits(b))]
    assert nan_bits == [0x7F, 0xFF]
    assert float(ALL_VALUES[0x7E]) == E4M3_MAX == -float(ALL_VALUES[0xFE])
    assert not bool(torch.isinf(ALL_VALUES).any())


@pytest.mark.parametrize("granularity", ["row", "tensor"])
def test_every_e4m3_value_roundtrips_with_scale_one(granularity: str) -> None:
    # A 448 in every row forces scale exactly 1.0, so each value must map back to its own bits.
    w = torch.stack([ALL_VALUES, torch.full((256,), E4M3_MAX)], dim=1)
    q = quantize_fp8(w, granularity)
    assert torch.equal(q.scale, torch.ones_like(q.scale))
    assert torch.equal(q.data[:, 0].view(torch.uint8), ALL_BITS)
    deq = q.dequantize()
    for b in range(256):
        assert same_float(float(deq[b, 0]), e4m3fn_from_bits(b)), hex(b)


# ---------------------------------------------------------------- round trips and error bounds


@pytest.mark.parametrize("shape", [(1, 1), (3, 17), (64, 256)])
@pytest.mark.parametrize("granularity", ["row", "tensor"])
def test_requantize_is_bit_exact(shape: tuple[int, int], granularity: str) -> None:
    gen = torch.Generator().manual_seed(shape[0] * 1000 + shape[1])
    q = quantize_fp8(random_rows(gen, *shape), granularity)
    q2 = quantize_fp8(q.dequantize(), granularity)
    assert torch.equal(q2.data.view(torch.uint8), q.data.view(torch.uint8))
    # amax' = fl(448 * s) and s' = fl(amax' / 448) can differ from s by one fp32 ulp
    # (448 = 7 * 2**6 is not a power of two); the e4m3 codes do not move.
    assert bool(((q2.scale - q.scale).abs() <= q.scale * 2.0**-23).all())


@pytest.mark.parametrize("granularity", ["row", "tensor"])
def test_error_within_bound(granularity: str) -> None:
    gen = torch.Generator().manual_seed(11)
    w = random_rows(gen, 32, 512)
    q = quantize_fp8(w, granularity)
    scale = q.scale.double().reshape(-1, 1) if granularity == "row" else q.scale.double()
    err = (q.dequantize(torch.float64) - w.double()).abs()
    bound = error_bound(w.double(), scale)
    assert bool((err <= bound).all()), float((err - bound).max())
    assert float((err / bound).max()) > 0.5  # the bound is not vacuous
    if granularity == "row":
        expected = w.abs().amax(dim=1) / E4M3_MAX
        assert torch.equal(q.scale, expected)


@settings(max_examples=max(200, settings.default.max_examples), deadline=None, database=None)
@given(st.lists(st.floats(allow_nan=False, allow_infinity=False, width=32), min_size=1, max_size=16))
def test_error_bound_any_row(row: list[float]) -> None:
    w = torch.tensor([row], dtype=torch.float32)
    q = quantize_fp8(w)
    assert float(q.scale[0]) >= SMALLEST_NORMAL_FP32 or float(q.scale[0]) == 1.0
    err = (q.dequantize(torch.float64) - w.double()).abs()
    assert bool((err <= error_bound(w.double(), q.scale.double())).all())


def test_output_dtypes_match_fp32_dequant() -> None:
    q = quantize_fp8(torch.randn(8, 64, generator=torch.Generator().manual_seed(12)))
    ref = q.dequantize(torch.float64)
    # e4m3 (4 significant bits) * fp32 scale (24) fits float64 exactly; fp32 output rounds once.
    assert torch.equal(ref, q.data.double() * q.scale.double().unsqueeze(1))
    assert torch.equal(q.dequantize(torch.float32), ref.float())
    for dtype in (torch.bfloat16, torch.float16):
        out = q.dequantize(dtype)
        assert out.dtype == dtype
        assert torch.allclose(out.double(), ref, rtol=2.0**-7, atol=0), dtype


# ---------------------------------------------------------------- edge cases


def test_zero_row_gets_scale_one_and_exact_zeros() -> None:
    w = torch.randn(3, 16, generator=torch.Generator().manual_seed(13))
    w[1] = 0.0
    q = quantize_fp8(w)
    assert float(q.scale[1]) == 1.0
    assert not bool(q.data[1].view(torch.uint8).any())
    assert torch.equal(q.dequantize()[1], torch.zeros(16))
    assert torch.equal(quantize_fp8(torch.zeros(4, 4), "tensor").scale, torch.tensor(1.0))


def test_negative_zero_keeps_its_sign() -> None:
    w = torch.tensor([[-0.0, 0.0, 1.0]])
    deq = quantize_fp8(w).dequantize()
    assert torch.signbit(deq).tolist() == [[True, False, False]]


def test_inf_saturates_and_nan_stays_local() -> None:
    w = torch.tensor([[INF, -INF, 2.0, -1.0], [NAN, 4.0, 1.0, 0.5], [INF, -INF, NAN, 0.0]])
    q = quantize_fp8(w)
    # amax ignores Inf/NaN: row 0 amax 2, row 1 amax 4, row 2 has no finite nonzero -> 1.
    assert torch.equal(q.scale, torch.tensor([2.0 / 448, 4.0 / 448, 1.0]))
    deq = q.dequantize()
    assert deq[0].tolist() == pytest.approx([2.0, -2.0, 2.0, -1.0], rel=2**-20)  # +-Inf -> +-448 * scale
    assert math.isnan(deq[1, 0]) and not bool(torch.isnan(deq[1, 1:]).any())
    assert deq[1, 1:].tolist() == pytest.approx([4.0, 1.0, 0.5], rel=2**-20)
    assert deq[2, :2].tolist() == [448.0, -448.0] and math.isnan(deq[2, 2]) and deq[2, 3] == 0.0


def test_values_are_clamped_before_cast() -> None:
    # The row max maps to 448 exactly; nothing may come out as NaN from overflow.
    gen = torch.Generator().manual_seed(14)
    w = torch.randn(256, 64, generator=gen) * torch.exp2(torch.randint(-60, 60, (256, 1), generator=gen).float())
    q = quantize_fp8(w)
    data = q.data.float()
    assert not bool(torch.isnan(data).any())
    assert torch.equal(data.abs().amax(dim=1), torch.full((256,), E4M3_MAX))


@pytest.mark.parametrize("magnitude", [1e-30, 1e30, 1e-38, 1e-44, 3e38])
def test_tiny_and_huge_rows(magnitude: float) -> None:
    gen = torch.Generator().manual_seed(15)
    w = (torch.rand(4, 32, generator=gen) * 2 - 1) * magnitude
    q = quantize_fp8(w)
    assert bool(torch.isfinite(q.scale).all() and (q.scale >= SMALLEST_NORMAL_FP32).all())
    deq = q.dequantize(torch.float64)
    assert not bool(torch.isnan(deq).any())
    assert bool(((deq - w.double()).abs() <= error_bound(w.double(), q.scale.double().unsqueeze(1))).all())


def test_input_dtypes_agree_with_fp32_upcast() -> None:
    w = torch.randn(16, 64, generator=torch.Generator().manual_seed(16)) * 30
    for dtype in (torch.bfloat16, torch.float16, torch.float64):
        for granularity in ("row", "tensor"):
            narrow = w.to(dtype)
            q, q32 = quantize_fp8(narrow, granularity), quantize_fp8(narrow.float(), granularity)
            assert torch.equal(q.data.view(torch.uint8), q32.data.view(torch.uint8)), dtype
            assert torch.equal(q.scale, q32.scale), dtype


def test_non_contiguous_input() -> None:
    base = torch.randn(64, 48, generator=torch.Generator().manual_seed(17))
    for w in (base.t(), base[::2, ::3]):
        assert not w.is_contiguous()
        q, qc = quantize_fp8(w), quantize_fp8(w.contiguous())
        assert torch.equal(q.data.view(torch.uint8), qc.data.view(torch.uint8))
        assert torch.equal(q.scale, qc.scale)


def test_per_tensor_scale() -> None:
    w = torch.tensor([[1.0, -3.0], [0.5, 2.0]])
    q = quantize_fp8(w, "tensor")
    assert q.scale.shape == () and float(q.scale) == pytest.approx(3.0 / 448, rel=2**-23)
    assert q.granularity == "tensor"
    assert torch.allclose(q.dequantize(), w, rtol=2**-4)


def test_empty_rows() -> None:
    q = quantize_fp8(torch.zeros(3, 0))
    assert q.scale.tolist() == [1.0, 1.0, 1.0] and q.dequantize().shape == (3, 0)


# ---------------------------------------------------------------- container and errors


def test_fp8_tensor_container() -> None:
    q = quantize_fp8(torch.randn(4, 8))
    assert q.shape == torch.Size((4, 8)) and q.granularity == "row"
    moved = q.to("cpu")
    assert isinstance(moved, FP8Tensor) and moved.granularity == "row"
    assert torch.equal(q.dequantize(), dequantize_fp8(q.data, q.scale))
    with pytest.raises(dataclasses.FrozenInstanceError):
        q.scale = q.scale  # type: ignore[misc]


def test_quantize_errors() -> None:
    with pytest.raises(ValueError, match=r"unknown FP8 granularity 'col'; allowed: 'row', 'tensor', 'block'"):
        quantize_fp8(torch.zeros(2, 2), "col")
    with pytest.raises(ValueError, match=r"must be 2-D \[N, K\], got shape \(2, 3, 4\)"):
        quantize_fp8(torch.zeros(2, 3, 4))
    with pytest.raises(ValueError, match=r"must be 2-D \[N, K\], got shape \(5,\)"):
        quantize_fp8(torch.zeros(5))
    with pytest.raises(TypeError, match="FP8 input must be float16.*got torch.int64"):
        quantize_fp8(torch.zeros(2, 2, dtype=torch.int64))
    with pytest.raises(TypeError, match="must be a torch.Tensor, got list"):
        quantize_fp8([[1.0]])  # type: ignore[arg-type]


def test_container_and_dequantize_errors() -> None:
    data = torch.zeros(4, 8).to(torch.float8_e4m3fn)
    scale = torch.ones(4)
    with pytest.raises(TypeError, match="FP8 data must be torch.float8_e4m3fn, got torch.float32"):
        FP8Tensor(data.float(), scale)
    with pytest.raises(TypeError, match="FP8 scale must be float32, got torch.float16"):
        dequantize_fp8(data, scale.half())
    with pytest.raises(ValueError, match=r"'row' scale must have shape \(4,\) .* got \(3,\)"):
        FP8Tensor(data, torch.ones(3))
    with pytest.raises(ValueError, match=r"'tensor' scale must have shape \(\) .* got \(4,\)"):
        FP8Tensor(data, scale, "tensor")
    with pytest.raises(ValueError, match="unknown FP8 granularity 'col'"):
        FP8Tensor(data, scale, "col")
    with pytest.raises(ValueError, match="an FP8 block size goes with granularity 'block' only, got 'block' and block None"):
        FP8Tensor(data, scale, "block")
    with pytest.raises(ValueError, match=r"'block' scale must have shape \(2, 1\) .* got \(4,\)"):
        FP8Tensor(data, scale, "block", (2, 8))
    with pytest.raises(ValueError, match=r"an FP8 block must be two positive whole numbers \(rows, columns\), got \(0, 8\)"):
        dequantize_fp8(data, torch.ones(2, 1), block=(0, 8))
    with pytest.raises(TypeError, match="output dtype must be .*got torch.int32"):
        dequantize_fp8(data, scale, torch.int32)
    with pytest.raises(TypeError, match="FP8 scale must be a torch.Tensor, got float"):
        dequantize_fp8(data, 1.0)  # type: ignore[arg-type]


@pytest.mark.parametrize("shape, block", [((300, 260), (128, 128)), ((7, 5), (2, 4)), ((64, 64), (64, 64))])
def test_block_quantization_is_within_half_an_e4m3_step_of_each_element(shape, block) -> None:
    """Blocks of very different magnitudes (2**+-12 apart): each element within half an e4m3 step
    of its value at its own block's scale (3 mantissa bits: 2**-4 relative; below the normal
    range, half the subnormal step, 2**-10 of the scale), and each block's largest magnitude
    maps to 448 exactly."""
    g = torch.Generator().manual_seed(shape[0])
    gn, gk = -(-shape[0] // block[0]), -(-shape[1] // block[1])
    level = torch.exp2(torch.randint(-12, 13, (gn, gk), generator=g).float())
    w = torch.randn(*shape, generator=g) * level.repeat_interleave(block[0], 0)[:shape[0]].repeat_interleave(
        block[1], 1)[:, :shape[1]]
    q = quantize_fp8(w, "block", block=block)
    assert q.scale.shape == (gn, gk) and q.block == block
    scale = q.scale.repeat_interleave(block[0], 0)[:shape[0]].repeat_interleave(block[1], 1)[:, :shape[1]]
    err = (q.dequantize() - w).abs()
    assert (err <= torch.maximum(w.abs() * 2**-4, scale * 2**-10) * (1 + 1e-6)).all()
    for i in range(gn):
        for j in range(gk):
            tile = q.data[i * block[0]:(i + 1) * block[0], j * block[1]:(j + 1) * block[1]].float().abs()
            assert tile.max().item() == 448.0
