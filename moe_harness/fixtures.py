"""The MoE harness's fixtures: its run state, the model under test and the MoE backends under test."""

from __future__ import annotations

import pytest

from moe_harness.state import HARNESS_KEY, MoeRun


@pytest.fixture(scope="session")
def moe_run(pytestconfig) -> MoeRun:
    """The harness's run state: `.options` (model, backend, head, ladder...), `.moe_backend`, `.core`."""
    return pytestconfig.stash[HARNESS_KEY]


@pytest.fixture(scope="session")
def moe_model(moe_run):
    """The model under test (`--moe-model`), built once per session on the device, in eval mode.
    A MoE backend that does not take the model's expert format (`Backend.formats`) or, on a model
    that clips SwiGLU, does not clip skips every test that needs the model, saying why."""
    import torch

    from impl import backends
    from impl.model import build_model
    from impl.serve import why_cannot_run
    model = build_model(moe_run.options.model, moe_run.core.device.torch_device,
                        getattr(torch, moe_run.dtype_name), moe_backend="reference", head=moe_run.options.head)
    backend = backends.get("moe", moe_run.moe_backend)
    reason = why_cannot_run(model, backend)
    if reason:
        pytest.skip(f"the MoE backend under test: {reason}")
    model.set_moe_backend(backend.name)
    return model


@pytest.fixture(scope="session")
def moe_backend(moe_run):
    """The MoE backend under test (`--moe-backend`), an `impl.backends.Backend` of kind `moe`."""
    from impl import backends
    return backends.get("moe", moe_run.moe_backend)


@pytest.fixture(scope="session")
def moe_checked_backend(moe_backend_name):
    """Each MoE backend a correctness suite checks (parametrized: see `MoeRun.backends_under_test`)."""
    from impl import backends
    return backends.get("moe", moe_backend_name)
