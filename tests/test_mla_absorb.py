"""impl.model.mla_absorb (MLA's query side and output side of the absorbed decode, one kernel each)
against the torch form's ops (`mla_query_reference`, `mla_output_reference`), on the CPU through
Triton's interpreter and on a GPU compiled (with PDL as in a decode step).

Fresh random inputs: norm weights and caches are random too, never ones or zeros, and the cache
rows a call must not write are checked unchanged bit for bit. Widths that are not multiples of the
tiles (dn, dv) check the masks. Tolerances: fp32 1e-6 relative (the same fp32 products summed in
another order over at most 128 or r terms); bf16 on a GPU 2^-7 relative: the kernels round once
where the torch form rounds each of the rope's products and cos/sin to bf16 (2^-9 each).
"""

from __future__ import annotations

import pytest
import torch

from impl.model.mla import MLAConfig, mla_rope_tables
from impl.model.mla_absorb import (MLAAbsorbLaunch, mla_output, mla_output_reference, mla_query,
                                   mla_query_reference)
from tests.helpers import rel_err

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
SMALL = MLAAbsorbLaunch(block_r=16, block_v=16)


def query_inputs(batch, tokens, heads, dn, dv, r, dr, dtype, seed, cache_rows=64):
    """The query kernel's arguments as MLAAttention passes them: q, kv_a and g as column views of
    one projection output; W_uk a view of kv_b_proj's weight."""
    g = torch.Generator().manual_seed(seed)
    rows = batch * tokens
    width = heads * (dn + dr) + r + dr + heads
    proj = torch.randn(rows, width, generator=g)
    q, kv_a = proj[:, :heads * (dn + dr)], proj[:, heads * (dn + dr):heads * (dn + dr) + r + dr]
    kv_b = torch.randn(heads, dn + dv, r, generator=g) * r ** -0.5
    norm_w = 1 + 0.5 * torch.randn(r, generator=g)
    cache = torch.randn(batch + 1, cache_rows, r + dr, generator=g)
    first = int(torch.randint(0, cache_rows - tokens, (1,), generator=g))
    pos = torch.arange(first, first + tokens)
    cos, sin = (t[pos] for t in mla_rope_tables(MLAConfig(64, heads, r, dn, dr, dv), cache_rows))
    to = dict(device=DEVICE)
    return (q.to(dtype=dtype, **to), kv_a.to(dtype=dtype, **to), kv_b[:, :dn].to(dtype=dtype, **to), cos.to(**to),
            sin.to(**to), norm_w.to(dtype=dtype, **to), 1e-6, pos.to(**to), cache.to(dtype=dtype, **to),
            kv_b[:, dn:].to(dtype=dtype, **to), proj[:, -heads:].to(dtype=dtype, **to))


# (batch, tokens): a decode token, a verify step's four tokens, a batch of decode tokens.
@pytest.mark.parametrize("batch,tokens", [(1, 1), (1, 4), (3, 1)], ids=["decode", "verify", "batch"])
@pytest.mark.parametrize("launch", [MLAAbsorbLaunch(), SMALL], ids=["default", "small"])
def test_query_kernel_matches_the_torch_form(batch, tokens, launch):
    q, kv_a, w_uk, cos, sin, norm_w, eps, pos, cache, _, _ = query_inputs(batch, tokens, 3, 24, 20, 32, 16,
                                                                         torch.float32, seed=batch * 10 + tokens)
    want_cache = cache.clone()
    want = mla_query_reference(q, kv_a, w_uk, cos, sin, norm_w, eps, pos, want_cache)
    got = mla_query(q, kv_a, w_uk, cos, sin, norm_w, eps, pos, cache, launch=launch)
    assert got.shape == want.shape and rel_err(got, want) <= 1e-6
    written = torch.zeros(cache.shape[:2], dtype=torch.bool)
    written[:batch, pos.cpu()] = True
    assert rel_err(cache[written], want_cache[written]) <= 1e-6
    assert torch.equal(cache[~written], want_cache[~written]), "rows the call must not write changed"
    # Negative control: the rope rotating consecutive halves, not interleaved pairs, is far off.
    x, at = q.view(batch * tokens, 3, 40)[..., 24:], torch.arange(batch * tokens) % tokens
    halves = x * cos[at, None] + torch.cat((-x[..., 8:], x[..., :8]), dim=-1) * sin[at, None]
    assert rel_err(got[..., 32:], halves) > 1e-2


@pytest.mark.parametrize("rows,dv,launch", [(1, 20, SMALL), (4, 32, MLAAbsorbLaunch()), (3, 48, SMALL)])
def test_output_kernel_matches_the_torch_form(rows, dv, launch):
    g = torch.Generator().manual_seed(rows + dv)
    heads, r = 3, 32
    lat = torch.randn(rows, heads, r, generator=g).to(DEVICE)
    gate = torch.randn(rows, heads + 5, generator=g).to(DEVICE)[:, 2:2 + heads]  # a column view, as g is
    w_uv = (torch.randn(heads, 24 + dv, r, generator=g) * r ** -0.5).to(DEVICE)[:, 24:]
    got = mla_output(lat, gate, w_uv, launch=launch)
    want = mla_output_reference(lat, gate, w_uv)
    assert got.shape == (rows, heads * dv) and rel_err(got, want) <= 1e-6
    # Negative control: the same without the gate is far off.
    assert rel_err(got, torch.einsum("bhr,hvr->bhv", lat, w_uv).reshape(rows, -1)) > 0.1


@pytest.mark.parametrize("rows,dv", [(1, 20), (4, 32)])
def test_output_kernel_without_a_gate_is_the_up_projection_alone(rows, dv):
    """DeepSeek-V3's MLA has no output gate: g None."""
    g = torch.Generator().manual_seed(7 * rows + dv)
    heads, r = 3, 32
    lat = torch.randn(rows, heads, r, generator=g).to(DEVICE)
    w_uv = (torch.randn(heads, 24 + dv, r, generator=g) * r ** -0.5).to(DEVICE)[:, 24:]
    got = mla_output(lat, None, w_uv, launch=SMALL)
    assert rel_err(got, mla_output_reference(lat, None, w_uv)) <= 1e-6
    assert rel_err(got, torch.einsum("bhr,hvr->bhv", lat.double(), w_uv.double()).reshape(rows, -1)) <= 1e-6


def test_bad_arguments_name_the_problem():
    q, kv_a, w_uk, cos, sin, norm_w, eps, pos, cache, w_uv, gate = query_inputs(1, 2, 2, 8, 8, 16, 8, torch.float32, 1)
    with pytest.raises(ValueError, match=r"must hold B x T rows for input_pos \[T\]"):
        mla_query(q[:1], kv_a[:1], w_uk, cos, sin, norm_w, eps, pos, cache)
    with pytest.raises(ValueError, match=r"cos and sin must be \[T=2, dr\]"):
        mla_query(q, kv_a, w_uk, cos[:1], sin[:1], norm_w, eps, pos, cache)
    with pytest.raises(ValueError, match=r"kv_a must be \[rows, >= 24\]"):
        mla_query(q, kv_a[:, :20], w_uk, cos, sin, norm_w, eps, pos, cache)
    with pytest.raises(ValueError, match=r"cache \(2, 64, 20\) must be \[>= B=1, S, r \+ dr=24\]"):
        mla_query(q, kv_a, w_uk, cos, sin, norm_w, eps, pos, cache[..., :20])
    lat = torch.randn(2, 2, 16, device=DEVICE)
    with pytest.raises(ValueError, match=r"lat must be \[rows, H=2, r=16\]"):
        mla_output(lat[:, :1], gate, w_uv)
    with pytest.raises(ValueError, match=r"g \(1, 2\) must have lat's 2 rows"):
        mla_output(lat, gate[:1], w_uv)
    with pytest.raises(ValueError, match="block_v must be a power of two"):
        MLAAbsorbLaunch(block_v=24)


@pytest.mark.gpu
@pytest.mark.skipif(DEVICE != "cuda", reason="bf16 as compiled needs a CUDA device")
@pytest.mark.parametrize("tokens", [1, 4], ids=["decode", "verify"])
# (heads, nope, v, latent, rope): Ling-3.0-flash's; GLM-4.7-Flash's (20 heads, a nope width of no
# power of two, v wider than nope).
@pytest.mark.parametrize("heads,dn,dv,r,dr", [(32, 128, 128, 512, 64), (20, 192, 256, 512, 64)],
                         ids=["ling-3.0-flash", "glm-4.7-flash"])
def test_bf16_at_real_shapes_on_the_gpu(tokens, heads, dn, dv, r, dr):
    q, kv_a, w_uk, cos, sin, norm_w, eps, pos, cache, w_uv, gate = query_inputs(
        1, tokens, heads, dn, dv, r, dr, torch.bfloat16, seed=tokens, cache_rows=256)
    want_cache = cache.clone()
    want = mla_query_reference(q, kv_a, w_uk, cos, sin, norm_w, eps, pos, want_cache)
    got = mla_query(q, kv_a, w_uk, cos, sin, norm_w, eps, pos, cache)
    assert rel_err(got, want) <= 2.0 ** -7
    assert rel_err(cache, want_cache) <= 2.0 ** -7
    lat = torch.randn(tokens, heads, r, device=DEVICE).to(torch.bfloat16)
    assert rel_err(mla_output(lat, gate, w_uv), mla_output_reference(lat, gate, w_uv)) <= 2.0 ** -7


@pytest.mark.gpu
@pytest.mark.skipif(DEVICE != "cuda", reason="bf16 as compiled needs a CUDA device")
def test_bf16_output_without_a_gate_at_deepseek_shapes_on_the_gpu():
    """DeepSeek-V3's MLA output side: 128 heads, v 128, latent 512, no gate."""
    g = torch.Generator().manual_seed(11)
    lat = torch.randn(4, 128, 512, generator=g).to(DEVICE, torch.bfloat16)
    w_uv = (torch.randn(128, 128, 512, generator=g) * 512 ** -0.5).to(DEVICE, torch.bfloat16)
    assert rel_err(mla_output(lat, None, w_uv), mla_output_reference(lat, None, w_uv)) <= 2.0 ** -7
