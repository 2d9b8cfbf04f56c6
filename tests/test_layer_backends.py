"""The layer backends of KDA and MLA layers: their attention (`triton`, the default, or `torch`)
and their projections (`gemv`, the default, or `cublas`), switched per model and per ladder row
(`attention=`, `projection=`), each call noting what ran, and a row whose provenance contradicts
its backends refused by name.

On a CPU every backend runs the plain path (the kernels need CUDA), so outputs are equal here and
the check that the kernels really ran applies to CUDA rows only; tests/test_kda_decode.py,
tests/test_mla_decode.py and tests/test_gemv.py compare the paths on the GPU.
"""

from __future__ import annotations

import pytest
import torch

from impl import backends
from impl.model.layer_backends import FALLBACKS, layer_modules, set_layer_backend
from impl.model.build import build_model
from impl.serve.rows import parse_row, parse_serve_config
from impl.serve.provenance import RowProvenance, provenance_problems


@pytest.fixture(scope="module")
def ling():
    return build_model("ling-3.0-tiny")


def test_the_backends_are_registered():
    assert backends.available("attention") == ["torch", "triton"]
    assert backends.available("projection") == ["cublas", "gemv"]
    assert backends.get("attention", "triton").description.startswith("KDA and MLA decode and verify steps")


@pytest.mark.parametrize("kind, default, other", [("attention", "triton", "torch"), ("projection", "gemv", "cublas")])
def test_every_kda_and_mla_layer_is_switched_the_draft_included(ling, kind, default, other):
    kinds = sorted({type(m).__name__ for m in layer_modules(ling)})
    assert kinds == ["KDAAttention", "MLAAttention"]
    assert any(m in layer_modules(ling.mtp) for m in layer_modules(ling))  # the NEXTN layer's MLA
    assert ling.layer_backend(kind) == default
    try:
        ling.set_layer_backend(kind, other)
        assert ling.layer_backend(kind) == other
        other_kind = "attention" if kind == "projection" else "projection"
        assert ling.layer_backend(other_kind) != other  # the other part stays
    finally:
        ling.set_layer_backend(kind, default)
    with pytest.raises(ValueError, match=rf"unknown {kind} backend 'flash'; available: \['{min(default, other)}'"):
        ling.set_layer_backend(kind, "flash")
    with pytest.raises(ValueError, match=r"unknown layer backend kind 'moe'; expected one of \['attention', "
                                         r"'projection'\]"):
        ling.set_layer_backend("moe", "triton")


def test_a_row_naming_a_layer_backend_for_a_model_without_such_layers_is_refused():
    """Nothing to switch: the row would run exactly as without its key, so naming one is an error."""
    from impl.serve.built_row import build_row
    from tests.helpers import byte_tokenizer
    model = build_model("tiny")
    with pytest.raises(ValueError, match=r"mine: projection: model 'tiny' has no KDA or MLA layers, whose "
                                         r"projection projection=cublas would choose"):
        build_row(model, parse_row("mine=moe=gather,projection=cublas", "cpu").config, tokenizer=byte_tokenizer(),
                  name="mine")
    build_row(model, parse_row("+fp8-head", "cpu").config, tokenizer=byte_tokenizer())  # the defaults are fine


def test_a_model_without_kda_or_mla_has_no_layer_backends():
    model = build_model("tiny")
    assert model.layer_backend("attention") == model.layer_backend("projection") == "none"
    model.set_layer_backend("attention", "torch")  # nothing to switch
    assert model.layer_backend("attention") == "none"


def test_each_call_notes_its_backends_and_paths(ling):
    """A prompt pass and a decode token on a CPU: the plain paths under every backend, noted under
    the backend that ran them; the logits equal."""
    ids = torch.randint(0, ling.config.vocab_size, (1, 6), generator=torch.Generator().manual_seed(0))
    out, events = {}, {}
    for attention, projection in (("triton", "gemv"), ("torch", "cublas")):
        ling.set_layer_backend("attention", attention)
        ling.set_layer_backend("projection", projection)
        ling.setup_caches(1, 16)
        with torch.inference_mode(), backends.record_provenance() as prov:
            prefill = ling(ids, torch.arange(6))
            step = ling(ids[:, -1:], torch.tensor([6]))
        out[attention] = (prefill, step)
        events[attention] = {(e.kind, e.backend, e.kernel) for e in prov.events
                             if e.kind in ("attention", "projection")}
    ling.set_layer_backend("attention", "triton")
    ling.set_layer_backend("projection", "gemv")
    assert events["triton"] == {("attention", "triton", "kda_torch"), ("attention", "triton", "mla_absorbed_sdpa"),
                                ("projection", "gemv", "F.linear")}
    assert events["torch"] == {("attention", "torch", "kda_torch"), ("attention", "torch", "mla_absorbed_sdpa"),
                               ("projection", "cublas", "F.linear")}
    for a, b in zip(out["triton"], out["torch"]):
        assert torch.equal(a, b)


def test_the_row_keys_parse_and_are_left_out_of_texts_at_their_defaults():
    row = parse_row("mine=+fp8-head,attention=torch,projection=cublas", "cpu")
    assert (row.config.attention, row.config.projection) == ("torch", "cublas")
    assert row.config.spec_text().endswith("head_scales=row,attention=torch,projection=cublas,spec=off")
    assert parse_serve_config(row.config.spec_text(), "cuda") == row.config
    default = parse_row("+fp8-head", "cuda").config
    assert (default.attention, default.projection) == ("triton", "gemv")
    assert "attention" not in default.spec_text() and "projection" not in default.spec_text()  # frozen keys stay
    with pytest.raises(ValueError, match=r"attention: unknown attention backend 'flash'; known: \['torch', 'triton'\]"):
        parse_row("attention=flash", "cpu")
    with pytest.raises(ValueError, match=r"projection: unknown projection backend 'x'; known: \['cublas', 'gemv'\]"):
        parse_row("projection=x", "cpu")


def _prov(device: str, attention: set[tuple[str, str]], projection: set[tuple[str, str]] = frozenset()
          ) -> RowProvenance:
    prov = RowProvenance("row", device, "bf16", requests=1, moe={("gather", "moe_gather")},
                         head={("bf16", "linear")}, head_class={"BF16Head"})
    prov.attention, prov.projection = set(attention), set(projection)
    return prov


KERNELS = {("triton", "kda_decode_kernel"), ("triton", "mla_query_kernel+mla_decode_kernel+mla_output_kernel")}
TORCH = {("triton", p) for p in FALLBACKS["attention"]}


@pytest.mark.parametrize("spec, device, attention, projection, problem", [
    ("moe=gather", "cuda", KERNELS | {("triton", "kda_torch")}, {("gemv", "gemv_kernel"), ("gemv", "F.linear")}, None),
    ("moe=gather", "cpu", TORCH, {("gemv", "F.linear")}, None),  # no kernels on a CPU: the plain paths
    ("moe=gather", "cuda", set(), set(), None),  # a model without KDA/MLA layers notes nothing
    ("moe=gather,attention=torch,projection=cublas", "cuda", {("torch", "kda_torch")}, {("cublas", "F.linear")}, None),
    ("moe=gather", "cuda", TORCH, {("gemv", "gemv_kernel")},
     "attention: the row names the triton attention kernels but only their fallback ran (['kda_torch', "
     "'mla_absorbed_sdpa', 'mla_expanded_sdpa'])"),
    ("moe=gather", "cuda", KERNELS, {("gemv", "F.linear")},
     "projection: the row names the gemv projection kernels but only their fallback ran (['F.linear'])"),
    ("moe=gather,attention=torch", "cuda", KERNELS, {("gemv", "gemv_kernel")},
     "attention: the row names the 'torch' attention backend but ['triton'] ran"),
    ("moe=gather,projection=cublas", "cuda", KERNELS, {("gemv", "gemv_kernel")},
     "projection: the row names the 'cublas' projection backend but ['gemv'] ran"),
    ("moe=gather", "cuda", KERNELS | {("torch", "kda_torch")}, {("gemv", "gemv_kernel")},
     "attention: the row names the 'triton' attention backend but ['torch', 'triton'] ran"),
])
def test_provenance_refuses_a_row_whose_layers_ran_other_backends(spec, device, attention, projection, problem):
    config = parse_serve_config(spec, device)
    problems = [p for p in provenance_problems("row", config, _prov(device, attention, projection))
                if p.startswith(("attention", "projection"))]
    if problem is None:
        assert problems == []
    else:
        assert len(problems) == 1 and problem in problems[0], problems


def test_a_ladder_row_switches_the_layer_backends_and_provenance_holds(ling):
    """Rows of the ladder on ling-3.0-tiny (CPU): the defaults and attention=torch,projection=cublas
    each run their backends (checked from provenance) and serve the same greedy text."""
    from impl.serve.built_row import build_rows
    from impl.serve.rows import parse_ladder
    from impl.serve.engine import EngineRow
    from impl.serve.ladder import Ladder
    from tests.helpers import byte_tokenizer, request
    rows = [EngineRow(a) for a in build_rows(
        ling, parse_ladder("kernels=moe=gather;torch=moe=gather,attention=torch,projection=cublas", "cpu"),
        tokenizer=byte_tokenizer())]
    try:
        served = Ladder(rows, [request("Q: 12 + 30 =", 12, ignore_eos=True)]).run()
    finally:
        ling.set_layer_backend("attention", "triton")
        ling.set_layer_backend("projection", "gemv")
    for row in rows:
        row.check()
    assert (rows[0].provenance.backends("attention"), rows[0].provenance.backends("projection")) == ({"triton"},
                                                                                                      {"gemv"})
    assert (rows[1].provenance.backends("attention"), rows[1].provenance.backends("projection")) == ({"torch"},
                                                                                                      {"cublas"})
    texts = {r.row: r.text for r in served}
    assert texts["kernels"] == texts["torch"]
