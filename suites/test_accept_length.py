"""Accept length of greedy MTP speculation (k = 3) on the model under test.

What a violated head-sharing contract looks like from outside: nothing crashes, the output stays
exactly the target's (verification guarantees it), and only the accept length quietly collapses
towards 1, because the draft ranks tokens with another head (a copy, FP8 bytes read without their
scales, a bf16 fallback). So this suite checks, on every run:
  * every verify step commits between 1 and k+1 tokens, and acceptance per position is
    non-increasing;
  * provenance: draft and verify ran the same head kernel, and an FP8 model's head ran an FP8
    kernel for both (a silent bf16 fallback fails here);
  * on a trained checkpoint (not a random-weight preset), a floor of MIN_ACCEPT_LENGTH: the
    trained tiny checkpoint reaches about 3.9 at k = 3 (notes/mtp.md), a draft without the
    target's head about 1; the failure message points at head sharing.
and with --moe-bench, gates the mean accept length and the acceptance per position against the
frozen figures (tolerance: moe_harness.tolerances, "accept_length"). On the byte-level
arithmetic checkpoint each generation stops where its answer ends (`#### N` and END), as
scripts/eval_tiny.py does: what it writes after an answer was never trained and drafts poorly, so
counting it would measure text no workload asks for.
"""

from __future__ import annotations

import pytest
import torch

from impl.data.arith import answer_length, take, text_of, writes_answers
from impl.model import PRESETS
from impl.speculative import SpeculativeDecoder, SpecStats
from moe_harness.tolerances import tolerance_for

K = 3
PROMPTS = 24
MAX_NEW_TOKENS = 64
# A trained checkpoint's floor: the tiny one reaches 3.9 at k = 3 and a draft ranking with another
# head about 1, so 2.5 separates the two with room on both sides.
MIN_ACCEPT_LENGTH = 2.5
GATE_CONFIG = {"k": K, "prompts": PROMPTS, "max_new_tokens": MAX_NEW_TOKENS, "stop": "answer end (byte-level)"}
HEAD_SHARING_HINT = ("check head sharing: the draft must hold the target's head module itself "
                     "(draft.head is target.lm_head), not a copy, not its weight tensor, and not FP8 data "
                     "without its scales")


def _tolerance(model) -> float:
    return tolerance_for("accept_length", model.embed_tokens.weight.device)


def _answer_closed(new_tokens: torch.Tensor) -> bool:
    """Generation stops where the answer ends, as a serving loop with END as its stop sequence
    does: what a checkpoint writes after it was never trained (the loss covers answer bytes)."""
    return answer_length(text_of(new_tokens)) is not None


def _prompts(model) -> list[torch.Tensor]:
    """Held-out arithmetic problems for the byte-level checkpoint, random ids otherwise."""
    if model.config.vocab_size == 128:
        return [torch.tensor(list(p.prompt.encode("ascii"))) for p in take("heldout", PROMPTS, seed=1)]
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, model.config.vocab_size, (16,), generator=g) for _ in range(PROMPTS)]


@pytest.fixture(scope="module")
def spec_run(moe_model) -> tuple[SpecStats, list[SpecStats]]:
    """Counters over all prompts, and per prompt."""
    if not len(getattr(moe_model, "mtp", ())):
        pytest.skip(f"model {moe_model.config.name!r} has no MTP layer")
    decoder = SpeculativeDecoder(moe_model, K)
    device = moe_model.embed_tokens.weight.device
    stats, per_prompt = SpecStats(K), []
    stop = _answer_closed if writes_answers(moe_model) else None
    for prompt in _prompts(moe_model):
        res = decoder.generate(prompt.to(device), MAX_NEW_TOKENS, stop=stop)
        stats.merge(res.stats)
        per_prompt.append(res.stats)
    return stats, per_prompt


def test_accept_length_sanity(spec_run):
    stats, _ = spec_run
    assert all(1 <= n <= K + 1 for n in stats.accept_lengths), sorted(set(stats.accept_lengths))
    assert stats.per_position == sorted(stats.per_position, reverse=True), stats.per_position


def test_head_provenance(moe_model, spec_run):
    stats, _ = spec_run
    assert stats.draft_head_backends == stats.verify_head_backends, (
        f"draft ran head kernels {sorted(stats.draft_head_backends)}, verify ran "
        f"{sorted(stats.verify_head_backends)}; {HEAD_SHARING_HINT}")
    if moe_model.head_kind == "fp8":
        assert all(b.startswith("fp8") for b in stats.draft_head_backends | stats.verify_head_backends), (
            f"the model has an FP8 head but {sorted(stats.draft_head_backends | stats.verify_head_backends)} "
            "ran: the FP8 head silently fell back to bf16")


def test_accept_length_floor(moe_model, spec_run):
    if moe_model.config.name in PRESETS:
        pytest.skip("random-weight preset: its draft is not trained, so there is no floor to hold")
    stats, _ = spec_run
    assert stats.mean_accept_length >= MIN_ACCEPT_LENGTH, (
        f"mean accept length {stats.mean_accept_length:.2f} at k={K} is below {MIN_ACCEPT_LENGTH} "
        f"(per position {[round(p, 3) for p in stats.per_position]}): the draft no longer predicts the "
        f"target's tokens; {HEAD_SHARING_HINT}")


@pytest.mark.moe_bench
def test_accept_length_gated(moe_model, spec_run, moe_gate):
    _, per_prompt = spec_run
    moe_gate.check(f"mtp_accept_length_k{K}", [s.mean_accept_length for s in per_prompt], unit="tokens/step",
                   direction="higher", tolerance=_tolerance(moe_model), config=GATE_CONFIG, portable=True)


@pytest.mark.moe_bench
@pytest.mark.parametrize("position", range(K))
def test_acceptance_per_position_gated(moe_model, spec_run, moe_gate, position):
    """P(draft `position` accepted) per prompt; later positions are rarer events, so their
    per-prompt fractions are noisier, but the samples are deterministic on a given device."""
    if moe_model.config.name in PRESETS:
        pytest.skip("random-weight preset: its draft is almost never accepted, so there is no rate to gate")
    _, per_prompt = spec_run
    moe_gate.check(f"mtp_acceptance_k{K}_pos{position + 1}", [s.per_position[position] for s in per_prompt],
                   unit="fraction", direction="higher", tolerance=_tolerance(moe_model), config=GATE_CONFIG,
                   portable=True)
