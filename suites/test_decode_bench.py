"""Decode throughput and per-layer MoE time of the model under test, gated against frozen figures.

Tolerances: 10% on absolute figures. On the CI machine kind the per-sample CV of a ~0.2 ms step
is under 1% (shared/DESIGN.md), but absolute speed drifts more between sessions (clock, neighbours),
so 10% is the smallest threshold that does not flag the machine instead of the code; the
bootstrap interval keeps noisier runs from failing on noise alone. The ratio against a
bytes-equivalent GEMV, measured interleaved in the same run, cancels most machine drift.
"""

from __future__ import annotations

import pytest
import torch

from impl.model.layers import MoEBlock

pytestmark = pytest.mark.moe_bench

CONTEXT = 64  # tokens in the cache when the decode step is timed
STEPS_PER_SAMPLE = 32


@pytest.fixture(scope="module")
def decode_step(moe_model):
    """One batch-1 decode step at a fixed position of a filled static cache (its cost is the same
    at every position: attention reads the whole masked cache)."""
    g = torch.Generator().manual_seed(0)
    device = moe_model.embed_tokens.weight.device
    prompt = torch.randint(0, moe_model.config.vocab_size, (1, CONTEXT), generator=g).to(device)
    moe_model.setup_caches(1, moe_model.config.max_seq_len)
    with torch.inference_mode():
        moe_model(prompt, torch.arange(CONTEXT, device=device))
    token = prompt[:, -1:].clone()
    pos = torch.tensor([CONTEXT], device=device)

    @torch.inference_mode()
    def step():
        token.copy_(moe_model(token, pos)[:, -1].argmax(-1, keepdim=True))

    return step


def _config(model) -> dict:
    return {"threads": torch.get_num_threads(), "moe_backend": model.moe_backend, "context": CONTEXT}


def test_decode_tokens_per_s(moe_model, decode_step, moe_sampler, moe_gate):
    seconds = moe_sampler.sample(decode_step, inner=STEPS_PER_SAMPLE)
    moe_gate.check("decode_tokens_per_s", [1 / s for s in seconds], unit="tok/s", direction="higher",
                   tolerance=0.10, config=_config(moe_model))


@pytest.fixture(scope="module")
def first_moe_layer(moe_model):
    block = next(layer.mlp for layer in moe_model.layers if isinstance(layer.mlp, MoEBlock))
    w = moe_model.embed_tokens.weight
    x = torch.randn(1, 1, moe_model.config.hidden_size, generator=torch.Generator().manual_seed(1)).to(w)
    return block, x


def _bytes_equivalent_gemv(model, x):
    """A dense GEMV reading as many weight bytes as one MoE layer does for one token."""
    c = model.config
    cols = 3 * c.moe_intermediate_size * c.top_k + 3 * c.shared_intermediate_size + c.num_experts
    w = torch.randn(c.hidden_size, cols, generator=torch.Generator().manual_seed(2)).to(x)
    flat = x.view(1, -1)
    return lambda: flat @ w


def test_moe_layer_us(moe_model, first_moe_layer, moe_sampler, moe_gate):
    block, x = first_moe_layer
    with torch.inference_mode():
        seconds = moe_sampler.sample(lambda: block(x), inner=200)
    moe_gate.check("moe_layer_us", [s * 1e6 for s in seconds], unit="us", direction="lower",
                   tolerance=0.10, config=_config(moe_model))


def test_moe_layer_vs_bytes_equivalent_gemv(moe_model, first_moe_layer, moe_sampler, moe_gate):
    block, x = first_moe_layer
    gemv = _bytes_equivalent_gemv(moe_model, x)
    with torch.inference_mode():
        s = moe_sampler.interleaved({"moe": lambda: block(x), "gemv": gemv}, inner=200)
    moe_gate.check_ratio("moe_layer_over_gemv", s["moe"], s["gemv"], direction="lower", tolerance=0.10,
                         config=_config(moe_model))
