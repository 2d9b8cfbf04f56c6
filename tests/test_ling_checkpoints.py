"""Ling 3.0 checkpoints in the layouts they ship in, each written from the tiny transformers checkpoint
(tests/ling_checkpoint.py) and loaded through impl.model.build, against its dequantized reference:
sharded with an index; FP8 e4m3 projections with block scales (DeepSeek-V3 / Ling-3.0-flash-fp8) or
per-channel scales (compressed-tensors); routed experts in MXFP4 as Ling's fp4 checkpoint stores them
(per expert, E8M0 `weight_scale_inv`), as compressed-tensors does (`weight_packed` / `weight_scale`)
and as gpt-oss does (fused `_blocks` / `_scales`, gate and up rows interleaved). Malformed checkpoints
name the tensor and the file, or the unknown quantization method.
"""

from __future__ import annotations

import json
import re
import shutil

import pytest
import torch

pytest.importorskip("transformers.models.bailing_hybrid")
from safetensors.torch import load_file, save_file  # noqa: E402

from impl.model.build import build_model  # noqa: E402
from impl.model.loading import CheckpointError, check_checkpoint, read_config  # noqa: E402
from impl.quant.mxfp4 import quantize_mxfp4  # noqa: E402
from tests.ling_checkpoint import LAYERS, write_tiny_ling  # noqa: E402
from tests.helpers import rel_err  # noqa: E402

EXPERT = re.compile(r"^(.*\.mlp\.experts)\.(\d+)\.(gate|up|down)_proj\.weight$")
# Projections a Ling FP8 checkpoint quantizes: 2-D weights of attention, dense and shared MLPs
# and eh_proj; never the router, embeddings, head, norms or the KDA conv / gate constants.
FP8_SKIP = ("mlp.gate.", "word_embeddings", "lm_head", "norm", "conv1d", "experts.")
BLOCK = (8, 8)  # FP8 block size here: the tiny weights (32 x 32) then hold several blocks


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    """A float checkpoint whose expert widths are multiples of 32, so MXFP4 can hold them."""
    return write_tiny_ling(tmp_path_factory.mktemp("ling-src"), moe_intermediate_size=32)[0]


def derive(source, dest, transform, quantization=None):
    """Copy `source` to `dest` with its tensors passed through `transform` and, when given, a
    `quantization_config` in config.json."""
    shutil.copytree(source, dest)
    tensors = transform(load_file(dest / "model.safetensors"))
    save_file(tensors, dest / "model.safetensors", metadata={"format": "pt"})
    if quantization is not None:
        raw = json.loads((dest / "config.json").read_text())
        raw["quantization_config"] = quantization
        (dest / "config.json").write_text(json.dumps(raw))
    return dest


def fp8_targets(tensors):
    return [k for k, t in tensors.items() if t.dim() == 2 and k.endswith(".weight") and not any(s in k for s in FP8_SKIP)]


def to_fp8_blocks(t: torch.Tensor, block=BLOCK):
    """(e4m3 data, fp32 scale_inv per block): value = data * scale over each block."""
    n, k = t.shape
    bn, bk = block
    pad = torch.zeros(-(-n // bn) * bn, -(-k // bk) * bk)
    pad[:n, :k] = t
    blocks = pad.view(pad.shape[0] // bn, bn, pad.shape[1] // bk, bk)
    scale = blocks.abs().amax(dim=(1, 3)) / 448.0
    data = (blocks / scale[:, None, :, None]).view_as(pad)[:n, :k].to(torch.float8_e4m3fn)
    return data, scale


def dequant_blocks(data, scale, block=BLOCK):
    n, k = data.shape
    return data.float() * scale.repeat_interleave(block[0], 0)[:n].repeat_interleave(block[1], 1)[:, :k]


def logits_of(folder, experts="dense", backend="gather"):
    model = build_model(str(folder), experts=experts, moe_backend=backend)
    tokens = torch.randint(0, 64, (1, 24), generator=torch.Generator().manual_seed(3))
    with torch.inference_mode():
        return model, model(tokens)


def test_sharded_checkpoint_loads_identically(source, tmp_path):
    whole = load_file(source / "model.safetensors")
    dest = tmp_path / "sharded"
    shutil.copytree(source, dest)
    (dest / "model.safetensors").unlink()
    keys = sorted(whole)
    weight_map = {}
    for i in range(3):
        name = f"model-{i + 1:05d}-of-00003.safetensors"
        part = {k: whole[k] for k in keys[i::3]}
        save_file(part, dest / name, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(part, name))
    (dest / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    a, b = build_model(str(source)), build_model(str(dest))
    for (name, x), y in zip(a.state_dict().items(), b.state_dict().values()):
        assert torch.equal(x, y), name
    # A damaged shard is named by the start-up check (impl.model.loading.check_checkpoint), which
    # reads every shard's header, not only when its first tensor is wanted.
    from impl.model.loading import check_checkpoint
    from impl.model.weight_formats import CheckpointError
    check_checkpoint(dest)
    shard = dest / "model-00002-of-00003.safetensors"
    shard.write_bytes(shard.read_bytes()[:64])
    with pytest.raises(CheckpointError, match=r"model-00002-of-00003.safetensors: not a readable safetensors file"):
        check_checkpoint(dest)


@pytest.mark.parametrize("layout", ["block", "channel"])
def test_fp8_projections_match_their_dequantized_reference(source, tmp_path, layout):
    deq = {}

    def quantize(tensors):
        for key in fp8_targets(tensors):
            t = tensors.pop(key)
            if layout == "block":
                data, scale = to_fp8_blocks(t)
                tensors[key], tensors[key + "_scale_inv"] = data, scale
                deq[key] = dequant_blocks(data, scale)
            else:
                scale = t.abs().amax(dim=1, keepdim=True) / 448.0
                data = (t / scale).to(torch.float8_e4m3fn)
                tensors[key], tensors[key[:-len("weight")] + "weight_scale"] = data, scale
                deq[key] = data.float() * scale
        return tensors

    q = ({"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": list(BLOCK)}
         if layout == "block" else {"quant_method": "compressed-tensors", "format": "float-quantized"})
    fp8 = derive(source, tmp_path / "fp8", quantize, q)
    assert deq, "nothing was quantized"
    ref = derive(source, tmp_path / "ref", lambda t: {**t, **deq})
    (m1, got), (m2, want) = logits_of(fp8), logits_of(ref)
    assert torch.equal(got, want)
    # and the FP8 rounding is really in: the dequantized weights differ from the float ones
    src, _ = logits_of(source)
    assert any(not torch.equal(x, y) for x, y in zip(m1.state_dict().values(), src.state_dict().values()))


def _mxfp4_experts(tensors, layout):
    """Routed experts -> MXFP4 in `layout`; returns (tensors, dequantized float experts)."""
    deq, per = {}, {}
    for key in [k for k in tensors if EXPERT.match(k)]:
        prefix, e, part = EXPERT.match(key).groups()
        q = quantize_mxfp4(tensors.pop(key))
        deq[key] = q.dequantize(torch.float32)
        per.setdefault(prefix, {}).setdefault(part, {})[int(e)] = q
        if layout == "ling":  # Ling-3.0-flash-fp4: int8 bytes, E8M0 scales as float8_e8m0fnu
            tensors[key], tensors[key + "_scale_inv"] = q.packed.view(torch.int8), q.scales.view(torch.float8_e8m0fnu)
        elif layout == "ling-uint8":
            tensors[key], tensors[key + "_scale_inv"] = q.packed, q.scales
        elif layout == "compressed":
            base = key[:-len("weight")]
            tensors[base + "weight_packed"], tensors[base + "weight_scale"] = q.packed, q.scales
    if layout == "gpt-oss":
        for prefix, parts in per.items():
            ids = sorted(parts["gate"])
            gate = [parts["gate"][i] for i in ids]
            up = [parts["up"][i] for i in ids]
            packed = torch.stack([torch.stack((g.packed, u.packed), 1).flatten(0, 1) for g, u in zip(gate, up)])
            scales = torch.stack([torch.stack((g.scales, u.scales), 1).flatten(0, 1) for g, u in zip(gate, up)])
            tensors[f"{prefix}.gate_up_proj_blocks"] = packed.view(*packed.shape[:2], -1, 16)
            tensors[f"{prefix}.gate_up_proj_scales"] = scales
            down = [parts["down"][i] for i in ids]
            tensors[f"{prefix}.down_proj_blocks"] = torch.stack([d.packed for d in down]).view(len(ids), -1,
                                                                                                down[0].scales.shape[-1], 16)
            tensors[f"{prefix}.down_proj_scales"] = torch.stack([d.scales for d in down])
    return tensors, deq


LING_FP4 = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128], "scale_fmt": "ue8m0",
            "routed_experts_quant_method": "mxfp4", "routed_experts_group_size": 32}
QUANT = {"ling": LING_FP4, "ling-uint8": LING_FP4,
         "compressed": {"quant_method": "compressed-tensors", "format": "mxfp4-pack-quantized"},
         "gpt-oss": {"quant_method": "mxfp4"}}


@pytest.mark.parametrize("layout", sorted(QUANT))
def test_mxfp4_experts_match_their_dequantized_reference(source, tmp_path, layout):
    deq = {}

    def quantize(tensors):
        out, d = _mxfp4_experts(tensors, layout)
        deq.update(d)
        return out

    mx = derive(source, tmp_path / "mx", quantize, QUANT[layout])
    ref = derive(source, tmp_path / "ref", lambda t: {**t, **deq})
    # Held as MXFP4: the checkpoint's bytes are kept, and the experts compute what the dequantized ones do.
    kept, got = logits_of(mx, experts="mxfp4", backend="reference")
    _, want = logits_of(ref)
    assert rel_err(got, want) <= 1e-5
    # Held dense: dequantized on load, equal to the reference's experts.
    dense, got_dense = logits_of(mx)
    assert torch.equal(got_dense, want)
    want_packed = quantize_mxfp4(torch.cat([deq["model.layers.1.mlp.experts.0.gate_proj.weight"],
                                            deq["model.layers.1.mlp.experts.0.up_proj.weight"]])).packed
    assert torch.equal(kept.layers[1].mlp.experts.gate_up_packed[0], want_packed)


def test_float_checkpoint_quantized_to_mxfp4_on_load(source):
    """A float checkpoint into MXFP4 experts: quantized a chunk at a time as read, equal to
    quantizing the loaded float experts at once."""
    dense = build_model(str(source))
    mx = build_model(str(source), experts="mxfp4", moe_backend="reference")
    for layer in (1, 2):
        want = quantize_mxfp4(dense.layers[layer].mlp.experts.gate_up_proj.data)
        assert torch.equal(mx.layers[layer].mlp.experts.gate_up_packed, want.packed)
        assert torch.equal(mx.layers[layer].mlp.experts.gate_up_scales, want.scales)


def test_missing_tensor_is_named(source, tmp_path):
    bad = derive(source, tmp_path / "bad", lambda t: {k: v for k, v in t.items()
                                                      if k != "model.layers.2.attention.kv_b_proj.weight"})
    with pytest.raises(CheckpointError, match=r"missing \['layers\.2\.self_attn\.kv_b_proj\.weight'\]"):
        build_model(str(bad))


def test_wrong_shape_names_tensor_and_file(source, tmp_path):
    def widen(t):
        t["model.layers.0.attention.dense.weight"] = torch.zeros(32, 48)
        return t
    bad = derive(source, tmp_path / "bad", widen)
    with pytest.raises(CheckpointError, match=r"model\.safetensors: model\.layers\.0\.attention\.dense\.weight: "
                                              r"layers\.0\.self_attn\.o_proj\.weight has shape \(32, 48\).*\(32, 32\)"):
        build_model(str(bad))


def test_expert_shapes_the_config_does_not_imply_are_named_before_the_build(source, tmp_path):
    """A routed expert stored at another width than the config's fails in check_checkpoint, which
    the plugin runs at start-up, naming the stored tensor, its shape and the config's widths; it
    used to pass there and fail in every test that built the model."""
    def widen(t):
        t["model.layers.1.mlp.experts.3.gate_proj.weight"] = torch.zeros(48, 32)
        return t
    bad = derive(source, tmp_path / "bad", widen)
    with pytest.raises(CheckpointError, match=r"model\.safetensors: model\.layers\.1\.mlp\.experts\.3\.gate_proj\.weight "
                                              r"has shape \(48, 32\), the config \(num_experts 8, hidden_size 32, "
                                              r"moe_intermediate_size 32\) implies \(32, 32\)"):
        check_checkpoint(bad)


def test_unexpected_tensor_names_its_file(source, tmp_path):
    bad = derive(source, tmp_path / "bad", lambda t: {**t, "model.layers.0.attention.bogus.weight": torch.ones(2)})
    with pytest.raises(CheckpointError, match=r"unexpected \['layers\.0\.self_attn\.bogus\.weight'\] "
                                              r"\(layers\.0\.self_attn\.bogus\.weight from model\.safetensors\)"):
        build_model(str(bad))


# Scales without their weight: in a decoder layer, in the NEXTN layer for a shared copy the model
# skips, and in a layer past the NEXTN one (skipped too).
@pytest.mark.parametrize("key", ["model.layers.0.attention.q_proj.weight_scale_inv",
                                 f"model.layers.{LAYERS}.word_embeddings.weight_scale",
                                 f"model.layers.{LAYERS + 1}.attention.q_proj.weight_scale",
                                 "model.layers.1.mlp.experts.down_proj_scales"])
def test_scale_without_its_weight_names_tensor_and_file(source, tmp_path, key):
    def orphan(t):
        t.pop(key.rsplit(".weight_scale", 1)[0] + ".weight", None)
        return {**t, key: torch.ones(4, dtype=torch.uint8)}
    bad = derive(source, tmp_path / "bad", orphan, QUANT["ling"])
    with pytest.raises(CheckpointError, match=rf"model\.safetensors: {re.escape(key)}: a scale tensor without the weight"):
        build_model(str(bad))


def test_fp8_weight_without_scale_names_tensor_and_file(source, tmp_path):
    def strip(t):
        t["model.layers.0.attention.q_proj.weight"] = t["model.layers.0.attention.q_proj.weight"].to(torch.float8_e4m3fn)
        return t
    bad = derive(source, tmp_path / "bad", strip, QUANT["ling"])
    with pytest.raises(CheckpointError, match=r"model\.safetensors: model\.layers\.0\.attention\.q_proj\.weight: "
                                              r"torch\.float8_e4m3fn weight without a scale"):
        build_model(str(bad))


@pytest.mark.parametrize("quant,message", [
    ({"quant_method": "awq", "bits": 4}, r"quantization method 'awq' is not supported"),
    ({"quant_method": "fp8", "fmt": "e5m2"}, r"FP8 format 'e5m2' is not supported"),
    ({"quant_method": "compressed-tensors", "format": "int-quantized"}, r"compressed-tensors format 'int-quantized'"),
    ({**LING_FP4, "routed_experts_group_size": 16}, r"routed_experts_group_size 16 is not supported"),
    ({"quant_method": "compressed-tensors", "format": "mxfp4-pack-quantized",
      "config_groups": {"group_0": {"weights": {"num_bits": 4, "group_size": 16}}}},
     r"config_groups\.group_0\.weights\.group_size 16 is not supported"),
])
def test_unknown_quantization_config_is_named(source, tmp_path, quant, message):
    bad = derive(source, tmp_path / "bad", lambda t: t, quant)
    with pytest.raises(CheckpointError, match=rf"config\.json: {message}"):
        build_model(str(bad))


def test_missing_expert_names_the_layer(source, tmp_path):
    bad = derive(source, tmp_path / "bad", lambda t: {k: v for k, v in t.items()
                                                      if not k.startswith("model.layers.2.mlp.experts.5.")})
    with pytest.raises(CheckpointError, match=r"layers\.2\.mlp\.experts: expected gate/up/down for experts 0\.\.7"):
        build_model(str(bad))


def test_swiglu_limits_load_and_malformed_ones_are_named(source, tmp_path):
    """Ling-3.0-flash's config clips SwiGLU in its late layers (per-layer limits, 0: none): zeros
    load as no clipping, limits as the layers' own; a list that is not one number >= 0 a decoder
    layer is refused, naming config.json and the key."""
    raw = json.loads((source / "config.json").read_text())
    layers = raw["num_hidden_layers"]
    cases = [({"expert_swiglu_limit_list": [0] * layers}, None),
             ({"expert_swiglu_limit_list": [0] * (layers - 1) + [7], "share_expert_swiglu_limit_list": [5] + [0] * (layers - 1)},
              None),
             ({"expert_swiglu_limit_list": [7] * (layers - 1)}, r"expert_swiglu_limit_list must list one finite limit"),
             ({"share_expert_swiglu_limit_list": [-1] * layers}, r"share_expert_swiglu_limit_list must list"),
             ({"expert_swiglu_limit_list": ["7"] * layers}, r"expert_swiglu_limit_list must list"),
             ({"expert_swiglu_limit_list": [0] * layers, "swiglu_limits": [7] * layers},
              r"expert_swiglu_limit_list and swiglu_limits name the same limits and differ")]
    for i, (keys, error) in enumerate(cases):
        folder = tmp_path / f"clip-{i}"
        shutil.copytree(source, folder)
        (folder / "config.json").write_text(json.dumps({**raw, **keys}))
        if error:
            with pytest.raises(CheckpointError, match=rf"config\.json: {error}"):
                read_config(folder)
            continue
        c = read_config(folder)
        assert c.clips_swiglu == (i == 1)
        if i == 1:
            assert c.swiglu_limits == (0,) * (layers - 1) + (7.0,)
            assert (c.swiglu_limit(layers - 1), c.swiglu_limit(0, shared=True), c.swiglu_limit(layers)) == (7.0, 5.0, None)
