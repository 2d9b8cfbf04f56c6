"""GPU timings of the LM head, bf16 against FP8 (the Triton kernel), gated against frozen figures.

Heads: the model under test's own head, and the Ling heads with random weights (157184 x 2560,
Ling-3.0-flash; 157184 x 4096, Ling-flash-2.0). For M = 1 and 4 rows, each head's call is
captured 10 times in one CUDA graph; a sample is 20 replays timed with CUDA events, reported per
call in microseconds and as a fraction of the FP8 byte floor (N * K bytes at the device-to-device
copy bandwidth measured once per module). Correctness comes first: each head's logits are
checked against the bf16 head before it is timed.

Gates (moe_gate): the FP8 time per shape and M (lower is better) and the FP8 / bf16 ratio
measured interleaved in one run (tolerances: moe_harness.tolerances, "timing" and "ratio").
On the H200 the FP8 head's targets (impl.head.targets) are checked as well.
"""

from __future__ import annotations

import statistics

import pytest
import torch

from impl import backends
from impl.gpu_timing import copy_bandwidth
from impl.graphs import capture_graph
from impl.head import BF16Head, FP8Head, compare_logits, require_head_backend
from impl.head.targets import H200_BARS_US, H200_MAX_M4_OVER_M1, H200_MIN_FLOOR_FRACTION, LING_HEADS
from moe_harness.tolerances import tolerance_for

pytestmark = [pytest.mark.moe_bench, pytest.mark.gpu]

CALLS_PER_REPLAY = 10
REPLAYS_PER_SAMPLE = 20
SHAPES = ("model", *LING_HEADS)
MAX_REL_ERR = 0.04  # the weight-quantization bound of suites/test_head_parity.py


@pytest.fixture(scope="module")
def copy_bytes_per_s(moe_device) -> float:
    """Device-to-device copy bandwidth (bytes read + written), the floor's denominator."""
    return copy_bandwidth(moe_device.torch_device)


class Heads:
    """bf16 and FP8 heads per shape, built on first use; one shape held at a time (the Ling
    heads are 1.3 GB in bf16)."""

    def __init__(self, model) -> None:
        self.model = model
        self.key = None
        self.value = None

    def get(self, shape: str):
        if shape != self.key:
            self.value = None
            torch.cuda.empty_cache()
            device = self.model.embed_tokens.weight.device
            if shape == "model":
                bf16 = self.model.lm_head
                if not isinstance(bf16, BF16Head):
                    pytest.skip("the model under test has no bf16 head to compare with")
            else:
                n, k = LING_HEADS[shape]
                bf16 = BF16Head(k, n, device=device, dtype=torch.bfloat16)
                with torch.no_grad():
                    bf16.weight.normal_(0, 0.02, generator=torch.Generator(device).manual_seed(0))
            self.key, self.value = shape, (bf16, FP8Head.from_linear(bf16, "row", "triton"))
        return self.value


@pytest.fixture(scope="module")
def heads(moe_model):
    return Heads(moe_model)


def _inputs(bf16: BF16Head, m: int, seed: int) -> torch.Tensor:
    gen = torch.Generator(bf16.weight.device).manual_seed(seed)
    return torch.randn(m, bf16.in_features, device=bf16.weight.device, generator=gen).to(bf16.weight.dtype)


def _graphs(heads, shape: str, m: int):
    bf16, fp8 = heads.get(shape)
    x = _inputs(bf16, m, seed=m)
    with torch.inference_mode():
        parity = compare_logits(fp8(x), bf16(x))
        assert parity.nonfinite_rows == 0 and parity.rel_err <= MAX_REL_ERR, parity
        with backends.record_provenance() as prov:
            g_fp8 = capture_graph([lambda: fp8(x)] * CALLS_PER_REPLAY)
        require_head_backend(prov, "fp8-triton")
        g_bf16 = capture_graph([lambda: bf16(x)] * CALLS_PER_REPLAY)
    return g_fp8, g_bf16, bf16.out_features * bf16.in_features


def _config(shape: str, m: int) -> dict:
    return {"shape": shape, "m": m, "head": "fp8-triton", "granularity": "row",
            "calls_per_replay": CALLS_PER_REPLAY}


@pytest.mark.parametrize("m", [1, 4])
@pytest.mark.parametrize("shape", SHAPES)
def test_fp8_head_us(heads, shape, m, moe_device, moe_sampler, moe_gate, copy_bytes_per_s):
    g_fp8, _, fp8_bytes = _graphs(heads, shape, m)

    def microseconds():
        per_replay = moe_sampler.sample(g_fp8.replay, inner=REPLAYS_PER_SAMPLE)
        return [s * 1e6 / CALLS_PER_REPLAY for s in per_replay]

    samples = microseconds()
    floor_us = fp8_bytes / copy_bytes_per_s * 1e6
    median = statistics.median(samples)
    print(f"FP8 head {shape} M={m}: {median:.1f} us, {100 * floor_us / median:.1f}% of the FP8 byte floor "
          f"({floor_us:.1f} us at {copy_bytes_per_s / 1e12:.2f} TB/s)")
    moe_gate.check(f"fp8_head_us_{shape}_m{m}", samples, unit="us", direction="lower",
                   tolerance=tolerance_for("timing", moe_device.torch_device), config=_config(shape, m),
                   remeasure=microseconds)


@pytest.mark.parametrize("m", [1, 4])
@pytest.mark.parametrize("shape", SHAPES)
def test_fp8_over_bf16_head(heads, shape, m, moe_device, moe_sampler, moe_gate):
    g_fp8, g_bf16, _ = _graphs(heads, shape, m)

    def side_by_side():
        s = moe_sampler.interleaved({"fp8": g_fp8.replay, "bf16": g_bf16.replay}, inner=REPLAYS_PER_SAMPLE)
        return s["fp8"], s["bf16"]

    result = moe_gate.check_ratio(f"fp8_over_bf16_head_{shape}_m{m}", side_by_side, direction="lower",
                                  tolerance=tolerance_for("ratio", moe_device.torch_device), config=_config(shape, m))
    print(f"FP8/bf16 head {shape} M={m}: {result.current:.4f} (SM clock {_sm_clock_mhz(heads.model)} MHz after)")


def _sm_clock_mhz(model) -> int | None:
    """The GPU's SM clock now (NVML), for reading a ratio that moved with what ran before."""
    try:
        return torch.cuda.clock_rate(model.embed_tokens.weight.device)
    except Exception:  # noqa: BLE001  (no NVML: the figure is only a diagnostic)
        return None


@pytest.mark.parametrize("shape", list(LING_HEADS))
def test_fp8_head_targets_on_h200(heads, shape, moe_device, moe_sampler, copy_bytes_per_s):
    if moe_device.fingerprint.get("name") != "NVIDIA H200":
        pytest.skip(f"the targets are H200 figures; the device is {moe_device.fingerprint.get('name')}")
    g1, _, fp8_bytes = _graphs(heads, shape, 1)
    g4, _, _ = _graphs(heads, shape, 4)
    s = moe_sampler.interleaved({"m1": g1.replay, "m4": g4.replay}, inner=REPLAYS_PER_SAMPLE)
    m1 = statistics.median(s["m1"]) * 1e6 / CALLS_PER_REPLAY
    m4 = statistics.median(s["m4"]) * 1e6 / CALLS_PER_REPLAY
    floor_fraction = fp8_bytes / copy_bytes_per_s * 1e6 / m1
    print(f"{shape}: M=1 {m1:.1f} us ({100 * floor_fraction:.1f}% of the floor), M=4 {m4:.1f} us ({m4 / m1:.3f}x)")
    assert m1 <= H200_BARS_US[shape], f"{shape}: M=1 {m1:.1f} us > bar {H200_BARS_US[shape]} us"
    assert floor_fraction >= H200_MIN_FLOOR_FRACTION.get(shape, 0), (
        f"{shape}: {100 * floor_fraction:.1f}% of the floor")
    assert m4 / m1 <= H200_MAX_M4_OVER_M1, f"{shape}: M=4 / M=1 = {m4 / m1:.3f}"
