"""The one-launch MoE layer (impl/moe/triton_layer.py) against the oracles: the router's own
top-k (impl.routing, through `Router.forward`) and `moe_reference` on the same weights.

On CPU the kernel runs under the interpreter as its three phase launches, with a few programs of
unequal shares (3, and 7: more programs than some phases have units); on a GPU as one launch of
one program an SM with its grid-wide barriers, at the Ling shapes too.

Tolerances, norm-wise relative error per token row against the oracle in fp32:
- plain experts, `RTOL_PLAIN = 1e-5` on CPU: everything in fp32 there (fp32 activations, bf16
  weights widened exactly), only the summation order differs (K <= 256 terms; seen: 3e-7 to
  4e-7);
- MXFP4 experts, `RTOL_DP4A = 2e-3` on CPU: the dp4a decode splits x and the activations into two
  int8 terms a block of 32 (impl/moe/triton_dp4a.py), |error| <= 2**-13 of the block's largest
  magnitude per element (seen: 5e-5 to 1e-4 of a row's norm through both products); 2e-3 is
  20x that and still 25x under a dropped expert of the tiny shapes;
- on a GPU, `RTOL_GPU = 1e-2`: the output is bf16 (u = 2**-9 a rounding), as the parity suite's
  RTOL_BF16 argues, plus the split's 1e-4.
The routing must choose the oracle's experts exactly and its weights to 1e-6 (both fp32 from the
same logits: the top-k's inputs are bit-equal but for the summation order of the logits).
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from impl import backends
from impl.model.config import get_config
from impl.model.layers import Router
from impl.moe.configs import MoELaunchConfig
from impl.moe.random_layer import random_moe_block, shared_of
from impl.moe.reference import moe_reference
from impl.moe.shared import SharedExpert
from impl.moe.triton_layer import MAX_TOKENS, moe_layer, moe_layer_routed, moe_triton_layer
from impl.triton_env import INTERPRET

RTOL_PLAIN = 1e-5
RTOL_DP4A = 2e-3
RTOL_GPU = 1e-2
DEVICE = torch.device("cpu" if INTERPRET else "cuda")
ACT_DTYPE = torch.float32 if INTERPRET else torch.bfloat16

# Small tiles so that the tiny shapes have several units a phase, K steps a unit and programs
# with unequal shares.
TINY_LAUNCH = MoELaunchConfig(one_launch=True, gemv_max_tokens=4, gemv_decode="dp4a", gate_up_block_n=32,
                              gate_up_block_k=64, down_block_n=16, down_block_k=64, shared_block_k=64,
                              gate_up_prefetch=2, down_prefetch=1, shared_prefetch=1, l2_prefetch=2)


def tiny_config(**changes):
    """The tiny preset's MoE (8 experts, top-2, H = I = 128), with changes (e.g. its router)."""
    return dataclasses.replace(get_config("tiny"), **changes)


def oracle(block, x):
    """(out fp32, weights, ids) of the oracles: the block's router, then moe_reference."""
    with torch.no_grad():
        weights, ids = block.gate(x)
        sh = shared_of(block)
        shared = None if sh is None else SharedExpert(sh.gate.float(), sh.up.float(), sh.down.float())
        return moe_reference(x.float(), weights, ids, *block.experts.weights(), shared), weights, ids


def row_errors(out, ref):
    out, ref = out.double(), ref.double()
    return (out - ref).norm(dim=-1) / ref.norm(dim=-1)


def check_against_oracle(block, x, launch, tol):
    with backends.record_provenance() as prov:
        out, weights, ids = moe_layer_routed(x, block.gate, *block.experts.weights(), shared_of(block), launch)
    assert "moe_layer_kernel" in prov.kernels("moe"), f"the one launch did not run: {prov.kernels('moe')}"
    ref, w_ref, ids_ref = oracle(block, x)
    order, order_ref = ids.long().argsort(-1), ids_ref.argsort(-1)
    assert torch.equal(ids.long().gather(-1, order), ids_ref.gather(-1, order_ref)), (ids, ids_ref)
    torch.testing.assert_close(weights.gather(-1, order), w_ref.gather(-1, order_ref), rtol=1e-6, atol=1e-7)
    rel = row_errors(out, ref)
    assert out.dtype == x.dtype and (rel <= tol).all(), f"relative error per row {rel.tolist()} > {tol}"
    return out


def tolerance(fmt: str) -> float:
    if DEVICE.type == "cuda":
        return RTOL_GPU
    return RTOL_DP4A if fmt == "mxfp4" else RTOL_PLAIN


def fresh_x(config, tokens, seed):
    """Fresh N(0, 1) activations: fp32 on CPU (as the parity suite: no output rounding there),
    bf16 on a GPU."""
    g = torch.Generator(DEVICE).manual_seed(seed)
    return torch.randn(tokens, config.hidden_size, generator=g, device=DEVICE).to(ACT_DTYPE)


# MXFP4 (the dp4a decode under the interpreter is the slow part of these tests) at a decode step
# and at a verify step padded to 4 rows; plain weights at every row count.
@pytest.mark.parametrize("fmt, tokens", [("bf16", 1), ("bf16", 2), ("bf16", 3), ("bf16", 4), ("mxfp4", 1),
                                         ("mxfp4", 3)])
def test_one_launch_matches_the_oracles(fmt, tokens):
    config = tiny_config()
    block = random_moe_block(config, fmt, DEVICE, "triton", seed=tokens)
    check_against_oracle(block, fresh_x(config, tokens, 10 + tokens), TINY_LAUNCH, tolerance(fmt))


@pytest.mark.parametrize("ahead, programs", [(0, 7), (1, 1), (2, 7), ("stages", 1)])
def test_one_launch_any_prefetch_and_programs(ahead, programs):
    """Every way the streams keep loads in flight (0-2 steps ahead in registers, Triton's
    software pipeline), one program (every unit its own) and more programs than some phases
    have units (empty shares), without a shared expert."""
    config = tiny_config(num_shared_experts=0)
    block = random_moe_block(config, "mxfp4", DEVICE, "triton", seed=programs)
    depth = 0 if ahead == "stages" else ahead
    launch = dataclasses.replace(TINY_LAUNCH, gate_up_prefetch=depth, down_prefetch=depth, shared_prefetch=depth,
                                 gemv_stages=3 if ahead == "stages" else 0, layer_programs=programs, l2_prefetch=depth)
    check_against_oracle(block, fresh_x(config, 2, 100 + depth), launch, tolerance("mxfp4"))


@pytest.mark.parametrize("router", ["softmax", "grouped"])
def test_one_launch_routers(router):
    """A softmax router (renormalized top-k) and sigmoid routing in groups (16 experts, 4 groups,
    the best 2 kept), at one and at four tokens (plain experts: the routing is under test)."""
    changes = (dict(router="softmax") if router == "softmax" else
               dict(num_experts=16, n_group=4, topk_group=2, top_k=3, routed_scaling_factor=2.5))
    config = tiny_config(**changes)
    block = random_moe_block(config, "bf16", DEVICE, "triton", seed=3)
    for tokens in (1, 4):
        check_against_oracle(block, fresh_x(config, tokens, 7 + tokens), TINY_LAUNCH, tolerance("bf16"))


def test_one_launch_nan_stays_in_its_row():
    """A NaN in one token's input reaches that token's output row and no other."""
    config = tiny_config()
    block = random_moe_block(config, "mxfp4", DEVICE, "triton", seed=5)
    x = fresh_x(config, 2, 11)
    x[1, 17] = float("nan")
    out = moe_layer(x, block.gate, *block.experts.weights(), shared_of(block), TINY_LAUNCH)
    finite = torch.isfinite(out).all(dim=-1)
    assert finite.tolist() == [True, False]


@pytest.mark.parametrize("case", ["uneven", "empty shares"])
def test_one_launch_uneven_shapes_and_empty_shares(case):
    """H and I not multiples of the tiles (masked K steps and column blocks: H = 160, I = 96,
    64-column gate_up blocks, 5 programs), and more programs than every phase has units (70
    programs at H = I = 64: most programs' shares are empty, in every phase)."""
    if case == "uneven":
        config = tiny_config(hidden_size=160, moe_intermediate_size=96)
        launch = dataclasses.replace(TINY_LAUNCH, gate_up_block_n=64, layer_programs=5)
        fmts, counts = ("bf16", "mxfp4"), (1, 3)
    else:
        config = tiny_config(hidden_size=64, moe_intermediate_size=64)
        launch, fmts, counts = dataclasses.replace(TINY_LAUNCH, layer_programs=70), ("bf16",), (1, 3)
    for fmt in fmts:
        block = random_moe_block(config, fmt, DEVICE, "triton", seed=4)
        for tokens in counts:
            check_against_oracle(block, fresh_x(config, tokens, 20 + tokens), launch, tolerance(fmt))


def test_one_launch_reads_a_strided_router():
    """A router weight that is a view with a longer row stride routes as the oracle does."""
    config = tiny_config()
    block = random_moe_block(config, "bf16", DEVICE, "triton", seed=2)
    with torch.no_grad():
        wide = torch.randn(config.num_experts, config.hidden_size + 32, device=DEVICE)
        wide[:, :config.hidden_size] = block.gate.weight
        block.gate.weight = torch.nn.Parameter(wide[:, :config.hidden_size], requires_grad=False)
    assert not block.gate.weight.is_contiguous()
    check_against_oracle(block, fresh_x(config, 2, 3), TINY_LAUNCH, tolerance("bf16"))


@pytest.mark.gpu
def test_one_launch_repeats_bit_for_bit():
    """Deterministic with its grid-wide barriers: the same inputs give the same bits (no atomics
    in the sums), and the barrier counters come back to zero after each call (on CPU the phases
    are separate launches that use no counters, so this is a GPU test)."""
    if DEVICE.type != "cuda":
        pytest.skip("the barriers run on a GPU")
    config = get_config("ling-3.0-flash")
    block = random_moe_block(config, "mxfp4", DEVICE, "triton", seed=6)
    weights, shared, launch = block.experts.weights(), shared_of(block), ling_launch("mxfp4")
    from impl.moe.triton_layer import _sync
    for tokens in (1, 4):
        x = fresh_x(config, tokens, 12)
        first = moe_layer(x, block.gate, *weights, shared, launch)
        assert all(torch.equal(first, moe_layer(x, block.gate, *weights, shared, launch)) for _ in range(3))
        torch.cuda.synchronize()
        assert not _sync(DEVICE).any()


def test_the_backend_runs_the_one_launch_when_its_config_says_so():
    """`moe_triton_layer` (the `triton` backend's layer) takes the one launch for up to
    MAX_TOKENS tokens of a one_launch config, and the multi-launch path beyond."""
    config = tiny_config()
    block = random_moe_block(config, "bf16", DEVICE, "triton", seed=8)
    weights = block.experts.weights()
    for tokens, kernel in ((MAX_TOKENS, "moe_layer_kernel"), (MAX_TOKENS + 1, "moe_gate_up_kernel")):
        x = fresh_x(config, tokens, tokens)
        with backends.record_provenance() as prov:
            out = moe_triton_layer(x, block.gate, *weights, shared_of(block), TINY_LAUNCH)
        assert any(kernel in k for k in prov.kernels("moe")), (tokens, prov.kernels("moe"))
        ref = oracle(block, x)[0]
        assert (row_errors(out, ref) <= tolerance("bf16")).all()


@pytest.mark.parametrize("case", ["tokens", "router dtype", "decode", "format mix", "shape"])
def test_one_launch_rejects_bad_input(case):
    config = tiny_config()
    block = random_moe_block(config, "mxfp4", DEVICE, "triton", seed=9)
    gu, dn = block.experts.weights()
    x = fresh_x(config, 1, 0)
    router, launch = block.gate, TINY_LAUNCH
    if case == "tokens":
        x, match = fresh_x(config, MAX_TOKENS + 1, 0), "at most|1 to 4 tokens"
    elif case == "router dtype":
        router = Router(config).to(DEVICE).to(torch.bfloat16)
        match = "router weight must be fp32"
    elif case == "decode":
        launch, match = dataclasses.replace(TINY_LAUNCH, gemv_decode="word32"), "dp4a"
    elif case == "format mix":
        dn, match = torch.zeros(dn.shape, dtype=torch.bfloat16, device=DEVICE), "both be MXFP4"
    else:
        x, match = torch.zeros(1, config.hidden_size + 32, dtype=ACT_DTYPE, device=DEVICE), "hidden size"
    with pytest.raises((ValueError, TypeError), match=match):
        moe_layer(x, router, gu, dn, shared_of(block), launch)


@pytest.mark.parametrize("field, value", [("layer_programs", 64), ("l2_prefetch", 1), ("layer_launches", 3),
                                          ("l2_prefetch", 3), ("layer_launches", 2), ("layer_programs", -1)])
def test_launch_config_rejects_one_launch_knobs_alone_or_out_of_range(field, value):
    """The one launch's knobs are an error without one_launch (not silently ignored), and out of
    their range with it."""
    with pytest.raises(ValueError, match=field):
        MoELaunchConfig(**{field: value})
    if (field, value) in (("l2_prefetch", 3), ("layer_launches", 2), ("layer_programs", -1)):
        with pytest.raises(ValueError, match=field):
            MoELaunchConfig(one_launch=True, **{field: value})
    else:
        MoELaunchConfig(one_launch=True, **{field: value})


def test_resident_programs_counts_what_an_sm_holds():
    """The residency guard's arithmetic (H200 SM: 64K registers, 2048 threads, 227 KB shared):
    128 registers at 4 warps fill an SM four times over, one register more three times; shared
    memory and threads cap it too."""
    from impl.moe.triton_layer import resident_programs
    assert resident_programs(128, 4, 4096) == 4
    assert resident_programs(129, 4, 4096) == 3
    assert resident_programs(64, 8, 100 * 1024) == 2
    assert resident_programs(32, 16, 0) == 4


def ling_launch(fmt: str) -> MoELaunchConfig:
    return MoELaunchConfig(one_launch=True, gemv_max_tokens=4, gemv_decode="dp4a" if fmt == "mxfp4" else "bits16",
                           gate_up_block_n=32, gate_up_block_k=512, gate_up_warps=8, down_block_n=32, down_block_k=256,
                           shared_block_k=128, gate_up_prefetch=2, down_prefetch=1, shared_prefetch=1, l2_prefetch=1)


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 2, 4])
@pytest.mark.parametrize("fmt", ["mxfp4", "bf16"])
@pytest.mark.parametrize("shape", ["ling-3.0-flash", "ling-flash-2.0"])
def test_one_launch_ling_shapes(shape, fmt, tokens):
    if DEVICE.type != "cuda":
        pytest.skip("the Ling shapes run on a GPU")
    config = get_config(shape)
    block = random_moe_block(config, fmt, DEVICE, "triton", seed=tokens)
    launch = ling_launch(fmt)
    for seed in range(3):  # fresh inputs; the same bits on a repeat (barriers, counters reset)
        x = fresh_x(config, tokens, 1000 * tokens + seed)
        out = check_against_oracle(block, x, launch, RTOL_GPU)
        assert torch.equal(out, moe_layer(x, block.gate, *block.experts.weights(), shared_of(block), launch))


@pytest.mark.gpu
def test_one_launch_refuses_programs_that_cannot_be_resident():
    """More programs than the GPU can hold at once is a clear error, not a hang."""
    if DEVICE.type != "cuda":
        pytest.skip("residency is a GPU's")
    config = tiny_config()
    block = random_moe_block(config, "mxfp4", DEVICE, "triton", seed=0)
    sms = torch.cuda.get_device_properties(DEVICE).multi_processor_count
    launch = dataclasses.replace(TINY_LAUNCH, layer_programs=33 * sms)  # an SM holds at most 32 programs
    with pytest.raises(ValueError, match="cannot all be resident"):
        moe_layer(fresh_x(config, 1, 0), block.gate, *block.experts.weights(), shared_of(block), launch)


@pytest.mark.gpu
def test_one_launch_under_cuda_graphs():
    """Captured once on a static input buffer, then replayed on fresh inputs copied into it:
    every replay's output (poisoned before it) equals an eager call on that input bit for bit,
    so each replay recomputed everything after both barriers (a stale read would show)."""
    if DEVICE.type != "cuda":
        pytest.skip("CUDA graphs need a GPU")
    from impl.graphs import capture_graph
    config = get_config("ling-3.0-flash")
    block = random_moe_block(config, "mxfp4", DEVICE, "triton", seed=0)
    weights, shared, launch = block.experts.weights(), shared_of(block), ling_launch("mxfp4")
    x_static = fresh_x(config, 1, 0)
    outs = []
    with torch.no_grad():
        graph = capture_graph([lambda: outs.append(moe_layer(x_static, block.gate, *weights, shared, launch))])
        out = outs[-1]  # the capture's own output buffer (capture_graph runs the call 3 times)
        for seed in range(1, 5):
            x = fresh_x(config, 1, seed)
            x_static.copy_(x)
            out.fill_(float("nan"))
            graph.replay()
            torch.cuda.synchronize()
            assert torch.equal(out, moe_layer(x, block.gate, *weights, shared, launch)), seed
