"""Decode throughput and per-layer MoE time of the model under test, gated against frozen figures.

Two ratios put the MoE layer beside a yardstick timed interleaved with it: a dense MLP of the
same useful width (what routing and gathering cost on top of the math: the GPU's gate) and the
same layer in plain PyTorch (the CPU's gate: both sides run the same kinds of op, so a host's
speed moves them alike, where the dense MLP's GEMVs and the layer's ~20 small ops move apart by
9-15% between machines of one fingerprint; notes/gate-trust.md). On a CPU both are timed at one
thread in rounds of CALLS_PER_ROUND_CPU calls (the tiny layers' 128-wide ops gain nothing from a
second thread but its scheduling noise; 40 ms rounds let the host's speed change between the two
sides). Tolerances: moe_harness.tolerances ("timing" for tokens/s and the layer's time,
"moe_over_dense", "moe_over_plain_torch"), each number with its reason.
On a GPU every timed call is a CUDA graph replay, as a decode loop runs there; eager calls would
time the host's launches (an eager decode step of the tiny model took 3.4 ms on the H200).
"""

from __future__ import annotations

import contextlib

import pytest
import torch

from impl.decode_runner import PlainRunner
from impl.graphs import StepGraph
from impl.model.layers import MLP, MoEBlock
from impl.moe.gather import moe_gather
from impl.moe.shared import SharedExpert, shared_expert
from impl.quant.mxfp4 import MXFP4Tensor
from moe_harness.tolerances import tolerance_for

pytestmark = pytest.mark.moe_bench

CONTEXT = 64  # tokens in the cache when the decode step is timed
STEPS_PER_SAMPLE = 32
CALLS_PER_SAMPLE = 200
CALLS_PER_ROUND_CPU = 20  # MoE over dense on a CPU: short rounds, ROUNDS_FACTOR_CPU times as many
ROUNDS_FACTOR_CPU = 5


def _tolerance(figure: str, model) -> float:
    return tolerance_for(figure, model.embed_tokens.weight.device)


def _config(model) -> dict:
    return {"threads": torch.get_num_threads(), "context": CONTEXT}


@pytest.fixture(scope="module")
def decode_step(moe_model):
    """One batch-1 decode step at a fixed position of a filled static cache (its cost is the same
    at every position: attention reads the whole masked cache)."""
    g = torch.Generator().manual_seed(0)
    runner = PlainRunner(moe_model)
    with torch.inference_mode():
        runner.begin(torch.randint(0, moe_model.config.vocab_size, (CONTEXT,), generator=g), 1)
    # Replayed from a CUDA graph on a GPU, as a decode loop runs there (a plain call on CPU): the
    # same position is rewritten every time, so replays can repeat without limit.
    return _graphed(runner.held_step(CONTEXT), moe_model)


@pytest.fixture(scope="module")
def moe_layer(moe_model):
    """The first MoE block of the model and one random token's hidden state."""
    block = next(layer.mlp for layer in moe_model.layers if isinstance(layer.mlp, MoEBlock))
    w = moe_model.embed_tokens.weight
    x = torch.randn(1, 1, moe_model.config.hidden_size, generator=torch.Generator().manual_seed(1)).to(w)
    return block, x


def _graphed(fn, model) -> StepGraph:
    return StepGraph(fn, model.embed_tokens.weight.device)


def test_decode_tokens_per_s(moe_model, decode_step, moe_sampler, moe_gate):
    def tokens_per_s():
        return [1 / s for s in moe_sampler.sample(decode_step, inner=STEPS_PER_SAMPLE)]

    moe_gate.check("decode_tokens_per_s", tokens_per_s(), unit="tok/s", direction="higher",
                   tolerance=_tolerance("timing", moe_model), config=_config(moe_model), remeasure=tokens_per_s)


def test_model_moe_layer_us(moe_model, moe_layer, moe_sampler, moe_gate):
    block, x = moe_layer

    layer = _graphed(lambda: block(x), moe_model)

    def microseconds():
        return [s * 1e6 for s in moe_sampler.sample(layer, inner=CALLS_PER_SAMPLE)]

    moe_gate.check("moe_layer_us", microseconds(), unit="us", direction="lower",
                   tolerance=_tolerance("timing", moe_model), config=_config(moe_model), remeasure=microseconds)


def test_moe_layer_over_dense_equivalent(moe_model, moe_layer, moe_sampler, moe_gate):
    """MoE layer time over a dense SwiGLU MLP doing the same useful work for one token (width
    top_k * I + shared): what routing, gathering and combining cost on top of the math."""
    block, x = moe_layer
    c = moe_model.config
    dense = MLP(c.hidden_size, c.top_k * c.moe_intermediate_size + c.shared_intermediate_size).to(x)
    _gate_beside(moe_model, moe_sampler, moe_gate, block, x, lambda: dense(x),
                 "moe_over_dense_equivalent", "moe_over_dense")


def test_moe_layer_over_plain_torch(moe_model, moe_layer, moe_sampler, moe_gate):
    """MoE layer time over the same layer in plain PyTorch, called directly (never through the
    backend registry, so a planted or user backend does not reach it): its router, the gather
    formulation (impl.moe.gather) over its experts (MXFP4 ones dequantized once, beforehand) and its
    shared expert. With the CPU's default `gather` backend it is the block's own overhead on the
    same formulation (about 1.1x); with a kernel backend, that kernel's speed against plain PyTorch."""
    block, x = moe_layer
    w_gate_up, w_down = (w.dequantize(x.dtype) if isinstance(w, MXFP4Tensor) else w for w in block.experts.weights())
    s = block.shared_experts
    shared = None if s is None else SharedExpert(s.gate_proj.weight, s.up_proj.weight, s.down_proj.weight, s.limit)
    flat = x.reshape(-1, x.shape[-1])

    def plain_torch():
        weights, ids = block.gate(flat)
        out = moe_gather(flat, weights, ids, w_gate_up, w_down, block.swiglu_limit)
        return out if shared is None else out + shared_expert(flat, shared)

    # A yardstick computing another layer would time something else. 5e-2: a bf16 kernel against
    # bf16 einsums, each output rounded to bf16 (fp32 on a CPU agrees to ~1e-7); a wrong expert or
    # weight is off by O(1).
    with torch.inference_mode():
        want, got = block(x).reshape(flat.shape).float(), plain_torch().float()
    err = float((got - want).norm() / want.norm())
    assert err <= 5e-2, f"the plain-PyTorch yardstick does not compute the MoE layer: relative error {err:.2e}"
    _gate_beside(moe_model, moe_sampler, moe_gate, block, x, plain_torch, "moe_over_plain_torch", "moe_over_plain_torch")


def _gate_beside(model, sampler, gate, block, x, yardstick, metric: str, figure: str) -> None:
    """Gate the MoE block's time over `yardstick`'s, the two timed interleaved (on a CPU at one
    thread in short rounds)."""
    fns = {"moe": _graphed(lambda: block(x), model), "yardstick": _graphed(yardstick, model)}
    on_gpu = model.embed_tokens.weight.is_cuda
    inner = CALLS_PER_SAMPLE if on_gpu else CALLS_PER_ROUND_CPU
    rounds = sampler.rounds * (1 if on_gpu else ROUNDS_FACTOR_CPU)

    def side_by_side():
        with _threads(torch.get_num_threads() if on_gpu else 1):
            s = sampler.interleaved(fns, inner=inner, rounds=rounds)
        return s["moe"], s["yardstick"]

    config = _config(model) if on_gpu else {**_config(model), "threads": 1, "calls_per_round": inner}
    gate.check_ratio(metric, side_by_side, direction="lower", tolerance=_tolerance(figure, model), config=config)


@contextlib.contextmanager
def _threads(n: int):
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)
