"""A decode step's components, each one that can be left out of the model for a while, and the
bytes of the roofline (impl.model.roofline) each one reads.

Timing the step with a component left out, against the whole step in the same process, gives the
component's share of the measured time (the probe's method: the difference of two captured
graphs). Left out means its modules return their input (attention, MoE, dense MLP: the residual
add still runs, no kernel is launched for the module) or, for the head, a persistent buffer of
logits (the argmax after it still runs). Values go wrong while a component is out; only the
time is meaningful.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch
from torch import nn

from impl.model.kda import KDAAttention
from impl.model.layers import MLP, Attention, MoEBlock
from impl.model.mla import MLAAttention

# component -> the roofline components (impl.model.roofline.token_bytes keys) its modules read.
ROOFLINE_PARTS = {
    "moe": ("routed experts", "shared expert", "router"),
    "kda": ("attention kda", "kda state"),
    "mla": ("attention mla", "mla cache"),
    "mha": ("attention mha", "kv cache"),
    "dense mlp": ("dense mlp",),
    "head": ("head",),
}
COMPONENTS = tuple(ROOFLINE_PARTS)
_ATTENTION = {"kda": KDAAttention, "mla": MLAAttention, "mha": Attention}


def component_modules(model, component: str) -> list[nn.Module]:
    """The modules of the plain decode step (not the MTP layers) that make up `component`."""
    if component not in ROOFLINE_PARTS:
        raise ValueError(f"unknown component {component!r}; expected one of {COMPONENTS}")
    if component == "head":
        return [model.lm_head]
    if component == "moe":
        return [layer.mlp for layer in model.layers if isinstance(layer.mlp, MoEBlock)]
    if component == "dense mlp":
        return [layer.mlp for layer in model.layers if isinstance(layer.mlp, MLP)]
    return [layer.self_attn for layer in model.layers if type(layer.self_attn) is _ATTENTION[component]]


def present(model) -> tuple[str, ...]:
    """The components this model's decode step has."""
    return tuple(c for c in COMPONENTS if component_modules(model, c))


def _identity(x, *args, **kwargs):
    return x


@contextlib.contextmanager
def left_out(model, component: str) -> Iterator[None]:
    """`component`'s modules skipped while inside (module docstring); restored on exit."""
    modules = component_modules(model, component)
    if not modules:
        raise ValueError(f"model {model.config.name!r} has no {component} component (it has {present(model)})")
    if component == "head":
        logits: dict[tuple, torch.Tensor] = {}
        vocab = model.config.vocab_size

        def forward(x, *args, **kwargs):
            shape = (*x.shape[:-1], vocab)
            if shape not in logits:
                logits[shape] = torch.zeros(shape, dtype=x.dtype, device=x.device)
            return logits[shape]
    else:
        forward = _identity
    for m in modules:
        m.forward = forward
    try:
        yield
    finally:
        for m in modules:
            del m.forward


def component_bytes(parts: dict[str, float]) -> dict[str, float]:
    """Roofline bytes (token_bytes' output) summed per component; the rest (norms, the embedding
    row) under "other"."""
    out = {c: sum(parts.get(p, 0.0) for p in names) for c, names in ROOFLINE_PARTS.items()}
    claimed = {p for names in ROOFLINE_PARTS.values() for p in names}
    out["other"] = sum(v for k, v in parts.items() if k not in claimed)
    return {k: v for k, v in out.items() if v}




def component_times(model, step, rounds: int = 7, rep: int = 100) -> dict[str, dict]:
    """On a CUDA device: `step` (a decode step reading and writing persistent buffers) captured
    whole and once with each component left out, replayed interleaved (impl.gpu_timing); per
    component the round-by-round differences whole - without (microseconds), and the whole
    step's replay times under "step"."""
    import statistics

    from impl.gpu_timing import interleaved_replay_us
    from impl.graphs import capture_graph
    if model.embed_tokens.weight.device.type != "cuda":
        raise ValueError("component_times replays CUDA graphs: the model must be on a CUDA device")
    graphs = {"step": capture_graph([step])}
    for c in present(model):
        with left_out(model, c):
            graphs[c] = capture_graph([step])
    samples = interleaved_replay_us(graphs, rounds=rounds, rep=rep)
    whole = samples.pop("step")
    out = {"step": {"us": statistics.median(whole), "samples": whole}}
    for c, times in samples.items():
        diffs = [w - t for w, t in zip(whole, times)]
        out[c] = {"us": statistics.median(diffs), "samples": diffs}
    return out


__all__ = ["COMPONENTS", "ROOFLINE_PARTS", "component_bytes", "component_modules", "component_times", "left_out",
           "present"]
