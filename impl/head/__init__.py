"""The LM head: bf16 baseline and FP8 e4m3 (quantized online, scales owned by the module), as
`head` backends with provenance. The Triton kernel (impl.head.fp8_gemv) is imported on first use,
so importing this package never needs Triton."""

from impl.head.fp8_head import (
    ACTIVATION_DTYPES,
    FP8_DTYPES,
    HEAD_BACKEND_ALIASES,
    BF16Head,
    FP8Head,
    LogitParity,
    as_bf16_weight,
    compare_logits,
    default_fp8_backend,
    require_head_backend,
    resolve_fp8_backend,
)

__all__ = [
    "ACTIVATION_DTYPES",
    "BF16Head",
    "FP8Head",
    "FP8_DTYPES",
    "HEAD_BACKEND_ALIASES",
    "LogitParity",
    "as_bf16_weight",
    "compare_logits",
    "default_fp8_backend",
    "require_head_backend",
    "resolve_fp8_backend",
]
