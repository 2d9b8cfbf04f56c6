"""impl.serve.provenance: what ran for each preset row, and the rows it must refuse: a +mtp draft
that holds a different module around the FP8 head's tensors (the negative control), a head that
is not the one configured, a row named after a preset it does not run."""

from __future__ import annotations

import dataclasses

import pytest

from impl.data.arith import take
from impl.serve.built_row import build_row
from impl.serve.rows import PRESETS, parse_serve_config, resolve_preset
from impl.serve.provenance import ProvenanceError, check_provenance, provenance_problems, unshared_head_row
from tests.helpers import byte_tokenizer, engine_row, request


@pytest.fixture(scope="module")
def prompt() -> str:
    return take("heldout", 1, seed=9)[0].prompt


def preset_row(model, name):
    return build_row(model, resolve_preset(name, "cpu"), tokenizer=byte_tokenizer(), name=name)


def served(built, prompt, n=12):
    row = engine_row(built)
    row.serve(request(prompt, n, ignore_eos=True))
    return row.provenance


@pytest.mark.parametrize("name", PRESETS)
def test_each_preset_runs_what_it_says(model, prompt, name):
    built = preset_row(model, name)
    prov = served(built, prompt)
    check_provenance(name, built.config, prov)
    assert prov.backends("moe") == {"gather"} and prov.expert_format == "fp32" and prov.requests == 1
    fp8 = name in ("+fp8-head", "+mtp")
    assert prov.head == ({("fp8-scaled-mm", "torch._scaled_mm")} if fp8 else {("bf16", "F.linear")})
    assert prov.head_class == ({"FP8Head"} if fp8 else {"BF16Head"})
    if name == "+mtp":
        assert prov.draft_head == prov.head and prov.draft_head_is_target_head == {True}
        assert prov.draft_head_sharing == {"same module"} and prov.drafts_per_step == {3} and prov.verify_steps > 0
    else:
        assert not prov.speculative and not prov.draft_head and prov.verify_steps == 0


@pytest.mark.parametrize("mode, shared", [("weight", "only its weight tensor is shared, without its scales"),
                                          ("copy", "another module object around the same storage")])
def test_a_draft_without_the_target_head_module_is_refused(model, prompt, mode, shared):
    good = preset_row(model, "+mtp")
    bad = unshared_head_row(good, mode)
    # Every flag of the defective row says MTP and FP8: the configuration is the same.
    assert bad.config == good.config and bad.decoder.k == good.decoder.k
    check_provenance("+mtp", good.config, served(good, prompt))
    prov = served(bad, prompt)
    problems = provenance_problems("+mtp", bad.config, prov)
    assert any(p.startswith("+mtp: the draft's head is a different module from the target's") and shared in p
               for p in problems), problems
    with pytest.raises(ProvenanceError, match="draft.head is target.lm_head"):
        check_provenance("+mtp", bad.config, prov)
    if mode == "weight":
        # The e4m3 bytes read as values run no registered head kernel: provenance says so too.
        assert not prov.draft_head and any("recorded no head kernel" in p for p in problems)
    else:
        assert prov.draft_head == prov.head  # same kernel, same numbers: only identity tells
    # The good row on the same model is untouched by the defective one.
    check_provenance("+mtp", good.config, served(good, prompt))


def test_a_bf16_draft_head_around_the_same_weight_is_refused(model, prompt):
    good = build_row(model, parse_serve_config("spec=mtp:2", "cpu"), tokenizer=byte_tokenizer(), name="bf16-mtp")
    bad = unshared_head_row(good, "weight")
    prov = served(bad, prompt)
    assert prov.draft_head == prov.head == {("bf16", "F.linear")}
    with pytest.raises(ProvenanceError, match="bf16-mtp: the draft's head is a different module"):
        check_provenance("bf16-mtp", bad.config, prov)


def test_a_head_that_is_not_the_configured_one_is_refused(model, prompt):
    built = preset_row(model, "+fp8-head")
    bf16 = preset_row(model, "baseline")
    broken = dataclasses.replace(built, head=bf16.head)  # a switch that lost the FP8 head
    problems = provenance_problems("+fp8-head", broken.config, served(broken, prompt))
    assert any(p.startswith("head: the row names the 'fp8-scaled-mm' head backend but the target's head ran "
                            "['bf16'] (a fallback to the unquantized head)") for p in problems), problems
    assert any("model's head was ['BF16Head']" in p for p in problems)


def test_the_fp8_backend_is_switched_per_row(model, prompt):
    # Two rows share one FP8Head module with different backends: each request runs its own.
    a = build_row(model, parse_serve_config("head=fp8:scaled_mm", "cpu"), tokenizer=byte_tokenizer(), name="a")
    b = build_row(model, parse_serve_config("head=fp8:dequant", "cpu"), tokenizer=byte_tokenizer(), name="b")
    assert a.head is b.head
    for _ in range(2):
        served(a, prompt, 3), served(b, prompt, 3)
    pa, pb = engine_row(a).provenance, engine_row(b).provenance
    assert pa.backends("head") == {"fp8-scaled-mm"} and pb.backends("head") == {"fp8-dequant"}
    check_provenance("a", a.config, pa)
    check_provenance("b", b.config, pb)


def test_a_row_named_after_a_preset_must_run_it(model, prompt):
    built = build_row(model, resolve_preset("+fp8-head", "cpu"), tokenizer=byte_tokenizer(), name="+mtp")
    problems = provenance_problems("+mtp", built.config, served(built, prompt))
    assert problems and problems[0].startswith("+mtp: the row is named after the preset but runs")
    mtp_named_baseline = dataclasses.replace(preset_row(model, "+mtp"), name="baseline")
    with pytest.raises(ProvenanceError, match="baseline: the row is named after the preset"):
        check_provenance("baseline", mtp_named_baseline.config, served(mtp_named_baseline, prompt))


def test_no_request_no_provenance(model):
    from impl.serve.provenance import RowProvenance
    prov = RowProvenance("x", "cpu", "fp32")
    assert provenance_problems("x", resolve_preset("baseline", "cpu"), prov) == [
        "x: no request ran, so nothing shows what this row runs"]
