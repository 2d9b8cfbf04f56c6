"""scripts/gpu/bench_gemv.py on CPU: the projection shapes it times are the Ling-3.0-flash
modules' own (hand-counted), and the kernel call it times, the FP8 head's GEMV kernel on its
16-bit path with a bf16 weight and a unit scale, computes x @ w.T (Triton's interpreter, fp32
math; relative error 1e-2, the bench's own acceptance: bf16 output rounding is 4e-3)."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts" / "gpu"))

import bench_gemv as bg  # noqa: E402

H, HEADS, D = 2560, 32, 128


def test_the_projection_shapes_are_the_models():
    shapes = bg.projections()
    assert shapes["kda in_proj (q|k|v|f|g|b)"] == (5 * HEADS * D + HEADS, H)
    assert shapes["kda o_proj"] == (H, HEADS * D)
    # MLA: q (32 heads x (128 nope + 64 rope)), kv_a (512 latent + 64 rope), g (one gate a head).
    assert shapes["mla in_proj (q|kv_a|g)"] == (HEADS * 192 + 576 + HEADS, H)
    assert shapes["mla o_proj"] == (H, HEADS * D)


def test_the_timed_kernel_call_is_the_product():
    g = torch.Generator().manual_seed(0)
    n, k = 48, 512
    w = (torch.randn(n, k, generator=g) * 0.02).to(torch.bfloat16)
    x = torch.randn(1, k, generator=g).to(torch.bfloat16)
    out = torch.full((1, n), float("nan"), dtype=torch.bfloat16)
    cfg = bg.GemvConfig(16, 256, 4, 1, path="dot")
    bg.kernel_call(x, w, out, torch.ones(()), cfg)()
    ref = x.float() @ w.float().t()
    assert float((out.float() - ref).norm() / ref.norm()) <= bg.MAX_REL
    assert len(bg.configs()) == 32 and all(c.path == "dot" for c in bg.configs())
