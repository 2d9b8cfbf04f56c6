"""MoE layer implementations, registered as `moe` backends.

A `moe` backend is fn(x [T, H], weights fp32 [T, k], ids [T, k], w_gate_up, w_down, shared)
-> [T, H], where the routed weights are [E, 2I, H] / [E, H, I] tensors or MXFP4Tensor and
`shared` is a SharedExpert or None; a backend that clips SwiGLU (`clips_swiglu`, every one
here) also takes `swiglu_limit=` for layers whose routed experts clip.
"""

import importlib.util

import torch

from impl import backends
from impl.moe.gather import moe_gather
from impl.moe.reference import check_moe_inputs, moe_reference, swiglu
from impl.moe.shared import SharedExpert, shared_expert
from impl.quant.mxfp4 import MXFP4Tensor


def _reference(x, weights, ids, w_gate_up, w_down, shared=None, swiglu_limit=None):
    backends.note("moe", "reference", "moe_reference", tokens=x.shape[0])
    return moe_reference(x, weights, ids, w_gate_up, w_down, shared, swiglu_limit)


def _gather(x, weights, ids, w_gate_up, w_down, shared=None, swiglu_limit=None):
    if isinstance(w_gate_up, MXFP4Tensor) or isinstance(w_down, MXFP4Tensor):
        raise TypeError("the gather MoE backend takes plain tensors; use 'triton' or 'reference' for MXFP4 experts")
    backends.note("moe", "gather", "moe_gather", tokens=x.shape[0])
    out = moe_gather(x, weights, ids, w_gate_up, w_down, swiglu_limit)
    return out if shared is None else out + shared_expert(x, shared)


def _triton(x, weights, ids, w_gate_up, w_down, shared=None, swiglu_limit=None):
    from impl.moe.triton_backend import moe_triton
    return moe_triton(x, weights, ids, w_gate_up, w_down, shared, swiglu_limit=swiglu_limit)


def _triton_layer(x, router, w_gate_up, w_down, shared=None, swiglu_limit=None):
    from impl.moe.triton_backend import moe_triton_layer
    from impl.moe.triton_routing import routing_supported
    if not routing_supported(router.config):
        return _triton(x, *router(x), w_gate_up, w_down, shared, swiglu_limit)
    return moe_triton_layer(x, router, w_gate_up, w_down, shared, swiglu_limit=swiglu_limit)


backends.register(backends.Backend(
    "moe", "reference", _reference, "fp32 loop over the chosen experts (the oracle)", clips_swiglu=True))
backends.register(backends.Backend(
    "moe", "gather", _gather, "gather the chosen experts' weights, two einsums; no host syncs; plain weights only",
    formats=("bf16", "fp32"), clips_swiglu=True))


def _humming(x, weights, ids, w_gate_up, w_down, shared=None, swiglu_limit=None):
    from impl.moe.humming import moe_humming
    return moe_humming(x, weights, ids, w_gate_up, w_down, shared, swiglu_limit=swiglu_limit)


def _humming_release():
    from impl.moe.humming import release
    release()


def _humming_layer(x, router, w_gate_up, w_down, shared=None, swiglu_limit=None):
    from impl.moe.humming import moe_humming_layer
    return moe_humming_layer(x, router, w_gate_up, w_down, shared, swiglu_limit=swiglu_limit)


def humming_importable() -> bool:
    """Whether `humming-kernels` is installed, without importing it (it JIT-compiles on use) or
    this package's module around it (Triton kernels)."""
    return importlib.util.find_spec("humming") is not None


def register_humming() -> bool:
    """Register the `humming` backend if `humming-kernels` is installed (not imported until used)."""
    if not humming_importable():
        return False
    backends.register(backends.Backend(
        "moe", "humming", _humming, "Humming's MXFP4 GEMMs (humming-kernels) with Triton routing preparation, "
        "SwiGLU and combine; shared expert on cuBLAS, side stream; CUDA, MXFP4 only",
        devices=("cuda",), formats=("mxfp4",), layer=_humming_layer, release=_humming_release, clips_swiglu=True),
        replace=True)
    return True


backends.register(backends.Backend(
    "moe", "triton", _triton, "fused Triton decode kernels, bf16 or MXFP4 experts, shared expert fused",
    layer=_triton_layer, clips_swiglu=True))
register_humming()

__all__ = ["SharedExpert", "check_moe_inputs", "moe_gather", "moe_reference", "swiglu"]
