"""MTP speculative decoding against plain decoding on the model under test, greedy, k = 3.

* Speed: tokens/s of speculative and of plain decoding measured interleaved in one process (A B
  A B), each run's steps replayed from CUDA graphs on a GPU (plain calls on CPU) by
  impl.decode_runner, after an untimed reset to its prompt (prefill; for speculation also the
  draft's pass over the prompt, so that every verify step, the first included, replays the
  captured step). On the byte-level arithmetic checkpoint every run stops where its answer ends (the `#### N` line and END), as a serving loop
  with END as its stop sequence does, on ANSWER_PROMPTS held-out problems; each side counts the
  tokens it committed in its timed steps up to its own END (a speculative step that runs past END
  is timed whole and counted only up to END). What a checkpoint writes after an answer was never
  trained (the loss covers answer bytes only) and is not a workload. Other models (random-weight
  presets) run a fixed PLAIN_STEPS / SPEC_STEPS. The ratio is gated against the frozen figure; on
  CPU a model this small is bound by per-call overhead, so the ratio sits near 1 there (see
  notes/mtp.md for the per-step costs); it is frozen, not promised.
* Agreement: the speculative output must be the plain greedy output. In fp32 on CPU it is, token
  for token (asserted). In bf16 on a GPU the verify pass (k+1 positions) and the decode step (1)
  reduce in different orders, so a near-tie argmax can flip and the two continuations part
  there; per prompt the agreement is the identical fraction of the generation before the first
  divergence, gated (direction higher) and reported with the divergence positions.

Tolerances: moe_harness.tolerances ("mtp_over_plain", "agreement"), each number with its reason.
"""

from __future__ import annotations

import functools
import statistics
from dataclasses import dataclass

import pytest
import torch

from impl.data.arith import answer_length, take, text_of, writes_answers
from impl.decode_runner import PlainRunner, Run, SpecRunner
from impl.speculative import SpeculativeDecoder
from moe_harness.tolerances import tolerance_for

pytestmark = pytest.mark.moe_bench

K = 3
PLAIN_STEPS = 64  # decode steps per timed plain run, models without answers
SPEC_STEPS = 24  # verify steps per timed speculative run (about 70 tokens at accept length 2.9)
ANSWER_PROMPTS = 4  # byte-level checkpoint: problems whose answers are timed
ANSWER_CAP = 120  # new tokens within which a plain run must close its answer (they take 40-90)
AGREEMENT_PROMPTS = 8
AGREEMENT_TOKENS = 64


def _prompts(model, n: int) -> list[torch.Tensor]:
    """Held-out arithmetic problems for the byte-level vocabulary, random ids otherwise."""
    if model.config.vocab_size == 128:
        return [torch.tensor(list(p.prompt.encode("ascii"))) for p in take("heldout", n, seed=2)]
    g = torch.Generator().manual_seed(2)
    return [torch.randint(0, model.config.vocab_size, (16,), generator=g) for _ in range(n)]


def _on_gpu(model) -> bool:
    return model.embed_tokens.weight.is_cuda


@pytest.fixture(scope="module")
def decoder(moe_model) -> SpeculativeDecoder:
    if not len(getattr(moe_model, "mtp", ())):
        pytest.skip(f"model {moe_model.config.name!r} has no MTP layer")
    return SpeculativeDecoder(moe_model, K)


@pytest.fixture(scope="module")
def runners(moe_model, decoder) -> tuple[PlainRunner, SpecRunner]:
    """One plain and one speculative runner, shared by every prompt's runs (each run resets them)."""
    return PlainRunner(moe_model).capture(), SpecRunner(decoder).capture()


@dataclass
class Runs:
    """One prompt's plain and speculative runs: steps replayed and tokens committed in them."""

    plain: Run
    spec: Run
    plain_steps: int
    spec_steps: int
    plain_tokens: int
    spec_tokens: int


def _answer_runs(runners, prompts: list[torch.Tensor]) -> list[Runs]:
    """Runs that stop where each side's answer ends (see the module docstring)."""
    plain_runner, spec_runner = runners
    runs = []
    for prompt in prompts:
        plain = Run(plain_runner, prompt, ANSWER_CAP)
        plain.reset()
        plain.run()
        n = answer_length(text_of(plain.new_tokens()))
        spec = Run(spec_runner, prompt, ANSWER_CAP // 3)
        spec.reset()
        steps = 0
        while (m := answer_length(text_of(spec.new_tokens()))) is None and steps < spec.steps:
            spec.run(1)
            steps += 1
        if n is None or m is None:
            pytest.fail(f"no answer end within {ANSWER_CAP} plain tokens ({n}) or {spec.steps} speculative "
                        f"steps ({m}): the checkpoint does not close its answers with END")
        # The prefill's token is untimed on both sides.
        runs.append(Runs(plain, spec, n - 1, steps, n - 1, m - 1))
    return runs


def _fixed_run(runners, prompt: torch.Tensor) -> Runs:
    plain_runner, spec_runner = runners
    plain = Run(plain_runner, prompt, PLAIN_STEPS)
    spec = Run(spec_runner, prompt, SPEC_STEPS)
    spec.reset()
    spec.run()
    committed = len(spec.new_tokens()) - 1  # greedy: deterministic
    return Runs(plain, spec, PLAIN_STEPS, SPEC_STEPS, PLAIN_STEPS, committed)


def test_mtp_speedup(moe_model, runners, moe_sampler, moe_gate):
    device = moe_model.embed_tokens.weight.device
    to_answer = writes_answers(moe_model)
    prompts = [p.to(device) for p in _prompts(moe_model, ANSWER_PROMPTS if to_answer else 1)]
    runs = _answer_runs(runners, prompts) if to_answer else [_fixed_run(runners, prompts[0])]
    fns = {f"{side}/{i}": functools.partial(getattr(r, side).run, getattr(r, f"{side}_steps"))
           for i, r in enumerate(runs) for side in ("spec", "plain")}
    setup = {f"{side}/{i}": getattr(r, side).reset for i, r in enumerate(runs) for side in ("spec", "plain")}
    first = [moe_sampler.interleaved(fns, setup=setup)]

    def tokens_per_s() -> tuple[list[float], list[float]]:
        s = first.pop() if first else moe_sampler.interleaved(fns, setup=setup)  # re-measured to confirm
        rounds = range(len(s["spec/0"]))
        return tuple([sum(getattr(r, f"{side}_tokens") for r in runs)
                      / sum(s[f"{side}/{i}"][j] for i in range(len(runs))) for j in rounds]
                     for side in ("spec", "plain"))

    # Where a speculative step's time goes, against a plain decode step (reported, not gated;
    # printed before the gate, which may fail or skip the test).
    r0, samples = runs[0], first[0]
    ms = {"decode step": 1e3 * statistics.median(samples["plain/0"]) / r0.plain_steps,
          "speculative step": 1e3 * statistics.median(samples["spec/0"]) / r0.spec_steps}
    r0.spec.reset()
    parts = r0.spec.runner.parts()
    # Reported only: not metered, so the host load the gate reads is the gated measurement's own.
    ms.update({name: 1e3 * statistics.median(moe_sampler.sample(fn, inner=20, metered=False))
               for name, fn in parts.items()})
    accept = sum(r.spec_tokens for r in runs) / sum(r.spec_steps for r in runs)
    print(f"\nmtp k={K}: {accept:.2f} tokens per speculative step over {len(runs)} run(s) "
          f"({'to the end of each answer' if to_answer else 'fixed length'}); per step (ms): "
          + ", ".join(f"{name} {v:.3f}" for name, v in ms.items())
          + f"; speedup {accept * ms['decode step'] / ms['speculative step']:.2f}")
    moe_gate.check_ratio(f"mtp_speedup_k{K}", tokens_per_s, direction="higher",
                         tolerance=tolerance_for("mtp_over_plain", device),
                         config={"k": K, "graphs": _on_gpu(moe_model),
                                 "runs": f"to answer end, {len(prompts)} prompts" if to_answer
                                 else f"{PLAIN_STEPS} plain / {SPEC_STEPS} speculative steps"})


def test_mtp_greedy_agreement(moe_model, runners, moe_gate):
    device = moe_model.embed_tokens.weight.device
    fractions, divergences = [], []
    for prompt in _prompts(moe_model, AGREEMENT_PROMPTS):
        prompt = prompt.to(device)
        plain = Run(runners[0], prompt, AGREEMENT_TOKENS - 1)
        plain.reset()
        plain.run()
        spec = Run(runners[1], prompt, AGREEMENT_TOKENS // (K + 1) + 1)
        spec.reset()
        spec.run()
        a, b = plain.new_tokens(), spec.new_tokens()
        n = min(len(a), len(b), AGREEMENT_TOKENS)
        differ = (a[:n] != b[:n]).nonzero()
        first = int(differ[0]) if len(differ) else n
        fractions.append(first / n)
        divergences.append(None if first == n else first)
    if not _on_gpu(moe_model) and moe_model.embed_tokens.weight.dtype == torch.float32:
        assert all(d is None for d in divergences), (
            f"fp32 speculative output differs from plain greedy at new-token positions {divergences}")
    print(f"\nmtp greedy agreement per prompt {[round(f, 3) for f in fractions]}, first divergence {divergences}")
    moe_gate.check(f"mtp_greedy_agreement_k{K}", fractions, unit="fraction", direction="higher",
                   tolerance=tolerance_for("agreement", device),
                   config={"k": K, "prompts": AGREEMENT_PROMPTS, "tokens": AGREEMENT_TOKENS}, portable=True)
