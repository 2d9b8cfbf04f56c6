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
* kind "norms", how the residual adds and RMS norms around the layer run (the one before it and
  the one after it, which feeds the MLP): `separate` (the default): each in its own launch
  (impl.model.add_rms_norm); `fused`: for a decode token on the kernels' path (attention `triton`,
  projection `gemv`, the input projections fused), the first inside the input projection's GEMV
  (impl.model.norm_gemv) and the second inside o_proj's (impl.model.gemv_norm), two launches
  fewer a layer; anything else as `separate`. `fused-input` folds the first only (o_proj's
  counting might cost more than the launch it saves, so the two are measured apart). fn is
  `fn(module, delta, residual, norm, post_norm, cos, sin, input_pos, mask)` -> (post_norm(the
  stream after the layer), that stream), where the stream before it is residual + delta.

A kernel backend whose kernel does not apply to a call (a prompt pass, a shape it does not take,
a CPU) notes the fallback it ran (`FALLBACKS`), so a row that names the kernels but never ran them
shows it. GQA softmax attention (impl.model.layers.Attention) has one form and no backends.
"""

from __future__ import annotations

from impl import backends

# kind -> (the attribute of a KDA/MLA module that holds its backend, the backend a model is built with)
PARTS = {"attention": ("attention_backend", "triton"), "projection": ("projection_backend", "gemv"),
         "norms": ("norms_backend", "separate")}
DEFAULTS = {kind: default for kind, (_, default) in PARTS.items()}
# kind -> {a kernel backend: what it notes when it runs the plain path instead of its kernel}.
FALLBACKS = {"attention": {"triton": ("kda_torch", "mla_absorbed_sdpa", "mla_expanded_sdpa")},
             "projection": {"gemv": ("F.linear",)},
             "norms": {"fused": ("add_rms_norm",), "fused-input": ("add_rms_norm",)}}


def _kernels(module, *args, **kwargs):
    return module.forward_kernels(*args, **kwargs)


def _torch(module, *args, **kwargs):
    return module.forward_torch(*args, **kwargs)


backends.register(backends.Backend(
    "attention", "triton", _kernels, "KDA and MLA decode and verify steps through their Triton kernels on CUDA; "
    "prompt passes and CPU calls through the torch form"))
backends.register(backends.Backend(
    "attention", "torch", _torch, "KDA and MLA through torch ops and SDPA (the kernels' reference)"))


def _separate_norms(module, delta, residual, norm, post_norm, cos, sin, input_pos, mask,
                    backend: str = "separate"):
    from impl.model.add_rms_norm import add_rms_norm
    backends.note("norms", backend, "add_rms_norm")
    h, residual = add_rms_norm(delta, residual, norm)
    return add_rms_norm(module(h, cos, sin, input_pos, mask), residual, post_norm)


def _fused_norms(module, delta, residual, norm, post_norm, cos, sin, input_pos, mask, backend: str = "fused"):
    """The module's `fused_norm_weight` says whether this call takes the kernels, and with what
    input weight; its `attend_projected` runs the layer up to o_proj."""
    w = module.fused_norm_weight(delta, cos, sin, input_pos, mask)
    if w is None:
        return _separate_norms(module, delta, residual, norm, post_norm, cos, sin, input_pos, mask, backend=backend)
    from impl.model.add_rms_norm import add_rms_norm
    from impl.model.gemv import linear
    from impl.model.gemv_norm import gemv_norm, gemv_norm_applies
    from impl.model.norm_gemv import norm_gemv
    proj, residual = norm_gemv(delta, residual, norm.weight, norm.eps, w)
    o, o_proj = module.attend_projected(proj, cos, sin, input_pos), module.o_proj
    if backend == "fused" and gemv_norm_applies(o, o_proj.weight, o_proj.bias):
        backends.note("norms", backend, "norm_gemv_kernel+gemv_norm_kernel", n=w.shape[0], k=w.shape[1])
        return gemv_norm(o, o_proj.weight, residual, post_norm.weight, post_norm.eps, module.o_proj_done)
    backends.note("norms", backend, "norm_gemv_kernel", n=w.shape[0], k=w.shape[1])  # or o_proj with a bias
    return add_rms_norm(linear(o, o_proj.weight, o_proj.bias, module.projection_backend), residual, post_norm)


def _fused_input_norm(*args):
    return _fused_norms(*args, backend="fused-input")


backends.register(backends.Backend(
    "norms", "separate", _separate_norms, "the residual adds and RMS norms around the layer, each in its own launch"))
backends.register(backends.Backend(
    "norms", "fused", _fused_norms, "a decode token's residual adds and RMS norms inside the input projection's and "
    "o_proj's GEMVs on the kernels' path (impl.model.norm_gemv, impl.model.gemv_norm); anything else as separate"))
backends.register(backends.Backend(
    "norms", "fused-input", _fused_input_norm, "as fused for the add and norm before the layer only; the one after "
    "it in its own launch"))


def kernels_path(module) -> bool:
    """Whether a KDA or MLA module runs its attention and projections through the default kernel
    backends (`triton`, `gemv`): the path the `fused` norms fold into."""
    return (module.attention_backend.name == DEFAULTS["attention"]
            and module.projection_backend.name == DEFAULTS["projection"])


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


__all__ = ["DEFAULTS", "FALLBACKS", "PARTS", "init_layer_backends", "kernels_path", "layer_backend", "layer_modules",
           "set_layer_backend"]
