"""Where this package's Triton kernels run: on the GPU, or on the CPU through Triton's interpreter.

Import `triton`/`tl` from here in every kernel module: without a CUDA device this turns the
interpreter on before any kernel is decorated (Triton reads TRITON_INTERPRET at decoration),
so CI checks on CPU the very kernel source the GPU runs. The interpreter computes bf16
arithmetic wrongly, so kernels take `FP32_MATH` as a constexpr and upcast before any math there.

Import order: when something imported Triton earlier with TRITON_INTERPRET unset (transformers
does), Triton's own `@triton.jit` helpers (`tl.zeros`, `tl.cdiv`, the reductions' combine
functions: 83 of them in Triton 3.9) were built for the compiler, and an interpreted kernel that
calls one fails with "Cannot call @triton.jit'd outside of the scope of a kernel". They are
rebuilt here for the interpreter; where that cannot be done (a Triton whose internals differ),
`TritonImportOrderError` says what to set instead, before any kernel runs.
"""

from __future__ import annotations

import dataclasses
import os
import sys

import torch


class TritonImportOrderError(ImportError):
    """Triton was imported for the compiler before this package turned its interpreter on."""


_PREIMPORTED = "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") is None
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
FP32_MATH = INTERPRET
# Inline PTX in kernels (the interpreter runs an emulation, or nothing for mere hints, instead).
ASM = tl.constexpr(not INTERPRET)

_JIT_OPTIONS = ("version", "do_not_specialize", "do_not_specialize_on_alignment", "debug", "noinline",
                "launch_metadata")


def _how_to_fix(why: str) -> str:
    return (f"{why}. Triton was imported (e.g. by transformers) before impl set TRITON_INTERPRET=1, "
            "which a machine without CUDA needs so that Triton's own @triton.jit helpers are built for its "
            "interpreter. Set TRITON_INTERPRET=1 in the environment before Python starts, or import impl "
            "(or impl.triton_env) before transformers or triton.")


def adopt_preimported_triton() -> int:
    """Rebuild, for the interpreter, the compiler-mode `@triton.jit` functions that Triton's
    language modules defined when Triton was imported without TRITON_INTERPRET; returns how many.
    Raises TritonImportOrderError where Triton's internals are not the ones this relies on."""
    try:
        from triton.runtime.interpreter import InterpretedFunction
        from triton.runtime.jit import JITFunction
    except ImportError as e:
        raise TritonImportOrderError(_how_to_fix(f"this Triton ({triton.__version__}) has no {e.name}")) from None
    rebuilt: dict[int, object] = {}
    for name, module in list(sys.modules.items()):
        if module is None or not (name == "triton.language" or name.startswith("triton.language.")):
            continue
        for attr, obj in list(vars(module).items()):
            if type(obj) is not JITFunction:
                continue
            if id(obj) not in rebuilt:
                try:
                    rebuilt[id(obj)] = InterpretedFunction(obj.fn, **{k: getattr(obj, k) for k in _JIT_OPTIONS})
                except (AttributeError, TypeError) as e:
                    raise TritonImportOrderError(_how_to_fix(
                        f"{name}.{attr} cannot be rebuilt for the interpreter ({e})")) from None
            setattr(module, attr, rebuilt[id(obj)])
    return len(rebuilt)


def _check_interpreter() -> None:
    """One tiny kernel through the helpers that break in the wrong import order."""

    @triton.jit
    def probe_kernel(out_ptr, N: tl.constexpr):
        offs = tl.arange(0, N)
        acc = tl.zeros((N,), dtype=tl.float32) + offs.to(tl.float32)
        tl.store(out_ptr + offs, acc + tl.sum(acc, axis=0) + tl.cdiv(N, 2))

    out = torch.empty(4)
    try:
        probe_kernel[(1,)](out, N=4)
    except Exception as e:  # noqa: BLE001  (any failure here means the interpreter is unusable)
        raise TritonImportOrderError(_how_to_fix(f"Triton's interpreter fails a probe kernel ({e!r})")) from None
    if out.tolist() != [8.0, 9.0, 10.0, 11.0]:
        raise TritonImportOrderError(_how_to_fix(f"Triton's interpreter computes a probe kernel wrongly "
                                                 f"({out.tolist()})"))


if INTERPRET and _PREIMPORTED:
    adopt_preimported_triton()
    _check_interpreter()
if INTERPRET:
    # Integer arithmetic as the compiled kernels do it (two's complement, overflow checked only
    # under `debug`): the interpreter checks every integer operation for overflow by default,
    # about a third of its time in the MXFP4 kernels' byte permutes.
    from triton.runtime.interpreter import interpreter_builder as _builder
    _builder.options = dataclasses.replace(_builder.options, sanitize_overflow=False)


def patch_language_once_a_launch() -> bool:
    """Make the interpreter patch `triton.language` once a launch instead of at every call of a
    device function (`@triton.jit` called from a kernel); returns whether it was installed.

    The interpreter's launch patches the language modules in a kernel's globals (an
    `inspect.getmembers` walk over `tl`, `tl.tensor`, `tl.math`: about 2 ms) and undoes that when
    the launch ends; every device-function call inside the launch repeats that walk, though it
    finds the same modules patched (the MXFP4 register path makes about 14,000 such calls a layer:
    35 of 86 s of a 4-token case). Here a call whose modules the launch already patched skips it;
    one that names other modules patches as before. A Triton without these internals is left as it is."""
    try:
        from triton.runtime import interpreter as ti
        original, scope_type = ti._patch_lang, ti._LangPatchScope
    except (ImportError, AttributeError):
        return False
    if getattr(original, "once_a_launch", False):
        return True
    launch: dict = {"patched": None}  # the language modules patched in the launch now running

    def langs(fn) -> set[int]:
        return {id(v) for v in fn.__globals__.values() if v is tl or v is tl.core}

    def patch_lang(fn):
        patched = launch["patched"]
        if patched is not None and langs(fn) <= patched:
            return scope_type()  # nothing patched, nothing to undo
        scope = original(fn)
        if patched is not None:  # a device function naming other modules: patched from now on
            patched |= langs(fn)
            return scope
        launch["patched"] = langs(fn)
        restore = scope.restore

        def end_launch():
            launch["patched"] = None
            restore()

        scope.restore = end_launch
        return scope

    patch_lang.once_a_launch = True
    ti._patch_lang = patch_lang
    return True


if INTERPRET:
    patch_language_once_a_launch()


__all__ = ["ASM", "FP32_MATH", "INTERPRET", "TritonImportOrderError", "adopt_preimported_triton",
           "patch_language_once_a_launch", "tl", "triton"]
