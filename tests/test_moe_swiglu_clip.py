"""SwiGLU clipping, as Ling-3.0-flash's late layers have it (`expert_swiglu_limit_list`,
`share_expert_swiglu_limit_list`; transformers' bailing_hybrid: silu(gate) capped at the limit, up
clamped to +-limit): each MoE path against the fp32 oracle on fresh random inputs, the model's
layers through every backend, and a backend that does not clip refused by a model that does.
Parity of a clipping checkpoint with transformers: tests/test_ling_parity.py."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from impl import backends
from impl.model.build import build_model
from impl.model.config import get_config
from impl.moe.moe_launch_config import MoELaunchConfig
from impl.moe.reference import moe_reference, swiglu_act
from tests.helpers import assert_rows_close, rel_rows
from tests.moe_cases import (DEVICE, DP4A_RTOL, RTOL, make_shared, make_weights, on_device, random_routing,
                             run_both)

# make_weights' rows give gate and up values of about unit size: 0.5 cuts a good share of them
# (the control below checks that the clip changes the output by far more than the tolerance).
LIMIT = 0.5


def test_swiglu_act_is_transformers_post_activation_clip():
    g, u = torch.tensor([-3.0, 0.2, 1.0, 6.0]), torch.tensor([2.0, -3.0, 0.3, 9.0])
    want = torch.minimum(torch.nn.functional.silu(g), torch.tensor(LIMIT)) * u.clamp(-LIMIT, LIMIT)
    assert torch.equal(swiglu_act(g, u, LIMIT), want)
    assert torch.equal(swiglu_act(g, u), torch.nn.functional.silu(g) * u)


CASES = [  # (weight format, tokens, launch config: the product path each takes)
    ("fp32", 1, None), ("fp32", 4, None), ("fp32", 20, None),  # register path; two chunks past M_PAD
    ("mxfp4", 1, MoELaunchConfig(gate_up_block_k=64, down_block_k=64, gemv_max_tokens=4)),  # dp4a
    ("mxfp4", 3, MoELaunchConfig(gate_up_block_k=64, down_block_k=64, gemv_max_tokens=4)),
    ("mxfp4", 16, MoELaunchConfig(gemv_max_tokens=0)),  # tensor-core tiles
]


@pytest.mark.parametrize("fmt,tokens,cfg", CASES)
@pytest.mark.parametrize("routed,shared", [(LIMIT, None), (None, LIMIT), (LIMIT, 2 * LIMIT)])
def test_triton_kernels_clip_as_the_oracle(fmt, tokens, cfg, routed, shared):
    w_gate_up, w_down = make_weights(6, 96, 160, fmt, seed=tokens)
    weights, ids = random_routing(tokens, 2, 6, seed=tokens + 1)
    x = torch.randn(tokens, 96, generator=torch.Generator().manual_seed(tokens + 2))
    expert = dataclasses.replace(make_shared(96, 64), limit=shared)
    with backends.record_provenance() as prov:
        out, ref = run_both(x, weights, ids, w_gate_up, w_down, expert, config=cfg, swiglu_limit=routed)
    tol = DP4A_RTOL if fmt == "mxfp4" and cfg.gemv_max_tokens >= tokens else RTOL
    assert_rows_close(out, ref, tol)
    noted = [e.config for e in prov.events if "shared_limit" in e.config]
    assert noted and all((c["swiglu_limit"], c["shared_limit"]) == (routed, shared) for c in noted)
    # Negative control: unclipped, the oracle is beyond the tolerance in every row, so a kernel that
    # ignored the clip would fail above. The margin is the GPU's (bf16 tolerance 1e-2): the least
    # the clip moves a row there is 0.048 (the shared expert's clip alone, one token).
    plain = moe_reference(*[on_device(a) for a in (x.float(), weights, ids, w_gate_up, w_down)],
                          on_device(dataclasses.replace(expert, limit=None)))
    assert rel_rows(plain, ref).min() > 3 * tol


# The model-level checks clip harder: at 0.1 the clip moves every logit row by at least 7% (MXFP4
# experts; 10% with fp32 ones; at 0.5 by 0.5%), well past the GPU's tolerance, so their negative
# control holds on every device.
MODEL_LIMIT = 0.1


def clipping_tiny(limit: float = LIMIT):
    """The tiny preset with some MoE layers clipped, routed and shared (the MTP layer never is)."""
    return get_config("tiny", swiglu_limits=(0, 0, limit, limit), shared_swiglu_limits=(0, limit, 0, limit))


def unclip(model) -> None:
    for layer in model.layers:
        if hasattr(layer.mlp, "backend"):
            layer.mlp.swiglu_limit = None
            layer.mlp.shared_experts.limit = None


@pytest.mark.parametrize("backend", ["gather", "triton"])
@pytest.mark.parametrize("tokens", [1, 40])  # a decode step; a prompt (the prefill paths)
def test_model_layers_clip_through_every_backend(backend, tokens):
    """On the device under test, fp32 weights; tolerance RTOL (1e-5 on a CPU, fp32 math; 1e-2 on a
    GPU, where the kernels' products are bf16 or TF32)."""
    model = build_model(clipping_tiny(MODEL_LIMIT), DEVICE, moe_backend="reference")
    ids = torch.randint(0, 128, (1, tokens), generator=torch.Generator().manual_seed(3)).to(DEVICE)
    with torch.inference_mode():
        want = model(ids).float()
        model.set_moe_backend(backend)
        got = model(ids).float()
        model.set_moe_backend("reference")
        unclip(model)  # negative control: the same weights unclipped
        plain = model(ids).float()
    err = rel_rows(got, want).max()
    assert err <= RTOL, f"{backend}: {float(err):.2e}"
    assert rel_rows(plain, want).min() > 5 * RTOL


def test_mxfp4_prompt_takes_the_grouped_path_clipped():
    model = build_model(clipping_tiny(MODEL_LIMIT), DEVICE, moe_backend="reference", experts="mxfp4")
    ids = torch.randint(0, 128, (1, 40), generator=torch.Generator().manual_seed(4)).to(DEVICE)
    with torch.inference_mode():
        want = model(ids).float()
        model.set_moe_backend("triton")
        with backends.record_provenance() as prov:
            got = model(ids).float()
        model.set_moe_backend("reference")
        unclip(model)
        plain = model(ids).float()
    assert "moe_grouped" in {e.kernel for e in prov.events if e.kind == "moe"}
    assert rel_rows(got, want).max() <= RTOL
    assert rel_rows(plain, want).min() > 5 * RTOL


@pytest.fixture
def non_clipping_backend():
    backend = backends.register(backends.Backend("moe", "clip-test-plain", lambda x, *a: x))
    yield backend
    backends._registry.pop(("moe", backend.name))


def test_a_backend_that_does_not_clip_is_refused_by_a_model_that_does(non_clipping_backend):
    model = build_model(clipping_tiny())
    with pytest.raises(backends.Unsupported, match=r"'clip-test-plain' MoE backend does not clip SwiGLU.*at 0\.5"):
        model.set_moe_backend("clip-test-plain")
    build_model("tiny").set_moe_backend("clip-test-plain")  # a model without clipping takes it


def test_a_ladder_row_on_a_backend_that_does_not_clip_is_refused(non_clipping_backend):
    from impl.data.text import ByteTokenizer
    from impl.serve import RowError, ServeConfig, build_row
    model = build_model(clipping_tiny())
    with pytest.raises(RowError, match=r"clip-test-plain.*does not clip SwiGLU"):
        build_row(model, ServeConfig(moe="clip-test-plain"), tokenizer=ByteTokenizer())


def test_the_one_reason_the_ladder_and_the_model_suites_give_names_the_clip(non_clipping_backend):
    from impl.serve import why_cannot_run
    assert why_cannot_run(build_model("tiny"), non_clipping_backend) is None
    reason = why_cannot_run(build_model(clipping_tiny()), non_clipping_backend)
    assert "'clip-test-plain' MoE backend does not clip SwiGLU" in reason
    assert why_cannot_run(build_model(clipping_tiny()), backends.get("moe", "reference")) is None


@pytest.mark.parametrize("field,value,message", [
    ("swiglu_limits", (0.5,) * 3, r"swiglu_limits has 3 entries for 4 layers"),
    ("shared_swiglu_limits", (0, -1, 0, 0), r"shared_swiglu_limits must be finite numbers >= 0"),
    ("swiglu_limits", (0, float("inf"), 0, 0), r"swiglu_limits must be finite"),
])
def test_bad_limits_are_named(field, value, message):
    with pytest.raises(ValueError, match=message):
        get_config("tiny", **{field: value})
