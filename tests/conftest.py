"""Fixtures that several test modules share (the helpers they share are in tests/helpers.py)."""

from __future__ import annotations

import pytest
import scipy.stats  # noqa: F401  (below)
import torch

from impl import backends

# In-process inner runs (pytester.runpytest) put sys.modules back as they found them, so what an
# inner run imports first is imported again by the next one: an extension module cannot load
# twice in one process, and a backend module would register its backends twice. The plugins load
# scipy.stats and the engine only when a run needs them, so both are loaded here, outside any
# inner run: the statistics, and every built-in backend module with what it imports.
backends.available("moe")


@pytest.fixture(scope="module")
def one_thread():
    """One torch thread for the module. The CI machines are 2 shared cores: a second torch thread
    spinning against other processes made a tiny decode step 60x slower there."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def model(one_thread):
    """The trained byte-level checkpoint `tiny-gsm` (CPU, fp32), built once per module. A module
    that defines its own `model` fixture uses that one."""
    from impl.model.build import build_model
    return build_model("tiny-gsm")
