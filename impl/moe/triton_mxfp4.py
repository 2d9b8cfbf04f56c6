"""MXFP4 codes to numbers in Triton, by assembling the bits (integer work only, no table and no
layout shuffles): E2M1 element codes to bf16, E8M0 scale codes to bf16 or fp32. Every value is
exact. The int8 form of E2M1 that the dp4a products use is in impl/moe/triton_dp4a.py.
"""

from __future__ import annotations

from impl.triton_env import tl, triton


@triton.jit
def e2m1_to_bf16(nib):
    """uint8 E2M1 codes -> bf16, exactly (0, 0.5, 1, 1.5, 2, 3, 4, 6 and negatives), by assembling
    the bits: integer work only, no table and no layout shuffles."""
    code = nib.to(tl.int16)
    exp = (code >> 1) & 3
    man = code & 1
    bits = tl.where(exp == 0, man * (126 << 7), ((exp + 126) << 7) | (man << 6))
    return (bits | ((code & 8) << 12)).to(tl.bfloat16, bitcast=True)


@triton.jit
def e8m0_to_bf16(code):
    """uint8 E8M0 codes -> bf16 2**(code - 127), exactly; 0 is the subnormal 2**-127, 255 is NaN."""
    c = code.to(tl.int16)
    bits = tl.where(c == 0, 0x40, tl.where(c == 255, 0x7FC0, c << 7))
    return bits.to(tl.bfloat16, bitcast=True)


@triton.jit
def e8m0_to_fp32(code):
    """uint8 E8M0 codes -> fp32 2**(code - 127) by the bits; 0 is the fp32 subnormal 2**-127, 255 NaN."""
    c = code.to(tl.int32)
    bits = tl.where(c == 0, 0x00400000, tl.where(c == 255, 0x7FC00000, c << 23))
    return bits.to(tl.float32, bitcast=True)



@triton.jit
def mxfp4_dequant_kernel(packed_ptr, scales_ptr, out_ptr, ROWS, BYTES, SCALES,
                         BLOCK_ROWS: tl.constexpr, BLOCK_BYTES: tl.constexpr):
    """MXFP4 rows [ROWS, 2 * BYTES] -> bf16: byte i of a row holds elements 2i (low nibble) and
    2i + 1 (high), scaled by the row's E8M0 code for its 32 elements (byte // 16). The two halves
    are interleaved in registers and stored as one contiguous tile: stored apart, each at a
    2-element stride, they ran at about 0.27 TB/s on the H200 (22.8 ms of a 30.5 ms MoE layer of a
    1024-token prompt, every expert of the layer dequantized)."""
    offs_r = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    offs_b = tl.program_id(1) * BLOCK_BYTES + tl.arange(0, BLOCK_BYTES)
    offs_e = tl.program_id(1) * (2 * BLOCK_BYTES) + tl.arange(0, 2 * BLOCK_BYTES)
    rows = offs_r[:, None].to(tl.int64)  # past 4 GiB of bf16 out, offsets pass 2**31 (a layer's experts: 6 GB)
    ok = (offs_r[:, None] < ROWS) & (offs_b[None, :] < BYTES)
    p = tl.load(packed_ptr + rows * BYTES + offs_b[None, :], mask=ok, other=0)
    s = e8m0_to_fp32(tl.load(scales_ptr + rows * SCALES + offs_b[None, :] // 16, mask=ok, other=127))
    lo = (e2m1_to_bf16(p & 0xF).to(tl.float32) * s).to(tl.bfloat16)
    hi = (e2m1_to_bf16(p >> 4).to(tl.float32) * s).to(tl.bfloat16)
    tl.store(out_ptr + rows * (2 * BYTES) + offs_e[None, :], tl.interleave(lo, hi),
             mask=(offs_r[:, None] < ROWS) & (offs_e[None, :] < 2 * BYTES))


# Tile of the dequantization: 16 rows x 256 bytes (512 elements, 16 scale groups) a program.
DEQUANT_BLOCK_ROWS, DEQUANT_BLOCK_BYTES = 16, 256


def dequantize_mxfp4_bf16(packed, scales):
    """packed uint8 [..., K/2] + E8M0 scales uint8 [..., K/32] -> bf16 [..., K] in one launch
    (torch's dequantize_mxfp4 takes a dozen passes over int64 and fp32 temporaries)."""
    import torch
    rows, nbytes = packed.numel() // packed.shape[-1], packed.shape[-1]
    packed, scales = packed.contiguous(), scales.contiguous()
    out = torch.empty(*packed.shape[:-1], 2 * nbytes, dtype=torch.bfloat16, device=packed.device)
    grid = (triton.cdiv(rows, DEQUANT_BLOCK_ROWS), triton.cdiv(nbytes, DEQUANT_BLOCK_BYTES))
    mxfp4_dequant_kernel[grid](packed, scales, out, rows, nbytes, scales.shape[-1],
                               BLOCK_ROWS=DEQUANT_BLOCK_ROWS, BLOCK_BYTES=DEQUANT_BLOCK_BYTES)
    return out
