"""impl/moe/random_layer.py: the timing suites' inputs repeat whatever ran before, and the
distinct-expert count that sets a call's bytes is the routing's own."""

from __future__ import annotations

import pytest
import torch

from impl.model.config import get_config
from impl.moe.random_layer import bytes_per_token, distinct_experts, random_inputs, random_moe_block


def test_inputs_do_not_depend_on_the_global_generator():
    cfg = get_config("tiny")
    torch.manual_seed(0)
    first = random_inputs(cfg, 4, 3, "cpu")
    torch.manual_seed(99)
    torch.randn(1000)  # another test drawing before this one
    second = random_inputs(cfg, 4, 3, "cpu")
    assert all(torch.equal(a, b) for a, b in zip(first, second, strict=True))
    assert [(x.shape, x.dtype) for x in first] == [((4, cfg.hidden_size), torch.bfloat16)] * 3
    assert len({x.sum().item() for x in first}) == 3, "each call gets its own input"
    other = random_inputs(cfg, 4, 3, "cpu", seed=7)
    assert not torch.equal(first[0], other[0])


def test_distinct_experts_counts_the_routers_choices():
    cfg = get_config("tiny")
    block = random_moe_block(cfg, "bf16", "cpu", "reference", seed=3)
    one = random_inputs(cfg, 1, 4, "cpu")
    assert distinct_experts(block, one) == cfg.top_k  # one token: top-k different experts
    xs = random_inputs(cfg, 4, 4, "cpu")
    with torch.no_grad():
        by_hand = [len(set(block.gate(x)[1].flatten().tolist())) for x in xs]
    assert distinct_experts(block, xs) == pytest.approx(sum(by_hand) / len(by_hand))
    assert cfg.top_k <= distinct_experts(block, xs) <= min(4 * cfg.top_k, cfg.num_experts)


def test_bytes_grow_with_the_distinct_experts():
    cfg = get_config("ling-3.0-flash")
    few, many = (bytes_per_token(cfg, "mxfp4", d) for d in (8, 31))
    assert many["routed"] == pytest.approx(few["routed"] * 31 / 8)
    assert (few["shared"], few["router"]) == (many["shared"], many["router"])
