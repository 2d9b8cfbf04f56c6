"""The integer pieces of the Triton MoE's dp4a decode (impl.moe.triton_dp4a): the byte permute and
the dot product against models of the PTX instructions written here in plain Python, the
E2M1 -> int8 lookup over every code at every position of a word, and the int8 split of
activations against its stated error bound. On a GPU these run the PTX instructions themselves;
on a CPU, the interpreter's emulation of them (so CI checks the tables and selectors).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from impl.moe.triton_dp4a import ASM, _dp4a, _e2m1_word_to_int8x4, _prmt, split_int8_kernel
from impl.quant.mxfp4 import decode_e2m1, unpack_nibbles
from impl.triton_env import tl, triton

DEVICE = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


@triton.jit
def prmt_dp4a_kernel(a_ptr, b_ptr, c_ptr, prmt_ptr, dp4a_ptr, N: tl.constexpr):
    offs = tl.arange(0, N)
    a, b, c = tl.load(a_ptr + offs), tl.load(b_ptr + offs), tl.load(c_ptr + offs)
    tl.store(prmt_ptr + offs, _prmt(a, b, c, ASM))
    tl.store(dp4a_ptr + offs, _dp4a(a, b, c, ASM))


def prmt_model(a: int, b: int, sel: int) -> int:
    """PTX ISA, prmt.b32 default mode: bytes {b, a} numbered 0-7 from a's low byte; result byte i
    is the byte numbered (nibble i of sel) & 7, or its sign bit copied into all 8 bits when the
    nibble's bit 3 is set."""
    src = (a & 0xFFFFFFFF) | ((b & 0xFFFFFFFF) << 32)
    out = 0
    for i in range(4):
        nib = (sel >> (4 * i)) & 0xF
        byte = (src >> (8 * (nib & 7))) & 0xFF
        if nib & 8:
            byte = 0xFF if byte & 0x80 else 0
        out |= byte << (8 * i)
    return out - (1 << 32) if out >= 1 << 31 else out


def dp4a_model(a: int, b: int, c: int) -> int:
    """PTX dp4a.s32.s32: c + the sum of the products of the signed bytes of a and b, mod 2**32."""
    def sbytes(v):
        return [((v >> (8 * i)) & 0xFF) - (256 if (v >> (8 * i)) & 0x80 else 0) for i in range(4)]
    r = (c + sum(x * y for x, y in zip(sbytes(a), sbytes(b)))) & 0xFFFFFFFF
    return r - (1 << 32) if r >= 1 << 31 else r


def test_prmt_and_dp4a_match_the_ptx_definitions():
    """Random words (so every selector nibble, sign bits included, and extreme bytes) plus edge
    cases, against the models above: exact."""
    g = np.random.default_rng(0)
    a, b, c = (g.integers(-2**31, 2**31, 256, dtype=np.int64) for _ in range(3))
    a[:4] = [-1, 0, 0x7F7F7F7F, -0x7F7F7F80]  # bytes 0xFF, 0x00, 0x7F, 0x80
    b[:4] = [-1, -0x7F7F7F80, 0x7F7F7F7F, -0x7F7F7F80]
    c[:4] = [0x7FFFFFFF, -2**31, 0x00008888, 0x7654]  # the sum wraps; sign-replicating selectors
    t = {k: torch.tensor(v, dtype=torch.int32, device=DEVICE) for k, v in dict(a=a, b=b, c=c).items()}
    prmt_out, dp4a_out = torch.empty_like(t["a"]), torch.empty_like(t["a"])
    prmt_dp4a_kernel[(1,)](t["a"], t["b"], t["c"], prmt_out, dp4a_out, N=256)
    assert prmt_out.cpu().tolist() == [prmt_model(*v) for v in zip(a.tolist(), b.tolist(), c.tolist())]
    assert dp4a_out.cpu().tolist() == [dp4a_model(*v) for v in zip(a.tolist(), b.tolist(), c.tolist())]


@triton.jit
def int8_decode_kernel(word_ptr, out_ptr, N: tl.constexpr):
    offs = tl.arange(0, N)
    d0, d1 = _e2m1_word_to_int8x4(tl.load(word_ptr + offs), ASM)
    tl.store(out_ptr + 2 * offs, d0)
    tl.store(out_ptr + 2 * offs + 1, d1)


def test_int8_decode_every_code_at_every_position():
    """Every byte value (so every pair of codes) at every byte of a word decodes to 2 x E2M1 of
    each code, as int8 in k order: exact, -0 as 0."""
    byte = torch.arange(256, dtype=torch.uint8)
    packed = torch.stack([byte, byte.flip(0), byte * 7, byte * 13 + 5], dim=1)
    packed = torch.cat([packed, packed.roll(1, dims=1), packed.roll(2, dims=1), packed.roll(3, dims=1)]).contiguous()
    words = packed.view(torch.int32).reshape(-1).to(DEVICE)
    out = torch.empty(2 * words.numel(), dtype=torch.int32, device=DEVICE)
    int8_decode_kernel[(1,)](words, out, N=words.numel())
    expected = (2 * decode_e2m1(unpack_nibbles(packed.reshape(-1)))).to(torch.int8)
    assert torch.equal(out.cpu().view(torch.int8), expected)


def reconstruct(planes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """a = 2 x scale x (128 hi + lo) from planes [M, 4, K/8] and scales [M, K/32], in float64."""
    m, _, w = planes.shape
    b = planes.cpu().contiguous().view(torch.int8).reshape(m, 4, w, 4).double()
    hi = torch.stack([b[:, 0], b[:, 1]], dim=2).reshape(m, 8 * w)  # word w: k = 8w..8w+3, then 8w+4..8w+7
    lo = torch.stack([b[:, 2], b[:, 3]], dim=2).reshape(m, 8 * w)
    return 2 * scales.cpu().double().repeat_interleave(32, dim=1) * (128 * hi + lo)


def split(a: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    m, k = a.shape
    planes = torch.empty(m, 4, k // 8, dtype=torch.int32, device=DEVICE)
    scales = torch.empty(m, k // 32, dtype=torch.float32, device=DEVICE)
    split_int8_kernel[(m, triton.cdiv(k, 128))](a, a.stride(0), planes, scales, k, BLOCK_K=128)
    return planes, scales


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_split_int8_error_bound(dtype):
    """Random rows over many magnitudes (K = 320: a masked tail in the last program): every value
    within 2**-13 of its block's largest magnitude; bf16 values within 2**6 of it exactly; an
    all-zero block is zeros; |hi|, |lo| <= 127 (the bytes are int8, checked by the reconstruction
    landing within the bound)."""
    g = torch.Generator().manual_seed(5)
    k = 320
    a = torch.randn(6, k, generator=g) * torch.exp2(torch.randint(-30, 30, (6, k // 32, 1), generator=g).float()
                                                    ).repeat_interleave(32, dim=1).reshape(6, k)
    a[0, :32] = 0.0
    a[1, 32:64] = torch.linspace(-1, 1, 32)  # exact halves and ties
    a = a.to(dtype)
    planes, scales = split(a.to(DEVICE))
    rec = reconstruct(planes, scales)
    exact = a.double()
    amax = exact.abs().reshape(6, k // 32, 32).amax(-1, keepdim=True).expand(6, k // 32, 32).reshape(6, k)
    err = (rec - exact).abs()
    assert (err <= 2.0**-13 * amax).all(), f"worst error / block max {(err / amax.clamp_min(1e-300)).max():.3g}"
    assert (rec[0, :32] == 0).all()
    if dtype == torch.bfloat16:
        near = exact.abs() >= amax * 2.0**-6
        assert torch.equal(rec[near], exact[near])


def test_split_int8_non_finite_blocks_get_nan_scales_and_tiny_blocks_stay_bounded():
    """A block holding NaN or inf gets a NaN scale (its token's outputs become NaN), the others
    are untouched; a block below 2**-106 is split with absolute error <= 2**-119."""
    a = torch.randn(1, 128, generator=torch.Generator().manual_seed(6))
    a[0, 5] = float("nan")
    a[0, 40] = float("inf")
    a[0, 96:] *= 2.0**-120
    planes, scales = split(a.to(DEVICE))
    assert scales[0, :2].isnan().all() and scales[0, 2:].isfinite().all()
    rec = reconstruct(planes, scales)
    assert ((rec[0, 64:96] - a[0, 64:96].double()).abs() <= 2.0**-13 * a[0, 64:96].abs().max()).all()
    assert ((rec[0, 96:] - a[0, 96:].double()).abs() <= 2.0**-119).all()
