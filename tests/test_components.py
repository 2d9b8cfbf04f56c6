"""A decode step's components (impl.model.components): each can be left out and comes back, and
its roofline bytes add up to the step's."""

import pytest
import torch

from impl import backends
from impl.model import build_model
from impl.model.components import component_bytes, component_times, left_out, present
from impl.model.roofline import token_bytes


@pytest.fixture(scope="module")
def model():
    m = build_model("ling-3.0-tiny", moe_backend="gather")
    m.setup_caches(1, 64)
    return m


def _step(model):
    """One decode token from fresh caches (a KDA state advances every step; setup_caches keeps
    caches of an unchanged size, so the size goes back and forth)."""
    model.setup_caches(1, 63)
    model.setup_caches(1, 64)
    torch.manual_seed(0)
    ids = torch.randint(0, model.config.vocab_size, (1, 1))
    with torch.inference_mode():
        return model(ids, torch.tensor([5]))


def test_the_hybrid_model_has_every_kind_of_component(model):
    assert present(model) == ("moe", "kda", "mla", "dense mlp", "head")
    assert present(build_model("tiny")) == ("moe", "mha", "head")


def test_a_component_left_out_runs_no_kernel_and_comes_back(model):
    whole = _step(model)
    with left_out(model, "moe"):
        with backends.record_provenance() as prov:
            without = _step(model)
    assert not prov.backends("moe")
    assert not torch.allclose(without, whole)
    with backends.record_provenance() as prov:
        again = _step(model)
    assert prov.backends("moe") == {"gather"}
    torch.testing.assert_close(again, whole)


def test_the_head_left_out_returns_logits_of_the_right_shape(model):
    with left_out(model, "head"):
        out = _step(model)
    assert out.shape == (1, 1, model.config.vocab_size) and not out.any()
    assert _step(model).any()


def test_left_out_is_undone_when_the_body_raises(model):
    with pytest.raises(RuntimeError, match="boom"):
        with left_out(model, "kda"):
            raise RuntimeError("boom")
    assert all("forward" not in vars(layer.self_attn) for layer in model.layers)


def test_unknown_or_absent_components_are_named(model):
    with pytest.raises(ValueError, match="unknown component 'router'; expected one of"):
        with left_out(model, "router"):
            pass
    with pytest.raises(ValueError, match="has no mha component"):
        with left_out(model, "mha"):
            pass
    with pytest.raises(ValueError, match="CUDA device"):
        component_times(model, lambda: _step(model))


def test_component_bytes_add_up_to_the_token(model):
    parts = token_bytes("ling-3.0-flash", 1024)
    comps = component_bytes(parts)
    assert set(comps) == {"moe", "kda", "mla", "dense mlp", "head", "other"}
    assert sum(comps.values()) == pytest.approx(sum(parts.values()))
    assert comps["other"] == pytest.approx(parts["norms"] + parts["embedding row"])
    # bf16 projections: 35 KDA layers' weights (130 MB each) outweigh 40 layers' 8 MXFP4 experts
    assert comps["kda"] > comps["moe"] > comps["mla"]
