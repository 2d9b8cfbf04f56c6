"""What the per-family parity tests against transformers share (tests/test_ling_parity.py,
tests/test_deepseek_parity.py): the per-position error, teacher-forced cached decoding, the NEXTN
layer's reference assembled from transformers' modules and ours beside it, and the serving ladder
run on a loaded model."""

from __future__ import annotations

import torch


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


def rel(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Per position ||a - b|| / ||b|| over the last (vocabulary or hidden) dimension."""
    return ((a - b).norm(dim=-1) / b.norm(dim=-1)).flatten()


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
    err = rel(cached_logits(model, tokens, prompt), want)
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

        def norm(x, w):
            return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))
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


def check_ladder_runs_unchanged(model, prompts: list[str], max_tokens: int) -> None:
    """One mechanism: the serving rows (FP8 head, MTP with the head shared) on `model` (CPU);
    provenance holds for every row and greedy +mtp serves exactly what +fp8-head serves."""
    from impl.serve.arm import build_arms
    from impl.serve.configs import parse_ladder
    from impl.serve.provenance import check_provenance
    from impl.serve.runner import run_ladder
    from tests.test_serve_engine import ByteTokenizer, request
    arms = build_arms(model, parse_ladder("baseline;+fp8-head;+mtp", "cpu"), tokenizer=ByteTokenizer())
    records = run_ladder(arms, [request(p, max_tokens, ignore_eos=True) for p in prompts])
    for arm in arms:
        check_provenance(arm.name, arm.config, arm.provenance)
    by = {(r["arm"], r["request_id"]): r for r in records}
    for p in prompts:
        rid = request(p).request_id
        assert by["+mtp", rid]["text"] == by["+fp8-head", rid]["text"]
        assert by["+mtp", rid]["output_tokens"] == max_tokens and by["+mtp", rid]["verify_steps"] > 0
