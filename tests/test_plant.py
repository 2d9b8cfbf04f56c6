"""Planted slowdowns (impl.plant): the known regressions a gate-trust run must catch."""

from __future__ import annotations

import re
import statistics
import time

import pytest
import torch

from impl import backends, plant

CALL_S = 0.02  # a backend call that takes this long on the host


@pytest.fixture(autouse=True)
def no_plants_left():
    yield
    plant.deactivate()


def _slow_head(x, weight, out_dtype):
    time.sleep(CALL_S)
    return x


def _register_slow_head():
    backends.register(backends.Backend("head", "test-sleep", _slow_head, "sleeps CALL_S"), replace=True)


def _elapsed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def test_a_planted_backend_takes_fraction_longer_and_says_so_in_provenance():
    _register_slow_head()
    plant.activate(plant.parse_plants("head:test-sleep=0.5", {}))
    planted = backends.get("head", "test-sleep")
    assert planted is backends.get("head", "test-sleep")  # one planted object per backend
    x = torch.ones(2)
    with backends.record_provenance() as prov:
        times = [_elapsed(lambda: planted.fn(x, None, x.dtype)) for _ in range(3)]
    assert min(times) >= 1.5 * CALL_S  # a busy wait of half the call's own time, after it
    assert prov.kernels("head") == {"planted_slowdown"}
    assert [e.config["fraction"] for e in prov.events] == [0.5] * 3
    plant.deactivate()
    assert backends.get("head", "test-sleep").fn is _slow_head


def test_only_the_named_backend_is_planted():
    _register_slow_head()
    plant.activate(plant.parse_plants("head:bf16=1.0", {}))
    assert backends.get("head", "test-sleep").fn is _slow_head
    assert backends.get("head", "bf16").fn.__wrapped__ is not None
    assert backends.get("moe", "gather").layer is None and "planted" not in backends.get("moe", "gather").fn.__name__


def test_a_planted_decoder_slows_the_runners_step_and_is_lifted_after():
    """The decoder kinds are planted in the registry like the others: a runner built while
    `decoder:plain` is planted calls the slowed step (its device found through the state object
    the step is given), one built after `deactivate` the original; `decoder:mtp` stays untouched."""
    from impl.decode_runner import PlainRunner
    from impl.generate import next_token
    from impl.model import build_model
    from impl.speculative import SpeculativeDecoder
    model = build_model("tiny", seed=0)
    plant.activate(plant.parse_plants("decoder:plain=1.0", {}))
    runner = PlainRunner(model)
    assert runner.decode.__wrapped__ is next_token
    assert backends.get("decoder", "mtp").fn is SpeculativeDecoder.step
    with torch.inference_mode(), backends.record_provenance() as prov:
        runner.begin(torch.zeros(4, dtype=torch.long), 2)
        runner.held_step(4)()
    assert ("decoder", "plain", "planted_slowdown") in {(e.kind, e.backend, e.kernel) for e in prov.events}
    plant.deactivate()
    assert PlainRunner(model).decode is next_token


def test_the_device_of_a_planted_call_is_found_in_its_state_object():
    from impl.generate import DecodeState
    state = DecodeState(torch.zeros(1, 2, dtype=torch.long, device="meta"), torch.zeros(1, dtype=torch.long))
    assert plant._device_of((object(), state, None), {}).type == "meta"
    assert plant._device_of((object(),), {}).type == "cpu"


def test_the_moe_plant_defaults_to_the_backend_under_test():
    (p,) = plant.parse_plants("moe=0.1", {"moe": "gather"})
    assert (p.kind, p.name, p.fraction) == ("moe", "gather", 0.1)
    assert str(p) == "moe:gather+10%"


@pytest.mark.parametrize("spec, message", [
    ("moe=0.1,moe:gather=0.2", "moe:gather is planted twice"),
    ("moe=0", "must be in (0, 10]"),
    ("moe=abc", "is not KIND[:NAME]=FRACTION"),
    ("head=0.1", "needs a backend name"),
])
def test_bad_plant_specs_are_named(spec, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        plant.parse_plants(spec, {"moe": "gather"})


def test_a_planted_moe_block_computes_the_same_and_records_the_plant():
    """Through the model's MoE block: the planted backend's output is bit-identical to the plain
    one's (a plant slows, it never changes what is computed), and provenance names it."""
    from impl.moe.random_layer import random_moe_block
    from impl.model.config import get_config
    cfg = get_config("tiny")
    block = random_moe_block(cfg, "bf16", torch.device("cpu"), "gather", dtype=torch.float32)
    x = torch.randn(1, 3, cfg.hidden_size, generator=torch.Generator().manual_seed(0))
    plain = block(x)
    plant.activate(plant.parse_plants("moe=1.0", {"moe": "gather"}))
    block.backend = backends.get("moe", "gather")  # what a model built after activation looks up
    with backends.record_provenance() as prov:
        planted = block(x)
    assert torch.equal(planted, plain)
    assert {(e.backend, e.kernel) for e in prov.events} == {("gather", "planted_slowdown"), ("gather", "moe_gather")}


@pytest.mark.gpu
@pytest.mark.parametrize("n", [2048, 8192])  # a ~3 us and a ~40 us call
def test_a_planted_call_captured_in_a_cuda_graph_takes_fraction_longer(moe_device, n):
    """Stamp + spin around a call, replayed from a graph: the replay slows by about the fraction
    of the call's own time (within 2 us plus 10% of it), and an empty pair's cost was calibrated."""
    from impl.graphs import capture_graph
    dev = moe_device.torch_device
    a = torch.randn(n, n, device=dev, dtype=torch.bfloat16)
    x = torch.randn(n, 16, device=dev, dtype=torch.bfloat16)
    backends.register(backends.Backend("head", "test-mm", lambda x, w, dt: w @ x, "a matmul"), replace=True)
    plain = backends.get("head", "test-mm")
    plant.activate(plant.parse_plants("head:test-mm=0.5", {}), dev)
    overhead = plant.overhead_ns(dev)
    assert overhead is not None and 0 < overhead < 20_000
    planted = backends.get("head", "test-mm")
    graphs = {name: capture_graph([lambda b=b: b.fn(x, a, None) for _ in range(10)])
              for name, b in (("plain", plain), ("planted", planted))}

    def replay_us(g):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(20):
            g.replay()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) * 1e3 / 200

    times = {name: statistics.median(replay_us(g) for _ in range(9)) for name, g in graphs.items()}
    print(f"n={n}: plain {times['plain']:.2f} us, planted {times['planted']:.2f} us "
          f"(x{times['planted'] / times['plain']:.3f}), empty pair {overhead / 1e3:.2f} us")
    assert times["planted"] == pytest.approx(1.5 * times["plain"], abs=2 + 0.1 * times["plain"]), times
