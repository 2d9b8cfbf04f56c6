"""Parity with code nobody here wrote: transformers' Qwen3MoeForCausalLM and Glm4MoeForCausalLM.

Each case builds a small transformers model, overwrites EVERY parameter and buffer that
matters with fresh random values (transformers initializes norms to ones and the routing
bias to zeros, which would hide a missing or misplaced weight), writes it with
`save_pretrained`, loads it with our `build_model(folder)` and compares in fp32.

Tolerance: RTOL = 1e-5 on ||ours - hf|| / ||hf||. Both sides compute in fp32 with a different
operation order (fused vs per-expert weights, SDPA vs eager attention), which gives ~1e-7;
1e-5 leaves two orders of headroom, while any real error (a wrong rope half, a missing norm
weight, a wrong routing bias) gives O(1e-2) to O(1).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from transformers import Glm4MoeConfig, Glm4MoeForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

from impl.model import build_model
from impl.model.layers import MoEBlock
from impl.model.loading import CheckpointError, read_config
from tests.helpers import rel_err

RTOL = 1e-5  # fp32 vs fp32 with another op order: ~1e-7 observed; real bugs give >= 1e-2
BATCH, SEQ = 2, 17

COMMON = dict(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, moe_intermediate_size=32, num_experts_per_tok=2,
              max_position_embeddings=64, rope_theta=25000.0)  # not the default: a misread theta shows

CASES = {
    "qwen3-norm_topk": ("qwen3", dict(num_experts=8, mlp_only_layers=[1], norm_topk_prob=True)),
    "qwen3-no_norm_topk-bias-tied": ("qwen3", dict(num_experts=8, mlp_only_layers=[1], norm_topk_prob=False,
                                                   attention_bias=True, tie_word_embeddings=True,
                                                   rms_norm_eps=1e-5)),
    "glm-qk_norm": ("glm", dict(n_routed_experts=8, first_k_dense_replace=1, n_group=2, topk_group=1,
                                n_shared_experts=1, routed_scaling_factor=2.5, use_qk_norm=True)),
    "glm-attention_bias": ("glm", dict(n_routed_experts=8, first_k_dense_replace=1, n_group=2, topk_group=1,
                                       n_shared_experts=1, routed_scaling_factor=2.5, attention_bias=True,
                                       norm_topk_prob=False)),
    # Scaled ropes through transformers' own rope functions: YaRN's factor on cos/sin (GLM: on half the head).
    "qwen3-yarn": ("qwen3", dict(num_experts=8, mlp_only_layers=[1],
                                 rope_parameters=dict(rope_type="yarn", rope_theta=25000.0, factor=4.0,
                                                      original_max_position_embeddings=16))),
    "glm-yarn": ("glm", dict(n_routed_experts=8, first_k_dense_replace=1, n_group=2, topk_group=1, n_shared_experts=1,
                             rope_parameters=dict(rope_type="yarn", rope_theta=25000.0, factor=4.0, mscale=0.8,
                                                  mscale_all_dim=1.0, original_max_position_embeddings=16,
                                                  partial_rotary_factor=0.5))),
}


def randomize_(model: torch.nn.Module, gen: torch.Generator) -> None:
    """Fresh random values for every parameter and the routing-bias buffers (never ones or zeros)."""
    hidden = model.config.hidden_size
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.3 * noise)  # norms around 1 so a missing one is visible
            elif name.endswith(".bias"):
                p.copy_(0.3 * noise)
            elif name.endswith("mlp.gate.weight"):
                # Router: logits with std ~2.5 so the top-k choice is far from ties.
                p.copy_(noise * 2.5 / math.sqrt(hidden))
            elif "embed_tokens" in name:
                p.copy_(noise)
            else:  # linear and fused expert weights [.., out, in]: unit-variance outputs
                p.copy_(noise / math.sqrt(p.shape[-1]))
        n_bias = 0
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                # Sigmoid scores live in (0, 1): a bias of this size changes the choice.
                b.copy_(0.3 * torch.randn(b.shape, generator=gen))
                n_bias += 1
        assert n_bias == (model.config.num_hidden_layers - 1 if isinstance(model, Glm4MoeForCausalLM) else 0)


def make_hf(kind: str, overrides: dict, seed: int) -> torch.nn.Module:
    if kind == "qwen3":
        config = Qwen3MoeConfig(**COMMON, **overrides)
        cls = Qwen3MoeForCausalLM
    else:
        config = Glm4MoeConfig(**COMMON, **overrides)  # partial_rotary_factor 0.5: the default
        cls = Glm4MoeForCausalLM
    # Eager attention and the per-expert loop: the plainest code transformers has.
    model = cls._from_config(config, attn_implementation="eager", experts_implementation="eager")
    randomize_(model, torch.Generator().manual_seed(seed))
    if config.tie_word_embeddings:
        assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    return model.eval()


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """name -> (hf model, checkpoint folder); one save per case for the whole module."""
    out = {}
    for seed, (name, (kind, overrides)) in enumerate(CASES.items()):
        hf = make_hf(kind, overrides, seed=1000 + seed)
        folder = tmp_path_factory.mktemp(name)
        hf.save_pretrained(folder)
        out[name] = (hf, folder)
    return out


def random_ids(seed: int, vocab: int = COMMON["vocab_size"]) -> torch.Tensor:
    return torch.randint(0, vocab, (BATCH, SEQ), generator=torch.Generator().manual_seed(seed))


def hf_moe_blocks(hf) -> list[tuple[int, torch.nn.Module]]:
    return [(i, layer.mlp) for i, layer in enumerate(hf.model.layers) if hasattr(layer.mlp, "gate")]


# --------------------------------------------------------------------------- full model


@pytest.mark.parametrize("case", list(CASES))
def test_config_read_matches_hf(checkpoints, case):
    hf, folder = checkpoints[case]
    c, h = read_config(folder), hf.config
    assert (c.vocab_size, c.hidden_size, c.num_layers) == (h.vocab_size, h.hidden_size, h.num_hidden_layers)
    assert (c.num_heads, c.num_kv_heads, c.head_dim) == (h.num_attention_heads, h.num_key_value_heads, h.head_dim)
    assert c.norm_topk_prob == h.norm_topk_prob
    assert c.rms_norm_eps == h.rms_norm_eps
    assert c.tie_word_embeddings == h.tie_word_embeddings
    dense = [i for i, layer in enumerate(hf.model.layers) if not hasattr(layer.mlp, "gate")]
    assert list(c.dense_layers) == dense
    assert c.rotary_dim == hf.model.rotary_emb.inv_freq.numel() * 2
    assert c.rope_theta == h.rope_parameters["rope_theta"] == COMMON["rope_theta"]
    assert dict(c.rope_parameters).get("rope_type", "default") == h.rope_parameters["rope_type"]


@pytest.mark.parametrize("case", list(CASES))
def test_logits_match_hf(checkpoints, case):
    hf, folder = checkpoints[case]
    ours = build_model(str(folder))
    ids = random_ids(seed=len(case))
    with torch.no_grad():
        ref = hf(ids).logits
        got = ours(ids)
    assert got.dtype == torch.float32 and got.shape == ref.shape == (BATCH, SEQ, COMMON["vocab_size"])
    assert rel_err(got, ref) <= RTOL, rel_err(got, ref)


@pytest.mark.parametrize("case", list(CASES))
def test_kv_cache_decode_matches_hf(checkpoints, case):
    """Prefill 5 tokens, then one token at a time with input_pos; every step against HF's full forward."""
    hf, folder = checkpoints[case]
    ours = build_model(str(folder), moe_backend="reference")
    ids = random_ids(seed=100 + len(case))
    with torch.no_grad():
        ref = hf(ids).logits
        ours.setup_caches(max_batch_size=BATCH, max_seq_len=32)
        prefill = 5
        steps = [ours(ids[:, :prefill], torch.arange(prefill))]
        for t in range(prefill, SEQ):
            steps.append(ours(ids[:, t:t + 1], torch.tensor([t])))
    got = torch.cat(steps, dim=1)
    assert got.shape == ref.shape
    assert rel_err(got, ref) <= RTOL, rel_err(got, ref)
    # Each decode step on its own, not only the whole: an error in one position can hide in the sum.
    for t in range(prefill, SEQ):
        assert rel_err(got[:, t], ref[:, t]) <= RTOL, (t, rel_err(got[:, t], ref[:, t]))


# --------------------------------------------------------------------------- MoE block and routing


@pytest.mark.parametrize("backend", ["reference", "gather"])
@pytest.mark.parametrize("case", list(CASES))
def test_moe_block_matches_hf(checkpoints, case, backend):
    hf, folder = checkpoints[case]
    ours = build_model(str(folder), moe_backend=backend)
    blocks = hf_moe_blocks(hf)
    assert blocks, "every case has MoE layers"
    gen = torch.Generator().manual_seed(7 + len(case))
    for i, hf_block in blocks:
        block = ours.layers[i].mlp
        assert isinstance(block, MoEBlock) and block.backend.name == backend
        x = torch.randn(BATCH, SEQ, COMMON["hidden_size"], generator=gen)
        with torch.no_grad():
            ref = hf_block(x)
            got = block(x)
        assert got.shape == ref.shape
        assert rel_err(got, ref) <= RTOL, (i, rel_err(got, ref))


def _choice_margin(hf_gate, x: torch.Tensor) -> float:
    """Smallest gap, over tokens, between the k-th and (k+1)-th candidate in HF's own selection
    (and between the chosen and the next group): how far the inputs are from a routing tie."""
    logits = torch.nn.functional.linear(x.float(), hf_gate.weight.float())
    k = hf_gate.top_k
    if not hasattr(hf_gate, "e_score_correction_bias"):
        top = logits.softmax(-1).topk(k + 1, dim=-1).values
        return (top[:, k - 1] - top[:, k]).min().item()
    choice = logits.sigmoid() + hf_gate.e_score_correction_bias
    g = hf_gate.num_group
    groups = choice.view(len(x), g, -1).topk(2, dim=-1).values.sum(-1).sort(-1, descending=True).values
    margin = (groups[:, hf_gate.topk_group - 1] - groups[:, hf_gate.topk_group]).min().item()
    keep = groups[:, hf_gate.topk_group - 1:hf_gate.topk_group]
    group_scores = choice.view(len(x), g, -1).topk(2, dim=-1).values.sum(-1)
    masked = choice.view(len(x), g, -1).masked_fill((group_scores < keep)[..., None], float("-inf"))
    top = masked.view(len(x), -1).topk(k + 1, dim=-1).values
    return min(margin, (top[:, k - 1] - top[:, k]).min().item())


@pytest.mark.parametrize("case", list(CASES))
def test_router_matches_hf(checkpoints, case):
    hf, folder = checkpoints[case]
    ours = build_model(str(folder))
    gen = torch.Generator().manual_seed(31 + len(case))
    for i, hf_block in hf_moe_blocks(hf):
        x = torch.randn(BATCH * SEQ, COMMON["hidden_size"], generator=gen)
        # Precondition on the inputs, not on the code: no token sits within 1e-4 of a tie, so
        # ids must agree exactly whatever the rounding.
        assert _choice_margin(hf_block.gate, x) > 1e-4
        with torch.no_grad():
            _, hf_w, hf_ids = hf_block.gate(x)
            w, ids = ours.layers[i].mlp.gate(x)
        assert ids.shape == hf_ids.shape == (BATCH * SEQ, COMMON["num_experts_per_tok"])
        assert ids.dtype == torch.int64 and w.dtype == torch.float32
        order, hf_order = ids.argsort(-1), hf_ids.argsort(-1)
        assert torch.equal(ids.gather(1, order), hf_ids.gather(1, hf_order)), f"layer {i}: different experts"
        # Weights are a few ops of fp32 on the same logits: 1e-6 relative covers the rounding.
        torch.testing.assert_close(w.gather(1, order), hf_w.float().gather(1, hf_order), rtol=1e-6, atol=1e-7)


# --------------------------------------------------------------------------- loader


def test_sharded_checkpoint_loads_identically(checkpoints, tmp_path):
    hf, folder = checkpoints["glm-qk_norm"]
    hf.save_pretrained(tmp_path, max_shard_size="40KB")
    shards = sorted(p.name for p in tmp_path.glob("*.safetensors"))
    assert len(shards) > 3 and (tmp_path / "model.safetensors.index.json").is_file()
    single, sharded = build_model(str(folder)), build_model(str(tmp_path))
    s1, s2 = single.state_dict(), sharded.state_dict()
    assert s1.keys() == s2.keys()
    for name in s1:
        assert torch.equal(s1[name], s2[name]), name
    ids = random_ids(seed=5)
    with torch.no_grad():
        assert torch.equal(single(ids), sharded(ids))


def test_bf16_checkpoint_loads_into_fp32_model(tmp_path):
    hf = make_hf("qwen3", CASES["qwen3-norm_topk"][1], seed=77)
    ids = random_ids(seed=9)
    with torch.no_grad():
        for p in hf.parameters():  # the reference: bf16-rounded weights, computed in fp32
            p.copy_(p.bfloat16().float())
        ref = hf(ids).logits
    # (Only now to bf16: .to() would also round HF's rope inv_freq buffer, which no checkpoint holds.)
    hf.to(torch.bfloat16).save_pretrained(tmp_path)
    with safe_open(tmp_path / "model.safetensors", framework="pt") as f:
        assert all(f.get_tensor(k).dtype == torch.bfloat16 for k in f.keys())
    ours = build_model(str(tmp_path))
    assert all(p.dtype == torch.float32 for p in ours.parameters())
    with torch.no_grad():
        got = ours(ids)
    assert rel_err(got, ref) <= RTOL, rel_err(got, ref)


def _edit_config(folder: Path, fn) -> None:
    path = folder / "config.json"
    raw = json.loads(path.read_text())
    fn(raw)
    path.write_text(json.dumps(raw))


def _edit_tensors(folder: Path, fn) -> None:
    path = folder / "model.safetensors"
    tensors = load_file(path)
    fn(tensors)
    save_file(tensors, path, metadata={"format": "pt"})


@pytest.fixture
def glm_copy(checkpoints, tmp_path):
    """A fresh, editable copy of the GLM checkpoint."""
    hf, _ = checkpoints["glm-qk_norm"]
    hf.save_pretrained(tmp_path)
    return tmp_path


def test_folder_without_config_json(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(CheckpointError, match="no config.json"):
        build_model(str(tmp_path))


def test_invalid_json_config(glm_copy):
    (glm_copy / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="not valid JSON"):
        build_model(str(glm_copy))


def test_a_config_missing_a_field_names_the_file_and_the_field(glm_copy):
    _edit_config(glm_copy, lambda raw: raw.pop("num_hidden_layers"))
    with pytest.raises(CheckpointError, match=r"config.json: missing the field 'num_hidden_layers' \(glm4_moe"):
        build_model(str(glm_copy))


@pytest.mark.parametrize("edit, problem", [
    (lambda raw: raw.update(num_experts_per_tok="two"), r"config.json: '<=' not supported"),  # a string
    (lambda raw: raw.update(num_experts_per_tok=None), r"config.json: .*NoneType"),
    (lambda raw: raw.update(num_experts_per_tok=64), r"config.json: top_k must be in \[1, num_experts="),
])
def test_a_config_field_of_the_wrong_type_or_range_names_the_file(glm_copy, edit, problem):
    _edit_config(glm_copy, edit)
    with pytest.raises(CheckpointError, match=problem):
        build_model(str(glm_copy))


def test_a_config_that_is_no_json_object_names_the_file(glm_copy):
    (glm_copy / "config.json").write_text("[]")
    with pytest.raises(CheckpointError, match=r"config.json: expected a JSON object of config fields, got a list"):
        build_model(str(glm_copy))


def test_a_damaged_weight_file_is_named_before_anything_is_built(glm_copy):
    from impl.model.loading import check_checkpoint
    check_checkpoint(glm_copy)  # the copy as saved: fine
    weights = sorted(glm_copy.glob("*.safetensors"))[0]
    weights.write_bytes(weights.read_bytes()[:100])
    with pytest.raises(CheckpointError, match=rf"{weights.name}: not a readable safetensors file"):
        check_checkpoint(glm_copy)


@pytest.mark.parametrize("edit, tensor", [
    (dict(vocab_size=COMMON["vocab_size"] * 2), "has shape .96, 64., the config implies .192, 64."),  # the headers' shapes disagree
    (dict(num_hidden_layers=COMMON["num_hidden_layers"] + 1), "missing"),    # a layer the files do not hold
])
def test_a_config_the_weights_do_not_fit_is_named_before_anything_is_built(glm_copy, edit, tensor):
    """Read from the headers alone, as the plugin checks a --moe-model folder at start-up."""
    from impl.model.loading import check_checkpoint
    _edit_config(glm_copy, lambda raw: raw.update(edit))
    with pytest.raises(CheckpointError, match=tensor) as e:
        check_checkpoint(glm_copy)
    assert str(glm_copy) in str(e.value)


def test_unsupported_architecture(glm_copy):
    _edit_config(glm_copy, lambda raw: raw.update(model_type="mixtral", architectures=["MixtralForCausalLM"]))
    with pytest.raises(CheckpointError, match=r"architecture 'mixtral' is not supported.*qwen3_moe"):
        build_model(str(glm_copy))


def test_unsupported_rope_type(glm_copy):
    def dynamic(raw):  # dynamic NTK: tables that follow the sequence length, not static ones
        raw["rope_parameters"].update(rope_type="dynamic", factor=4.0)
    _edit_config(glm_copy, dynamic)
    with pytest.raises(CheckpointError, match="rope type 'dynamic' is not supported; supported: default, linear, yarn"):
        build_model(str(glm_copy))


def test_a_prenorm_mtp_flag_that_is_no_bool_is_named(glm_copy):
    _edit_config(glm_copy, lambda raw: raw.update(moeperf_mtp_prenorm_hidden="false"))
    with pytest.raises(CheckpointError, match="moeperf_mtp_prenorm_hidden must be true or false, got 'false'"):
        read_config(glm_copy)


def test_unsupported_activation(glm_copy):
    _edit_config(glm_copy, lambda raw: raw.update(hidden_act="gelu"))
    with pytest.raises(CheckpointError, match="activation 'gelu'"):
        build_model(str(glm_copy))


def test_missing_tensor(glm_copy):
    _edit_tensors(glm_copy, lambda t: t.pop("model.layers.2.self_attn.k_norm.weight"))
    with pytest.raises(CheckpointError, match=r"missing \['layers\.2\.self_attn\.k_norm\.weight'\]"):
        build_model(str(glm_copy))


def test_missing_expert_tensor(glm_copy):
    _edit_tensors(glm_copy, lambda t: t.pop("model.layers.1.mlp.experts.5.up_proj.weight"))
    with pytest.raises(CheckpointError, match=r"layers\.1\.mlp\.experts: expected gate/up/down"):
        build_model(str(glm_copy))


def test_unexpected_tensor(glm_copy):
    def extra(t):
        t["model.layers.0.self_attn.rotary.weight"] = torch.randn(3)
    _edit_tensors(glm_copy, extra)
    with pytest.raises(CheckpointError, match=r"unexpected \['layers\.0\.self_attn\.rotary\.weight'\]"):
        build_model(str(glm_copy))


def test_tensor_of_wrong_shape(glm_copy):
    def reshape(t):
        key = "model.layers.0.mlp.up_proj.weight"
        t[key] = torch.randn(t[key].shape[0] + 1, t[key].shape[1])
    _edit_tensors(glm_copy, reshape)
    with pytest.raises(CheckpointError, match=r"layers\.0\.mlp\.up_proj\.weight has shape \(97, 64\).*\(96, 64\)"):
        build_model(str(glm_copy))


def test_folder_without_safetensors(glm_copy):
    (glm_copy / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="no .safetensors"):
        build_model(str(glm_copy))


def test_unknown_preset_name():
    with pytest.raises(ValueError, match=r"'nope' is neither a preset.*tiny.*nor a checkpoint folder"):
        build_model("nope")


def test_mtp_layers_are_skipped(glm_copy, checkpoints):
    """A NEXTN layer stored past num_hidden_layers is ignored by the target model."""
    hf, _ = checkpoints["glm-qk_norm"]
    def add_mtp(t):
        for key in [k for k in t if k.startswith("model.layers.2.")]:
            t[key.replace("layers.2.", "layers.3.")] = torch.randn(t[key].shape)
    _edit_tensors(glm_copy, add_mtp)
    ours = build_model(str(glm_copy))
    assert len(ours.layers) == 3
    ids = random_ids(seed=13)
    with torch.no_grad():
        assert rel_err(ours(ids), hf(ids).logits) <= RTOL


@pytest.mark.parametrize("case", ["qwen3-no_norm_topk-bias-tied", "glm-qk_norm"])
def test_config_keys_left_to_transformers_defaults(checkpoints, case, tmp_path):
    """A config.json may omit any key whose value is transformers' default (norm_topk_prob is
    False for Qwen3-MoE but True for GLM; GLM's rms_norm_eps is 1e-5, partial_rotary_factor 0.5,
    first_k_dense_replace 1, n_shared_experts 1). The loader must read such a file as transformers does."""
    hf, folder = checkpoints[case]
    hf.save_pretrained(tmp_path)
    raw = json.loads((tmp_path / "config.json").read_text())
    defaults = type(hf.config)().to_dict()
    rope = raw.get("rope_parameters") or {}
    if rope.get("partial_rotary_factor") == 0.5 and isinstance(hf, Glm4MoeForCausalLM):
        del rope["partial_rotary_factor"]
    stripped = {k: v for k, v in raw.items() if k == "model_type" or v != defaults.get(k, object())}
    dropped = set(raw) - set(stripped)
    assert {"norm_topk_prob"} <= dropped if case.startswith("qwen3") else \
        {"rms_norm_eps", "first_k_dense_replace", "n_shared_experts", "norm_topk_prob"} <= dropped
    (tmp_path / "config.json").write_text(json.dumps(stripped))
    # The stripped file means the same model to transformers...
    reread = type(hf.config).from_pretrained(tmp_path)
    for key in ("norm_topk_prob", "rms_norm_eps", "rope_parameters", "mlp_only_layers", "first_k_dense_replace",
                "n_shared_experts", "tie_word_embeddings"):
        assert getattr(reread, key, None) == getattr(hf.config, key, None), key
    # ...and must mean the same to us.
    ours = build_model(str(tmp_path))
    ids = random_ids(seed=21)
    with torch.no_grad():
        assert rel_err(ours(ids), hf(ids).logits) <= RTOL
