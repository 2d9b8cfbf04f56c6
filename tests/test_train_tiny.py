"""The training script (scripts/train_tiny.py): its learning-rate schedules, and its losses and
chained-MTP phase on a random-weight tiny model: depth 1 of the chained loss is the first phase's
MTP loss, every depth is finite, and the chained phase moves the MTP layer only (the target must
stay exactly as it was: its accuracy is what the first phase bought)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))

import train_tiny  # noqa: E402

from impl.model import build_model  # noqa: E402


def _model():
    model = build_model("tiny", moe_backend="reference", seed=4)
    return model.train()


def _batch():
    return next(train_tiny.batches(2, 64, seed=0))


def test_chained_depth_one_is_the_first_phase_mtp_loss():
    model = _model()
    ids, mask = _batch()
    with torch.no_grad():
        _, mtp = train_tiny.losses(model, ids, mask)
        last = model.last_hidden_states(ids[:, :-1])
        chained = train_tiny.mtp_losses(model, last, ids, mask, 3)
    assert len(chained) == 3 and all(torch.isfinite(v) for v in chained)
    torch.testing.assert_close(chained[0], mtp)


def test_chained_phase_trains_the_mtp_layer_only():
    model = _model()
    target = {n: p.detach().clone() for n, p in model.named_parameters() if not n.startswith("mtp.")}
    draft = {n: p.detach().clone() for n, p in model.named_parameters() if n.startswith("mtp.")}
    args = argparse.Namespace(batch=2, row_len=64, seed=0, chain_lr=1e-3, chain_depth=2)
    steps = train_tiny.train_chained_mtp(model, args, budget_s=2.0)
    assert steps >= 1
    params = dict(model.named_parameters())
    assert all(torch.equal(params[n], v) for n, v in target.items()), "the chained phase changed the target"
    assert any(not torch.equal(params[n], v) for n, v in draft.items()), \
        "the chained phase left the MTP layer as it was"


def test_lr_schedules():
    """wsd: full rate for the first 1 - decay_frac of the budget, then linear to 0; cosine: half
    the rate at mid-budget, 0 at the end."""
    f = train_tiny.lr_factor
    assert [f(p, "wsd", 0.25) for p in (0.0, 0.5, 0.75, 0.875, 1.0)] == [1.0, 1.0, 1.0, 0.5, 0.0]
    assert abs(f(0.5, "cosine", 0.25) - 0.5) < 1e-12 and f(0.0, "cosine", 0.25) == 1.0
    assert abs(f(1.0, "cosine", 0.25)) < 1e-12
