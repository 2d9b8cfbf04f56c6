"""The `attention` backends: which form of a Ling 3.0 layer's attention (KDA, MLA) runs.

* `triton` (the default): a decode token, and a verify pass over a few tokens, through the
  layer's Triton kernels (impl.model.kda_decode; impl.model.mla_absorb and impl.model.mla_decode)
  on a CUDA device with a cache; a prompt pass, and every call on a CPU, through the torch form.
* `torch`: the torch form always (torch ops, SDPA): the kernels' reference and their peer in a
  ladder row (`attention=torch`).

A backend's fn is `fn(module, x, cos, sin, input_pos, mask, **kwargs)`: the module's forward in
that form. Every call notes what ran (kind "attention", the module's backend, the kernels or the
torch path, `TORCH_PATHS`), so a row that names the kernels but ran only the torch form (a shape
the kernels do not take, a CPU) shows it. GQA softmax attention (impl.model.layers.Attention)
has one form and no backend.
"""

from __future__ import annotations

from impl import backends

DEFAULT = "triton"
# The kernels' names noted by the torch form of each layer kind (every other attention event is a kernel).
TORCH_PATHS = ("kda_torch", "mla_absorbed_sdpa", "mla_expanded_sdpa")


def _kernels(module, *args, **kwargs):
    return module.forward_kernels(*args, **kwargs)


def _torch(module, *args, **kwargs):
    return module.forward_torch(*args, **kwargs)


backends.register(backends.Backend(
    "attention", "triton", _kernels, "KDA and MLA decode and verify steps through their Triton kernels on CUDA; "
    "prompt passes and CPU calls through the torch form"))
backends.register(backends.Backend(
    "attention", "torch", _torch, "KDA and MLA through torch ops and SDPA (the kernels' reference)"))


def attention_modules(module) -> list:
    """The submodules of `module` (itself included) that have an attention backend."""
    return [m for m in module.modules() if hasattr(m, "forward_kernels") and hasattr(m, "forward_torch")]


def set_attention_backend(module, name: str) -> None:
    """Run every KDA and MLA layer in `module` (a model, a layer or the attention itself) through
    the attention backend `name`; ValueError naming the known ones when there is no such backend."""
    backend = backends.get("attention", name)
    for m in attention_modules(module):
        m.backend = backend


__all__ = ["DEFAULT", "TORCH_PATHS", "attention_modules", "set_attention_backend"]
