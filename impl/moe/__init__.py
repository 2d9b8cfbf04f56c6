"""MoE layer implementations, registered as `moe` backends."""

from impl import backends
from impl.moe.gather import moe_gather
from impl.moe.reference import check_moe_inputs, moe_reference, swiglu


def _reference(x, weights, ids, w_gate_up, w_down):
    backends.note("moe", "reference", "moe_reference", experts=w_gate_up.shape[0], tokens=x.shape[0])
    return moe_reference(x, weights, ids, w_gate_up, w_down)


def _gather(x, weights, ids, w_gate_up, w_down):
    backends.note("moe", "gather", "moe_gather", experts=w_gate_up.shape[0], tokens=x.shape[0])
    return moe_gather(x, weights, ids, w_gate_up, w_down)


backends.register(backends.Backend(
    "moe", "reference", _reference, "fp32 loop over the chosen experts (the oracle)"))
backends.register(backends.Backend(
    "moe", "gather", _gather, "gather the chosen experts' weights, two einsums; no host syncs"))

__all__ = ["check_moe_inputs", "moe_gather", "moe_reference", "swiglu"]
