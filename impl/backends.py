"""Named implementations ("backends") of the parts under test, and provenance of what ran.

Every implementation of a part (MoE layer, LM head, decoder) registers under a kind and a
name. Users add their own through the `moeperf.backends` entry-point group, loaded lazily on
the first lookup: each entry point names a `Backend` (or a callable returning one). Each call
of a backend records a `ProvenanceEvent`, so suites assert which kernels actually ran rather
than which flags were set.
"""

from __future__ import annotations

import contextlib
import contextvars
import importlib
import warnings
from dataclasses import dataclass, field
from importlib.metadata import entry_points
from typing import Any, Callable, Iterator

import torch

ENTRY_POINT_GROUP = "moeperf.backends"
# Modules whose import registers the built-in backends; imported on the first lookup.
BUILTIN_MODULES = ("impl.moe", "impl.head", "impl.generate", "impl.speculative.decoder", "impl.model.layer_backends",
                   "impl.model.gemv")
KINDS = ("moe", "head", "decoder", "attention", "projection")
WEIGHT_FORMATS = ("bf16", "fp32", "mxfp4")


def weight_format(w) -> str:
    """A routed weight's format as WEIGHT_FORMATS names it: "mxfp4" for an MXFP4Tensor, else its
    dtype ("bf16", "fp32"; another dtype by its torch name)."""
    from impl.quant.mxfp4 import MXFP4Tensor
    if isinstance(w, MXFP4Tensor):
        return "mxfp4"
    return {torch.bfloat16: "bf16", torch.float32: "fp32"}.get(w.dtype, str(w.dtype).replace("torch.", ""))


class Unsupported(ValueError):
    """A backend's refusal of well-formed input it does not cover (a shape outside a peer
    library's tiles, say): the suites skip such a case and say why; malformed input stays a
    plain ValueError or TypeError, which fails them."""


@dataclass(frozen=True)
class Backend:
    kind: str
    name: str
    fn: Callable[..., Any]
    description: str = ""
    devices: tuple[str, ...] = ("cpu", "cuda")
    # For kind "moe": the routed experts' weight formats it takes (WEIGHT_FORMATS); others are a
    # TypeError from fn, and the suites skip them with that reason.
    formats: tuple[str, ...] = ("bf16", "fp32", "mxfp4")
    # For kind "moe": optionally the whole layer, routing included (fused routing kernels):
    # layer(x, router, w_gate_up, w_down, shared) -> out. Without it, the model routes with
    # its own router and calls fn.
    layer: Callable[..., Any] | None = None
    # Optionally frees what the backend keeps on the device beside the model's own weights (a
    # peer's converted copy of the experts); its next call builds it again.
    release: Callable[[], None] | None = None
    # For kind "moe": whether it clips SwiGLU (Ling 3.0's late layers): fn and layer take a
    # keyword `swiglu_limit` (a float, given only to layers that clip) for the routed experts and
    # honour `SharedExpert.limit`. A model that clips refuses a backend without it, naming both.
    clips_swiglu: bool = False

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"backend {self.name!r} has unknown kind {self.kind!r}; expected one of {KINDS}")
        unknown = set(self.formats) - set(WEIGHT_FORMATS)
        if unknown or not self.formats:
            raise ValueError(f"backend {self.name!r} has unknown or no weight formats {sorted(unknown)}; "
                             f"expected some of {WEIGHT_FORMATS}")


_registry: dict[tuple[str, str], Backend] = {}
_entry_points_loaded = False
# Entry points that failed to load, "name = value" -> why: one broken installed package must not
# take the others' backends down, and asking for a backend it would have given says why it is missing.
_entry_point_failures: dict[str, str] = {}


def register(backend: Backend, *, replace: bool = False) -> Backend:
    key = (backend.kind, backend.name)
    if key in _registry and not replace and _registry[key] is not backend:
        raise ValueError(f"a {backend.kind} backend named {backend.name!r} is already registered")
    _registry[key] = backend
    return backend


def _load_entry_points() -> None:
    global _entry_points_loaded
    if _entry_points_loaded:
        return
    _entry_points_loaded = True
    for module in BUILTIN_MODULES:
        importlib.import_module(module)
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        try:
            obj = ep.load()
            backend = obj if isinstance(obj, Backend) else obj()
            if not isinstance(backend, Backend):
                raise TypeError(f"it gave {type(backend).__name__}, expected impl.backends.Backend")
            register(backend)
            if ep.name != backend.name:  # asked for by the entry point's name, it would be unknown
                warnings.warn(f"entry point {ep.name} = {ep.value} in {ENTRY_POINT_GROUP!r} registers the {backend.kind} "
                              f"backend {backend.name!r}: name it so (--moe-backend {backend.name}), or give the entry "
                              "point the backend's name", UserWarning, stacklevel=2)
        except Exception as e:  # the user's code: any error, kept with the entry point's name
            why = f"{type(e).__name__}: {e}"
            _entry_point_failures[f"{ep.name} = {ep.value}"] = why
            # Said at once too: a backend shadowed by a built-in of the same name would otherwise
            # pass every suite as the built-in, unnoticed.
            warnings.warn(f"entry point {ep.name} = {ep.value} in {ENTRY_POINT_GROUP!r} was not loaded ({why}); "
                          "its backend is unavailable", UserWarning, stacklevel=2)


def get(kind: str, name: str) -> Backend:
    if kind not in KINDS:
        raise ValueError(f"unknown backend kind {kind!r}; expected one of {KINDS}")
    _load_entry_points()
    try:
        return _registry[(kind, name)]
    except KeyError:
        raise ValueError(f"unknown {kind} backend {name!r}; available: {available(kind)}{load_failures()}") from None


def load_failures() -> str:
    """The entry points that failed to load, as a suffix for an unknown-backend message ("" if none)."""
    _load_entry_points()
    return "".join(f"; entry point {ep} in {ENTRY_POINT_GROUP!r} failed to load: {why}"
                   for ep, why in _entry_point_failures.items())


def available(kind: str) -> list[str]:
    _load_entry_points()
    return sorted(name for k, name in _registry if k == kind)


@dataclass(frozen=True)
class ProvenanceEvent:
    kind: str
    backend: str
    kernel: str
    config: dict = field(default_factory=dict)


class Provenance:
    """The events recorded while it was active, in call order."""

    def __init__(self) -> None:
        self.events: list[ProvenanceEvent] = []

    def kernels(self, kind: str | None = None) -> set[str]:
        return {e.kernel for e in self.events if kind is None or e.kind == kind}

    def backends(self, kind: str | None = None) -> set[str]:
        return {e.backend for e in self.events if kind is None or e.kind == kind}


_active: contextvars.ContextVar[Provenance | None] = contextvars.ContextVar("moeperf_provenance", default=None)


@contextlib.contextmanager
def record_provenance() -> Iterator[Provenance]:
    prov = Provenance()
    token = _active.set(prov)
    try:
        yield prov
    finally:
        _active.reset(token)


def note(kind: str, backend: str, kernel: str, **config: Any) -> None:
    """Called by a backend each time it runs; free when nothing is recording. Code being traced
    by torch.compile records nothing (Dynamo cannot trace a ContextVar; the compiled graph, like a
    replayed CUDA graph, runs no Python)."""
    if torch.compiler.is_compiling():
        return
    prov = _active.get()
    if prov is not None:
        prov.events.append(ProvenanceEvent(kind, backend, kernel, config))
