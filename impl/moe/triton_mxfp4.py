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

