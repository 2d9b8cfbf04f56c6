"""impl.serve.rows: the spec syntax, its errors, presets per device, ladders."""

from __future__ import annotations

import pytest

from impl import backends
from impl.generate import SamplingConfig
from impl.serve.rows import PRESETS, ServeConfig, parse_ladder, parse_row, parse_serve_config, resolve_preset


def test_a_full_spec():
    c = parse_serve_config("moe=triton,head=fp8,spec=mtp:3,temperature=0.7,top_p=0.9,seed=1", "cuda")
    assert c == ServeConfig(moe="triton", head="fp8", head_backend="fp8-triton", head_scales="row", spec="mtp", k=3,
                            sampling=SamplingConfig(0.7, None, 0.9), seed=1)
    # Without a device-dependent part left open, the same text means the same on a CPU, except
    # the FP8 head's default backend.
    assert parse_serve_config("moe=triton,head=fp8,spec=mtp:3", "cpu").head_backend == "fp8-scaled-mm"
    assert parse_serve_config("head=fp8:triton,head_scales=tensor", "cpu").head_backend == "fp8-triton"


def test_an_assumed_acceptance_row():
    c = parse_serve_config("+mtp,accept=3.9", "cpu")
    assert c.assumed_accept == 3.9 and c.acceptance_profile().mean_accept_length == pytest.approx(3.9)
    assert parse_serve_config("+mtp", "cpu").acceptance_profile() is None


@pytest.mark.parametrize("text", ["moe=gather", "+mtp,temperature=0.5,top_k=4,seed=3", "+mtp,accept=3.9",
                                  "head=fp8:dequant,head_scales=tensor,spec=mtp:2", "+fp8-head,moe=reference"])
def test_spec_text_round_trips(text):
    for device in ("cpu", "cuda"):
        c = parse_serve_config(text, device)
        assert parse_serve_config(c.spec_text(), "cpu" if device == "cuda" else "cuda") == c


@pytest.mark.parametrize("text, message", [
    ("mo=gather", "unknown key 'mo'"),
    ("moe=nope", "moe: unknown MoE backend 'nope'; known: .*gather.*triton"),
    ("moe", "'moe' is neither a preset"),
    ("moe=gather,", "empty item"),
    ("moe=", "moe= has no value"),
    ("moe=gather,moe=triton", "key 'moe' given twice"),
    ("moe=gather,experts=mxfp4", "moe/experts: the 'gather' MoE backend takes"),
    ("experts=int3", "experts: unknown expert weight format 'int3'"),
    ("head=fp16", "head: unknown head 'fp16'"),
    ("head=bf16:triton", "head: the bf16 head has one backend"),
    ("head=fp8:nope", "head: unknown head backend 'nope'"),
    ("head_scales=row", "head_scales: 'row' applies to head=fp8 only"),
    ("head=fp8,head_scales=col", "head_scales: expected one of"),
    ("spec=eagle", "spec: expected off or mtp"),
    ("spec=mtp:x", "spec: expected an integer"),
    ("spec=mtp:0", "spec: mtp needs k"),
    ("spec=off:2", "spec: expected off or mtp"),
    ("temperature=hot", "temperature: expected a number"),
    ("temperature=-1", "temperature: must be >= 0"),
    ("top_p=0.9", "top_k/top_p: they filter a sampled distribution and need temperature > 0"),
    ("temperature=1,top_p=0", r"top_p: must be in \(0, 1\]"),
    ("temperature=1,top_k=0", "top_k: must be >= 1"),
    ("seed=-1", "seed: must be an int >= 0"),
    ("accept=3", "accept: an assumed acceptance applies to greedy MTP rows only"),
    ("+mtp,accept=3,temperature=0.5", "accept: an assumed acceptance applies to greedy MTP rows only"),
    ("+mtp,accept=4.5", r"accept: a mean accept length with k=3 drafts lies in \[1, 4\]"),
    ("+mtp,accept=many", "accept: expected a number"),
    ("baseline,+mtp", "a second preset"),
    ("+turbo", "neither a preset"),
])
def test_errors_name_the_part(text, message):
    with pytest.raises(ValueError, match=message) as e:
        parse_serve_config(text, "cpu")
    assert f"serving spec {text!r}" in str(e.value)


def test_a_backend_that_does_not_run_on_the_device_is_refused():
    cuda_only = backends.Backend("moe", "serve-test-cuda-only", lambda *a: None, devices=("cuda",))
    backends.register(cuda_only, replace=True)
    try:
        assert parse_serve_config("moe=serve-test-cuda-only", "cuda").moe == "serve-test-cuda-only"
        with pytest.raises(ValueError, match=r"moe: the 'serve-test-cuda-only' MoE backend runs on \['cuda'\], not"):
            parse_serve_config("moe=serve-test-cuda-only", "cpu")
    finally:
        backends._registry.pop(("moe", "serve-test-cuda-only"))


def test_presets_on_cpu():
    base, kernels, fp8, mtp = (resolve_preset(p, "cpu") for p in PRESETS)
    # On a CPU the project's Triton kernels run only under the interpreter: the ladder stays on
    # gather and the FP8 head runs torch._scaled_mm (native on CPU).
    assert (base.moe, base.head, base.spec) == ("gather", "bf16", "off")
    assert kernels == base
    assert (fp8.moe, fp8.head, fp8.head_backend, fp8.spec) == ("gather", "fp8", "fp8-scaled-mm", "off")
    assert (mtp.head_backend, mtp.spec, mtp.k) == ("fp8-scaled-mm", "mtp", 3)
    assert resolve_preset("+mtp", "cpu", k=2).k == 2
    for c in (base, kernels, fp8, mtp):
        assert "cpu" in backends.get("moe", c.moe).devices and "cpu" in backends.get("head", c.head_backend).devices


def test_presets_on_cuda():
    base, kernels, fp8, mtp = (resolve_preset(p, "cuda") for p in PRESETS)
    assert (base.moe, base.head) == ("gather", "bf16")
    assert (kernels.moe, kernels.head) == ("triton", "bf16")
    assert (fp8.moe, fp8.head_backend) == ("triton", "fp8-triton")
    assert (mtp.moe, mtp.head_backend, mtp.spec, mtp.k) == ("triton", "fp8-triton", "mtp", 3)
    with pytest.raises(ValueError, match="unknown preset"):
        resolve_preset("+everything", "cuda")


def test_rows_and_ladders():
    assert [r.name for r in parse_ladder("baseline,+kernels,+fp8-head,+mtp", "cpu")] == list(PRESETS)
    rows = parse_ladder("baseline; mine=moe=gather,head=fp8 ;+mtp,temperature=0.5;fast=+mtp", "cpu")
    assert [r.name for r in rows] == ["baseline", "mine", "+mtp,temperature=0.5", "fast"]
    assert rows[1].config == parse_serve_config("head=fp8", "cpu")
    assert rows[2].config.sampling.temperature == 0.5 and rows[2].config.spec == "mtp"
    assert rows[3].config == resolve_preset("+mtp", "cpu")
    assert parse_row("moe=gather,head=fp8", "cpu").name == "moe=gather,head=fp8"  # a bare spec: named by its text
    with pytest.raises(ValueError, match="row names \\['a'\\] appear more than once"):
        parse_ladder("a=baseline;a=+mtp", "cpu")
    with pytest.raises(ValueError, match="\\['mine'\\] are not presets"):
        parse_ladder("baseline,+mtp,mine", "cpu")
    # With an "=" the commas belong to one spec: the baseline preset with an override.
    (row,) = parse_ladder("baseline,head=fp8", "cpu")
    assert row.config == ServeConfig(moe="gather", head="fp8", head_backend="fp8-scaled-mm", head_scales="row")
    with pytest.raises(ValueError, match="an empty row"):
        parse_ladder("baseline;;+mtp", "cpu")
    with pytest.raises(ValueError, match="ladder row 'x=head=fp9'.*head: unknown head 'fp9'"):
        parse_ladder("baseline;x=head=fp9", "cpu")
    with pytest.raises(ValueError, match="empty ladder"):
        parse_ladder(" ", "cpu")


def test_a_row_named_after_a_preset_must_run_it():
    """`+mtp=spec=mtp:2` would run gather + bf16 head + MTP under the preset's name: refused when
    the ladder is parsed (provenance refused it only after the whole ladder had run). Spelling out
    the preset's own configuration under its name is fine."""
    with pytest.raises(ValueError, match=r"\+mtp: the row is named after the preset but runs .*give the row a name "
                                         r"of its own"):
        parse_ladder("baseline;+mtp=spec=mtp:2", "cpu")
    spelled = resolve_preset("+fp8-head", "cpu").spec_text()
    assert parse_row(f"+fp8-head={spelled}", "cpu").config == resolve_preset("+fp8-head", "cpu")
    assert parse_row("mine=spec=mtp:2", "cpu").config.k == 2


@pytest.mark.parametrize("extra", ["temperature=0.7,seed=3", "seed=1", "experts=bf16", "head_scales=tensor"])
def test_a_row_named_after_a_preset_may_not_change_its_sampling_or_formats(extra):
    """A sampled row under the name `+mtp` read as the greedy preset in the ladder's tables."""
    spelled = "moe=gather,head=fp8,spec=mtp:3"
    assert parse_row(f"+mtp={spelled}", "cpu").config == resolve_preset("+mtp", "cpu")
    with pytest.raises(ValueError, match=r"\+mtp: the row is named after the preset but .*give the row a name"):
        parse_row(f"+mtp={spelled},{extra}", "cpu")
    assert parse_row(f"mine={spelled},{extra}", "cpu").name == "mine"


def test_a_preset_row_with_an_assumed_acceptance_keeps_its_name():
    """Labelled in every output (the Ling ladder's +mtp row)."""
    row = parse_row("+mtp=moe=gather,head=fp8,spec=mtp:3,accept=3.9", "cpu")
    assert row.name == "+mtp" and row.config.assumed_accept == 3.9


def test_a_row_runs_as_the_code_its_device_takes():
    """On a CPU the layer kernels' backends take the torch form for every call: naming
    attention=torch or projection=cublas there runs what the default runs; on CUDA it does not."""
    from impl.serve.rows import parse_row
    plain, torch_layers = (parse_row(t, "cpu").config
                           for t in ("moe=gather", "moe=gather,attention=torch,projection=cublas"))
    assert plain.runs_as("cpu") == torch_layers.runs_as("cpu") == plain.spec_text()
    assert plain.runs_as("cuda") != torch_layers.runs_as("cuda")


def test_a_users_own_layer_backend_is_not_taken_for_the_default_on_a_cpu(monkeypatch):
    """Only the built-in kernel backends take their torch form on a CPU; a backend of the user's
    own may run otherwise, so a row naming it is not an A/A pair with the default."""
    from impl import backends
    from impl.serve.rows import parse_row
    monkeypatch.setitem(backends._registry, ("attention", "mine"),
                        backends.Backend("attention", "mine", lambda module, *a, **k: None, "a user's own"))
    mine = parse_row("moe=gather,attention=mine", "cpu").config
    assert mine.runs_as("cpu") != parse_row("moe=gather", "cpu").config.runs_as("cpu")
