"""scripts/gpu/bench_gemv.py on CPU: the projection shapes it times are the Ling-3.0-flash
modules' own (hand-counted), and each projection it times computes x @ w.T of the x its producer
made just before it (Triton's interpreter; relative error 1e-2, the bench's own acceptance: bf16
output rounding is 4e-3)."""

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


def test_each_timed_projection_reads_what_its_producer_made():
    """The chain the bench captures, run eagerly: every projection's output is x @ w.T for the x
    its producer wrote just before it, with the launches the sweep times (Triton's interpreter)."""
    from impl.model.gemv import gemv
    g = torch.Generator().manual_seed(0)
    n, k = 48, 512
    ws = [(torch.randn(n, k, generator=g) * 0.02).to(torch.bfloat16) for _ in range(3)]
    outs = [torch.full((1, n), float("nan"), dtype=torch.bfloat16) for _ in ws]
    made = []
    xs = [torch.zeros(1, k, dtype=torch.bfloat16)]

    def producer():
        xs[0] = torch.randn(1, k, generator=g).to(torch.bfloat16)
        made.append(xs[0])

    launch = bg.launches()[0]
    for call in bg.chain(producer, lambda x, w, o: gemv(x, w, launch, out=o), xs, ws, outs):
        call()
    assert len(made) == len(ws)
    for x, w, out in zip(made, ws, outs):
        ref = x.float() @ w.float().t()
        assert float((out.float() - ref).norm() / ref.norm()) <= bg.MAX_REL
    assert len(bg.launches()) == len(bg.BLOCK_N) * len(bg.BLOCK_K) * len(bg.WARPS)
    assert all(lc.pdl for lc in bg.launches())
    from impl.model.gemv import launch_for
    assert bg.launches(2560, 4096) == [launch_for(2560, 4096)]
