"""The `humming` backend's own parts (impl/moe/humming.py): on CPU, under Triton's interpreter,
the routing preparation (Humming's indexed layout), SwiGLU and combine kernels against plain
torch, the input checks and the registration; on a GPU with `humming-kernels` installed, the whole
backend against the oracle (the parity suite runs it too: `--moe-backend humming`).

Tolerances: the layout is integer (exact); SwiGLU and the combine compute in fp32 like the torch
expressions they are compared with, only the combine's summation order may differ (top-k <= 16
terms): RTOL_FP32 = 1e-6 (seen: 0 to 1e-7). On the GPU, the parity suite's RTOL_BF16 = 1e-2 (its
docstring argues it: bf16 intermediate and output roundings; Humming accumulates in fp32).
"""

from __future__ import annotations

import functools
import math

import pytest
import torch
from hypothesis import given, strategies as st

from impl import backends
import impl.moe
from impl.moe import humming, humming_importable, register_humming
from impl.moe.humming import (HUMMING_BLOCK, MAX_SLOTS, check_humming_inputs, check_humming_shape, humming_align,
                              humming_combine, humming_swiglu)
from impl.moe.reference import swiglu_act
from impl.moe.shared import SharedExpert
from impl.quant.mxfp4 import quantize_mxfp4

RTOL_FP32 = 1e-6
RTOL_GPU = 1e-2


@pytest.fixture(scope="module")
def dev(moe_device):
    """Where the kernels run: the GPU, or the CPU under the interpreter. Inputs are drawn on the
    CPU and moved, results compared on the CPU."""
    return moe_device.torch_device


def expected_layout(ids: torch.Tensor, experts: int, block: int = HUMMING_BLOCK):
    """Humming's indexed layout as its own test helper builds it, on the host: experts ascending,
    each in whole blocks, its slots in order, pads = the slot count."""
    flat = ids.reshape(-1).tolist()
    pad = len(flat)
    sorted_ids, expert_ids = [], []
    for e in range(experts):
        slots = [s for s, v in enumerate(flat) if v == e]
        blocks = math.ceil(len(slots) / block)
        sorted_ids += slots + [pad] * (blocks * block - len(slots))
        expert_ids += [e] * blocks
    return sorted_ids, expert_ids


def assert_layout(ids, experts, sorted_ids, expert_ids, padded, block=HUMMING_BLOCK):
    want_sorted, want_experts = expected_layout(ids, experts, block)
    n = int(padded.item())
    assert n == len(want_sorted), f"num_tokens_padded {n}, expected {len(want_sorted)}"
    assert sorted_ids[:n].tolist() == want_sorted, "sorted_ids differ from Humming's layout"
    assert expert_ids[:n // block].tolist() == want_experts, "expert_ids differ from Humming's layout"
    assert (sorted_ids[n:] == ids.numel()).all(), "entries past the last block must be pads"


@pytest.mark.parametrize("tokens,top_k,experts", [
    (1, 8, 512),   # a decode step: 8 distinct experts, 8 blocks of one slot
    (4, 8, 64),    # a verify step: some experts chosen by several tokens
    (16, 16, 4),   # 64 slots an expert: several blocks each
    (16, 16, 1),   # every slot to one expert: 32 blocks
    (1, 1, 1),
])
def test_align_matches_humming_layout(dev, tokens, top_k, experts):
    g = torch.Generator().manual_seed(tokens * 1000 + top_k * 10 + experts)
    ids = torch.stack([torch.randperm(max(experts, top_k), generator=g)[:top_k] % experts for _ in range(tokens)])
    assert_layout(ids, experts, *(t.cpu() for t in humming_align(ids.to(dev), experts)))


@given(st.integers(1, 16), st.integers(1, 16), st.integers(1, 40), st.randoms(use_true_random=False))
def test_align_property(dev, tokens, top_k, experts, rnd):
    """Any ids, repeats within a token included (the layout does not need them distinct)."""
    ids = torch.tensor([[rnd.randrange(experts) for _ in range(top_k)] for _ in range(tokens)], dtype=torch.int64)
    assert_layout(ids, experts, *(t.cpu() for t in humming_align(ids.to(dev), experts)))


def test_layout_check_catches_a_wrong_layout(dev):
    """Negative control: the check above fails on a layout with two slots swapped across experts."""
    ids = torch.tensor([[3, 1, 2, 0]])
    sorted_ids, expert_ids, padded = (t.cpu() for t in humming_align(ids.to(dev), 4))
    sorted_ids = sorted_ids.clone()
    sorted_ids[[0, HUMMING_BLOCK]] = sorted_ids[[HUMMING_BLOCK, 0]]
    with pytest.raises(AssertionError, match="sorted_ids differ"):
        assert_layout(ids, 4, sorted_ids, expert_ids, padded)


def test_align_refuses_too_many_slots(dev):
    with pytest.raises(ValueError, match=f"1 to {MAX_SLOTS} slots"):
        humming_align(torch.zeros(17, 16, dtype=torch.int64, device=dev), 4)


@pytest.mark.parametrize("rows,inter", [(1, 768), (32, 1024), (3, 96), (2, 1536)])
@pytest.mark.parametrize("limit", [None, 2.0])  # values of y reach about 10: 2 clips many of them
def test_swiglu_matches_torch(dev, rows, inter, limit):
    y = torch.randn(rows, 2 * inter) * 3
    want = swiglu_act(y[:, :inter], y[:, inter:], limit)
    torch.testing.assert_close(humming_swiglu(y.to(dev), limit=limit).cpu(), want, rtol=RTOL_FP32, atol=1e-7)


@pytest.mark.parametrize("shared", [False, True])
@pytest.mark.parametrize("tokens,top_k,hidden", [(1, 8, 2560), (4, 8, 96), (3, 1, 4096)])
def test_combine_matches_torch(dev, tokens, top_k, hidden, shared):
    z = torch.randn(tokens * top_k, hidden)
    w = torch.rand(tokens, top_k) * 2.5
    s = torch.randn(tokens, hidden) if shared else None
    want = (z.view(tokens, top_k, hidden) * w[..., None]).sum(1) + (s if shared else 0)
    out = humming_combine(z.to(dev), w.to(dev), None if s is None else s.to(dev), torch.float32).cpu()
    torch.testing.assert_close(out, want, rtol=RTOL_FP32, atol=1e-6)


def test_combine_keeps_a_nan_row_in_its_token(dev):
    z = torch.randn(3 * 2, 64)
    z[2, 5] = float("nan")  # token 1's first slot
    out = humming_combine(z.to(dev), torch.ones(3, 2, device=dev), None, torch.float32).cpu()
    assert out[1].isnan().any() and not out[[0, 2]].isnan().any()


def _mxfp4_pair(experts=4, hidden=64, inter=32):
    return (quantize_mxfp4(torch.randn(experts, 2 * inter, hidden)), quantize_mxfp4(torch.randn(experts, hidden, inter)))


def test_inputs_named_errors():
    gu, dn = _mxfp4_pair()
    x = torch.randn(1, 64).to(torch.bfloat16)
    w, ids = torch.ones(1, 2), torch.zeros(1, 2, dtype=torch.int32)
    with pytest.raises(TypeError, match="takes MXFP4 experts.*gate_up weight is a Tensor"):
        check_humming_inputs(x, w, ids, torch.randn(4, 64, 64), dn)
    with pytest.raises(ValueError, match="needs CUDA tensors.*got x on cpu"):
        check_humming_inputs(x, w, ids, gu, dn)
    with pytest.raises(ValueError, match="needs x contiguous"):
        check_humming_inputs(torch.randn(64, 2).to(torch.bfloat16).t(), torch.ones(2, 2),
                             torch.zeros(2, 2, dtype=torch.int32), gu, dn)
    h, i_s = 64, 32
    shared = SharedExpert(torch.randn(i_s, h).to(torch.bfloat16), torch.randn(i_s, h).to(torch.bfloat16),
                          torch.randn(h, i_s))
    with pytest.raises(TypeError, match="shared expert in x's dtype torch.bfloat16"):
        check_humming_inputs(x, w, ids, gu, dn, shared)
    with pytest.raises(ValueError, match="shared expert must be"):
        check_humming_inputs(x, w, ids, gu, dn, SharedExpert(shared.gate, shared.up, shared.gate))


def test_shapes_outside_humming_tiles_are_unsupported_in_words(monkeypatch):
    """N = 96 (a tiny model's hidden size) is outside Humming's tiles: refused as Unsupported,
    which the suites skip, naming the weight and the rule; the Ling shapes pass."""
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    cuda = torch.device("cuda")
    with pytest.raises(backends.Unsupported, match=r"N a multiple of 128 .*down weight is \[E, N, K\] = \[4, 96, 64\]"):
        check_humming_shape("down", quantize_mxfp4(torch.randn(4, 96, 64)), cuda)
    for n, k in ((1536, 2560), (2560, 768), (2048, 4096), (4096, 1024)):
        check_humming_shape("gate_up", quantize_mxfp4(torch.randn(1, n, k)), cuda)


def test_prepared_state_is_rebuilt_when_its_inputs_change_and_dropped_with_them():
    prepared = humming._Prepared()
    gate, up = torch.ones(2, 4), torch.zeros(2, 4)
    build = lambda: torch.cat((gate, up))  # noqa: E731
    first = prepared.get(gate, build, up)
    assert prepared.get(gate, build, up) is first, "an unchanged weight is converted once"
    up.add_(1)  # the other input changes in place
    second = prepared.get(gate, build, up)
    assert second is not first and torch.equal(second[2:], up)
    del gate, first, second, build
    import gc
    gc.collect()
    assert not prepared._entries, "the state of a weight that is gone must go with it"


def test_registered_only_when_importable(monkeypatch):
    """Not installed: no `humming` backend, and asking for one lists what there is; installed
    (pretended here): registered for CUDA and MXFP4 only, with its whole-layer path."""
    registry = dict(backends._registry)
    try:
        if not humming_importable():
            with pytest.raises(ValueError, match="unknown moe backend 'humming'; available:"):
                backends.get("moe", "humming")
        monkeypatch.setattr(impl.moe, "humming_importable", lambda: False)
        backends._registry.pop(("moe", "humming"), None)
        assert register_humming() is False and "humming" not in backends.available("moe")
        monkeypatch.setattr(impl.moe, "humming_importable", lambda: True)
        assert register_humming() is True
        b = backends.get("moe", "humming")
        assert b.devices == ("cuda",) and b.formats == ("mxfp4",) and b.layer is not None
    finally:
        backends._registry.clear()
        backends._registry.update(registry)


@functools.lru_cache(maxsize=1)  # tests run shape by shape: one block (GBs) and its Humming layout at a time
def _ling_block(shape: str):
    from impl.model.config import get_config
    from impl.moe.random_layer import random_moe_block
    return random_moe_block(get_config(shape), "mxfp4", torch.device("cuda"), "humming", seed=0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or not humming_importable(), reason="needs CUDA and humming-kernels")
@pytest.mark.parametrize("tokens", [1, 2, 4, 16])
@pytest.mark.parametrize("shape", ["ling-3.0-flash", "ling-flash-2.0"])
def test_whole_layer_matches_the_oracle_and_replays_in_a_graph(shape, tokens):
    """The layer (Triton routing, Humming's GEMMs, shared expert on the side stream) against the
    oracle on the same routing and weights, eagerly and as a CUDA graph replayed on fresh inputs.
    The replay is held to the oracle, not bit-compared with an eager call: cuBLAS may choose
    another algorithm for the shared expert under capture (split-K at Ling-flash-2.0 M=1), which
    rounds differently but within the same tolerance."""
    from impl.graphs import capture_graph
    from impl.model.config import get_config
    from impl.moe.random_layer import shared_of
    from impl.moe.reference import moe_reference
    from impl.moe.shared import SharedExpert
    cfg = get_config(shape)
    block = _ling_block(shape)
    gu, dn = block.experts.weights()
    sh = shared_of(block)
    sh32 = SharedExpert(sh.gate.float(), sh.up.float(), sh.down.float())
    layer = backends.get("moe", "humming").layer

    def assert_matches_oracle(x, out, what):
        w, ids = block.gate(x)
        ref = moe_reference(x.float(), w, ids, gu, dn, sh32)
        rel = ((out.double() - ref.double()).norm(dim=-1) / ref.double().norm(dim=-1)).max().item()
        assert rel <= RTOL_GPU, f"humming layer vs oracle, {what}: worst row relative error {rel:.3g}"

    x = torch.randn(tokens, cfg.hidden_size, device="cuda").to(torch.bfloat16)
    with torch.no_grad():
        with backends.record_provenance() as prov:
            out = layer(x, block.gate, gu, dn, sh)
        assert prov.backends("moe") == {"humming"}
        assert_matches_oracle(x, out, "eager")
        static, captured = x.clone(), {}

        def call():
            captured["out"] = layer(static, block.gate, gu, dn, sh)
        graph = capture_graph([call])
        static.copy_(torch.randn_like(x))
        captured["out"].fill_(float("nan"))  # what the replay does not write stays NaN
        graph.replay()
        torch.cuda.synchronize()
        assert_matches_oracle(static, captured["out"], "graph replay on fresh inputs")
