"""The FP8 LM head module, its backends and provenance, the bf16 head, and the model's head switch.

Tolerances, relative Frobenius error (`compare_logits`):
  * against the dequantize-then-matmul oracle of the *same* FP8 weight: "fp8-dequant" is that
    oracle (1e-6: only op order differs); "fp8-triton" 1e-5 under the interpreter / 2e-3 on a
    GPU (tests/test_fp8_gemv.py says why); "fp8-scaled-mm" quantizes the activations to e4m3 as
    well (W8A8), which adds an independent error of RMS 2**-3 * sqrt(0.541 / 12) = 2.65% (see
    WEIGHT_QUANT_RMS below), so its bound is 2**-4 / sqrt(3) = 3.6% (the worst case of that RMS,
    for values all at the bottom of their binade) plus margin: 4.5%.
  * against the unquantized head: the weight quantization error alone, same bound: 4%.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from torch import nn

from impl import backends
from impl.generate import generate
from impl.head import (BF16Head, FP8Head, HEAD_BACKEND_ALIASES, LogitParity, as_bf16_weight, compare_logits,
                       default_fp8_backend, require_head_backend)
from impl.model import build_model, get_config
from impl.quant import FP8Tensor, quantize_fp8
from impl.triton_env import INTERPRET

DEVICE = torch.device("cpu" if INTERPRET else "cuda")
# e4m3 keeps 3 mantissa bits: a value in [2**e, 2**(e+1)) is rounded to a multiple of 2**(e-3),
# an error uniform in +-2**(e-4), RMS 2**(e-3) / sqrt(12). Relative to the value, for values spread
# evenly in log over the binade (E[1/v**2] = 0.541 * 2**-2e), the RMS relative error is
# 2**-3 * sqrt(0.541 / 12) = 2.65%; the worst case (every value at 2**e) is 2**-4 / sqrt(3) = 3.6%.
# A logit is a sum of many such errors times activations, so its error relative to the logit
# vector is the same ~2.65% (measured: 2.64-2.66% on the H200 for 157184-row heads).
WEIGHT_QUANT_RMS = 2**-3 * math.sqrt(0.541 / 12)
MAX_REL_ERR_W8A16 = 0.04
MAX_REL_ERR_W8A8 = 0.045
KERNEL_TOL = 1e-5 if INTERPRET else 2e-3


def linear(v: int, h: int, seed: int, dtype=torch.float32) -> nn.Linear:
    lin = nn.Linear(h, v, bias=False)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(v, h, generator=torch.Generator().manual_seed(seed)) * 0.02)
    return lin.to(DEVICE, dtype)


def hidden(shape, seed: int, dtype=torch.float32) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(DEVICE, dtype)


# --------------------------------------------------------------------------- module contract

def test_from_linear_owns_data_and_scales_together():
    lin = linear(150, 96, 0)
    for granularity in ("row", "tensor"):
        head = FP8Head.from_linear(lin, granularity)
        want = quantize_fp8(lin.weight.detach(), granularity)
        got = head.fp8_weight
        assert isinstance(got, FP8Tensor) and got.granularity == granularity
        assert torch.equal(got.data.view(torch.uint8), want.data.view(torch.uint8))
        assert torch.equal(got.scale, want.scale)
        assert (head.in_features, head.out_features) == (96, 150)
        assert set(head.state_dict()) == {"_fp8_data", "_fp8_scale"}
        assert list(head.parameters()) == []


def test_no_weight_attribute_and_a_message_that_says_why():
    head = FP8Head.from_linear(linear(20, 16, 1))
    with pytest.raises(AttributeError, match=r"FP8Head has no `\.weight`.*e4m3 data and fp32 scales.*module"):
        head.weight  # noqa: B018
    assert not hasattr(head, "weight")
    with pytest.raises(AttributeError, match="has no attribute 'bias'"):  # other names: the usual error
        head.bias  # noqa: B018


def test_dtype_changes_keep_the_fp8_format_and_device_moves_carry_both():
    head = FP8Head.from_linear(linear(30, 32, 2))
    before = head.fp8_weight
    for convert in (lambda m: m.to(torch.bfloat16), lambda m: m.half(), lambda m: m.float(), lambda m: m.double()):
        convert(head)
        assert head._fp8_data.dtype == torch.float8_e4m3fn and head._fp8_scale.dtype == torch.float32
        assert torch.equal(head._fp8_scale, before.scale)
    head.to("meta")
    assert head._fp8_data.device.type == head._fp8_scale.device.type == "meta"
    assert head._fp8_data.dtype == torch.float8_e4m3fn


def test_a_model_cast_after_quantizing_keeps_the_head():
    model = build_model("tiny", head="fp8")
    model.to(torch.bfloat16)
    assert model.lm_head._fp8_data.dtype == torch.float8_e4m3fn
    assert model.lm_head._fp8_scale.dtype == torch.float32


def test_state_dict_round_trip():
    a = FP8Head.from_linear(linear(40, 24, 3), "tensor")
    b = FP8Head(quantize_fp8(torch.zeros(40, 24), "tensor")).to(DEVICE)  # load_state_dict copies values only
    b.load_state_dict(a.state_dict())
    x = hidden((3, 24), 4)
    assert torch.equal(a(x), b(x))


# ------------------------------------------------------------------------ FP8 never read as bf16

def test_bf16_paths_refuse_fp8_weights_loudly():
    q = quantize_fp8(torch.randn(8, 16), "row")
    with pytest.raises(TypeError, match="FP8Tensor.*bf16 head path.*share the head \\*module\\*"):
        as_bf16_weight(q)
    with pytest.raises(TypeError, match="bare torch.float8_e4m3fn tensor.*without their scales"):
        as_bf16_weight(q.data)
    with pytest.raises(TypeError, match="FP8 bytes viewed as integers"):
        as_bf16_weight(q.data.view(torch.uint8))
    bf16 = backends.get("head", "bf16")
    with pytest.raises(TypeError, match="FP8Tensor"):
        bf16.fn(torch.randn(2, 16), q, torch.float32)
    w = torch.randn(8, 16, dtype=torch.bfloat16)
    assert as_bf16_weight(w) is w


def test_fp8_backends_refuse_bare_fp8_bytes():
    q = quantize_fp8(torch.randn(8, 16), "row")
    for name in ("fp8-triton", "fp8-scaled-mm", "fp8-dequant"):
        with pytest.raises(TypeError, match="without its scales"):
            backends.get("head", name).fn(torch.randn(2, 16), q.data, torch.float32)
        with pytest.raises(TypeError, match="takes an FP8Tensor"):
            backends.get("head", name).fn(torch.randn(2, 16), torch.randn(8, 16), torch.float32)


def test_a_draft_that_takes_the_weight_instead_of_the_module_fails():
    """The speculative-decoding defect: a draft built from `target.lm_head.weight` instead of the
    head module. With an FP8 head there is no such weight to take."""
    model = build_model("tiny", head="fp8")
    with pytest.raises(AttributeError, match="FP8Head has no `.weight`"):
        nn.Linear(1, 1).weight = model.lm_head.weight  # what a careless draft would do


# --------------------------------------------------------------------------- backends and parity

def test_head_backends_are_registered():
    assert {"bf16", "fp8-triton", "fp8-scaled-mm", "fp8-dequant"} <= set(backends.available("head"))
    assert set(HEAD_BACKEND_ALIASES.values()) <= set(backends.available("head"))


def test_unknown_or_non_fp8_backend_is_refused_with_the_list():
    lin = linear(10, 16, 5)
    with pytest.raises(ValueError, match=r"unknown head backend 'cutlass'; available: .*fp8-triton.*short names"):
        FP8Head.from_linear(lin, backend="cutlass")
    with pytest.raises(ValueError, match="'bf16' is not an FP8 head backend"):
        FP8Head.from_linear(lin, backend="bf16")
    head = FP8Head.from_linear(lin)
    with pytest.raises(ValueError, match="unknown head backend"):
        head.backend = "nope"
    assert head.backend == "fp8-triton"


@pytest.mark.parametrize("granularity", ["row", "tensor"])
@pytest.mark.parametrize("backend, tol", [("dequant", 1e-6), ("triton", KERNEL_TOL), ("scaled_mm", MAX_REL_ERR_W8A8)])
def test_each_backend_against_the_fp8_oracle_and_the_unquantized_head(granularity, backend, tol):
    lin = linear(300, 128, 6)
    head = FP8Head.from_linear(lin, granularity, backend)
    oracle = FP8Head(head.fp8_weight, backend="dequant")
    dtype = torch.float32 if INTERPRET else torch.bfloat16
    x = hidden((2, 5, 128), 7, dtype)
    ours = head(x)
    assert ours.shape == (2, 5, 300) and ours.dtype == dtype
    assert compare_logits(ours, oracle(x)).rel_err <= tol
    bound = MAX_REL_ERR_W8A8 if backend == "scaled_mm" else MAX_REL_ERR_W8A16
    parity = compare_logits(ours.float(), x.float() @ lin.weight.float().t())
    assert parity.nonfinite_rows == 0 and parity.rel_err <= bound, parity


def test_weight_quantization_error_is_what_the_bound_assumes():
    """The measured error sits near the 2.65% RMS derived above and under the 3.6% worst case."""
    lin = linear(2000, 256, 8)
    x = hidden((64, 256), 9)
    p = compare_logits(FP8Head.from_linear(lin, backend="dequant")(x), lin(x))
    assert 0.8 * WEIGHT_QUANT_RMS <= p.rel_err <= 2**-4 / math.sqrt(3), p


def test_out_dtype_and_leading_dims():
    lin = linear(64, 32, 10)
    x = hidden((3, 4, 32), 11)
    head = FP8Head.from_linear(lin, out_dtype=torch.bfloat16)
    out = head(x)
    assert out.shape == (3, 4, 64) and out.dtype == torch.bfloat16
    assert head(x[:0]).shape == (0, 4, 64)
    assert head(x[0, 0]).shape == (64,)  # a single hidden vector


def test_bad_inputs_are_refused_clearly():
    head = FP8Head.from_linear(linear(64, 32, 12))
    with pytest.raises(ValueError, match=r"hidden states \[\.\.\., 32\], got shape \(2, 31\)"):
        head(hidden((2, 31), 0))
    with pytest.raises(TypeError, match="got torch.int64"):
        head(torch.ones(2, 32, dtype=torch.long, device=DEVICE))
    with pytest.raises(TypeError, match="FP8 activations are not an input format"):
        head(hidden((2, 32), 0).to(torch.float8_e4m3fn))
    with pytest.raises(ValueError, match="hidden states are on meta but the FP8 head's weight and scales are on"):
        head(torch.empty(2, 32, device="meta"))
    with pytest.raises(TypeError, match="torch.Tensor"):
        head([[0.0] * 32])
    with pytest.raises(ValueError, match="already an FP8Head"):
        FP8Head.from_linear(head)
    with pytest.raises(ValueError, match="bias"):
        FP8Head.from_linear(nn.Linear(4, 4, bias=True))
    with pytest.raises(ValueError, match="granularity"):
        FP8Head.from_linear(linear(4, 4, 0), granularity="block")
    with pytest.raises(TypeError, match="FP8Tensor"):
        FP8Head(torch.zeros(4, 4))


def test_nan_rows_propagate_through_every_backend():
    lin = linear(100, 64, 13)
    x = hidden((5, 64), 14)
    x[2, 10] = float("nan")
    for backend in ("triton", "dequant", "scaled_mm"):
        for granularity in ("row", "tensor"):
            out = FP8Head.from_linear(lin, granularity, backend)(x)
            nan_rows = torch.isnan(out).any(dim=1).tolist()
            assert nan_rows == [False, False, True, False, False], (backend, granularity)
            assert torch.isnan(out[2]).all()


# ------------------------------------------------------------------------------- parity helper

def test_compare_logits_counts_what_it_says():
    ref = torch.tensor([[5.0, 4.0, 3.0, 2.0, 1.0, 0.0, -1.0], [0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0]])
    same = compare_logits(ref.clone(), ref)
    assert same.rel_err == 0 and same.top1_agreement == 1 and same.top5_overlap == 1
    swapped = ref.clone()
    swapped[0, [0, 6]] = swapped[0, [6, 0]]  # row 0: top-1 moves out of the top 5
    p = compare_logits(swapped, ref)
    assert p.top1_agreement == 0.5 and p.top5_overlap == pytest.approx((4 / 5 + 1) / 2)
    nan = ref.clone()
    nan[1, 3] = float("nan")
    p = compare_logits(nan, ref)
    assert p.nonfinite_rows == 1 and p.rows == 2
    with pytest.raises(AssertionError, match="non-finite"):
        p.check(max_rel_err=1, min_top1=0, min_top5=0)
    empty = compare_logits(torch.full((1, 7), float("nan")), ref[:1])
    with pytest.raises(AssertionError, match="relative error nan"):
        empty.check(max_rel_err=1, min_top1=0, min_top5=0)
    with pytest.raises(ValueError, match="shapes differ"):
        compare_logits(ref[:1], ref)
    assert isinstance(same, LogitParity)


def test_parity_flags_a_head_whose_fp8_bytes_are_read_without_scales():
    """Negative control (a): the FP8 bytes upcast as if they were the bf16 weight (no scales),
    per row and per tensor, fail the parity bound that the real FP8 head passes."""
    lin = linear(500, 128, 15)
    x = hidden((32, 128), 16)
    ref = lin(x)
    bounds = dict(max_rel_err=MAX_REL_ERR_W8A16, min_top1=0.5, min_top5=0.5)
    for granularity in ("row", "tensor"):
        head = FP8Head.from_linear(lin, granularity)
        compare_logits(head(x), ref).check(**bounds)
        unscaled = BF16Head(128, 500).to(DEVICE)
        with torch.no_grad():
            unscaled.weight.copy_(head.fp8_weight.data.float())  # the bytes' values, scales dropped
        with pytest.raises(AssertionError, match="relative error"):
            compare_logits(unscaled(x), ref).check(**bounds)


# ---------------------------------------------------------------------------------- provenance

def test_provenance_names_the_kernel_that_ran():
    lin = linear(64, 32, 17)
    x = hidden((2, 32), 18)
    with backends.record_provenance() as prov:
        FP8Head.from_linear(lin, "row", "triton")(x)
    (event,) = prov.events
    assert (event.kind, event.backend, event.kernel) == ("head", "fp8-triton", "fp8_gemv_kernel")
    assert event.config["M"] == 2 and event.config["granularity"] == "row"
    assert event.config["config_rule"] == ("interpreter" if INTERPRET else event.config["config_rule"])
    with backends.record_provenance() as prov:
        BF16Head(32, 64).to(DEVICE)(x)
    assert prov.backends("head") == {"bf16"} and prov.kernels("head") == {"F.linear"}


def test_require_head_backend_catches_a_silent_bf16_fallback():
    """Negative control (b): FP8 was asked for, the bf16 head ran; the provenance check fails."""
    model = build_model("tiny", head="bf16")  # what a silent fallback leaves behind
    prompt = torch.randint(0, 128, (1, 4), generator=torch.Generator().manual_seed(0))
    with backends.record_provenance() as prov:
        generate(model, prompt, max_new_tokens=2)
    require_head_backend(prov, "bf16")
    with pytest.raises(AssertionError, match="silent fallback to the unquantized bf16 head"):
        require_head_backend(prov, "fp8-triton")
    with pytest.raises(AssertionError, match="no head call was recorded"):
        require_head_backend(backends.Provenance(), "triton")


# -------------------------------------------------------------------------------- model switch

def test_build_model_head_switch_and_generate():
    bf16 = build_model("tiny", device=DEVICE)
    assert isinstance(bf16.lm_head, BF16Head) and isinstance(bf16.lm_head, nn.Linear)
    assert bf16.head_kind == "bf16"
    fp8 = build_model("tiny", device=DEVICE, head="fp8")
    assert isinstance(fp8.lm_head, FP8Head) and fp8.head_kind == "fp8"
    # The device's own FP8 head unless told: the Triton GEMV on CUDA, torch's scaled matmul on the CPU.
    assert fp8.lm_head.backend == default_fp8_backend(DEVICE.type) and fp8.lm_head.granularity == "row"
    # Same seed, same weights: the FP8 head is the quantized bf16 head.
    want = quantize_fp8(bf16.lm_head.weight.detach(), "row")
    assert torch.equal(fp8.lm_head.fp8_weight.scale, want.scale)
    prompt = torch.randint(0, 128, (2, 5), generator=torch.Generator().manual_seed(1))
    with backends.record_provenance() as prov:
        out = generate(fp8, prompt, max_new_tokens=3)
    assert out.new_tokens.shape == (2, 3)
    require_head_backend(prov, default_fp8_backend(DEVICE.type))
    tensor = build_model("tiny", head="fp8", head_backend="dequant", head_granularity="tensor")
    assert tensor.lm_head.backend == "fp8-dequant" and tensor.lm_head.granularity == "tensor"


def test_build_model_rejects_bad_head_options_before_building():
    with pytest.raises(ValueError, match="unknown head 'int4'"):
        build_model("tiny", head="int4")
    with pytest.raises(ValueError, match="needs head='fp8'"):
        build_model("tiny", head_backend="triton")
    with pytest.raises(ValueError, match="unknown head backend"):
        build_model("tiny", head="fp8", head_backend="nope")
    with pytest.raises(ValueError, match="head_granularity"):
        build_model("tiny", head="fp8", head_granularity="block")


def test_quantize_head_in_place_once_and_tied_embeddings():
    model = build_model(get_config("tiny", tie_word_embeddings=True))
    embed = model.embed_tokens.weight.detach().clone()
    head = model.quantize_head("tensor", "dequant")
    assert model.lm_head is head and model.head_kind == "fp8"
    assert torch.equal(model.embed_tokens.weight, embed)  # the embedding stays unquantized
    with pytest.raises(ValueError, match="already FP8"):
        model.quantize_head()
    ids = torch.randint(0, 128, (1, 6), generator=torch.Generator().manual_seed(2))
    logits = model(ids)
    assert logits.shape == (1, 6, 128) and torch.isfinite(logits).all()


# ------------------------------------------------------------- the parity suite, sabotaged

PARITY_SUITE = Path(__file__).resolve().parents[1] / "suites" / "test_head_parity.py"

SILENT_FALLBACK = """
import pytest
from impl.model.causal_lm import MoECausalLM

@pytest.fixture(autouse=True)
def silent_fallback(monkeypatch):
    # `quantize_head` that quietly keeps the bf16 head: every flag says FP8, nothing changed.
    monkeypatch.setattr(MoECausalLM, "quantize_head", lambda self, **kw: self.lm_head)
"""

SCALES_DROPPED = """
import pytest
import torch
from impl.head import FP8Head
from impl.quant import FP8Tensor

@pytest.fixture(autouse=True)
def scales_dropped(monkeypatch):
    # The FP8 bytes handed on without their scales (scale 1 everywhere).
    monkeypatch.setattr(FP8Head, "fp8_weight", property(
        lambda self: FP8Tensor(self._fp8_data, torch.ones_like(self._fp8_scale), self.granularity)))
"""


def _run_parity_suite(pytester, conftest: str):
    """suites/test_head_parity.py as shipped, with `conftest` planting a fault (unsabotaged, the
    suite runs in every default session)."""
    # Another module name: the outer session may have imported suites/test_head_parity.py already.
    pytester.makepyfile(test_head_parity_planted=PARITY_SUITE.read_text())
    pytester.makeconftest(conftest)
    result = pytester.runpytest("-p", "no:cacheprovider", "-q", "-rf", "--moe-device", "cpu")
    failed = {line.split("::", 1)[1].split(" ", 1)[0] for line in result.outlines if line.startswith("FAILED")}
    return result, failed


def test_parity_suite_catches_a_silent_fallback_to_bf16(pytester):
    """Negative control (b), suite level: the logits all 'agree' (bf16 against itself); only the
    provenance checks can tell, and they must fail."""
    result, failed = _run_parity_suite(pytester, SILENT_FALLBACK)
    assert failed == {"test_greedy_generation_agrees_token_by_token[row]",
                      "test_greedy_generation_agrees_token_by_token[tensor]",
                      "test_fp8_head_module_is_what_the_model_runs"}
    result.stdout.fnmatch_lines(["*silent fallback to the unquantized bf16 head*"])


def test_parity_suite_catches_fp8_bytes_read_without_scales(pytester):
    """Negative control (a), suite level: every logit-parity test fails on the relative error."""
    result, failed = _run_parity_suite(pytester, SCALES_DROPPED)
    logit_tests = {f"test_logits_on_{which}[{g}]" for which in ("hidden_states_from_real_decoding",
                                                                 "random_hidden_states") for g in ("row", "tensor")}
    assert logit_tests <= failed
    result.stdout.fnmatch_lines(["*parity failed: relative error*"])
