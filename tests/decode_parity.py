"""What the per-family parity tests against transformers share (tests/test_ling_parity.py,
tests/test_deepseek_parity.py): the per-position error, teacher-forced cached decoding, the NEXTN
layer's reference assembled from transformers' modules and ours beside it, and the serving ladder
run on a loaded model."""

from __future__ import annotations

import torch

from tests.helpers import rel_rows


def add_nextn_extras(folder, layer: int, hidden: int, final_norm: str, seed: int) -> dict[str, torch.Tensor]:
    """Write a NEXTN layer's own tensors (enorm, hnorm, eh_proj, and its final norm under the
    family's name `final_norm`) as layer `layer` into folder/model.safetensors, random but well
    away from an identity; returns them by name. transformers has no NEXTN module, so the parity
    checkpoints are a model saved with one layer more, then these added."""
    from safetensors.torch import load_file, save_file
    g = torch.Generator().manual_seed(seed)
    extras = {"enorm": 1 + 0.1 * torch.randn(hidden, generator=g), "hnorm": 1 + 0.1 * torch.randn(hidden, generator=g),
              "eh_proj": 0.2 * torch.randn(hidden, 2 * hidden, generator=g),
              final_norm: 1 + 0.1 * torch.randn(hidden, generator=g)}
    path = folder / "model.safetensors"
    tensors = load_file(path)
    for name, t in extras.items():
        tensors[f"model.layers.{layer}.{name}.weight"] = t
    save_file(tensors, path, metadata={"format": "pt"})
    return extras


def write_mla_checkpoint(folder, causal_lm, base_model, config, layers: int, hidden: int, seed: int,
                         moe_layer: dict) -> tuple:
    """A tiny MLA-on-every-layer checkpoint (DeepSeek-V3, GLM-4.7-Flash) with one NEXTN layer, and
    its references in float64: (folder, transformers' model of the main layers, a one-layer model
    holding the NEXTN layer's block with its final norm as `norm`, the NEXTN extras).

    transformers has no NEXTN module: a `causal_lm` of `layers + 1` layers (`config(n, **kw)`
    gives the family's config) is saved, config.json cut back to `layers` with
    num_nextn_predict_layers 1, and the layer's enorm, hnorm, eh_proj and shared_head.norm added
    in the family's names. `moe_layer`: the config keys that make a one-layer model's layer MoE,
    as layer `layers` is."""
    import json

    from tests.ling_checkpoint import randomize
    big = causal_lm(config(layers + 1)).eval()
    randomize(big, seed=seed)
    big.save_pretrained(folder)
    raw = json.loads((folder / "config.json").read_text())
    raw.update(num_hidden_layers=layers, num_nextn_predict_layers=1)
    if isinstance(raw.get("mlp_layer_types"), list):
        raw["mlp_layer_types"] = raw["mlp_layer_types"][:layers]
    (folder / "config.json").write_text(json.dumps(raw))
    extras = add_nextn_extras(folder, layers, hidden, "shared_head.norm", seed=seed + 1)
    ref = causal_lm(config(layers)).eval()
    nextn = base_model(config(1, **moe_layer)).eval()
    with torch.no_grad():
        ref.model.load_state_dict({k: v for k, v in big.model.state_dict().items()
                                   if not k.startswith(f"layers.{layers}.")})
        ref.lm_head.load_state_dict(big.lm_head.state_dict())
        nextn.layers[0].load_state_dict(big.model.layers[layers].state_dict())
        nextn.norm.weight.copy_(extras["shared_head.norm"])
    for model in (ref, nextn):
        model.set_experts_implementation("eager")  # the grouped matmul takes no float64
    return folder, ref.double(), nextn.double(), {name: t.double() for name, t in extras.items()}


def cached_logits(model, tokens: torch.Tensor, prompt: int) -> torch.Tensor:
    """Prefill `prompt` tokens, then one decode step per remaining token (teacher forced)."""
    model.setup_caches(1, 64)
    with torch.inference_mode():
        out = [model(tokens[:, :prompt], torch.arange(prompt))]
        out += [model(tokens[:, t:t + 1], torch.tensor([t])) for t in range(prompt, tokens.shape[1])]
    return torch.cat(out, dim=1)


def assert_decode_matches(model, ref, tokens: torch.Tensor, prompt: int, tol: float) -> None:
    """`model`'s prefill of `prompt` tokens, then >= 32 teacher-forced decode steps, each position
    within `tol` of transformers' `ref` over the whole sequence at once."""
    with torch.no_grad():
        want = ref(tokens).logits
    err = rel_rows(cached_logits(model, tokens, prompt), want).flatten()
    assert err.shape == (tokens.shape[1],) and tokens.shape[1] - prompt >= 32
    assert err.max() <= tol, f"worst position {int(err.argmax())}: {float(err.max()):.2e}"


def nextn_reference(ref, nextn, extras: dict, tokens: torch.Tensor) -> torch.Tensor:
    """The NEXTN layer's logits at positions 0..T-2 from transformers' modules: the target `ref`'s
    final-normed hidden state at i and token i + 1 through enorm, hnorm and eh_proj (`extras`),
    then `nextn` (a one-layer model holding the layer's block, its final norm as `norm`) and the
    target's head."""
    with torch.no_grad():
        h = ref.model(tokens).last_hidden_state[:, :-1]
        e = ref.model.embed_tokens(tokens[:, 1:])

        eps = ref.config.rms_norm_eps  # enorm and hnorm are the model's RMSNorms

        def norm(x, w):
            return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))
        x = torch.cat((norm(e, extras["enorm"]), norm(h, extras["hnorm"])), dim=-1) @ extras["eh_proj"].T
        return ref.lm_head(nextn(inputs_embeds=x).last_hidden_state)


def nextn_logits(model, tokens: torch.Tensor, hidden: torch.Tensor | None = None) -> torch.Tensor:
    """Our NEXTN layer's logits at positions 0..T-2, fed `hidden` (default: what the model feeds it)."""
    t = tokens.shape[1]
    mtp = model.mtp[0]
    model.setup_caches(1, 64)
    with torch.inference_mode():
        if hidden is None:
            hidden = model.forward_with_hidden(tokens, torch.arange(t))[1]
        cos, sin, mask = model.positions(t - 1, torch.arange(t - 1))
        return mtp.logits(mtp.hidden(hidden[:, :-1], tokens[:, 1:], cos, sin, torch.arange(t - 1), mask))


def assert_nextn_matches(model, checkpoint: tuple, tokens: torch.Tensor, tol: float) -> torch.Tensor:
    """Our NEXTN layer's logits within `tol` of the reference from transformers' modules at every
    position (`checkpoint`: a parity checkpoint's (folder, ref, nextn, extras)); returns the reference."""
    _, ref, nextn, extras = checkpoint
    want = nextn_reference(ref, nextn, extras, tokens)
    err = rel_rows(nextn_logits(model, tokens), want).flatten()
    assert err.max() <= tol, f"worst position {int(err.argmax())}: {float(err.max()):.2e}"
    return want


def assert_speculative_equals_greedy(model, prompt: torch.Tensor, tokens: int) -> None:
    """MTP speculative decoding (k = 3) of `tokens` tokens equals plain greedy decoding, with some
    draft rejected: random weights reject most drafts, so the rollback after a rejection is tested."""
    from impl.generate import generate
    from impl.speculative import SpeculativeDecoder
    plain = generate(model, prompt, tokens).new_tokens[0]
    result = SpeculativeDecoder(model, k=3).generate(prompt, tokens)
    assert torch.equal(result.new_tokens[0, :tokens], plain)
    assert result.stats.accepted < result.stats.drafted, "no draft was rejected: the rollback went untested"


def check_ladder_runs_unchanged(model, prompts: list[str], max_tokens: int) -> None:
    """One mechanism: the serving rows (FP8 head, MTP with the head shared) on `model` (CPU);
    provenance holds for every row and greedy +mtp serves exactly what +fp8-head serves."""
    from impl.serve.built_row import build_rows
    from impl.serve.rows import parse_ladder
    from impl.serve.engine import EngineRow
    from impl.serve.ladder import Ladder
    from tests.helpers import byte_tokenizer, request
    rows = [EngineRow(a) for a in build_rows(model, parse_ladder("baseline;+fp8-head;+mtp", "cpu"),
                                             tokenizer=byte_tokenizer())]
    served = Ladder(rows, [request(p, max_tokens, ignore_eos=True) for p in prompts]).run()
    for row in rows:
        row.check()
    by = {(r.row, r.request_id): r for r in served}
    for p in prompts:
        rid = request(p).request_id
        assert by["+mtp", rid].text == by["+fp8-head", rid].text
        assert by["+mtp", rid].output_tokens == max_tokens and by["+mtp", rid].acceptance.verify_steps > 0
