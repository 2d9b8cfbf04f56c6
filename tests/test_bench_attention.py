"""The attention benchmark's byte floors (scripts/gpu/bench_attention.py), on CPU: the bytes counted
from the modules (built on the meta device, nothing allocated) against hand formulas for the
Ling-3.0-flash shapes. A floor that missed a projection, or counted an fp32 tensor as bf16, would
report a fraction of floor that is wrong by the same factor."""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts" / "gpu"))

import bench_attention as ba  # noqa: E402

H, HEADS, D, KERNEL = 2560, 32, 128, 4
QKV = HEADS * D  # 4096
BF16, FP32 = 2, 4


def test_kda_parameter_bytes_match_hand_formula():
    m = ba.build_kda()
    assert all(p.is_meta for p in m.parameters())
    hand = (5 * H * QKV * BF16          # q, k, v, g, f_proj
            + QKV * H * BF16            # o_proj
            + H * HEADS * BF16          # b_proj
            + 3 * QKV * KERNEL * FP32   # conv1d [12288, 1, 4]
            + HEADS * FP32              # A_log
            + QKV * FP32                # dt_bias
            + D * BF16)                 # o_norm
    assert hand == 126_206_336
    assert ba.param_bytes(m) == hand
    assert ba.kda_proj_bytes(m) == 6 * H * QKV * BF16 + H * HEADS * BF16


def test_kda_keeps_checkpoint_fp32_parameters():
    m = ba.build_kda()
    dtypes = {name: p.dtype for name, p in m.named_parameters()}
    assert {n for n, t in dtypes.items() if t == torch.float32} == set(ba.KDA_FP32_PARAMS)
    assert {t for n, t in dtypes.items() if n not in ba.KDA_FP32_PARAMS} == {torch.bfloat16}


def test_kda_state_bytes_match_hand_formula_and_buffers():
    m = ba.build_kda()
    hand = 2 * (HEADS * D * D * FP32 + 3 * QKV * (KERNEL - 1) * FP32)  # read + written
    assert hand == 4_489_216
    assert ba.kda_state_bytes(m) == hand
    state = m.setup_cache(1, device="meta")
    assert ba.kda_state_bytes(m) == 2 * sum(b.numel() * b.element_size() for b in state.buffers())


def test_mla_parameter_and_cache_bytes_match_hand_formula():
    m = ba.build_mla()
    assert all(p.is_meta for p in m.parameters())
    hand = BF16 * (H * HEADS * (128 + 64)      # q_proj
                   + H * (512 + 64)            # kv_a_proj_with_mqa
                   + 512                       # kv_a_layernorm
                   + 512 * HEADS * (128 + 128)  # kv_b_proj
                   + HEADS * 128 * H           # o_proj
                   + H * HEADS)                # g_proj
    assert hand == 63_931_392
    assert ba.param_bytes(m) == hand
    for ctx in (1024, 8192, 32768):
        s = ctx + ba.MLA_CACHE_SLACK
        assert ba.mla_cache_bytes(ba.FLASH_MLA, s) == (s + 1) * 576 * BF16
    cache = m.setup_cache(1, 1040, torch.bfloat16, "meta")
    assert cache.bytes_per_token == 576 * BF16


def test_floor_arithmetic():
    kda = ba.param_bytes(ba.build_kda()) + ba.kda_state_bytes(ba.build_kda())
    assert ba.floor_us(kda, ba.NOMINAL_BYTES_PER_S) == pytest.approx(130_695_552 / 4.8e12 * 1e6)
    assert ba.floor_us(4.8e6, 4.8e12) == pytest.approx(1.0)
    mla_32k = ba.param_bytes(ba.build_mla()) + ba.mla_cache_bytes(ba.FLASH_MLA, 32768 + 16)
    assert ba.floor_us(mla_32k, 4.8e12) == pytest.approx(21.19, abs=0.01)


def test_main_exits_without_cuda(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit) as exc:
        ba.main(["--contexts", "1024", "--kinds", "kda"])
    assert exc.value.code == 2
    assert "needs a CUDA device" in capsys.readouterr().err


def test_main_rejects_unknown_kind():
    with pytest.raises(SystemExit):
        ba.main(["--kinds", "gqa"])


def test_best_attention_config_takes_the_least_summed_time_over_every_context():
    a, b, c = ba.MLA_CONFIGS[:3]
    rows = [dict(form="a", config=a.__dict__, measured_us=10.0), dict(form="a", config=a.__dict__, measured_us=50.0),
            dict(form="b", config=b.__dict__, measured_us=20.0), dict(form="b", config=b.__dict__, measured_us=30.0),
            dict(form="c", config=c.__dict__, measured_us=1.0),  # failed at the other context: not a candidate
            dict(form="c", config=c.__dict__, error="boom"),
            dict(form="gemv", measured_us=0.5)]  # no config: not an attention row
    assert ba.best_attention_config(rows) == (b, [20.0, 30.0])
    assert ba.best_attention_config([]) is None


def test_adopt_best_sets_the_devices_entry_and_names_the_run(monkeypatch, tmp_path):
    from impl.model import mla_decode
    monkeypatch.setattr(mla_decode, "TABLE", dataclasses.replace(mla_decode.TABLE, path=tmp_path / "tuned.json"))
    monkeypatch.setitem(mla_decode.TUNED, ("gpu-x",), mla_decode.DEFAULT_CONFIG)
    a, b = ba.MLA_CONFIGS[1:3]
    rows = [dict(form="a", config=a.__dict__, measured_us=9.0), dict(form="a", config=a.__dict__, measured_us=30.0),
            dict(form="b", config=b.__dict__, measured_us=10.0), dict(form="b", config=b.__dict__, measured_us=20.0)]
    ba.adopt_best_attention(rows, "gpu-x", [1024, 32768])
    assert mla_decode.TUNED[("gpu-x",)] == b
    (entry,) = json.loads(mla_decode.TABLE.path.read_text())
    assert entry == dict(key=dict(device="gpu-x"), config=dataclasses.asdict(b),
                         measured="scripts/gpu/bench_attention.py --adopt-best, the kernel alone: "
                                  "10.0 / 20.0 us at 1024 / 32768 rows")
