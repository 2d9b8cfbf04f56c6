"""How impl.triton_env runs Triton's interpreter on a machine without CUDA: the language is
patched once a launch (`patch_language_once_a_launch`), not at every device-function call, and
the launch leaves `triton.language` as it found it."""

from __future__ import annotations

import pytest
import torch

from impl.triton_env import INTERPRET, tl, triton

pytestmark = pytest.mark.skipif(not INTERPRET, reason="Triton's interpreter only (no CUDA device)")


@triton.jit
def _twice(x):
    return x * 2


@triton.jit
def flat_kernel(out_ptr, N: tl.constexpr):
    offs = tl.arange(0, N)
    tl.store(out_ptr + offs, offs.to(tl.float32) * 32)


@triton.jit
def nested_kernel(out_ptr, N: tl.constexpr):
    offs = tl.arange(0, N)
    x = offs.to(tl.float32)
    for _ in tl.static_range(5):
        x = _twice(x)
    tl.store(out_ptr + offs, x)


def _walks(monkeypatch, kernel) -> tuple[int, list[float]]:
    """How many module walks one launch of `kernel` makes, and what it computes."""
    from triton.runtime import interpreter as ti
    walks = []
    real = ti._patch_builtin
    monkeypatch.setattr(ti, "_patch_builtin", lambda *a: (walks.append(a[0]), real(*a))[1])
    out = torch.empty(4)
    kernel[(1,)](out, N=4)
    monkeypatch.undo()
    return len(walks), out.tolist()


def test_a_launch_patches_the_language_once_however_many_device_functions_it_calls(monkeypatch):
    """Five device-function calls walk the language modules as often as none (before: once more
    for each call), and compute the same."""
    flat, flat_out = _walks(monkeypatch, flat_kernel)
    nested, nested_out = _walks(monkeypatch, nested_kernel)
    assert flat > 0 and nested == flat, (flat, nested)
    assert nested_out == flat_out == [0.0, 32.0, 64.0, 96.0]


def test_the_language_is_restored_after_a_launch_even_one_that_fails():
    where = tl.where

    @triton.jit
    def failing_kernel(out_ptr, N: tl.constexpr):
        offs = tl.arange(0, N)
        tl.store(out_ptr + offs, _twice(offs.to(tl.float32)) + tl.arange(0, 2 * N))  # shapes 4 and 8

    with pytest.raises(Exception):
        failing_kernel[(1,)](torch.empty(4), N=4)
    out = torch.empty(4)
    nested_kernel[(1,)](out, N=4)
    assert tl.where is where and out.tolist() == [0.0, 32.0, 64.0, 96.0]
