"""Where this package's Triton kernels run: on the GPU, or on the CPU through Triton's interpreter.

Import `triton`/`tl` from here in every kernel module: without a CUDA device this turns the
interpreter on before any kernel is decorated (Triton reads TRITON_INTERPRET at decoration),
so CI checks on CPU the very kernel source the GPU runs. The interpreter computes bf16
arithmetic wrongly, so kernels take `FP32_MATH` as a constexpr and upcast before any math there.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
FP32_MATH = INTERPRET

__all__ = ["FP32_MATH", "INTERPRET", "tl", "triton"]
