"""The `attention` backend kind: KDA and MLA layers run through a named backend (`triton`, the
default, or `torch`), switched per model and per ladder row (`attention=`), each call noting what
ran, and a row whose provenance contradicts its attention backend refused by name.

On a CPU both backends run the torch form (the kernels need CUDA), so their outputs are equal
here and the check that the kernels really ran applies to CUDA rows only; tests/test_kda_decode.py
and tests/test_mla_decode.py compare the two forms on the GPU.
"""

from __future__ import annotations

import pytest
import torch

from impl import backends
from impl.model.attention_backends import TORCH_PATHS, attention_modules, set_attention_backend
from impl.model.build import build_model
from impl.serve.configs import parse_row, parse_serve_config
from impl.serve.provenance import RowProvenance, provenance_problems


@pytest.fixture(scope="module")
def ling():
    return build_model("ling-3.0-tiny")


def test_both_backends_are_registered():
    assert backends.available("attention") == ["torch", "triton"]
    assert backends.get("attention", "triton").description.startswith("KDA and MLA decode and verify steps")


def test_every_kda_and_mla_layer_is_switched_the_draft_included(ling):
    kinds = sorted({type(m).__name__ for m in attention_modules(ling)})
    assert kinds == ["KDAAttention", "MLAAttention"]
    assert any(m in attention_modules(ling.mtp) for m in attention_modules(ling))  # the NEXTN layer's MLA
    assert ling.attention_backend == "triton"
    try:
        ling.set_attention_backend("torch")
        assert ling.attention_backend == "torch"
        assert {m.backend.name for m in attention_modules(ling)} == {"torch"}
    finally:
        ling.set_attention_backend("triton")
    with pytest.raises(ValueError, match=r"unknown attention backend 'flash'; available: \['torch', 'triton'\]"):
        ling.set_attention_backend("flash")


def test_a_model_without_kda_or_mla_has_no_attention_backend():
    model = build_model("tiny")
    assert model.attention_backend == "none"
    model.set_attention_backend("torch")  # nothing to switch
    assert model.attention_backend == "none"


def test_each_call_notes_its_backend_and_path(ling):
    """A prompt pass and a decode token on a CPU: the torch form under either backend, noted
    under the backend that ran it; the logits equal."""
    ids = torch.randint(0, ling.config.vocab_size, (1, 6), generator=torch.Generator().manual_seed(0))
    out, events = {}, {}
    for name in ("triton", "torch"):
        ling.set_attention_backend(name)
        ling.setup_caches(1, 16)
        with torch.inference_mode(), backends.record_provenance() as prov:
            prefill = ling(ids, torch.arange(6))
            step = ling(ids[:, -1:], torch.tensor([6]))
        out[name] = (prefill, step)
        events[name] = {(e.backend, e.kernel) for e in prov.events if e.kind == "attention"}
    ling.set_attention_backend("triton")
    assert events["triton"] == {("triton", k) for k in ("kda_torch", "mla_absorbed_sdpa")}
    assert events["torch"] == {("torch", k) for k in ("kda_torch", "mla_absorbed_sdpa")}
    for a, b in zip(out["triton"], out["torch"]):
        assert torch.equal(a, b)


def test_the_row_key_parses_and_is_left_out_of_texts_at_its_default():
    row = parse_row("mine=+fp8-head,attention=torch", "cpu")
    assert row.config.attention == "torch"
    assert row.config.spec_text().endswith("head_scales=row,attention=torch,spec=off")
    assert parse_serve_config(row.config.spec_text(), "cuda") == row.config
    default = parse_row("+fp8-head", "cuda").config
    assert default.attention == "triton" and "attention" not in default.spec_text()  # frozen rows keep their keys
    with pytest.raises(ValueError, match=r"attention: unknown attention backend 'flash'; known: \['torch', 'triton'\]"):
        parse_row("attention=flash", "cpu")


def _prov(device: str, events: set[tuple[str, str]]) -> RowProvenance:
    prov = RowProvenance("row", device, "bf16", requests=1, moe={("gather", "moe_gather")},
                         head={("bf16", "linear")}, head_class={"BF16Head"})
    prov.attention = set(events)
    return prov


KERNELS = {("triton", "kda_decode_kernel"), ("triton", "mla_query_kernel+mla_decode_kernel+mla_output_kernel")}


@pytest.mark.parametrize("spec, device, events, problem", [
    ("moe=gather", "cuda", KERNELS | {("triton", "kda_torch")}, None),  # the prompt pass in torch, decode kernels
    ("moe=gather", "cpu", {("triton", p) for p in TORCH_PATHS}, None),  # no kernels on a CPU: the torch form
    ("moe=gather", "cuda", set(), None),  # a model without KDA/MLA layers notes nothing
    ("moe=gather,attention=torch", "cuda", {("torch", "kda_torch")}, None),
    ("moe=gather", "cuda", {("triton", "kda_torch"), ("triton", "mla_absorbed_sdpa")},
     "the row names the triton attention kernels but only the torch form ran (['kda_torch', 'mla_absorbed_sdpa'])"),
    ("moe=gather,attention=torch", "cuda", KERNELS,
     "the row names the 'torch' attention backend but ['triton'] ran"),
    ("moe=gather", "cuda", KERNELS | {("torch", "kda_torch")},
     "the row names the 'triton' attention backend but ['torch', 'triton'] ran"),
])
def test_provenance_refuses_a_row_whose_attention_is_not_what_it_names(spec, device, events, problem):
    config = parse_serve_config(spec, device)
    problems = [p for p in provenance_problems("row", config, _prov(device, events)) if p.startswith("attention")]
    if problem is None:
        assert problems == []
    else:
        assert len(problems) == 1 and problem in problems[0], problems


def test_a_ladder_row_switches_the_attention_backend_and_provenance_holds(ling):
    """Rows of the ladder on ling-3.0-tiny (CPU): the default and attention=torch each run their
    backend (checked from provenance) and serve the same greedy text."""
    from impl.serve.arm import build_arms
    from impl.serve.configs import parse_ladder
    from impl.serve.provenance import check_provenance
    from impl.serve.runner import run_ladder
    from tests.test_serve_engine import ByteTokenizer, request
    arms = build_arms(ling, parse_ladder("kernels=moe=gather;torch=moe=gather,attention=torch", "cpu"),
                      tokenizer=ByteTokenizer())
    records = run_ladder(arms, [request("Q: 12 + 30 =", 12, ignore_eos=True)])
    for arm in arms:
        check_provenance(arm.name, arm.config, arm.provenance)
    assert arms[0].provenance.backends("attention") == {"triton"}
    assert arms[1].provenance.backends("attention") == {"torch"}
    texts = {r["arm"]: r["text"] for r in records}
    assert texts["kernels"] == texts["torch"]
    ling.set_attention_backend("triton")
