"""The NEXTN (MTP) layer: DeepSeek-V3 layout, sharing of the target's embedding and head
modules, its KV-cache path, and checkpoints in transformers' GLM-4.5 layout (written by
impl.model.saving, read by impl.model.loading, and readable by transformers itself)."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from impl.model import build_model, get_config
from impl.model.saving import save_checkpoint
from impl.speculative import SpeculativeDecoder
from tests.helpers import rel_err

RTOL = 1e-5  # fp32 vs fp32, another op order (see tests/test_hf_parity.py)


def randomize_(model, seed: int):
    """Norm weights and routing biases away from their defaults, so a misplaced one shows."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(torch.randn(p.shape, generator=g) * (0.1 if p.ndim > 1 else 0.3) + (p.ndim == 1))
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(torch.randn(b.shape, generator=g) * 0.1)
    return model


@pytest.fixture(scope="module")
def model():
    return randomize_(build_model("tiny"), seed=0)


def test_layout_and_sharing(model):
    mtp = model.mtp[0]
    assert len(model.mtp) == model.config.num_mtp_layers == 1
    assert mtp.head is model.lm_head and mtp.embed_tokens is model.embed_tokens
    assert mtp.eh_proj.weight.shape == (128, 256)
    keys = {k for k in model.state_dict() if k.startswith("mtp.")}
    assert {"mtp.0.enorm.weight", "mtp.0.hnorm.weight", "mtp.0.eh_proj.weight", "mtp.0.final_norm.weight",
            "mtp.0.block.mlp.experts.gate_up_proj"} <= keys
    assert not any("head" in k or "embed" in k for k in keys), "shared modules must not be duplicated"
    assert sum(p.numel() for p in model.parameters()) == model.config.num_parameters()


def test_mtp_formula(model):
    """h' = block(eh_proj(cat(enorm(embed(next)), hnorm(h)))); logits = head(final_norm(h'))."""
    mtp = model.mtp[0]
    ids = torch.randint(0, 128, (2, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        h = model.last_hidden_states(ids[:, :-1])
        cos, sin, _ = model.positions(8, None)
        out = mtp.hidden(h, ids[:, 1:], cos, sin, None, None)
        x = mtp.eh_proj(torch.cat((mtp.enorm(model.embed_tokens(ids[:, 1:])), mtp.hnorm(h)), -1))
        assert rel_err(out, mtp.block(x, cos, sin, None, None)) <= RTOL
        assert rel_err(mtp.logits(out), model.lm_head(mtp.final_norm(out))) <= RTOL


def test_cached_mtp_matches_full_forward(model):
    """The decoder's draft path (KV cache, one span then single positions) equals the cacheless one."""
    model = copy.deepcopy(model)  # caches stay off the shared fixture
    mtp = model.mtp[0]
    ids = torch.randint(0, 128, (1, 12), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        h = model.last_hidden_states(ids[:, :-1])
        cos, sin, _ = model.positions(11, None)
        ref = mtp.hidden(h, ids[:, 1:], cos, sin, None, None)
        model.setup_caches(1, model.config.max_seq_len)
        def step(prev, nxt, pos):
            cos, sin, mask = model.positions(len(pos), pos)
            return mtp.hidden(prev, nxt, cos, sin, pos, mask)

        parts = [step(h[:, :8], ids[:, 1:9], torch.arange(8))]
        parts += [step(h[:, i:i + 1], ids[:, i + 1:i + 2], torch.tensor([i])) for i in range(8, 11)]
        assert rel_err(torch.cat(parts, 1), ref) <= RTOL


def test_checkpoint_roundtrip(model, tmp_path):
    save_checkpoint(model, tmp_path)
    raw = json.loads((tmp_path / "config.json").read_text())
    assert raw["model_type"] == "glm4_moe" and raw["num_nextn_predict_layers"] == 1
    tensors = load_file(tmp_path / "model.safetensors")
    for name in ("enorm", "hnorm", "eh_proj", "shared_head.norm", "shared_head.head", "embed_tokens"):
        assert f"model.layers.4.{name}.weight" in tensors
    assert "model.layers.4.mlp.experts.7.down_proj.weight" in tensors
    loaded = build_model(str(tmp_path))
    assert loaded.mtp[0].head is loaded.lm_head and loaded.mtp[0].embed_tokens is loaded.embed_tokens
    ours, theirs = model.state_dict(), loaded.state_dict()
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)


def test_transformers_reads_our_checkpoint(model, tmp_path):
    """The target part of our glm4_moe checkpoint means the same to transformers."""
    transformers = pytest.importorskip("transformers")
    save_checkpoint(model, tmp_path)
    hf = transformers.Glm4MoeForCausalLM.from_pretrained(tmp_path, torch_dtype=torch.float32).eval()
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(3))
    fresh = build_model(str(tmp_path))
    with torch.no_grad():
        assert rel_err(fresh(ids), hf(ids).logits) <= RTOL


def test_checkpoint_without_mtp_layer_cannot_speculate(model, tmp_path):
    save_checkpoint(model, tmp_path)
    path = tmp_path / "model.safetensors"
    tensors = {k: v for k, v in load_file(path).items() if not k.startswith("model.layers.4.")}
    save_file(tensors, path)
    loaded = build_model(str(tmp_path))
    assert len(loaded.mtp) == 0 and loaded.config.num_mtp_layers == 0
    with pytest.raises(ValueError, match="has no MTP .*NEXTN.* layer to draft with"):
        SpeculativeDecoder(loaded, 3)


def test_preset_without_mtp_builds_none():
    assert len(build_model(get_config("tiny", num_mtp_layers=0)).mtp) == 0
