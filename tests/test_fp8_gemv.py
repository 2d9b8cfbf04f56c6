"""The Triton FP8 GEMV (impl.head.fp8_gemv) against its fp32 oracle, its edge cases, bad input,
and the launch-configuration table.

On a machine without CUDA these run the kernel source under Triton's interpreter; with CUDA they
run it compiled. Tolerances (relative Frobenius error against `fp8_gemv_reference`, fp32 out):
  * interpreter, every path: 1e-5. Both sides compute fp32 products of exact values (an e4m3
    weight times a bf16/fp32 activation, or the exact e4m3 split of a bf16 activation) and sum
    them in fp32 in a different order: ~sqrt(K) * 2**-24 relative, measured <= 1.2e-6 at K <= 333.
  * CUDA, "split" path: 2e-3. The FP8 tensor cores accumulate within a K tile with fewer bits
    than fp32 (measured on the H200: 2e-4 with BLOCK_K = 256); still below the bf16 rounding of
    the logits (~1.1e-3), while a wrong scale, row or tile gives >= 1e-2.
A planted fault (scales dropped, or applied twice) gives a relative error of order 1 or more.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from impl.head import compare_logits
from impl.head.gemv_config import ANY, GENERIC, INTERPRETER, TUNED, GemvConfig, lookup, m_bucket
from impl.head.fp8_gemv import _to_e4m3, fp8_gemv, fp8_gemv_reference, kernel_path
from impl.quant import quantize_fp8
from impl.quant.fp8 import dequantize_fp8
from impl.triton_env import FP32_MATH, INTERPRET, tl, triton
from tests.helpers import rel_err

DEVICE = torch.device("cpu" if INTERPRET else "cuda")
EXACT = 1e-5


def tolerance(path: str) -> float:
    return 2e-3 if (path == "split" and not INTERPRET) else EXACT


def weights(n: int, k: int, gen: torch.Generator, granularity: str = "row"):
    """Gaussian rows with row norms spread over ~2**+-6, so per-row scales differ."""
    w = torch.randn(n, k, generator=gen) * torch.exp2(torch.randint(-6, 7, (n, 1), generator=gen).float())
    return quantize_fp8(w, granularity).to(DEVICE)


DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def activations(m: int, k: int, gen: torch.Generator, dtype: torch.dtype) -> torch.Tensor:
    """Rows of very different magnitudes (e**(3 N(0,1))): the split path's per-row scales matter."""
    # Row factors capped so that |x| stays finite in fp16 (max 65504): at e**11 and more a draw
    # overflowed to inf, and with it the reference.
    row = torch.exp(3 * torch.randn(m, 1, generator=gen)).clamp(max=torch.finfo(dtype).max / 64)
    x = torch.randn(m, k, generator=gen) * row
    return x.to(dtype).to(DEVICE)


CONFIGS = {
    "split-8": GemvConfig(32, 64, 4, 1, path="split", block_m=8),
    "split-16": GemvConfig(64, 128, 4, 2, path="split", block_m=16),
    "dot": GemvConfig(32, 64, 4, 2, path="dot"),
    "fma": GemvConfig(32, 64, 4, 1, path="fma", block_m=4),
}


@pytest.mark.parametrize("m", [1, 2, 4, 16, 19])
@pytest.mark.parametrize("granularity", ["row", "tensor"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_kernel_equals_reference_default_config(m, granularity, dtype):
    """N=77, K=333: neither a multiple of any block (tails masked / clamped)."""
    # Seeded by the dtype's position, not hash(str): string hashes change from process to process.
    gen = torch.Generator().manual_seed(m * 31 + len(granularity) + 7 * DTYPES.index(dtype))
    q = weights(77, 333, gen, granularity)
    x = activations(m, 333, gen, dtype)
    out = fp8_gemv(x, q.data, q.scale, torch.float32)
    ref = fp8_gemv_reference(x, q.data, q.scale, torch.float32)
    assert out.shape == (m, 77) and out.dtype == torch.float32
    assert torch.isfinite(out).all()
    path = kernel_path(INTERPRETER if INTERPRET else GENERIC[m_bucket(m)], dtype, DEVICE)
    assert rel_err(out, ref) <= tolerance(path)


@pytest.mark.parametrize("name", sorted(CONFIGS))
@pytest.mark.parametrize("m", [1, 5, 17])
def test_every_path_equals_reference(name, m):
    cfg = CONFIGS[name]
    gen = torch.Generator().manual_seed(7 * m + len(name))
    q = weights(150, 200, gen, "row")
    x = activations(m, 200, gen, torch.bfloat16)
    out = fp8_gemv(x, q.data, q.scale, torch.float32, config=cfg)
    assert rel_err(out, fp8_gemv_reference(x, q.data, q.scale, torch.float32)) <= tolerance(cfg.path)


@pytest.mark.skipif(INTERPRET, reason="CUDA only: a 4.3 GB output, far past what the interpreter can fill")
@pytest.mark.parametrize("name", [*sorted(CONFIGS), "table"])
def test_logits_past_2_31_elements_land_in_their_rows(name):
    """A prompt's logits over a large vocabulary pass 2**31 elements (13,663 tokens of Ling's
    157,184): row offsets computed in 32 bits wrapped there and wrote out of bounds (an illegal
    address on the H200 at a 32k prompt). M x N = 8200 x 262144 = 2.15e9; the first and the last
    rows (the last past 2**31) against the oracle within bf16's output rounding (half an ulp is 2e-3
    relative: 4e-3, above every path's own tolerance)."""
    gen = torch.Generator().manual_seed(31)
    m, n, k = 8200, 262144, 32
    q = weights(n, k, gen, "row")
    x = activations(m, k, gen, torch.bfloat16)
    out = fp8_gemv(x, q.data, q.scale, torch.bfloat16, config=CONFIGS.get(name))
    for rows in (slice(0, 4), slice(m - 4, m)):
        want = fp8_gemv_reference(x[rows], q.data, q.scale, torch.float32)
        assert rel_err(out[rows], want) <= 4e-3
    del out


@given(m=st.integers(1, 20), n=st.integers(1, 160), k=st.integers(1, 300),
       granularity=st.sampled_from(["row", "tensor"]), dtype=st.sampled_from([torch.bfloat16, torch.float32]),
       seed=st.integers(0, 2**31 - 1))
def test_kernel_equals_reference_any_shape(m, n, k, granularity, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    q = weights(n, k, gen, granularity)
    x = activations(m, k, gen, dtype)
    out = fp8_gemv(x, q.data, q.scale, torch.float32)
    ref = fp8_gemv_reference(x, q.data, q.scale, torch.float32)
    assert torch.isfinite(out).all()
    assert rel_err(out, ref) <= (EXACT if INTERPRET else tolerance("split"))


@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
def test_output_dtype_is_the_rounded_fp32_result(out_dtype):
    gen = torch.Generator().manual_seed(3)
    q = weights(64, 96, gen)
    x = activations(3, 96, gen, torch.bfloat16)
    out = fp8_gemv(x, q.data, q.scale, out_dtype)
    assert out.dtype == out_dtype
    # Rounding the fp32 result to the output: half an ulp, relative <= 2**-8 per element for bf16
    # (8 significant bits), 2**-11 for fp16 (11 bits), so norm-wise no more than that either.
    bound = {torch.bfloat16: 2**-8, torch.float16: 2**-11, torch.float32: 0}[out_dtype] + tolerance("split")
    assert rel_err(out, fp8_gemv_reference(x, q.data, q.scale, torch.float32)) <= bound


def test_default_output_dtype_is_the_input_dtype():
    gen = torch.Generator().manual_seed(4)
    q = weights(40, 64, gen)
    assert fp8_gemv(activations(2, 64, gen, torch.bfloat16), q.data, q.scale).dtype == torch.bfloat16


# --------------------------------------------------------------- block scales (FP8 checkpoints)

def block_weights(n: int, k: int, block: tuple[int, int], gen: torch.Generator):
    """Gaussian weights whose blocks differ in magnitude by up to 2**+-6 (so a scale read from
    the wrong block, or applied after the K tiles were summed, is off by far more than rounding),
    quantized per block."""
    gn, gk = -(-n // block[0]), -(-k // block[1])
    level = torch.exp2(torch.randint(-6, 7, (gn, gk), generator=gen).float())
    spread = level.repeat_interleave(block[0], 0)[:n].repeat_interleave(block[1], 1)[:, :k]
    return quantize_fp8(torch.randn(n, k, generator=gen) * spread, "block", block=block).to(DEVICE)


# Small blocks keep the interpreter's work small while giving several blocks each way, tiles cut
# to the block (64 -> 32) and ragged tails of both, through every path; 128 x 128, the
# checkpoints' own size, through the table's config.
BLOCK_CASES = [pytest.param(block, n, k, m, name, id=f"{block[0]}x{block[1]}-M{m}-{name or 'table'}")
               for block, n, k in [((16, 32), 77, 333), ((32, 64), 150, 200), ((128, 128), 160, 384)]
               for m in (1, 2, 4, 16) for name in ([None, *sorted(CONFIGS)] if block[0] < 128 else [None])]


@pytest.mark.parametrize("block, n, k, m, name", BLOCK_CASES)
def test_block_scaled_weights_equal_reference(block, n, k, m, name):
    """Every path at M = 1..4 (a decode step and a verify pass) and 16 (a prompt pass), bf16
    activations, against the oracle on the dequantized weight; tolerances as per row."""
    gen = torch.Generator().manual_seed(m * 13 + n + (len(name) if name else 0))
    q = block_weights(n, k, block, gen)
    assert q.scale.shape == (-(-n // block[0]), -(-k // block[1]))
    x = activations(m, k, gen, torch.bfloat16)
    out = fp8_gemv(x, q.data, q.scale, torch.float32, config=CONFIGS.get(name), block=block)
    ref = fp8_gemv_reference(x, q.data, q.scale, torch.float32, block=block)
    path = CONFIGS[name].path if name else kernel_path(INTERPRETER if INTERPRET else GENERIC[m_bucket(m)],
                                                       torch.bfloat16, DEVICE)
    assert torch.isfinite(out).all() and rel_err(out, ref) <= tolerance(path)


@pytest.mark.parametrize("planted", ["scales of the next K block", "one scale a row block"])
def test_a_block_scale_read_wrongly_is_caught(planted):
    """The check above fails on block scales misread: shifted one block along K, or one scale
    used for a whole row of blocks (what a per-row kernel given block scales would compute)."""
    gen = torch.Generator().manual_seed(21)
    block = (32, 64)
    q = block_weights(150, 200, block, gen)
    x = activations(4, 200, gen, torch.bfloat16)
    wrong = q.scale.roll(1, dims=1) if planted.startswith("scales") else q.scale[:, :1].expand_as(q.scale)
    out = fp8_gemv(x, q.data, wrong.contiguous(), torch.float32, block=block)
    assert rel_err(out, fp8_gemv_reference(x, q.data, q.scale, torch.float32, block=block)) > 100 * EXACT


def test_block_scales_cover_their_blocks_and_the_ragged_tails():
    """Ones [5, 7] in blocks of 2 x 4 (a 3 x 2 scale, the last block row and column partial): each
    element takes its own block's scale, built here element by element."""
    scale = torch.tensor([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]])
    got = dequantize_fp8(torch.ones(5, 7).to(torch.float8_e4m3fn), scale, block=(2, 4))
    assert got.tolist() == [[scale[i // 2, j // 4].item() for j in range(7)] for i in range(5)]


@pytest.mark.parametrize("case, message", [
    ("scale of the wrong shape", r"a scale per block of 32x64 of a \(150, 200\) weight must be float32 \[5, 4\]"),
    ("columns not a power of two", r"block must be \(rows, columns\) with a power-of-two column count"),
    ("block scale without block", r"scale must be float32 \[N=150\] \(per row\) or \[\] \(per tensor\)"),
])
def test_bad_block_scales_are_named(case, message):
    gen = torch.Generator().manual_seed(23)
    q = block_weights(150, 200, (32, 64), gen)
    x = activations(1, 200, gen, torch.bfloat16)
    scale, block = {"scale of the wrong shape": (q.scale[:, :3], (32, 64)),
                    "columns not a power of two": (q.scale, (32, 48)),
                    "block scale without block": (q.scale, None)}[case]
    with pytest.raises(ValueError, match=message):
        fp8_gemv(x, q.data, scale, torch.float32, block=block)


# ------------------------------------------------------------------------------------ edge cases

def test_zero_rows_give_zero_logits_and_no_nan():
    gen = torch.Generator().manual_seed(5)
    w = torch.randn(70, 130, generator=gen)
    w[[0, 33, 69]] = 0.0
    q = quantize_fp8(w, "row").to(DEVICE)
    assert q.scale[[0, 33, 69]].eq(1.0).all()  # zero rows get scale 1, not 0 / 448
    for cfg in [None, *CONFIGS.values()]:
        out = fp8_gemv(activations(4, 130, gen, torch.bfloat16), q.data, q.scale, torch.float32, config=cfg)
        assert torch.isfinite(out).all()
        assert out[:, [0, 33, 69]].eq(0).all()


def test_all_zero_weight_per_tensor():
    q = quantize_fp8(torch.zeros(20, 50), "tensor").to(DEVICE)
    out = fp8_gemv(activations(2, 50, torch.Generator().manual_seed(6), torch.bfloat16), q.data, q.scale,
                   torch.float32)
    assert out.eq(0).all()


def test_weights_beyond_e4m3_range_saturate_never_nan():
    """Entries of 1e30, -1e20 and +-Inf: the quantizer's scale absorbs the finite ones and Inf
    saturates to +-448 * scale; the logits stay finite."""
    gen = torch.Generator().manual_seed(8)
    w = torch.randn(64, 96, generator=gen)
    w[3, 5], w[10, 0], w[20, 95], w[21, 7] = 1e30, -1e20, float("inf"), float("-inf")
    for granularity in ("row", "tensor"):
        q = quantize_fp8(w, granularity).to(DEVICE)
        assert not torch.isnan(q.data.float()).any()
        assert q.data.float().abs().max() <= 448
        x = torch.randn(3, 96, generator=gen).to(torch.bfloat16).to(DEVICE)  # |x w| << fp32 max
        out = fp8_gemv(x, q.data, q.scale, torch.float32)
        assert torch.isfinite(out).all()
        assert rel_err(out, fp8_gemv_reference(x, q.data, q.scale, torch.float32)) <= tolerance("split")


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_nan_inputs_propagate_to_exactly_their_rows(name):
    gen = torch.Generator().manual_seed(9)
    q = weights(90, 200, gen)
    x = activations(6, 200, gen, torch.bfloat16)
    x[1, 17] = float("nan")
    x[4, 199] = float("nan")  # in the K tail
    out = fp8_gemv(x, q.data, q.scale, torch.float32, config=CONFIGS[name])
    assert torch.isnan(out[1]).all() and torch.isnan(out[4]).all()
    others = out[[0, 2, 3, 5]]
    assert torch.isfinite(others).all()
    ref = fp8_gemv_reference(x[[0, 2, 3, 5]], q.data, q.scale, torch.float32)
    assert rel_err(others, ref) <= tolerance(CONFIGS[name].path)


def test_empty_and_degenerate_shapes():
    gen = torch.Generator().manual_seed(10)
    q = weights(30, 40, gen)
    assert fp8_gemv(activations(1, 40, gen, torch.bfloat16)[:0], q.data, q.scale).shape == (0, 30)
    q0 = quantize_fp8(torch.zeros(30, 0), "row").to(DEVICE)
    out = fp8_gemv(torch.zeros(2, 0, dtype=torch.bfloat16, device=DEVICE), q0.data, q0.scale, torch.float32)
    assert out.shape == (2, 30) and out.eq(0).all()
    # One row, one column.
    q1 = weights(1, 1, gen)
    x1 = activations(1, 1, gen, torch.float32)
    assert rel_err(fp8_gemv(x1, q1.data, q1.scale), fp8_gemv_reference(x1, q1.data, q1.scale)) <= EXACT


def test_outlier_channels_keep_the_split_exact():
    """Hidden states with a few channels 1000x the rest (as LLMs have): the other elements sit far
    below the tile's amax, where the split into hi + lo / 32 is still exact (>= amax * 2**-15)."""
    gen = torch.Generator().manual_seed(14)
    q = weights(100, 256, gen)
    x = torch.randn(4, 256, generator=gen)
    x[:, [3, 130]] *= 1000
    x = x.to(torch.bfloat16).to(DEVICE)
    out = fp8_gemv(x, q.data, q.scale, torch.float32)
    assert rel_err(out, fp8_gemv_reference(x, q.data, q.scale, torch.float32)) <= tolerance("split")


def test_non_contiguous_input():
    gen = torch.Generator().manual_seed(11)
    q = weights(50, 64, gen)
    x = activations(64, 4, gen, torch.bfloat16).t()  # [4, 64], stride (1, 4)
    out = fp8_gemv(x, q.data, q.scale, torch.float32)
    assert rel_err(out, fp8_gemv_reference(x, q.data, q.scale, torch.float32)) <= tolerance("split")


@triton.jit
def _round_kernel(x_ptr, y_ptr, n, BLOCK: tl.constexpr, FP32_MATH: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offs, mask=offs < n, other=0.0)
    tl.store(y_ptr + offs, _to_e4m3(x, FP32_MATH).to(tl.float32), mask=offs < n)


def test_e4m3_rounding_matches_torch_at_midpoints_and_binade_edges():
    """The split path rounds activations to e4m3 in-kernel (`_to_e4m3`): on the GPU by the
    hardware cast, under the interpreter by bit arithmetic. Both must equal torch's cast
    (round to nearest, ties to even) on every midpoint between e4m3 values and across binades."""
    v = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    v = v[torch.isfinite(v)].unique()
    mids = (v[1:] + v[:-1]) / 2
    x = torch.cat([v, mids, mids.nextafter(torch.tensor(math.inf)), mids.nextafter(torch.tensor(-math.inf)),
                   torch.linspace(-300, 300, 20001), torch.tensor([127.99, -127.99, 255.9, 0.0137])])
    x = x[x.abs() < 448].contiguous().to(DEVICE)
    y = torch.empty_like(x)
    _round_kernel[(triton.cdiv(x.numel(), 1024),)](x, y, x.numel(), BLOCK=1024, FP32_MATH=FP32_MATH)
    want = x.cpu().to(torch.float8_e4m3fn).float()
    assert torch.equal(y.cpu(), want)


# ------------------------------------------------------------------------------------- bad input

def test_bad_inputs_are_refused_clearly():
    gen = torch.Generator().manual_seed(12)
    q = weights(30, 40, gen)
    x = activations(2, 40, gen, torch.bfloat16)
    with pytest.raises(ValueError, match="K=41 but the weight has K=40"):
        fp8_gemv(activations(2, 41, gen, torch.bfloat16), q.data, q.scale)
    with pytest.raises(ValueError, match="2-D"):
        fp8_gemv(x[0], q.data, q.scale)
    with pytest.raises(TypeError, match="bfloat16, float16 or float32"):
        fp8_gemv(torch.ones(2, 40, dtype=torch.int32, device=DEVICE), q.data, q.scale)
    with pytest.raises(TypeError, match="bfloat16, float16 or float32"):
        fp8_gemv(x.to(torch.float8_e4m3fn), q.data, q.scale)
    with pytest.raises(TypeError, match="float8_e4m3fn"):
        fp8_gemv(x, q.data.float(), q.scale)
    with pytest.raises(ValueError, match="scale must be float32"):
        fp8_gemv(x, q.data, q.scale[:-1])
    with pytest.raises(ValueError, match="scale must be float32"):
        fp8_gemv(x, q.data, q.scale.double())
    with pytest.raises(TypeError, match="out_dtype"):
        fp8_gemv(x, q.data, q.scale, torch.int32)
    with pytest.raises(ValueError, match="one device"):
        fp8_gemv(x.to("meta"), q.data, q.scale)


# -------------------------------------------------------------------------- planted faults (a)

def test_dropped_or_doubled_scales_are_caught_by_the_parity_check():
    """Negative control: the FP8 bytes used without their scales (scale 1), or with the scales
    applied twice, must fail the parity check that the real kernel passes."""
    gen = torch.Generator().manual_seed(13)
    w = torch.randn(128, 96, generator=gen) * 0.02
    q = quantize_fp8(w, "row").to(DEVICE)
    x = activations(8, 96, gen, torch.bfloat16)
    truth = x.float() @ w.to(DEVICE).t()
    bounds = dict(max_rel_err=0.04, min_top1=0.5, min_top5=0.5)
    compare_logits(fp8_gemv(x, q.data, q.scale, torch.float32), truth).check(**bounds)
    for planted in (torch.ones_like(q.scale), q.scale * q.scale):
        bad = compare_logits(fp8_gemv(x, q.data, planted, torch.float32), truth)
        assert bad.rel_err > 0.5, bad  # ~1e4 without scales, ~1 with them squared (logits -> 0)
        with pytest.raises(AssertionError, match="relative error"):
            bad.check(**bounds)


# -------------------------------------------------------------------------------- config table

def test_lookup_rules_in_order():
    h200 = "NVIDIA H200"
    cfg, rule = lookup(157184, 2560, 1, h200)
    assert rule == "exact" and cfg is TUNED[(157184, 2560, 1, h200)]
    assert lookup(157184, 4096, 3, h200)[1] == "exact"  # M=3 -> bucket 4
    assert lookup(1000, 2560, 1, h200)[1] == "device"
    assert lookup(157184, 2560, 1, "NVIDIA A100-SXM4-80GB") == (GENERIC[1], "generic")
    assert lookup(5, 7, 40, "cpu") == (GENERIC[16], "generic")
    assert lookup(157184, 2560, 1, h200, interpreter=True) == (INTERPRETER, "interpreter")
    TUNED[(ANY, 12345, 2, "test-gpu")] = CONFIGS["dot"]
    try:
        assert lookup(999, 12345, 2, "test-gpu") == (CONFIGS["dot"], "hidden")
    finally:
        del TUNED[(ANY, 12345, 2, "test-gpu")]


def test_every_table_entry_is_valid_and_buckets_cover_m():
    assert [m_bucket(m) for m in (1, 2, 3, 4, 5, 8, 9, 16, 17, 400)] == [1, 2, 4, 4, 8, 8, 16, 16, 16, 16]
    for cfg in [*TUNED.values(), *GENERIC.values(), INTERPRETER]:
        assert isinstance(cfg, GemvConfig)
        assert cfg.block_n * cfg.block_k <= 2**20  # the interpreter's block limit


@pytest.mark.parametrize("kwargs, match", [
    (dict(block_n=48, block_k=64, num_warps=4, num_stages=2), "power of two"),
    (dict(block_n=64, block_k=16, num_warps=4, num_stages=2), "block_k >= 32"),
    (dict(block_n=64, block_k=64, num_warps=4, num_stages=2, path="dot", block_m=8), "block_m >= 16"),
    (dict(block_n=64, block_k=64, num_warps=3, num_stages=2), "num_warps"),
    (dict(block_n=64, block_k=64, num_warps=4, num_stages=2, path="wgmma"), "path must be one of"),
])
def test_bad_configs_are_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        GemvConfig(**kwargs)


def test_paths_by_activation_dtype():
    split = CONFIGS["split-8"]
    assert kernel_path(split, torch.bfloat16, torch.device("cpu")) == "split"
    assert kernel_path(split, torch.float16, torch.device("cpu")) == "dot"  # 11 bits: not exact in 2 terms
    assert kernel_path(split, torch.float32, torch.device("cpu")) == "dot"
    assert kernel_path(CONFIGS["fma"], torch.float32, torch.device("cpu")) == "fma"
