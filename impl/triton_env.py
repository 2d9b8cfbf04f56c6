"""Where this package's Triton kernels run: on the GPU, or on the CPU through Triton's interpreter.

Import `triton`/`tl` from here in every kernel module: without a CUDA device this turns the
interpreter on before any kernel is decorated (Triton reads TRITON_INTERPRET at decoration),
so CI checks on CPU the very kernel source the GPU runs. The interpreter computes bf16
arithmetic wrongly, so kernels take `FP32_MATH` as a constexpr and upcast before any math there.
"""

from __future__ import annotations

import functools
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
FP32_MATH = INTERPRET
# Inline PTX in kernels (the interpreter runs an emulation, or nothing for mere hints, instead).
ASM = tl.constexpr(not INTERPRET)


@functools.lru_cache(maxsize=None)
def _cuda_name(index: int) -> str:
    return torch.cuda.get_device_name(index)


def device_name(device: torch.device) -> str:
    """The name tuned launch configs are keyed by: the CUDA device's, or "cpu" (cached: kernels
    look their configs up on every call)."""
    if device.type != "cuda":
        return "cpu"
    return _cuda_name(device.index if device.index is not None else torch.cuda.current_device())


__all__ = ["ASM", "FP32_MATH", "INTERPRET", "device_name", "tl", "triton"]
