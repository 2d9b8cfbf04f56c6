"""impl.serve on a CUDA device (skipped elsewhere): the presets resolve to this project's kernels,
steps replay from CUDA graphs and provenance comes from their capture, greedy rows match plain
greedy decoding, sampled rows draw reproducibly from the device generator under graphs, and the
unshared-head control is refused there too."""

from __future__ import annotations

import pytest
import torch

from impl.data.arith import take, text_of
from impl.generate import generate
from impl.serve.built_row import build_row, build_rows
from impl.serve.rows import PRESETS, parse_ladder, parse_serve_config
from impl.serve.engine import EngineRow
from impl.serve.provenance import ProvenanceError, check_provenance, unshared_head_row
from impl.serve.ladder import Ladder
from tests.helpers import byte_tokenizer, engine_row, request, serve

pytestmark = pytest.mark.gpu
N = 48


@pytest.fixture(scope="module")
def models():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    from impl.model.build import build_model
    return {dtype: build_model("tiny-gsm", "cuda", getattr(torch, dtype)) for dtype in ("float32", "bfloat16")}


@pytest.fixture(scope="module")
def prompts():
    return [p.prompt for p in take("heldout", 4, seed=11)]


def test_presets_run_the_kernels_from_graphs(models, prompts):
    model = models["bfloat16"]
    rows = [EngineRow(b) for b in build_rows(model, parse_ladder(",".join(PRESETS), "cuda"),
                                             tokenizer=byte_tokenizer())]
    served = Ladder(rows, [request(p, N, ignore_eos=True) for p in prompts]).run()
    for row in rows:
        row.check()
        prov = row.provenance
        assert prov.graphs, f"{row.name}: steps did not replay from CUDA graphs"
        assert prov.backends("moe") == {"gather" if row.name == "baseline" else "triton"}
    by = {(r.row, r.request_id): r for r in served}
    for p in prompts:
        rid = request(p).request_id
        texts = {r.name: by[r.name, rid].text for r in rows}
        print(f"\n{rid!r}: " + "; ".join(f"{r.name} {by[r.name, rid].decode_tokens_per_s:.0f} tok/s "
                                         f"ttft {1e3 * by[r.name, rid].ttft_s:.2f} ms" for r in rows))
        assert texts["+mtp"][:24] == texts["+fp8-head"][:24]


def test_greedy_rows_equal_generate_on_the_device(models, prompts):
    model = models["float32"]
    plain = build_row(model, parse_serve_config("moe=triton", "cuda"), tokenizer=byte_tokenizer())
    mtp = build_row(model, parse_serve_config("moe=triton,spec=mtp:3", "cuda"), tokenizer=byte_tokenizer())
    for p in [*prompts, "Q: 1"]:
        plain.activate()
        ref = text_of(generate(model, torch.tensor(list(p.encode())), N).new_tokens[0].cpu())
        got = [serve(a, request(p, N, ignore_eos=True)).text for a in (plain, mtp, plain)]
        assert got[0] == got[2] == ref
        # fp32 on the GPU: the verify pass over k+1 positions and a one-token decode step reduce in
        # different orders, so only a near-tie could part them; none does on these prompts.
        assert got[1] == ref, f"MTP and plain part at {next(i for i, (a, b) in enumerate(zip(got[1], ref)) if a != b)}"
    assert engine_row(mtp).provenance.graphs and engine_row(mtp).provenance.verify_steps > 0


def test_sampled_rows_under_graphs(models, prompts):
    model = models["bfloat16"]
    spec = "moe=triton,temperature=3.0,top_k=20,top_p=0.95,seed=3"
    for text in (spec, spec + ",spec=mtp:3"):
        built = build_row(model, parse_serve_config(text, "cuda"), tokenizer=byte_tokenizer())
        a, b, c = (serve(built, request(prompts[0], N, rid=r, ignore_eos=True)).text for r in ("x", "x", "y"))
        assert a == b and a != c
        assert engine_row(built).provenance.graphs


def test_unshared_head_is_refused_on_the_device(models, prompts):
    model = models["bfloat16"]
    good = build_row(model, parse_serve_config("+mtp", "cuda"), tokenizer=byte_tokenizer(), name="+mtp")
    serve(good, request(prompts[0], N, ignore_eos=True))
    check_provenance("+mtp", good.config, engine_row(good).provenance)
    bad = unshared_head_row(good, "weight")
    served = serve(bad, request(prompts[0], N, ignore_eos=True))
    print(f"\nshared head: {engine_row(good).provenance.verify_steps} verify steps; unshared: {served.acceptance}")
    with pytest.raises(ProvenanceError, match="only its weight tensor is shared"):
        check_provenance("+mtp", bad.config, engine_row(bad).provenance)


@pytest.mark.parametrize("s", [5, 16, 20, 300])
def test_graphed_draft_prompt_pass_writes_the_eager_cache(models, s):
    """The draft's prompt pass replayed from a bucket's graph (positions past s padded with stale
    rows) leaves the draft's KV cache at positions 0..s-1 as the eager pass over exactly s
    positions does. fp32; 1e-5 relative: the padded pass may route more than 16 tokens through
    the gather prefill where the eager one takes the decode kernels, which sum in another order
    (fp32 rounding, about 1e-7 a term over the few hundred terms of a row)."""
    model = models["float32"]
    row = EngineRow(build_row(model, parse_serve_config("moe=triton,spec=mtp:3", "cuda"), tokenizer=byte_tokenizer()))
    row.prepare()
    loop = row._runner
    assert loop.draft_prompt.graphs, "no bucket graphs captured on CUDA"
    cache = model.mtp[0].block.self_attn.kv_cache
    g = torch.Generator(device="cuda").manual_seed(s)
    hidden = torch.randn(1, s, model.config.hidden_size, device="cuda", generator=g)
    ids = torch.randint(0, model.config.vocab_size, (1, s), device="cuda", generator=g)
    with torch.inference_mode():
        loop.draft_prompt._pass(hidden, ids, s)  # eager, exactly s positions
        want_k, want_v = cache.k[:, :, :s].clone(), cache.v[:, :, :s].clone()
        cache.k.normal_()
        cache.v.normal_()
        events = loop.draft_prompt(hidden, ids, s)
        torch.cuda.synchronize()
    assert events, "the replayed pass reported no provenance"
    for got, want in ((cache.k[:, :, :s], want_k), (cache.v[:, :, :s], want_v)):
        rel = ((got - want).norm() / want.norm()).item()
        assert rel <= 1e-5, f"s={s}: draft cache differs from the eager pass by {rel:.2e}"
