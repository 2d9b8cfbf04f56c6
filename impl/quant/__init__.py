"""Weight quantization formats: OCP MXFP4 and FP8 e4m3 with per-row / per-tensor scales."""

from impl.quant.fp8 import E4M3_MAX, GRANULARITIES, FP8Tensor, dequantize_fp8, quantize_fp8
from impl.quant.mxfp4 import (
    BLOCK_SIZE,
    E2M1_VALUES,
    E8M0_NAN,
    MXFP4Tensor,
    decode_e2m1,
    decode_e8m0,
    dequantize_mxfp4,
    encode_e2m1,
    pack_nibbles,
    quantize_mxfp4,
    unpack_nibbles,
)

__all__ = [
    "BLOCK_SIZE",
    "E2M1_VALUES",
    "E4M3_MAX",
    "E8M0_NAN",
    "GRANULARITIES",
    "FP8Tensor",
    "MXFP4Tensor",
    "decode_e2m1",
    "decode_e8m0",
    "dequantize_fp8",
    "dequantize_mxfp4",
    "encode_e2m1",
    "pack_nibbles",
    "quantize_fp8",
    "quantize_mxfp4",
    "unpack_nibbles",
]
