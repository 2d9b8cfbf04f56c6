"""The backends a KDA or MLA layer runs its parts through, switched per model and per ladder row
(`attention=`, `projection=`), each call noting what ran.

* kind "attention", which form of the attention runs:
  `triton` (the default): a decode token, and a verify pass over a few tokens, through the
  layer's Triton kernels (impl.model.kda_decode; impl.model.mla_absorb and impl.model.mla_decode)
  on a CUDA device with a cache; a prompt pass, and every call on a CPU, through the torch form.
  `torch`: the torch form always (torch ops, SDPA): the kernels' reference and their peer.
  A backend's fn is `fn(module, x, cos, sin, input_pos, mask, **kwargs)`, the module's forward
  in that form.
* kind "projection" (registered in impl.model.gemv), how the layer's projections run: `gemv` (the
  default): one row of 16-bit activations on CUDA through the PDL-launched Triton GEMV, anything
  else through F.linear; `cublas`: F.linear always. fn is `fn(x, w, bias)`.

A kernel backend whose kernel does not apply to a call (a prompt pass, a shape it does not take,
a CPU) notes the fallback it ran (`FALLBACKS`), so a row that names the kernels but never ran them
shows it. GQA softmax attention (impl.model.layers.Attention) has one form and no backends.
"""

from __future__ import annotations

from impl import backends

# kind -> (the attribute of a KDA/MLA module that holds its backend, the backend a model is built with)
PARTS = {"attention": ("attention_backend", "triton"), "projection": ("projection_backend", "gemv")}
DEFAULTS = {kind: default for kind, (_, default) in PARTS.items()}
# What each kind's default backend, the kernel one, notes when it runs the plain path instead of its kernel.
FALLBACKS = {"attention": ("kda_torch", "mla_absorbed_sdpa", "mla_expanded_sdpa"), "projection": ("F.linear",)}


def _kernels(module, *args, **kwargs):
    return module.forward_kernels(*args, **kwargs)


def _torch(module, *args, **kwargs):
    return module.forward_torch(*args, **kwargs)


backends.register(backends.Backend(
    "attention", "triton", _kernels, "KDA and MLA decode and verify steps through their Triton kernels on CUDA; "
    "prompt passes and CPU calls through the torch form"))
backends.register(backends.Backend(
    "attention", "torch", _torch, "KDA and MLA through torch ops and SDPA (the kernels' reference)"))


def init_layer_backends(module) -> None:
    """Give a KDA or MLA module every part's default backend (what a model is built with)."""
    for kind, (attr, default) in PARTS.items():
        setattr(module, attr, backends.get(kind, default))


def layer_modules(module) -> list:
    """The submodules of `module` (itself included) with layer backends: KDA and MLA attention."""
    return [m for m in module.modules() if all(hasattr(m, attr) for attr, _ in PARTS.values())]


def _attr(kind: str) -> str:
    if kind not in PARTS:
        raise ValueError(f"unknown layer backend kind {kind!r}; expected one of {list(PARTS)}")
    return PARTS[kind][0]


def set_layer_backend(module, kind: str, name: str) -> None:
    """Run part `kind` of every KDA and MLA layer in `module` (a model, a layer or the attention
    itself) through backend `name`; ValueError naming the known ones when there is no such backend."""
    attr, backend = _attr(kind), backends.get(kind, name)
    for m in layer_modules(module):
        setattr(m, attr, backend)


def layer_backend(module, kind: str) -> str:
    """The backend(s) part `kind` of `module`'s KDA and MLA layers runs through; "none" without such layers."""
    attr = _attr(kind)
    names = sorted({getattr(m, attr).name for m in layer_modules(module)})
    return ",".join(names) if names else "none"


__all__ = ["DEFAULTS", "FALLBACKS", "PARTS", "init_layer_backends", "layer_backend", "layer_modules",
           "set_layer_backend"]
