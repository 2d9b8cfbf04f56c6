"""Unit tests of the `triton` MoE backend (impl/moe/triton_backend.py and the kernels it launches):
fixed shapes against the oracle, the slot grouping on crafted routings, chunking beyond M_PAD
tokens, launch configurations and plans, and the errors bad inputs get.

Runs on the GPU when there is one (the kernels need CUDA tensors there), else on the CPU. On a CPU
the kernels run in Triton's interpreter with fp32 math (FP32_MATH), so the oracle on the same
(exactly dequantized) weights agrees to fp32 rounding: per token row, norm-wise relative error
<= 1e-5 (seen: ~3e-7). On a GPU the activations go through bf16: 1e-2 (suites/test_moe_parity.py
has the derivation of both).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from impl import backends
from impl.moe import moe_launch_config, triton_launch
from impl.moe.moe_launch_config import M_PAD, MoELaunchConfig, lookup, m_bucket
from impl.moe.shared import SharedExpert
from impl.moe.triton_backend import moe_triton
from impl.moe.triton_slots import slots_from_routing
from impl.quant.mxfp4 import MXFP4Tensor
from impl.launch_tables import device_name
from impl.triton_env import INTERPRET
from tests.helpers import assert_rows_close
from tests.moe_cases import (DEVICE, DP4A_RTOL, RTOL, make_shared, make_weights, on_device, random_routing,
                             run_both)


# --- fixed shapes against the oracle -------------------------------------------------------

FIXED = [
    # (experts, top_k, tokens, hidden, inter, shared_inter, weight format)
    pytest.param(1, 1, 1, 32, 32, None, "bf16", id="smallest"),
    pytest.param(8, 3, 5, 96, 160, 32, "mxfp4", id="mxfp4-h96-i160-shared32"),
    pytest.param(16, 2, 4, 256, 64, 64, "fp16", id="fp16-h256-two-k-blocks"),
    pytest.param(6, 6, 3, 64, 32, 96, "fp32", id="fp32-every-expert"),
]


@pytest.mark.parametrize("experts,top_k,tokens,hidden,inter,shared_inter,fmt", FIXED)
def test_fixed_shapes_match_reference(experts, top_k, tokens, hidden, inter, shared_inter, fmt):
    w_gate_up, w_down = make_weights(experts, hidden, inter, fmt)
    shared = make_shared(hidden, shared_inter) if shared_inter else None
    weights, ids = random_routing(tokens, top_k, experts)
    x = torch.randn(tokens, hidden, generator=torch.Generator().manual_seed(3))
    with backends.record_provenance() as prov:
        out, ref = run_both(x, weights, ids, w_gate_up, w_down, shared)
    assert out.dtype == x.dtype
    assert_rows_close(out, ref, RTOL)
    assert prov.backends("moe") == {"triton"}
    # The weights' own format (fp16, outside WEIGHT_FORMATS, by its torch name), not the plan's
    # "plain tensors" class they are launched as.
    assert {e.config["format"] for e in prov.events if "format" in e.config} == {{"fp16": "float16"}.get(fmt, fmt)}


def test_bf16_activations_round_only_the_output():
    """bf16 x: on a CPU fp32 math inside and one rounding of the output to bf16 (2**-9 relative)."""
    w_gate_up, w_down = make_weights(8, 64, 64, "bf16")
    weights, ids = random_routing(4, 2, 8)
    x = torch.randn(4, 64, generator=torch.Generator().manual_seed(4)).bfloat16()
    out, ref = run_both(x, weights, ids, w_gate_up, w_down, make_shared(64, 32, torch.bfloat16))
    assert out.dtype == torch.bfloat16
    assert_rows_close(out.float(), ref, max(RTOL, 2**-8))


# --- slot grouping ---------------------------------------------------------------------------

def expected_slots(weights, ids, experts):
    """What the slot kernel must produce: experts in order of first appearance (pairs taken token
    by token), each slot's per-token weight sums and token bit mask; unused slots -1 / 0 / 0."""
    m, k = ids.shape
    n = min(m * k, experts)
    order: list[int] = []
    weight = torch.zeros(n, M_PAD)
    tokens = [0] * n
    for t in range(m):
        for j in range(k):
            e = int(ids[t, j])
            if e not in order:
                order.append(e)
            s = order.index(e)
            weight[s, t] += float(weights[t, j])
            tokens[s] |= 1 << t
    return order + [-1] * (n - len(order)), weight, tokens


SLOT_CASES = {
    # name: (ids, experts)
    "all-tokens-one-expert": (torch.full((16, 1), 3), 4),
    "all-distinct": (torch.arange(16).view(4, 4), 16),
    "same-set-every-token": (torch.tensor([[5, 1, 7]] * 6), 8),
    "duplicates-within-a-token": (torch.tensor([[2, 2], [2, 5], [5, 5]]), 6),
    "more-pairs-than-experts": (torch.tensor([[0, 1, 2, 3], [3, 2, 1, 0], [1, 3, 0, 2]] * 4), 4),
    "one-token": (torch.tensor([[6, 0, 3]]), 7),
}


@pytest.mark.parametrize("name", list(SLOT_CASES))
def test_slot_grouping_on_crafted_ids(name):
    ids, experts = SLOT_CASES[name]
    weights = torch.rand(ids.shape, generator=torch.Generator().manual_seed(5)) + 0.1
    slots = slots_from_routing(on_device(weights), on_device(ids), experts)
    expert, weight, tokens = expected_slots(weights, ids, experts)
    assert slots.expert.tolist() == expert
    assert slots.tokens.tolist() == tokens
    torch.testing.assert_close(slots.weight.cpu(), weight, rtol=1e-6, atol=0)
    # ... and the whole MoE on that routing (duplicates within a token sum, as in the oracle).
    w_gate_up, w_down = make_weights(experts, 32, 64, "fp32")
    x = torch.randn(ids.shape[0], 32, generator=torch.Generator().manual_seed(6))
    assert_rows_close(*run_both(x, weights, ids, w_gate_up, w_down), RTOL)


def test_slot_grouping_int32_ids_and_noncontiguous_routing():
    ids = torch.tensor([[1, 4, 2], [4, 0, 1]], dtype=torch.int32).t().contiguous().t()  # [2, 3], column-major
    weights = torch.rand(3, 2).t()
    assert not ids.is_contiguous() and not weights.is_contiguous()
    slots = slots_from_routing(on_device(weights), on_device(ids), 5)
    expert, weight, tokens = expected_slots(weights, ids, 5)
    assert slots.expert.tolist() == expert and slots.tokens.tolist() == tokens
    torch.testing.assert_close(slots.weight.cpu(), weight, rtol=1e-6, atol=0)


# --- more tokens than one chunk ----------------------------------------------------------------

@pytest.mark.parametrize("tokens", [17, 40])
def test_more_than_m_pad_tokens_run_in_chunks(tokens):
    w_gate_up, w_down = make_weights(4, 32, 32, "bf16")
    weights, ids = random_routing(tokens, 2, 4)
    x = torch.randn(tokens, 32, generator=torch.Generator().manual_seed(7))
    shared = make_shared(32, 32)
    with backends.record_provenance() as prov:
        out, ref = run_both(x, weights, ids, w_gate_up, w_down, shared)
    assert_rows_close(out, ref, RTOL)
    # The expert kernels ran once per chunk of at most M_PAD tokens.
    chunks = [e.config["tokens"] for e in prov.events if "config" in e.config]
    assert chunks == [min(M_PAD, tokens - i) for i in range(0, tokens, M_PAD)]


def test_empty_batch_gives_an_empty_output():
    w_gate_up, w_down = make_weights(4, 32, 32)
    out, _ = run_both(torch.randn(0, 32), torch.rand(0, 2), torch.zeros(0, 2, dtype=torch.long), w_gate_up, w_down)
    assert out.shape == (0, 32)


def test_rows_of_x_may_be_strided():
    w_gate_up, w_down = make_weights(4, 64, 32)
    weights, ids = random_routing(3, 2, 4)
    x = torch.randn(6, 64, device=DEVICE)[::2]  # stride(0) = 128: rows apart, hidden contiguous
    assert not x.is_contiguous()
    assert_rows_close(*run_both(x, weights, ids, w_gate_up, w_down), RTOL)


# --- launch configurations ---------------------------------------------------------------------

@pytest.mark.parametrize("field,value", [
    ("gate_up_block_k", 16), ("gate_up_block_k", 48), ("down_block_k", 96), ("down_block_k", 0),
    ("gate_up_block_n", 8), ("gate_up_block_n", 24), ("down_block_n", 48),
])
def test_launch_config_rejects_blocks_that_are_not_powers_of_two_or_too_small(field, value):
    with pytest.raises(ValueError, match=f"{field} must be a power of two"):
        MoELaunchConfig(**{field: value})


def test_m_buckets():
    assert [m_bucket(m) for m in (1, 2, 3, 4, 5, 8, 9, 16)] == [1, 2, 4, 4, 8, 8, 16, 16]


def test_lookup_falls_back_for_untuned_shapes_and_uses_tuned_ones(monkeypatch):
    monkeypatch.setattr(moe_launch_config, "TUNED", {})
    assert lookup(8, 64, 32, 2, 3, "bf16", DEVICE) == MoELaunchConfig()
    tuned = MoELaunchConfig(gate_up_block_n=16, gate_up_block_k=32, down_block_n=64, down_block_k=64)
    monkeypatch.setitem(moe_launch_config.TUNED, (8, 64, 32, 2, 4, "bf16", device_name(DEVICE)), tuned)
    assert lookup(8, 64, 32, 2, 3, "bf16", DEVICE) is tuned  # M=3 falls in the M=4 bucket
    assert lookup(8, 64, 32, 2, 5, "bf16", DEVICE) == MoELaunchConfig()  # another bucket
    assert lookup(8, 64, 32, 2, 3, "mxfp4", DEVICE) == MoELaunchConfig()  # another format
    # moe_triton picks the tuned configuration up, records it, and computes the same result.
    w_gate_up, w_down = make_weights(8, 64, 32, "bf16")
    weights, ids = random_routing(3, 2, 8)
    x = torch.randn(3, 64)
    with backends.record_provenance() as prov:
        out, ref = run_both(x, weights, ids, w_gate_up, w_down)
    assert [e.config["config"] for e in prov.events if "config" in e.config] == [tuned]
    assert_rows_close(out, ref, RTOL)


@pytest.mark.parametrize("cfg", [
    MoELaunchConfig(gate_up_block_n=16, gate_up_block_k=32, down_block_n=16, down_block_k=32),
    # (gate_up 64 x 256 tiles at 3 stages need 288 KiB of shared memory; the H200 has 232 KiB.)
    MoELaunchConfig(gate_up_block_n=64, gate_up_block_k=128, down_block_n=128, down_block_k=64),
], ids=["small-blocks", "large-blocks"])
def test_explicit_launch_configs_give_the_same_result(cfg):
    """Blocks smaller and larger than H = 96 and I = 160 (masked tails, several K steps, one
    program covering everything): MXFP4 scale indexing must follow the block size."""
    w_gate_up, w_down = make_weights(4, 96, 160, "mxfp4")
    weights, ids = random_routing(2, 1, 4)
    x = torch.randn(2, 96)
    shared = make_shared(96, 32)
    with backends.record_provenance() as prov:
        out, ref = run_both(x, weights, ids, w_gate_up, w_down, shared, config=cfg)
    assert [e.config["config"] for e in prov.events if "config" in e.config] == [cfg]
    assert_rows_close(out, ref, RTOL)


# --- bad input gives a clear error -----------------------------------------------------------

E, H, I, T, K = 4, 64, 32, 3, 2


def good():
    """Valid inputs: x, weights, ids, w_gate_up, w_down, shared."""
    w_gate_up, w_down = make_weights(E, H, I, "bf16")
    weights, ids = random_routing(T, K, E)
    return dict(x=torch.randn(T, H), weights=weights, ids=ids, w_gate_up=w_gate_up, w_down=w_down,
                shared=make_shared(H, 32))


def mxfp4_pair():
    return make_weights(E, H, I, "mxfp4")


def noncontiguous(t: torch.Tensor) -> torch.Tensor:
    """The same values in a transposed layout (same shape, not contiguous)."""
    out = t.transpose(-1, -2).contiguous().transpose(-1, -2)
    assert not out.is_contiguous()
    return out


def on_meta(shared: SharedExpert) -> SharedExpert:
    return SharedExpert(shared.gate.to("meta"), shared.up.to("meta"), shared.down.to("meta"))


BAD = {
    # name: (change to the good inputs, exception, message pattern)
    "x-1d": (lambda a: {"x": a["x"][0]}, ValueError, r"x must be \[tokens, hidden\]"),
    "x-3d": (lambda a: {"x": a["x"][None]}, ValueError, r"x must be \[tokens, hidden\]"),
    "gate_up-wrong-hidden": (lambda a: {"w_gate_up": a["w_gate_up"][..., :32].contiguous()}, ValueError,
                             r"gate_up weight .* does not fit hidden size 64"),
    "down-wrong-shape": (lambda a: {"w_down": a["w_down"][:, :32].contiguous()}, ValueError,
                         r"down weight must be \(4, 64, 32\)"),
    "down-fewer-experts": (lambda a: {"w_down": a["w_down"][:3].contiguous()}, ValueError, r"down weight must be"),
    "ids-weights-shapes-differ": (lambda a: {"weights": a["weights"][:, :1]}, ValueError,
                                  r"routing ids .* and weights .* must both be"),
    "ids-other-token-count": (lambda a: {"ids": a["ids"][:2], "weights": a["weights"][:2]}, ValueError,
                              r"must both be \[3, top_k\]"),
    "top-k-zero": (lambda a: {"ids": a["ids"][:, :0], "weights": a["weights"][:, :0]}, ValueError, r"top_k >= 1"),
    "x-int": (lambda a: {"x": a["x"].int()}, TypeError, r"x must be floating point"),
    "weights-int": (lambda a: {"weights": a["weights"].int()}, TypeError, r"routing weights must be floating"),
    "ids-float": (lambda a: {"ids": a["ids"].float()}, TypeError, r"routing ids must be int32 or int64"),
    "ids-int16": (lambda a: {"ids": a["ids"].short()}, TypeError, r"routing ids must be int32 or int64"),
    "gate_up-int8": (lambda a: {"w_gate_up": a["w_gate_up"].to(torch.int8)}, TypeError,
                     r"gate_up weight must be floating point"),
    "weights-fp64": (lambda a: {"w_gate_up": a["w_gate_up"].double(), "w_down": a["w_down"].double()}, TypeError,
                     r"gate_up weight must be bf16, fp16, fp32 or MXFP4"),
    "all-on-meta": (lambda a: {k: v.to("meta") for k, v in a.items() if k != "shared"} | {"shared": None},
                    ValueError, r"needs .*tensors, got x on meta"),
    "x-on-meta": (lambda a: {"x": a["x"].to("meta")}, ValueError, r"got x on meta"),
    "ids-on-meta": (lambda a: {"ids": a["ids"].to("meta")}, ValueError, r"different devices: \[.*'meta'\]"),
    "down-on-meta": (lambda a: {"w_down": a["w_down"].to("meta")}, ValueError, r"different devices"),
    "mxfp4-on-meta": (lambda a: dict(zip(("w_gate_up", "w_down"), (w.to("meta") for w in mxfp4_pair()))),
                      ValueError, r"different devices"),
    "shared-on-meta": (lambda a: {"shared": on_meta(a["shared"])}, ValueError,
                       r"shared expert weights must be contiguous and on the device of x"),
    "gate_up-noncontiguous": (lambda a: {"w_gate_up": noncontiguous(a["w_gate_up"])}, ValueError,
                              r"gate_up weight must be contiguous"),
    "down-noncontiguous": (lambda a: {"w_down": noncontiguous(a["w_down"])}, ValueError,
                           r"down weight must be contiguous"),
    "mxfp4-packed-noncontiguous": (
        lambda a: (lambda gu, dn: {"w_gate_up": MXFP4Tensor(noncontiguous(gu.packed), gu.scales), "w_down": dn})(
            *mxfp4_pair()), ValueError, r"gate_up weight must be contiguous"),
    "mxfp4-scales-noncontiguous": (
        lambda a: (lambda gu, dn: {"w_gate_up": MXFP4Tensor(gu.packed, noncontiguous(gu.scales)), "w_down": dn})(
            *mxfp4_pair()), ValueError, r"gate_up weight must be contiguous"),
    "x-noncontiguous-hidden": (lambda a: {"x": noncontiguous(a["x"])}, ValueError,
                               r"x must be contiguous along the hidden dimension"),
    "shared-noncontiguous": (lambda a: {"shared": SharedExpert(noncontiguous(a["shared"].gate), a["shared"].up,
                                                               a["shared"].down)},
                             ValueError, r"shared expert weights must be contiguous"),
    "ids-negative": (lambda a: {"ids": a["ids"] - a["ids"].max() - 1}, ValueError,
                     r"expert ids must be in \[0, 4\), got range \[-\d+, -1\]"),
    "ids-too-large": (lambda a: {"ids": a["ids"] + E}, ValueError, r"expert ids must be in \[0, 4\), got range"),
    "ids-equal-to-E": (lambda a: {"ids": torch.full_like(a["ids"], E)}, ValueError, r"got range \[4, 4\]"),
    "hidden-not-multiple-of-32": (
        lambda a: {"x": torch.randn(T, 48), "w_gate_up": torch.randn(E, 2 * I, 48), "w_down": torch.randn(E, 48, I),
                   "shared": None}, ValueError, r"multiples of 32, got H=48, I=32"),
    "inter-not-multiple-of-32": (
        lambda a: {"w_gate_up": torch.randn(E, 2 * 48, H), "w_down": torch.randn(E, H, 48)}, ValueError,
        r"multiples of 32, got H=64, I=48"),
    "gate_up-mxfp4-down-bf16": (lambda a: {"w_gate_up": mxfp4_pair()[0]}, TypeError,
                                r"both be MXFP4 or both be plain tensors"),
    "gate_up-bf16-down-mxfp4": (lambda a: {"w_down": mxfp4_pair()[1]}, TypeError,
                                r"both be MXFP4 or both be plain tensors"),
    "shared-gate-wrong-hidden": (lambda a: {"shared": SharedExpert(torch.randn(32, H + 32), a["shared"].up,
                                                                   a["shared"].down)},
                                 ValueError, r"shared expert must be \[Is, 64\], \[Is, 64\], \[64, Is\]"),
    "shared-down-transposed": (lambda a: {"shared": SharedExpert(a["shared"].gate, a["shared"].up,
                                                                 a["shared"].down.t().contiguous())},
                               ValueError, r"shared expert must be"),
    "shared-up-other-width": (lambda a: {"shared": SharedExpert(a["shared"].gate, torch.randn(64, H),
                                                                a["shared"].down)},
                              ValueError, r"shared expert must be"),
}


@pytest.mark.parametrize("name", list(BAD))
def test_bad_input_gives_a_clear_error(name):
    change, exc, pattern = BAD[name]
    args = {k: on_device(v) for k, v in good().items()}
    args.update({k: on_device(v) for k, v in change(args).items()})
    with pytest.raises(exc, match=pattern):
        moe_triton(**args)


def test_the_good_inputs_of_the_error_cases_run():
    """The baseline the error cases change one thing of: valid as is."""
    assert_rows_close(*run_both(**good()), RTOL)


# --- MXFP4 product paths: tensor cores, or the register path's dp4a products -------------------

# name: (config, the product recorded for M <= 4, for M = 16). Blocks of 32 x 64 leave masked
# tails at H = 96 and I = 160 and take several K steps; 64 x 256 covers all of K in one step.
MXFP4_VARIANTS = {
    "dot-bits": (MoELaunchConfig(gate_up_block_k=64, down_block_k=64), "dot-bits", "dot-bits"),
    "gemv-dp4a": (MoELaunchConfig(gate_up_block_k=64, down_block_k=64, gemv_max_tokens=4), "gemv-dp4a", "dot-bits"),
    "gemv-dp4a-large-blocks": (MoELaunchConfig(gate_up_block_n=64, gate_up_block_k=256, down_block_n=64,
                                               down_block_k=256, gemv_max_tokens=4), "gemv-dp4a", "dot-bits"),
    "gemv-dp4a-one-scale-block": (MoELaunchConfig(gate_up_block_n=32, gate_up_block_k=32, down_block_n=16,
                                                  down_block_k=32, gemv_max_tokens=2), "gemv-dp4a", "dot-bits"),
    # Each K step of the register loops loading the next one's weights, or the one after next's
    # (the loads past K masked off; K = 96 here: in tiles of 64 a partial second step, in tiles of
    # 32 three whole steps and two loads past the end).
    "gemv-dp4a-lookahead": (MoELaunchConfig(gate_up_block_k=64, down_block_k=64, gemv_max_tokens=4,
                                            gate_up_lookahead=1, down_lookahead=1, shared_lookahead=1), "gemv-dp4a",
                            "dot-bits"),
    "gemv-dp4a-lookahead2": (MoELaunchConfig(gate_up_block_k=32, down_block_k=32, gemv_max_tokens=4,
                                             gate_up_lookahead=2, down_lookahead=2, shared_lookahead=2), "gemv-dp4a",
                             "dot-bits"),
    # Launches overlapping (PDL, on a GPU; the interpreter runs launches in order anyway).
    "gemv-dp4a-pdl": (MoELaunchConfig(gate_up_block_k=64, down_block_k=64, gemv_max_tokens=4, pdl=True,
                                      l2_prefetch=True), "gemv-dp4a", "dot-bits"),
}


def variant_rtol(variant: str) -> float:
    """The tolerance of a variant name, or of a weight format on the register path (MXFP4 there
    takes the dp4a products)."""
    return DP4A_RTOL if "dp4a" in variant or variant == "mxfp4" else RTOL


# The PDL variant differs from gemv-dp4a only in how launches overlap on a GPU. Under Triton's
# interpreter PDL is never used (impl.moe.triton_pdl.use_pdl: PDL and L2_PREFETCH are False), so
# there its cases would run gemv-dp4a's very kernels on the very inputs again: they run on a GPU
# only. On a CPU a PDL config is still run end to end by test_layer_with_overlapping_launches_*.
ON_A_GPU_ONLY = pytest.mark.skipif(INTERPRET, reason="under the interpreter PDL is off: gemv-dp4a's case again")
VARIANT_CASES = ([(v, m) for v in ("dot-bits", "gemv-dp4a") for m in (1, 2, 3, 4, 16)]
                 + [("gemv-dp4a-large-blocks", 1), ("gemv-dp4a-large-blocks", 4),
                    ("gemv-dp4a-one-scale-block", 1), ("gemv-dp4a-one-scale-block", 2)]
                 + [pytest.param("gemv-dp4a-pdl", m, marks=ON_A_GPU_ONLY) for m in (1, 3, 16)]
                 + [("gemv-dp4a-lookahead", m) for m in (1, 2, 4)] + [("gemv-dp4a-lookahead2", m) for m in (1, 4)])


@pytest.mark.parametrize("variant,tokens", VARIANT_CASES)
def test_mxfp4_variants_match_reference(variant, tokens):
    """Each MXFP4 product path against the oracle at the stated tolerance, for M in {1, 2, 4, 16} (and 3:
    a GEMV of 4 rows with one row masked), with a shared expert; provenance names the product
    that ran (tensor cores beyond gemv_max_tokens)."""
    cfg, small, large = MXFP4_VARIANTS[variant]
    w_gate_up, w_down = make_weights(6, 96, 160, "mxfp4", seed=tokens)
    weights, ids = random_routing(tokens, 2, 6, seed=tokens + 1)
    x = torch.randn(tokens, 96, generator=torch.Generator().manual_seed(tokens + 2))
    with backends.record_provenance() as prov:
        out, ref = run_both(x, weights, ids, w_gate_up, w_down, make_shared(96, 32), config=cfg)
    assert_rows_close(out, ref, variant_rtol(variant) if tokens <= cfg.gemv_max_tokens else RTOL)
    expected = small if tokens <= cfg.gemv_max_tokens else large
    assert [e.config["product"] for e in prov.events if "product" in e.config] == [expected]


@pytest.mark.parametrize("fmt,split,tokens", [
    ("mxfp4", 2, 1), ("mxfp4", 8, 3), ("mxfp4", 4, 2), ("bf16", 4, 4),
    ("mxfp4", 4, 16),  # beyond gemv_max_tokens: tensor cores, one shared program
])
def test_shared_split_matches_reference(fmt, split, tokens):
    """shared_split programs share the shared expert (gate_up: rows of a block; down: K in whole
    blocks of 32, here I_s = 160 = 5 blocks, so at a split of 4 or 8 some programs get a shorter
    share and some none) and the result is the oracle's."""
    cfg = MoELaunchConfig(gate_up_block_k=64, down_block_k=64, gemv_max_tokens=4, shared_split=split)
    w_gate_up, w_down = make_weights(6, 96, 64, fmt, seed=21)
    weights, ids = random_routing(tokens, 2, 6, seed=22)
    x = torch.randn(tokens, 96, generator=torch.Generator().manual_seed(23))
    out, ref = run_both(x, weights, ids, w_gate_up, w_down, make_shared(96, 160), config=cfg)
    assert_rows_close(out, ref, variant_rtol(fmt) if tokens <= 4 else RTOL)


@pytest.mark.parametrize("fmt,split,tokens,lookahead", [
    ("mxfp4", 1, 1, 0), ("mxfp4", 2, 3, 0), ("mxfp4", 1, 4, 0), ("bf16", 1, 1, 0), ("bf16", 2, 3, 0),
    ("fp32", 1, 4, 0), ("mxfp4", 2, 1, 1), ("mxfp4", 1, 4, 1), ("bf16", 1, 1, 1), ("bf16", 2, 3, 1),
    ("mxfp4", 1, 1, 2), ("bf16", 2, 3, 2),
])
def test_whole_tiles_load_unmasked_and_match_reference(fmt, split, tokens, lookahead):
    """Shapes every tile divides (as the presets' do), so the register paths load without masks
    (`even_tiles`), with the shared expert in K tiles of its own, loading one or two steps
    ahead or not (the look-ahead past the last step masked off even here): against the oracle."""
    cfg = MoELaunchConfig(gate_up_block_n=32, gate_up_block_k=64, down_block_n=32, down_block_k=32,
                          gemv_max_tokens=4, shared_split=split, shared_block_k=32,
                          gate_up_lookahead=lookahead, down_lookahead=lookahead, shared_lookahead=lookahead)
    hidden, inter, i_shared = 128, 64, 64
    assert triton_launch.even_tiles(cfg, hidden, inter, i_shared, split, (32, 32)) == (True, True)
    w_gate_up, w_down = make_weights(6, hidden, inter, fmt, seed=31)
    weights, ids = random_routing(tokens, 2, 6, seed=32)
    x = torch.randn(tokens, hidden, generator=torch.Generator().manual_seed(33))
    with backends.record_provenance() as prov:
        out, ref = run_both(x, weights, ids, w_gate_up, w_down, make_shared(hidden, i_shared), config=cfg)
    assert_rows_close(out, ref, variant_rtol(fmt))
    assert [e.config["config"].shared_block_k for e in prov.events if "product" in e.config] == [32]


# (gate_up routed, gate_up shared, down routed, down shared): the shared expert's down loop never
# looks ahead (`MoELaunchConfig.shared_lookahead`).
@pytest.mark.parametrize("fields,tokens,aheads", [
    (dict(gate_up_lookahead=2, down_lookahead=1), 1, (2, 0, 1, 0)),
    (dict(gate_up_lookahead=2, down_lookahead=1, shared_lookahead=1), 2, (2, 1, 1, 0)),
    (dict(gate_up_lookahead=1, down_lookahead=1, shared_lookahead=2), 8, (0, 0, 0, 0)),  # past gemv_max_tokens
])
def test_expert_launch_encodes_each_kernels_lookahead(fields, tokens, aheads):
    """The register loops' look-ahead per kernel as `expert_launch` hands it to the kernels. The
    interpreter computes the same sums at any look-ahead, so a wrong encoding here would pass
    every CPU parity test and only change what the GPU runs."""
    cfg = MoELaunchConfig(gemv_max_tokens=4, gate_up_block_n=32, shared_split=2, **fields)
    launch = triton_launch.expert_launch(cfg, tokens=tokens, num_slots=3, hidden=128, inter=64, i_shared=64,
                                         mxfp4=True, pdl=False)
    assert tuple(k.consts[c] for k in (launch.gate_up, launch.down) for c in ("AHEAD", "SHARED_AHEAD")) == aheads
    split = 2 if tokens <= 4 else 1  # the shared expert's programs: its split on the register path only
    assert launch.gate_up.grid == (3 + split, 2) and launch.down.grid == (128 // cfg.down_block_n, 3 + split)


def test_even_tiles_needs_every_tile_whole():
    """The no-mask rule: every routed and shared tile of a kernel inside its weight."""
    cfg = MoELaunchConfig(gate_up_block_n=32, gate_up_block_k=512, down_block_n=32, down_block_k=256,
                          shared_block_k=128)
    even = triton_launch.even_tiles
    assert even(cfg, 2560, 768, 768, 1, (128, 128)) == (True, True)  # Ling-3.0-flash
    assert even(cfg, 4096, 1024, 1024, 1, (128, 128)) == (True, True)  # Ling-flash-2.0
    assert even(cfg, 2560, 768, 0, 1, (128, 128)) == (True, True)  # no shared expert
    assert even(cfg, 2304, 768, 768, 1, (128, 128)) == (False, True)  # H not a multiple of the gate_up K tile
    assert even(cfg, 2560, 784, 768, 1, (128, 128)) == (False, False)  # I: gate_up rows and down K
    assert even(cfg, 2560, 768, 112, 1, (128, 128)) == (False, False)  # shared rows and shared K
    assert even(cfg, 2560, 768, 96, 1, (128, 128)) == (True, False)  # shared K 96: not whole tiles of 128
    assert even(cfg, 2560, 768, 768, 4, (128, 64)) == (True, True)  # shared K shares of 192: 3 tiles of 64
    assert even(cfg, 2560, 768, 768, 4, (128, 128)) == (True, False)  # ... but 1.5 tiles of 128


@pytest.mark.parametrize("value", [16, 48, -32])
def test_launch_config_rejects_bad_shared_k_tiles(value):
    with pytest.raises(ValueError, match=f"shared_block_k must be a power of two >= 32.*got {value}"):
        MoELaunchConfig(shared_block_k=value)


@pytest.mark.parametrize("fmt", ["mxfp4", "bf16"])
def test_layer_with_overlapping_launches_matches_reference(fmt, monkeypatch):
    """The whole layer (router kernels + expert kernels) under a tuned config with PDL (on a GPU:
    each launch starting while the one before finishes, the shared expert's gate_up during the
    router's top-k) against the oracle backend on the same block, twice in a row (the second
    call's router overlapping the first call's down kernel); provenance says the router ran with
    PDL and its L2 prefetch."""
    from impl.model.config import get_config
    from impl.moe.random_layer import random_moe_block
    cfg = get_config("tiny")
    tuned = MoELaunchConfig(gate_up_block_k=64, down_block_k=64, gemv_max_tokens=4, pdl=True, l2_prefetch=True)
    for bucket in (1, 2):
        monkeypatch.setitem(moe_launch_config.TUNED, (cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size, cfg.top_k,
                                            bucket, fmt, device_name(DEVICE)), tuned)
    ours, oracle = (random_moe_block(cfg, fmt, DEVICE, backend, seed=5, dtype=torch.float32)
                    for backend in ("triton", "reference"))
    for tokens in (1, 2):
        x = torch.randn(tokens, cfg.hidden_size, generator=torch.Generator().manual_seed(tokens)).to(DEVICE)
        with backends.record_provenance() as prov, torch.no_grad():
            out = ours(x)
            ref = oracle(x)
        assert [(e.kernel, e.config.get("pdl"), e.config.get("l2_prefetch")) for e in prov.events
                if "router" in e.kernel] == [("router_logits_kernel+router_topk_kernel", True, True)]
        assert [e.config["config"] for e in prov.events if "config" in e.config] == [tuned]
        assert_rows_close(out.cpu(), ref.cpu(), variant_rtol(fmt))


@pytest.mark.parametrize("field", ["pdl", "l2_prefetch"])
def test_launch_config_rejects_non_bool_pdl_flags(field):
    with pytest.raises(TypeError, match=f"{field} must be a bool, got 1"):
        MoELaunchConfig(**{field: 1})


def test_pdl_on_a_gpu_older_than_sm90_is_a_clear_error(monkeypatch):
    """A launch config asking for PDL on a GPU without it fails by name, not deep in ptxas; on
    sm_90 it is used; under the interpreter it is never used."""
    from impl.moe import triton_pdl
    if triton_pdl.INTERPRET:
        assert triton_pdl.use_pdl(True, torch.device("cpu")) is False
    monkeypatch.setattr(triton_pdl, "INTERPRET", False)
    with pytest.raises(ValueError, match="pdl needs an sm_90 or newer GPU .*got cpu"):
        triton_pdl.use_pdl(True, torch.device("cpu"))
    monkeypatch.setattr(triton_pdl.torch.cuda, "get_device_name", lambda index=None: "Fake A100")
    monkeypatch.setattr(triton_pdl, "_capability", lambda index: (8, 0))
    with pytest.raises(ValueError, match="pdl needs an sm_90 or newer GPU .*got Fake A100"):
        triton_pdl.use_pdl(True, torch.device("cuda", 0))
    monkeypatch.setattr(triton_pdl, "_capability", lambda index: (9, 0))
    assert triton_pdl.use_pdl(True, torch.device("cuda", 0)) and not triton_pdl.use_pdl(False, torch.device("cuda", 0))


@pytest.mark.parametrize("fields,message", [
    (dict(gate_up_lookahead=3), "gate_up_lookahead must be 0, 1 or 2 .K steps ahead., got 3"),
    (dict(down_lookahead=True), "down_lookahead must be 0, 1 or 2 .K steps ahead., got True"),
    (dict(shared_lookahead=-1), "shared_lookahead must be 0, 1 or 2 .K steps ahead., got -1"),
])
def test_launch_config_rejects_bad_lookaheads(fields, message):
    with pytest.raises(ValueError, match=message):
        MoELaunchConfig(**fields)


def test_l2_prefetch_needs_pdl():
    with pytest.raises(ValueError, match="l2_prefetch needs pdl"):
        MoELaunchConfig(l2_prefetch=True)


@pytest.mark.parametrize("split", [0, 3, 16])
def test_launch_config_rejects_other_shared_splits(split):
    with pytest.raises(ValueError, match=f"shared_split must be 1, 2, 4 or 8, got {split}"):
        MoELaunchConfig(shared_split=split)


@pytest.mark.parametrize("variant", ["dot-bits", "gemv-dp4a"])
def test_plain_weights_take_the_plain_products(variant):
    """Configs made for MXFP4 experts run plain weights through the plain products: same result,
    the plain product recorded."""
    cfg = MXFP4_VARIANTS[variant][0]
    w_gate_up, w_down = make_weights(4, 64, 64, "bf16")
    weights, ids = random_routing(2, 2, 4)
    x = torch.randn(2, 64)
    with backends.record_provenance() as prov:
        out, ref = run_both(x, weights, ids, w_gate_up, w_down, make_shared(64, 32), config=cfg)
    assert_rows_close(out, ref, RTOL)
    assert [e.config["product"] for e in prov.events if "product" in e.config] == [
        "gemv-plain" if cfg.gemv_max_tokens >= 2 else "dot-plain"]


def test_launch_config_rejects_the_register_path_with_gate_up_blocks_under_32():
    """The gate_up kernel splits its output for the dp4a down projection in whole blocks of 32."""
    with pytest.raises(ValueError, match="the register path needs gate_up_block_n >= 32 .*got 16"):
        MoELaunchConfig(gemv_max_tokens=4, gate_up_block_n=16)
    MoELaunchConfig(gemv_max_tokens=4, gate_up_block_n=32, down_block_n=16)
    MoELaunchConfig(gate_up_block_n=16)  # tensor cores only


def test_tuned_configs_load_missing_fields_as_defaults_and_reject_unknown_ones(tmp_path):
    """An entry that leaves fields out gets their defaults; one naming a field that no longer
    exists (a removed path) is an error naming the file and the field."""
    path = tmp_path / "tuned.json"
    key = ('{"experts": 8, "hidden": 64, "intermediate": 32, "top_k": 2, "m_bucket": 1, "format": "mxfp4", '
           '"device": "cpu"}')
    path.write_text(f'[{{"key": {key}, "config": {{"gemv_max_tokens": 4}}}}]')
    table = dataclasses.replace(moe_launch_config.TABLE, path=path)
    (cfg,) = table.load().values()
    assert (cfg.gemv_max_tokens, cfg.gate_up_lookahead, cfg.pdl) == (4, 0, False)
    path.write_text(f'[{{"key": {key}, "config": {{"gemv_decode": "word32"}}}}]')
    with pytest.raises(ValueError, match=r"tuned.json: malformed tuned MoE configs .*gemv_decode"):
        table.load()


@pytest.mark.parametrize("ids", [
    [[0, 1], [0, 2], [3, 4], [5, 0]],  # expert 0 chosen by three tokens, the others by one each
    [[0, 1], [2, 3], [4, 5], [6, 7]],  # every expert by one token (a typical verify step)
    [[6, 2], [2, 6], [6, 2]],  # every expert by every token
], ids=["mixed", "all-single", "all-shared"])
@pytest.mark.parametrize("variant", ["gemv-dp4a", "gemv-dp4a-lookahead"])
def test_register_path_rows_of_single_token_experts(ids, variant):
    """The register path computes only the row of an MXFP4 expert chosen by exactly one token (its
    `tokens` mask has one bit): both that branch and the all-rows branch against the oracle."""
    cfg = MXFP4_VARIANTS[variant][0]
    ids = torch.tensor(ids)
    w_gate_up, w_down = make_weights(8, 64, 96, "mxfp4", seed=11)
    weights = torch.rand(ids.shape, generator=torch.Generator().manual_seed(12)) + 0.1
    x = torch.randn(ids.shape[0], 64, generator=torch.Generator().manual_seed(13))
    assert_rows_close(*run_both(x, weights, ids, w_gate_up, w_down, config=cfg), variant_rtol(variant))


def test_experts_on_x_split_elsewhere_match_their_own_split():
    """moe_experts given x already split (as the router's logits kernel does in the layer) gives
    bit for bit what it gives splitting x itself, without its split launch; `split_buffers`
    offers buffers only when the dp4a products will run."""
    from impl.moe.triton_backend import moe_experts, split_buffers
    from impl.moe.triton_dp4a import split_int8_kernel
    cfg = MXFP4_VARIANTS["gemv-dp4a"][0]
    w_gate_up, w_down = (on_device(w) for w in make_weights(6, 96, 64, "mxfp4", seed=31))
    weights, ids = random_routing(2, 2, 6, seed=32)
    x = torch.randn(2, 96, generator=torch.Generator().manual_seed(33)).to(DEVICE)
    slots = slots_from_routing(weights.to(DEVICE), ids.to(DEVICE), 6)
    plan = triton_launch.plan
    assert split_buffers(x, plan(2, 2, w_gate_up, w_down, DEVICE, MXFP4_VARIANTS["dot-bits"][0])) is None
    assert split_buffers(x[:1].expand(16, 96), plan(16, 2, w_gate_up, w_down, DEVICE, cfg)) is None  # tensor cores
    q, s = split_buffers(x, plan(2, 2, w_gate_up, w_down, DEVICE, cfg))
    split_int8_kernel[(2, 1)](x, x.stride(0), q, s, 96, BLOCK_K=128)
    with backends.record_provenance() as prov:
        given = moe_experts(x, slots, w_gate_up, w_down, config=cfg, x_split=(q, s))
    assert [e.kernel for e in prov.events] == ["moe_gate_up_kernel+moe_down_kernel"]
    with backends.record_provenance() as prov:
        own = moe_experts(x, slots, w_gate_up, w_down, config=cfg)
    assert [e.kernel for e in prov.events] == ["split_int8_kernel+moe_gate_up_kernel+moe_down_kernel"]
    assert torch.equal(given, own)
    with pytest.raises(ValueError, match=r"x_split must be contiguous int32 planes \[2, 4, 12\]"):
        moe_experts(x, slots, w_gate_up, w_down, config=cfg, x_split=(q[:1], s[:1]))


def test_dp4a_nan_in_an_input_row_reaches_exactly_that_row():
    """The dp4a products split x per token and block of 32: a NaN in token 1's row gives that
    block a NaN scale, so token 1's outputs are all NaN (as the oracle's), and no other token's
    (each token's split is its own)."""
    cfg = MXFP4_VARIANTS["gemv-dp4a"][0]
    w_gate_up, w_down = make_weights(6, 96, 64, "mxfp4", seed=41)
    weights, ids = random_routing(3, 2, 6, seed=42)
    ids[1] = ids[0]  # token 1 shares token 0's experts: one slot computes both rows
    x = torch.randn(3, 96, generator=torch.Generator().manual_seed(43))
    x[1, 50] = float("nan")
    out, ref = run_both(x, weights, ids, w_gate_up, w_down, make_shared(96, 32), config=cfg)
    assert out[1].isnan().all() and ref[1].isnan().all()
    assert out[[0, 2]].isfinite().all()
    assert_rows_close(out[[0, 2]], ref[[0, 2]], DP4A_RTOL)


@pytest.mark.parametrize("fmt,tokens,kernel", [("bf16", 40, "moe_gather"), ("mxfp4", 20, "moe_gate_up_kernel")])
def test_layer_prefill_of_plain_experts_takes_one_gather_pass(fmt, tokens, kernel):
    """More than M_PAD tokens through the whole layer: plain experts in one gather pass over all
    tokens (recorded as the triton backend's `moe_gather`, prefill), MXFP4 experts in chunks of
    the expert kernels; both against the oracle backend on the same block."""
    from impl.model.config import get_config
    from impl.moe.random_layer import random_moe_block
    cfg = get_config("tiny")
    ours, oracle = (random_moe_block(cfg, fmt, DEVICE, backend, seed=7, dtype=torch.float32)
                    for backend in ("triton", "reference"))
    x = torch.randn(tokens, cfg.hidden_size, generator=torch.Generator().manual_seed(8)).to(DEVICE)
    with backends.record_provenance() as prov, torch.no_grad():
        out = ours(x)
        ref = oracle(x)
    ran = [e.kernel for e in prov.events if e.backend == "triton"]
    assert any(kernel in k for k in ran), ran
    assert ("moe_gather" in ran) == (fmt == "bf16"), ran
    assert_rows_close(out.cpu(), ref.cpu(), variant_rtol(fmt) if fmt == "mxfp4" else RTOL)
