"""The one-launch expert kernel (impl.moe.triton_fused, `MoELaunchConfig.fused_down`): against the
oracle and against the two-kernel path on the same inputs, its fallbacks, and on a GPU at the
issue-3 shapes, its determinism from call to call and under CUDA graphs (the arrival counter
must be back to zero after every call, or the next call would sum partials too early).

Tolerances as tests/test_triton_moe.py: the oracle within RTOL (fp32 math under the interpreter,
bf16 activations on a GPU) or the dp4a decode's (its int8 split of the activations); the two
kernel paths compute the same products and differ only in the order partial sums are added (here
per block of intermediate columns, there per slot): 1e-5 of the row norm under the interpreter
(fp32 rounding of sums of a few hundred terms), 1e-2 on a GPU (bf16 activations rounded at
different points: the fused kernel's down input is the gate_up block straight from registers).
"""

from __future__ import annotations

import pytest
import torch

from impl import backends
from impl.moe.configs import MoELaunchConfig
from impl.moe.triton_fused import fused_launch
from impl.moe.triton_moe import DP4A
from test_triton_moe import (DEVICE, RTOL, assert_rows_close, make_shared, make_weights, on_device, random_routing,
                             run_both, variant_rtol)

TWO_PATHS_RTOL = 1e-2 if DEVICE.type == "cuda" else 1e-5


def _cfg(decode: str, fused: bool, **fields) -> MoELaunchConfig:
    base = dict(gate_up_block_n=32, gate_up_block_k=32, down_block_n=32, gemv_max_tokens=4, gemv_decode=decode,
                shared_block_k=32)
    return MoELaunchConfig(**{**base, **fields, "fused_down": fused})


def _kernels(prov) -> list[str]:
    return [e.kernel for e in prov.events if "product" in e.config]


@pytest.mark.parametrize("fmt,decode,tokens,split", [
    ("mxfp4", "dp4a", 1, 2), ("mxfp4", "dp4a", 3, 1), ("mxfp4", "dp4a", 4, 4), ("mxfp4", "word32", 2, 1),
    ("bf16", "bits16", 1, 2), ("bf16", "bits16", 4, 1), ("fp32", "bits16", 2, 2),
])
def test_fused_matches_the_oracle_and_the_two_kernels(fmt, decode, tokens, split):
    """Routed and shared experts in one launch: H = 96 (three down steps of 32 rows, combined by
    two blocks of 64 columns, the second partly outside H), I = 64 (two blocks a slot)."""
    hidden, inter, i_shared = 96, 64, 64
    w_gate_up, w_down = make_weights(8, hidden, inter, fmt, seed=41)
    weights, ids = random_routing(tokens, 3, 8, seed=42 + tokens)
    x = torch.randn(tokens, hidden, generator=torch.Generator().manual_seed(43))
    shared = make_shared(hidden, i_shared)
    with backends.record_provenance() as prov:
        out, ref = run_both(x, weights, ids, w_gate_up, w_down, shared, config=_cfg(decode, True, shared_split=split))
    two, _ = run_both(x, weights, ids, w_gate_up, w_down, shared, config=_cfg(decode, False, shared_split=split))
    assert _kernels(prov) == [("split_int8_kernel+" if decode == "dp4a" else "") + "moe_fused_kernel"]
    assert_rows_close(out, ref, variant_rtol(decode) if fmt == "mxfp4" else RTOL)
    assert_rows_close(out, two.float(), TWO_PATHS_RTOL)


def test_fused_without_shared_expert_and_with_unused_slots():
    """Two tokens choosing the same three experts: six slots, three of them unused (their programs
    write zero partials); no shared expert."""
    w_gate_up, w_down = make_weights(8, 64, 32, "mxfp4", seed=51)
    ids = torch.tensor([[5, 1, 7], [7, 5, 1]])
    weights = torch.rand(2, 3, generator=torch.Generator().manual_seed(52)) + 0.1
    x = torch.randn(2, 64, generator=torch.Generator().manual_seed(53))
    out, ref = run_both(x, weights, ids, w_gate_up, w_down, None, config=_cfg("dp4a", True))
    assert_rows_close(out, ref, variant_rtol("dp4a"))


def test_nan_in_a_token_reaches_exactly_its_row():
    """A NaN in token 1's input makes its output row NaN and leaves token 0's finite: the
    partials of experts token 1 did not choose add exact zeros, not 0 * NaN."""
    w_gate_up, w_down = make_weights(4, 64, 32, "mxfp4", seed=61)
    weights, ids = torch.tensor([[1.0], [1.0]]), torch.tensor([[0], [2]])
    x = torch.randn(2, 64, generator=torch.Generator().manual_seed(62))
    x[1, 5] = float("nan")
    out, _ = run_both(x, weights, ids, w_gate_up, w_down, None, config=_cfg("dp4a", True))
    assert torch.isfinite(out[0]).all() and torch.isnan(out[1]).all()


@pytest.mark.parametrize("fields,tokens,why", [
    (dict(), 8, "more tokens than gemv_max_tokens: tensor cores"),
    (dict(gate_up_block_n=64), 1, "I = 96 is not a multiple of the 64-column block"),
])
def test_fused_falls_back_to_two_kernels(fields, tokens, why):
    w_gate_up, w_down = make_weights(4, 64, 96, "bf16", seed=71)
    weights, ids = random_routing(tokens, 2, 4, seed=72)
    x = torch.randn(tokens, 64, generator=torch.Generator().manual_seed(73))
    with backends.record_provenance() as prov:
        out, ref = run_both(x, weights, ids, w_gate_up, w_down, None, config=_cfg("bits16", True, **fields))
    assert _kernels(prov) == ["moe_gate_up_kernel+moe_down_kernel"], why
    assert [e.config["fused_down"] for e in prov.events if "product" in e.config] == [False]
    assert_rows_close(out, ref)


def test_fused_launch_tasks_and_combiners():
    """Task counts as the docstring of impl.moe.triton_fused has them; at most half the SMs
    combine (what keeps the combiners' wait from deadlocking), at most one per 64 columns."""
    cfg = _cfg("dp4a", True, gate_up_block_n=32, shared_split=2, down_block_n=256)
    launch = fused_launch(cfg, tokens=1, num_slots=8, hidden=2560, inter=768, i_shared=768, gemv_rows=1,
                          word32=DP4A.value, mxfp4=True, pdl=False, sms=132)
    assert (launch.shared_tasks, launch.routed_tasks, launch.kernel.grid) == (48, 192, (240, 1))
    assert launch.combiners == 40 and launch.kernel.consts["H_STEPS"] == 10
    assert fused_launch(cfg, tokens=1, num_slots=8, hidden=8192, inter=768, i_shared=0, gemv_rows=1,
                        word32=DP4A.value, mxfp4=True, pdl=False, sms=132).combiners == 66
    # A small down tile over a large H is widened to at most 16 unrolled steps.
    wide = fused_launch(_cfg("dp4a", True, down_block_n=32), tokens=1, num_slots=8, hidden=4096, inter=1024,
                        i_shared=0, gemv_rows=1, word32=DP4A.value, mxfp4=True, pdl=False, sms=132)
    assert wide.kernel.consts["BLOCK_H"] == 256 and wide.kernel.consts["H_STEPS"] == 16
    assert fused_launch(_cfg("dp4a", False), tokens=1, num_slots=8, hidden=2560, inter=768, i_shared=0,
                        gemv_rows=1, word32=DP4A.value, mxfp4=True, pdl=False, sms=132) is None


def test_fused_down_with_topk_in_experts_is_rejected():
    with pytest.raises(ValueError, match="fused_down takes its slots from the router's top-k kernel"):
        _cfg("dp4a", True, topk_in_experts=True)


@pytest.mark.skipif(DEVICE.type != "cuda", reason="the issue-3 shapes take minutes under the interpreter; "
                    "the tests above run the same kernel source on CPU")
@pytest.mark.parametrize("shape", [(512, 2560, 768, 768), (256, 4096, 1024, 1024)],
                         ids=["ling-3.0-flash", "ling-flash-2.0"])
@pytest.mark.parametrize("tokens", [1, 4])
def test_fused_at_model_shapes_is_deterministic_and_graph_safe(shape, tokens):
    """At the issue-3 shapes on the GPU, with PDL and the L2 prefetch: the oracle's result, the
    same bits on every call (the combine's fixed order, the counters reset) and under CUDA graph
    replays with new inputs."""
    experts, hidden, inter, i_shared = shape
    cfg = _cfg("dp4a", True, gate_up_block_k=256, down_block_n=256, shared_split=4, shared_block_k=128, pdl=True,
               pdl_prefetch=True)
    w_gate_up, w_down = (on_device(w) for w in make_weights(experts, hidden, inter, "mxfp4", seed=81))
    shared = on_device(make_shared(hidden, i_shared, torch.bfloat16))
    weights, ids = (on_device(t) for t in random_routing(tokens, 8, experts, seed=82))
    x = torch.randn(tokens, hidden, generator=torch.Generator().manual_seed(83)).to(DEVICE, torch.bfloat16)
    out, ref = run_both(x, weights, ids, w_gate_up, w_down, shared, config=cfg)
    assert_rows_close(out.float(), ref, variant_rtol("dp4a"))
    from impl.moe.triton_moe import moe_triton
    again = [moe_triton(x, weights, ids, w_gate_up, w_down, shared, config=cfg) for _ in range(3)]
    assert all(torch.equal(a, out) for a in again)
    static_x = x.clone()
    graph = torch.cuda.CUDAGraph()
    moe_triton(static_x, weights, ids, w_gate_up, w_down, shared, config=cfg)  # compiled before capture
    with torch.cuda.graph(graph):
        static_out = moe_triton(static_x, weights, ids, w_gate_up, w_down, shared, config=cfg)
    for seed in range(3):
        static_x.copy_(torch.randn(tokens, hidden, generator=torch.Generator().manual_seed(seed)).to(DEVICE))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(static_out, moe_triton(static_x, weights, ids, w_gate_up, w_down, shared, config=cfg))
