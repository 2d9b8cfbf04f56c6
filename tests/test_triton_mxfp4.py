"""The Triton MXFP4 decoders (impl/moe/triton_mxfp4.py) for every code, bit for bit against
impl.quant's decode: on the GPU when there is one, else under Triton's interpreter."""

from __future__ import annotations

import pytest
import torch

from impl.moe.triton_mxfp4 import e2m1_to_bf16, e8m0_to_bf16, e8m0_to_fp32
from impl.quant.mxfp4 import decode_e2m1, decode_e8m0
from impl.triton_env import tl, triton

DEVICE = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


@triton.jit
def decode_kernel(code_ptr, e2m1_ptr, e8m0_bf16_ptr, e8m0_fp32_ptr):
    offs = tl.arange(0, 256)
    codes = tl.load(code_ptr + offs)
    tl.store(e2m1_ptr + offs, e2m1_to_bf16(codes & 0xF))
    tl.store(e8m0_bf16_ptr + offs, e8m0_to_bf16(codes))
    tl.store(e8m0_fp32_ptr + offs, e8m0_to_fp32(codes))


def test_every_e2m1_and_e8m0_code_decodes_exactly():
    """E2M1 codes 0-15 (each byte's low nibble, so every code 16 times) to bf16, E8M0 codes 0-255
    to bf16 and fp32: equal bits to the reference decode (-0.0 and the subnormal 2**-127 of code
    0 included), NaN for E8M0 255."""
    codes = torch.arange(256, dtype=torch.uint8, device=DEVICE)
    e2m1 = torch.empty(256, dtype=torch.bfloat16, device=DEVICE)
    e8m0_bf16 = torch.empty(256, dtype=torch.bfloat16, device=DEVICE)
    e8m0_fp32 = torch.empty(256, dtype=torch.float32, device=DEVICE)
    decode_kernel[(1,)](codes, e2m1, e8m0_bf16, e8m0_fp32)
    codes = codes.cpu()
    want_e2m1 = decode_e2m1(codes & 0xF).to(torch.bfloat16)
    assert torch.equal(e2m1.cpu().view(torch.int16), want_e2m1.view(torch.int16))
    want = decode_e8m0(codes)
    assert torch.equal(e8m0_fp32.cpu()[:255].view(torch.int32), want[:255].view(torch.int32))
    assert torch.equal(e8m0_bf16.cpu()[:255].view(torch.int16), want[:255].to(torch.bfloat16).view(torch.int16))
    assert e8m0_fp32[255].isnan() and e8m0_bf16[255].isnan()


@pytest.mark.parametrize("shape", [(3, 20, 96), (2, 17, 544)])
def test_dequantize_kernel_equals_the_torch_dequantization(shape):
    """mxfp4_dequant_kernel (the grouped prefill's) against dequantize_mxfp4 in bf16: equal, every
    product being a power-of-two scaling of an E2M1 value; rows and bytes past a tile are masked
    (17 rows, 272 bytes: neither a multiple of the 16 x 256 tile)."""
    from impl.moe.triton_mxfp4 import dequantize_mxfp4_bf16
    from impl.quant.mxfp4 import dequantize_mxfp4, quantize_mxfp4
    g = torch.Generator().manual_seed(shape[-1])
    q = quantize_mxfp4(torch.randn(*shape, generator=g) * torch.logspace(-3, 3, shape[-1]))
    got = dequantize_mxfp4_bf16(q.packed.to(DEVICE), q.scales.to(DEVICE)).cpu()
    assert torch.equal(got, dequantize_mxfp4(q.packed, q.scales, torch.bfloat16))
