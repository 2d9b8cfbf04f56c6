"""scripts/gpu/ab_step.py on CPU: its variant syntax (GEMV tiles and layer backends), the model
set as each variant says, the correctness check every variant's tiles pass before they are timed
(Triton's interpreter), and that check failing a wrong product."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts" / "gpu"))

import ab_step as ab  # noqa: E402
from impl.model.gemv import GemvLaunch  # noqa: E402


def test_variants_parse_into_tiles_per_weight_shape_and_layer_backends():
    v = ab.parse_variants("committed; o=2560,4096:2,4096,4+6752,2560:4,1024,8; f=projection:cublas+2560,4096:2,4096,4")
    assert v == {"committed": ab.Variant(),
                 "o": ab.Variant({(2560, 4096): GemvLaunch(2, 4096, 4), (6752, 2560): GemvLaunch(4, 1024, 8)}),
                 "f": ab.Variant({(2560, 4096): GemvLaunch(2, 4096, 4)}, {"projection": "cublas"})}


def test_each_variant_sets_the_model_and_the_table_and_the_base_restores_them():
    from impl.model.build import build_model
    from impl.model.gemv import TUNED
    model, committed = build_model("ling-3.0-tiny"), dict(TUNED)
    v = ab.parse_variants("f=projection:cublas+attention:torch+64,64:2,64,4")["f"]
    try:
        ab.apply(model, v, committed)
        assert (model.layer_backend("projection"), model.layer_backend("attention")) == ("cublas", "torch")
        assert TUNED == {**committed, (64, 64): GemvLaunch(2, 64, 4)}
    finally:
        ab.apply(model, ab.Variant(), committed)
    assert (model.layer_backend("projection"), model.layer_backend("attention")) == ("gemv", "triton")
    assert TUNED == committed


@pytest.mark.parametrize("text, problem", [
    ("o=2560,4096:2,4096", "variant 'o=2560,4096:2,4096': expected NAME=N,K:BLOCK_N,BLOCK_K,WARPS"),
    ("f=projection:inline", "unknown projection backend 'inline'; known: ['cublas', 'gemv']"),
    ("f=projections:cublas", "unknown layer backend kind 'projections'"),
    ("o=2560:2,4096,4", "expected NAME=N,K"),
    ("o=2560,4096:3,4096,4", "GemvLaunch.block_n must be a power of two"),
    ("a;a", "a repeated name"),
    ("=2560,4096:2,4096,4", "no name"),
    (" ; ", "no variants"),
])
def test_a_malformed_variant_is_named(text, problem):
    with pytest.raises(ValueError, match=problem.replace("(", r"\(").replace("[", r"\[")):
        ab.parse_variants(text)


def test_tiles_are_checked_against_an_fp32_product_before_timing(monkeypatch):
    tiles = {(48, 96): GemvLaunch(2, 128, 4)}  # a tile longer than the row: the masked path
    ab.check_tiles(tiles, torch.device("cpu"))
    monkeypatch.setattr(ab.gemv, "gemv", lambda x, w, launch: torch.zeros(1, w.shape[0], dtype=x.dtype))
    with pytest.raises(SystemExit, match=r"tile GemvLaunch\(block_n=2, block_k=128.*\(48, 96\) is wrong"):
        ab.check_tiles(tiles, torch.device("cpu"))
