"""Parity of the FP8 LM head with the model's own head, on the model under test (`--moe-model`).

The FP8 head is made the way a user makes it: `moe_model.quantize_head(...)` (restored afterwards,
the model is shared by the session). It is compared with the model's head (bf16 on a GPU, fp32 on
the CPU) on hidden states taken from real greedy decoding and on random ones, then both heads
decode greedily from the same prompts and the tokens are compared one by one. Provenance must
show that the FP8 kernel ran: a silent fallback to the bf16 head would pass every parity check.

Bounds, and why:
  * relative error of the logits <= MAX_REL_ERR = 4%. e4m3 keeps 3 mantissa bits, so a weight is
    rounded by at most 2**-4 of its binade's base; the RMS relative error is 2**-3 * sqrt(0.541/12)
    = 2.65% for values spread over a binade and at most 2**-4 / sqrt(3) = 3.6% (all values at the
    bottom of their binade). A logit sums K such errors times activations (a random walk), so the
    error of the logit vector relative to its norm is that same RMS. 4% = the worst case plus
    margin for sampling and for the bf16 rounding of the logits on a GPU (2**-8 per element,
    ~1.1e-3 norm-wise, adding in quadrature).
  * top-1 agreement and top-5 overlap: not fixed numbers, since they depend on how close the
    reference logits are to each other (a random model's are close; a trained model's top-1 is
    usually far ahead). With the error at its bound, each logit moves by about
    N(0, (MAX_REL_ERR * ||row|| / sqrt(V))**2), independently across the vocabulary, so logits i
    and j swap with probability <= P(N(0, 2 s**2) > l_i - l_j). Summed over pairs (a union bound,
    an over-estimate) this gives the expected number of top-1 flips / top-5 swaps E; the check
    allows E + 4 sqrt(E) + 1 (a Poisson count's mean plus four standard deviations, plus one).
  * greedy agreement (token by token, over all new tokens): the first divergence changes every
    later context, so only the prefix before it is predictable. With q the top-1 flip rate
    measured on the real decoding states, a prefix of j tokens survives with probability
    (1 - q)**j, so the agreement rate is at least (1/L) sum_j (1 - q)**j in expectation; minus
    three standard deviations of a mean of B values in [0, 1] (<= 0.5 / sqrt(B)).
"""

from __future__ import annotations

import contextlib
import math

import pytest
import torch

from impl import backends
from impl.generate import generate
from impl.head import FP8Head, compare_logits, require_head_backend
from impl.head.fp8_head import HEAD_GRANULARITIES as GRANULARITIES

BACKEND = "triton"
MAX_REL_ERR = 0.04
PROMPTS, PROMPT_LEN, NEW_TOKENS = 16, 8, 16


@pytest.fixture(autouse=True)
def _needs_bf16_head(moe_model):
    if moe_model.head_kind != "bf16":
        pytest.skip("this suite quantizes the model's bf16 head itself and compares against it; "
                    f"the model under test already has a {moe_model.head_kind} head (run with --moe-head bf16)")


@contextlib.contextmanager
def fp8_head(model, granularity: str):
    """The model with its head quantized through the model switch; the original head restored after
    (the MTP draft re-pointed at it too: later suites on this model decode speculatively)."""
    original = model.lm_head
    try:
        yield model.quantize_head(granularity=granularity, backend=BACKEND)
    finally:
        model.set_head(original)


def swap_bounds(ref: torch.Tensor, sigma_rel: float) -> tuple[float, float]:
    """Expected top-1 flips and top-5 swaps (summed over rows) if every logit of a row moved by
    N(0, (sigma_rel * ||row|| / sqrt(V))**2): union bounds over pairs, capped per row."""
    ref = ref.detach().reshape(-1, ref.shape[-1]).to("cpu", torch.float64)
    v = ref.shape[1]
    k = min(5, v)
    s = sigma_rel * ref.norm(dim=1, keepdim=True) / math.sqrt(v)
    top = ref.topk(k, dim=1)
    gap1 = top.values[:, :1] - ref  # >= 0; 0 at the argmax itself
    p1 = 0.5 * torch.erfc(gap1 / (2 * s))
    p1 = p1.scatter(1, top.indices[:, :1], 0.0)  # no flip with itself
    flips = p1.sum(dim=1).clamp(max=1).sum().item()
    outside = ref.scatter(1, top.indices, -math.inf)  # logits not in the top k
    p5 = 0.5 * torch.erfc((top.values.unsqueeze(2) - outside.unsqueeze(1)) / (2 * s.unsqueeze(2)))
    swaps = p5.sum(dim=(1, 2)).clamp(max=k).sum().item()
    return flips, swaps


def check_against(ours: torch.Tensor, ref: torch.Tensor, what: str):
    rows = ref.numel() // ref.shape[-1]
    flips, swaps = swap_bounds(ref, MAX_REL_ERR)
    k = min(5, ref.shape[-1])
    min_top1 = 1 - (flips + 4 * math.sqrt(flips) + 1) / rows
    min_top5 = 1 - (swaps + 4 * math.sqrt(swaps) + 1) / (k * rows)
    parity = compare_logits(ours, ref)
    print(f"{what}: {parity} (bounds: rel_err <= {MAX_REL_ERR}, top1 >= {min_top1:.4f}, top5 >= {min_top5:.4f})")
    return parity.check(max_rel_err=MAX_REL_ERR, min_top1=min_top1, min_top5=min_top5, what=what)


@pytest.fixture(scope="module")
def prompts(moe_model):
    device = moe_model.embed_tokens.weight.device
    gen = torch.Generator().manual_seed(4)
    return torch.randint(0, moe_model.config.vocab_size, (PROMPTS, PROMPT_LEN), generator=gen).to(device)


@pytest.fixture(scope="module")
def reference_decoding(moe_model, prompts):
    """Greedy decoding with the model's own head, and every hidden state its head was given."""
    seen = []
    hook = moe_model.lm_head.register_forward_pre_hook(lambda module, args: seen.append(args[0].detach()))
    try:
        result = generate(moe_model, prompts, NEW_TOKENS)
    finally:
        hook.remove()
    hidden = torch.cat([h.reshape(-1, h.shape[-1]) for h in seen])
    return result.new_tokens, hidden


@pytest.mark.parametrize("granularity", GRANULARITIES)
def test_logits_on_hidden_states_from_real_decoding(moe_model, reference_decoding, granularity):
    _, hidden = reference_decoding
    with torch.inference_mode():
        ref = moe_model.lm_head(hidden)
        with fp8_head(moe_model, granularity) as head:
            ours = head(hidden)
    check_against(ours, ref, f"decoding hidden states, {granularity} scales")


@pytest.mark.parametrize("granularity", GRANULARITIES)
def test_logits_on_random_hidden_states(moe_model, reference_decoding, granularity):
    """Gaussian hidden states with the real ones' mean norm (fresh draws, never zeros)."""
    _, real = reference_decoding
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(256, real.shape[-1], generator=gen, dtype=torch.float64)
    x = x / x.norm(dim=1, keepdim=True) * real.double().norm(dim=1).mean().cpu()
    x = x.to(real.device, real.dtype)
    with torch.inference_mode():
        ref = moe_model.lm_head(x)
        with fp8_head(moe_model, granularity) as head:
            ours = head(x)
    check_against(ours, ref, f"random hidden states, {granularity} scales")


@pytest.mark.parametrize("granularity", GRANULARITIES)
def test_greedy_generation_agrees_token_by_token(moe_model, prompts, reference_decoding, granularity, request):
    want, hidden = reference_decoding
    with torch.inference_mode():
        ref = moe_model.lm_head(hidden)
        with fp8_head(moe_model, granularity) as head:
            q = 1 - compare_logits(head(hidden), ref).top1_agreement
            with backends.record_provenance() as prov:
                got = generate(moe_model, prompts, NEW_TOKENS).new_tokens
    require_head_backend(prov, f"fp8-{BACKEND}")
    same = got == want
    agreement = same.double().mean().item()
    first = torch.where(same.all(dim=1), NEW_TOKENS, (~same).int().argmax(dim=1)).double()
    expected = sum((1 - q) ** j for j in range(1, NEW_TOKENS + 1)) / NEW_TOKENS
    bound = max(0.0, expected - 3 * 0.5 / math.sqrt(PROMPTS))
    print(f"greedy FP8 ({granularity}) vs original head: token agreement {agreement:.3f} over "
          f"{PROMPTS}x{NEW_TOKENS} tokens, mean first divergence {first.mean().item():.1f}, "
          f"per-step flip rate q={q:.3f}, bound {bound:.3f}")
    request.node.user_properties.append((f"greedy_token_agreement_{granularity}", agreement))
    assert agreement >= bound, (agreement, bound)


def test_fp8_head_module_is_what_the_model_runs(moe_model, prompts):
    """The model calls the head module it owns (with its scales), and only the FP8 kernel ran."""
    with torch.inference_mode(), fp8_head(moe_model, "row") as head:
        assert isinstance(moe_model.lm_head, FP8Head) and moe_model.lm_head is head
        assert moe_model.head_kind == "fp8"
        with backends.record_provenance() as prov:
            generate(moe_model, prompts[:2], 2)
    require_head_backend(prov, f"fp8-{BACKEND}")
    assert moe_model.head_kind == "bf16"  # restored for the rest of the session
