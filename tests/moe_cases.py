"""MoE kernel cases against the oracle, shared by tests/test_triton_moe.py and
tests/test_moe_swiglu_clip.py: weights, shared expert and routing built on the CPU from seeds, moved
to the device under test, and `moe_triton` run beside the fp32 oracle.

Tolerances (norm-wise relative error per token row, tests.helpers.assert_rows_close): on a CPU the
kernels run in Triton's interpreter with fp32 math, so the oracle on the same (exactly dequantized)
weights agrees to fp32 rounding: 1e-5 (seen: ~3e-7). On a GPU the activations go through bf16: 1e-2
(suites/test_moe_parity.py has the derivation of both)."""

from __future__ import annotations

import math

import torch

from impl.moe.reference import moe_reference
from impl.moe.shared import SharedExpert
from impl.moe.triton_backend import moe_triton
from impl.quant.mxfp4 import MXFP4Tensor, quantize_mxfp4

DEVICE = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
RTOL = 1e-2 if DEVICE.type == "cuda" else 1e-5


def on_device(obj):
    """Tensors (plain, MXFP4, shared expert) built on the CPU moved to DEVICE; meta ones stay."""
    if isinstance(obj, torch.Tensor):
        return obj.to(DEVICE) if obj.device.type == "cpu" else obj
    if isinstance(obj, MXFP4Tensor):
        return MXFP4Tensor(on_device(obj.packed), on_device(obj.scales))
    if isinstance(obj, SharedExpert):
        return SharedExpert(on_device(obj.gate), on_device(obj.up), on_device(obj.down), obj.limit)
    return obj


def run_both(x, weights, ids, w_gate_up, w_down, shared=None, **kwargs):
    """(moe_triton's output, the oracle's in fp32) on DEVICE."""
    args = [on_device(a) for a in (x, weights, ids, w_gate_up, w_down, shared)]
    out = moe_triton(*args, **kwargs)
    return out, moe_reference(args[0].float(), *args[1:], swiglu_limit=kwargs.get("swiglu_limit"))


def make_weights(experts, hidden, inter, fmt="fp32", seed=0):
    """Routed weights [E, 2I, H] and [E, H, I] with a factor 2**U(-2, 2) per block of 32 along K
    (so that MXFP4 blocks of a row get different scales)."""
    g = torch.Generator().manual_seed(seed)

    def weight(shape):
        w = torch.randn(shape, generator=g) / math.sqrt(shape[-1])
        blocks = torch.exp2(torch.rand(*shape[:-1], shape[-1] // 32, 1, generator=g) * 4 - 2)
        return w * blocks.expand(*shape[:-1], shape[-1] // 32, 32).reshape(shape)

    gu, dn = weight((experts, 2 * inter, hidden)), weight((experts, hidden, inter))
    if fmt == "mxfp4":
        return quantize_mxfp4(gu), quantize_mxfp4(dn)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[fmt]
    return gu.to(dtype), dn.to(dtype)


def make_shared(hidden, inter, dtype=torch.float32, seed=1):
    g = torch.Generator().manual_seed(seed)
    return SharedExpert((torch.randn(inter, hidden, generator=g) / math.sqrt(hidden)).to(dtype),
                        (torch.randn(inter, hidden, generator=g) / math.sqrt(hidden)).to(dtype),
                        (torch.randn(hidden, inter, generator=g) / math.sqrt(inter)).to(dtype))


def random_routing(tokens, top_k, experts, seed=2):
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(experts, generator=g)[:top_k] for _ in range(tokens)])
    return torch.rand(tokens, top_k, generator=g) + 0.1, ids



# The dp4a products split x and the intermediate activations into two int8 terms, each value to
# within 2**-13 of its block of 32's largest magnitude (impl/moe/triton_dp4a.py): in norm at most
# 2**-13 * sqrt(32) = 6.9e-4 of a row per split, two splits (seen: 1.5e-4). On a GPU the bf16
# roundings of the other variants dominate (RTOL).
DP4A_RTOL = max(RTOL, 2e-3)
