"""Fixtures that several test modules share (the helpers they share are in tests/helpers.py)."""

from __future__ import annotations

import pytest
import torch


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
