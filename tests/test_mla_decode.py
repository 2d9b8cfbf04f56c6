"""impl.model.mla_decode (MLA's absorbed attention for one token, split-K over the cache rows)
against SDPA over the valid rows, and the module's dispatch against its torch form. Fresh random
queries and caches; rows past the valid length are filled with huge values, so a kernel that read
them would be far off. Tolerance 1e-5 relative in fp32 (the same sums in another order, an online
softmax against SDPA's; measured 4e-7 on the interpreter); bf16 on the GPU: 2e-2.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
import torch.nn.functional as F

from impl import backends
from impl.model.layer_backends import set_layer_backend
from impl.model.mla_decode import MLADecodeConfig, mla_decode_attention

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def reference(query, kv, n, r, scale):
    key = kv[:, None, :n].float()
    return F.scaled_dot_product_attention(query[:, None].float(), key, key[..., :r], scale=scale)[:, 0]


SMALL = MLADecodeConfig(splits=4, min_chunk_rows=16, block_rows=16, num_warps=4, num_stages=1, combine_block_r=16)
# A split count that is no power of two (as the SM count a device's config follows).
SMALL_3 = MLADecodeConfig(splits=3, min_chunk_rows=16, block_rows=16, num_warps=4, num_stages=1, combine_block_r=16)
CONFIGS = dict(argvalues=[None, SMALL, SMALL_3], ids=["launch-config", "small", "three-splits"])


# n rows valid of a cache of `cache` rows: one row; fewer rows than one chunk; several chunks of the
# minimum size (fewer used than the splits); every split used with chunks above the minimum (with
# SMALL: 32-row chunks; with the H200's config: 9000 rows in 128-row chunks over 71 of 132 programs).
@pytest.mark.parametrize("config", **CONFIGS)
@pytest.mark.parametrize("heads,n,cache", [(4, 1, 40), (4, 11, 40), (4, 37, 40), (20, 100, 200), (20, 9000, 9100)])
def test_kernel_equals_attention_over_the_valid_rows(heads, n, cache, config):
    if DEVICE == "cpu" and n > 1000:
        pytest.skip("thousands of rows: minutes under the interpreter; the GPU runs it")
    r, dr = (32, 16) if DEVICE == "cpu" else (512, 64)
    g = torch.Generator(DEVICE).manual_seed(n)
    query = torch.randn(2, heads, r + dr, device=DEVICE, generator=g)
    kv = torch.randn(2, cache, r + dr, device=DEVICE, generator=g)
    kv[:, n:] = 1e4  # never attended: reading one would swamp the result
    got = mla_decode_attention(query, kv, torch.tensor([n], device=DEVICE), r, 0.1, config=config)
    want = reference(query, kv, n, r, 0.1)
    assert float((got - want).norm() / want.norm()) <= 1e-5


# Positions instead of lengths (the model's call): the kernels read them before waiting for the
# launch before. One row; fewer rows than a chunk; several chunks (every split used on the GPU).
@pytest.mark.parametrize("config", **CONFIGS)
@pytest.mark.parametrize("n", [1, 20, 100, 9000])
def test_from_positions_equals_attention_over_the_rows_up_to_them(n, config):
    if DEVICE == "cpu" and n > 1000:
        pytest.skip("thousands of rows: minutes under the interpreter; the GPU runs it")
    r, dr = (32, 16) if DEVICE == "cpu" else (512, 64)
    g = torch.Generator(DEVICE).manual_seed(n)
    query = torch.randn(2, 4, r + dr, device=DEVICE, generator=g)
    kv = torch.randn(2, n + 24, r + dr, device=DEVICE, generator=g)
    kv[:, n:] = 1e4
    kv[:, n - 1] *= 3  # the token's own row stands out: attending one row short moves the result
    got = mla_decode_attention(query, kv, None, r, 0.1, config=config, positions=torch.tensor([n - 1], device=DEVICE))
    want = reference(query, kv, n, r, 0.1)
    assert float((got - want).norm() / want.norm()) <= 1e-5
    if n > 1:  # negative control: attention one row short is far from it
        short = reference(query, kv, n - 1, r, 0.1)
        assert float((short - want).norm() / want.norm()) > 1e-3


def test_exactly_one_of_length_and_positions():
    query, kv = torch.randn(1, 2, 48), torch.randn(1, 8, 48)
    with pytest.raises(ValueError, match="exactly one of length and positions"):
        mla_decode_attention(query, kv, torch.tensor([3]), 32, 0.1, positions=torch.tensor([2]))
    with pytest.raises(ValueError, match="exactly one of length and positions"):
        mla_decode_attention(query, kv, None, 32, 0.1)
    with pytest.raises(ValueError, match=r"positions must be \[1\] or \[B=1\]"):
        mla_decode_attention(query, kv, None, 32, 0.1, positions=torch.tensor([2, 3]))
    with pytest.raises(ValueError, match=r"positions must be int32 or int64 on the query's device \(cpu\), got "
                                         r"torch.float32"):
        mla_decode_attention(query, kv, None, 32, 0.1, positions=torch.tensor([2.0]))


@pytest.mark.parametrize("config", **CONFIGS)
def test_a_verify_steps_tokens_share_the_cache_each_up_to_its_position(config):
    """T query rows over one cache (batch stride 0), row j attending to rows 0..length[j]-1, as a
    verify step's tokens do; each equals attention over its own valid rows."""
    r, dr = (32, 16) if DEVICE == "cpu" else (512, 64)
    g = torch.Generator(DEVICE).manual_seed(7)
    lengths = torch.tensor([33, 34, 35, 36], device=DEVICE)
    query = torch.randn(4, 4, r + dr, device=DEVICE, generator=g)
    kv = torch.randn(1, 64, r + dr, device=DEVICE, generator=g)
    kv[:, 36:] = 1e4
    got = mla_decode_attention(query, kv.expand(4, -1, -1), lengths, r, 0.1, config=config)
    for j, n in enumerate(lengths.tolist()):
        want = reference(query[j:j + 1], kv, n, r, 0.1)
        assert float((got[j:j + 1] - want).norm() / want.norm()) <= 1e-5, j
    # Negative control: one shared length for all four rows is not what they need.
    shared = mla_decode_attention(query, kv.expand(4, -1, -1), lengths[-1:], r, 0.1, config=config)
    assert float((shared[0] - got[0]).norm() / got[0].norm()) > 1e-3
    with pytest.raises(ValueError, match=r"length must be \[1\] or \[B=4\]"):
        mla_decode_attention(query, kv.expand(4, -1, -1), lengths[:2], r, 0.1)
    # From positions, as the model's verify step passes them.
    early = mla_decode_attention(query, kv.expand(4, -1, -1), None, r, 0.1, config=config, positions=lengths - 1)
    assert float((early - got).norm() / got.norm()) <= 1e-5


def test_a_latent_width_the_tiles_cannot_hold_is_refused():
    with pytest.raises(ValueError, match=r"kv_lora_rank \(48\) and the rope dim \(16\) must be powers of two"):
        mla_decode_attention(torch.randn(1, 2, 64), torch.randn(1, 8, 64), torch.tensor([3]), 48, 0.1)


def test_config_rejects_a_tile_tl_dot_cannot_take():
    with pytest.raises(ValueError, match="block_rows must be >= 16"):
        MLADecodeConfig(block_rows=8)
    with pytest.raises(ValueError, match="splits must be >= 1"):
        MLADecodeConfig(splits=0)
    with pytest.raises(ValueError, match="min_chunk_rows must be a power of two"):
        MLADecodeConfig(min_chunk_rows=48)



@pytest.mark.gpu
@pytest.mark.parametrize("batch,tokens", [(1, 1), (1, 4), (3, 1)], ids=["decode", "verify", "batch"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_module_dispatch_on_the_device(dtype, batch, tokens):
    """A cached call of one token (of one sequence or of a batch), or of a verify step's four, on
    CUDA takes the kernels; through the torch attention backend the same call runs SDPA over the masked cache:
    the two agree, and write the same cache rows, with the cache longer than the context."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    from impl.model.mla import MLAAttention, MLAConfig, mla_rope_tables
    cfg = MLAConfig(hidden_size=512, num_heads=16, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
                    v_head_dim=128)
    torch.manual_seed(0)
    m = MLAAttention(cfg).cuda().to(dtype).eval()
    with torch.no_grad():
        for p in m.parameters():
            p.normal_(0, 0.05)
    cache = m.setup_cache(batch, 3000)
    ctx = 2100
    cache.kv[:, :ctx].normal_()
    before = cache.kv.clone()
    cos, sin = (t[ctx:ctx + tokens].cuda() for t in mla_rope_tables(cfg, 3000))
    mask = torch.ones(3000, 3000, dtype=torch.bool, device="cuda").tril()[ctx:ctx + tokens]
    x = torch.randn(batch, tokens, 512, device="cuda").to(dtype)
    pos = torch.arange(ctx, ctx + tokens, device="cuda")
    with torch.inference_mode(), backends.record_provenance() as prov:
        got = m(x, cos, sin, pos, mask)
        rows = cache.kv.clone()
        cache.kv.copy_(before)
        set_layer_backend(m, "attention", "torch")
        want = m(x, cos, sin, pos, mask)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    err = float((got.float() - want.float()).norm() / want.float().norm())
    assert err <= tol, err
    written = rows[:, ctx:ctx + tokens].float()
    assert float((written - cache.kv[:, ctx:ctx + tokens].float()).norm() / written.norm()) <= tol
    assert torch.equal(rows[:, :ctx], before[:, :ctx]) and torch.equal(rows[:, ctx + tokens:], before[:, ctx + tokens:])
    assert [(e.backend, e.kernel) for e in prov.events if e.kind == "attention"] == [
        ("triton", "mla_query_kernel+mla_decode_kernel+mla_output_kernel"), ("torch", "mla_absorbed_sdpa")], \
        prov.events


def test_a_build_that_spills_is_refused_before_launch_and_a_clean_one_checked_once():
    """`_refuse_spills` compiles through the kernel's warmup (no launch) and reads the loaded
    binary's spill count: a spilling build raises naming the config, its bytes and the dtype, every
    time; a clean one is compiled for the check once (the memo), not at every call."""
    from impl.model import mla_decode

    class Build:
        def __init__(self, spills):
            self.n_spills, self.n_regs = spills, 255

        def _init_handles(self):
            pass

    class Kernel:
        def __init__(self, spills):
            self.spills, self.warmups = spills, 0

        def warmup(self, *args, grid, **meta):
            self.warmups += 1
            return Build(self.spills)

        def __getitem__(self, grid):
            raise AssertionError("launched")

    query = torch.randn(1, 4, 48)
    cfg = MLADecodeConfig(splits=7, block_rows=32)
    args, meta = (query, 3, 0.5), dict(R=32, num_warps=4)
    spilling = Kernel(spills=30)
    for _ in range(2):
        with pytest.raises(ValueError, match=r"splits=7.*spills 120 bytes a thread on cpu .*torch.float32 rows"):
            mla_decode._refuse_spills(spilling, cfg, (1, 7), args, meta)
    assert spilling.warmups == 2
    clean = Kernel(spills=0)
    meta = dict(meta, num_warps=8)  # another build: not in the memo yet
    for _ in range(3):
        mla_decode._refuse_spills(clean, cfg, (1, 7), args, meta)
    assert clean.warmups == 1


def test_tuned_configs_round_trip_keep_other_devices_and_name_a_malformed_file(tmp_path):
    from impl.model.mla_decode import TABLE
    path = tmp_path / "tuned.json"
    table = dataclasses.replace(TABLE, path=path)
    assert table.load() == {}
    table.save({("gpu-a",): SMALL}, "run a")
    table.save({("gpu-b",): SMALL_3}, "run b")
    table.save({("gpu-a",): SMALL_3}, "run a again")
    assert table.load() == {("gpu-a",): SMALL_3, ("gpu-b",): SMALL_3}
    assert [e["measured"] for e in json.loads(path.read_text())] == ["run a again", "run b"]
    assert [p.name for p in tmp_path.iterdir()] == ["tuned.json"]  # no temporary file left
    bad = '[{"key": {"device": "gpu-a"}, "config": {"splits": 0}}]'
    path.write_text(bad)
    with pytest.raises(ValueError, match=r"tuned.json: malformed tuned MLA decode configs .*splits must be >= 1"):
        table.load()
    with pytest.raises(ValueError, match=r"tuned.json: malformed tuned MLA decode configs"):
        table.save({("gpu-c",): SMALL}, "run c")  # nothing written over a file it cannot read
    assert path.read_text() == bad
    path.write_text("[{")
    with pytest.raises(ValueError, match=r"tuned.json: malformed tuned MLA decode configs"):
        table.load()


def test_the_committed_tuned_configs_load():
    from impl.model.mla_decode import TABLE
    assert TABLE.load(), TABLE.path


def test_32_bit_rows_take_the_smallest_tile_of_the_devices_config(monkeypatch):
    from impl.model import mla_decode
    tuned = MLADecodeConfig(splits=132, min_chunk_rows=64, block_rows=64, num_warps=4, num_stages=3)
    monkeypatch.setattr(mla_decode, "config_devices", lambda device: ("some-gpu",))
    monkeypatch.setitem(mla_decode.TUNED, ("some-gpu",), tuned)
    cuda = torch.device("cuda", 0)
    assert mla_decode.launch_config(cuda, 2) == tuned
    assert mla_decode.launch_config(cuda, 4) == MLADecodeConfig(splits=132, min_chunk_rows=64, block_rows=16,
                                                                 num_warps=8, num_stages=1)
    assert mla_decode.launch_config(torch.device("cpu"), 4) == mla_decode.INTERPRETER
