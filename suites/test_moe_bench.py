"""The whole MoE layer (routing, experts, shared expert, combine) of the backend under test at
the Ling shapes, timed on the GPU under CUDA graphs and gated against the frozen H200 figures.

Each sample replays a graph of 10 layer calls on 10 different inputs, so the chosen experts
stream from HBM rather than L2; the figure is microseconds per call. Tolerances:
moe_harness.tolerances ("timing" for the layer's time, "ratio" for ours over Humming's).

`test_moe_layer_over_humming` times the backend under test beside the peer, Humming's whole layer
(the `humming` backend, when humming-kernels is installed), on the same weights and inputs,
interleaved sample by sample, and gates the ratio (below 1: faster than Humming side by side).

The inputs come from a generator of their own (`random_inputs`), not the global one: its state
depends on which tests ran before, and at M = 4 the inputs decide how many distinct experts a
call reads (about 31 of 32 slots), so unseeded draws moved the bandwidth-bound bf16 M = 4
figure by 6% with no code change (Ling-flash-2.0 on the H200: 224.2 us against 210.8 frozen;
notes/moe-h200.md). The gate's config records that
count, so a change of routing or inputs shows as another configuration, not as a speed change.
"""

from __future__ import annotations

import pytest
import torch

from impl import backends
from impl.gpu_timing import copy_bandwidth
from impl.graphs import capture_graph
from impl.model.config import get_config
from impl.moe.random_layer import bytes_per_token, distinct_experts, random_inputs, random_moe_block, shared_of
from moe_harness.tolerances import tolerance_for

pytestmark = [pytest.mark.moe_bench, pytest.mark.gpu]

CALLS_PER_GRAPH = 10
REPLAYS_PER_SAMPLE = 20


@pytest.fixture(scope="module")
def copy_bytes_per_s(moe_device) -> float:
    """Device-to-device copy bandwidth (bytes read + written), the floor's denominator."""
    return copy_bandwidth(moe_device.torch_device)


@pytest.fixture(scope="module")
def blocks(moe_device, moe_backend):
    """The random blocks by (shape, format), each built once for the module (M = 1 and 4 and the
    Humming ratio time the same weights; the four take about 16 GB)."""
    made = {}

    def get(shape: str, fmt: str):
        if (shape, fmt) not in made:
            made[shape, fmt] = random_moe_block(get_config(shape), fmt, moe_device.torch_device, moe_backend.name)
        return made[shape, fmt]

    yield get
    made.clear()
    torch.cuda.empty_cache()


@pytest.mark.parametrize("m", [1, 4])
@pytest.mark.parametrize("fmt", ["mxfp4", "bf16"])
@pytest.mark.parametrize("shape", ["ling-3.0-flash", "ling-flash-2.0"])
def test_moe_layer_us(shape, fmt, m, moe_device, moe_backend, blocks, moe_sampler, moe_gate, copy_bytes_per_s):
    if fmt not in moe_backend.formats:
        pytest.skip(f"backend {moe_backend.name!r} takes {', '.join(moe_backend.formats)} experts, not {fmt}")
    cfg = get_config(shape)
    dev = moe_device.torch_device
    block = blocks(shape, fmt)
    xs = random_inputs(cfg, m, CALLS_PER_GRAPH, dev)
    distinct = distinct_experts(block, xs)
    with torch.no_grad():
        graph = capture_graph([lambda x=x: block(x[None]) for x in xs])

    def microseconds():
        return [s * 1e6 / CALLS_PER_GRAPH for s in moe_sampler.sample(graph.replay, inner=REPLAYS_PER_SAMPLE)]

    floor_us = sum(bytes_per_token(cfg, fmt, distinct).values()) / copy_bytes_per_s * 1e6
    result = moe_gate.check(f"moe_layer_us[{shape},{fmt},M={m}]", microseconds(), unit="us", direction="lower",
                            tolerance=tolerance_for("timing", dev),
                            config={"shape": shape, "format": fmt, "tokens": m, "distinct_experts": round(distinct, 2)},
                            remeasure=microseconds)
    print(f"{shape} {fmt} M={m}: {result.current:.1f} us, floor {floor_us:.1f} us "
          f"({floor_us / result.current:.0%} of the bytes floor)")


@pytest.mark.parametrize("m", [1, 4])
@pytest.mark.parametrize("shape", ["ling-3.0-flash", "ling-flash-2.0"])
def test_moe_layer_over_humming(shape, m, moe_device, moe_backend, blocks, moe_sampler, moe_gate):
    """MXFP4 layer time of the backend under test over Humming's whole layer, side by side."""
    if "humming" not in backends.available("moe"):
        pytest.skip("humming-kernels is not installed: no peer to time against")
    if moe_backend.name == "humming" or "mxfp4" not in moe_backend.formats:
        pytest.skip(f"backend {moe_backend.name!r} is the peer itself or takes no MXFP4 experts")
    cfg = get_config(shape)
    dev = moe_device.torch_device
    block = blocks(shape, "mxfp4")
    xs = random_inputs(cfg, m, CALLS_PER_GRAPH, dev)
    peer = backends.get("moe", "humming").layer
    weights, shared = block.experts.weights(), shared_of(block)
    with torch.no_grad():
        graphs = {"ours": capture_graph([lambda x=x: block(x[None]) for x in xs]),
                  "humming": capture_graph([lambda x=x: peer(x, block.gate, *weights, shared) for x in xs])}

    def side_by_side():
        s = moe_sampler.interleaved({k: g.replay for k, g in graphs.items()}, inner=REPLAYS_PER_SAMPLE)
        return s["ours"], s["humming"]

    result = moe_gate.check_ratio(f"moe_layer_over_humming[{shape},mxfp4,M={m}]", side_by_side, direction="lower",
                                  tolerance=tolerance_for("ratio", dev),
                                  config={"shape": shape, "format": "mxfp4", "tokens": m,
                                          "distinct_experts": round(distinct_experts(block, xs), 2)})
    print(f"{shape} mxfp4 M={m}: {moe_backend.name} / humming whole layer = {result.current:.3f}x "
          f"({'faster' if result.current < 1 else 'not faster'} than Humming side by side)")
