"""Graph-replayable decoding runs (impl/speculative/graphed.py) on CPU, fp32, where a "graph" is a plain
call of the same step: plain runs equal `generate`, speculative runs equal plain greedy decoding
token for token, `reset` restarts the same run, and replaying a step's parts changes nothing.
Also the negative control of suites/test_spec_bench.py's agreement check: a verify pass fed the
wrong positions makes it fail."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from impl.generate import SamplingConfig, generate
from impl.model import build_model
from impl.speculative import GraphedDecoding, GraphedSpeculation, SpeculativeDecoder
from tests.helpers import echo_draft_

ROOT = Path(__file__).resolve().parents[1]
STEPS = 12


@pytest.fixture(scope="module")
def models():
    return {"random": build_model("tiny", seed=3), "echo": echo_draft_(build_model("tiny", seed=3))}


def prompt(seed: int) -> torch.Tensor:
    return torch.randint(0, 128, (10,), generator=torch.Generator().manual_seed(seed))


def test_graphed_decoding_equals_generate(models):
    model = models["random"]
    run = GraphedDecoding(model, prompt(0), STEPS)
    run.reset()
    run.run()
    assert torch.equal(run.new_tokens(), generate(model, prompt(0), STEPS + 1).new_tokens[0])


@pytest.mark.parametrize("draft", ["random", "echo"])
@pytest.mark.parametrize("k", [1, 3])
def test_graphed_speculation_equals_plain_greedy(models, draft, k):
    model = models[draft]
    spec = GraphedSpeculation(SpeculativeDecoder(model, k), prompt(1), STEPS)
    spec.reset()
    spec.run()
    got = spec.new_tokens()
    # The prefill's token, then 1 to k+1 tokens per step (the eager first step too).
    assert STEPS <= spec.committed() <= STEPS * (k + 1)
    assert STEPS + 1 <= len(got) - 1 <= (STEPS + 1) * (k + 1)
    ref = generate(model, prompt(1), len(got)).new_tokens[0]
    assert torch.equal(got, ref), f"first divergence at {int((got != ref).int().argmax())}"


def test_reset_restarts_the_same_run_and_parts_change_nothing(models):
    spec = GraphedSpeculation(SpeculativeDecoder(models["echo"], 3), prompt(2), STEPS)
    spec.reset()
    spec.run()
    first, committed = spec.new_tokens(), spec.committed()
    spec.reset()
    n = int(spec.state.n)
    for part in spec.parts().values():
        part()
        part()
    assert int(spec.state.n) == n
    spec.run()
    assert spec.committed() == committed and torch.equal(spec.new_tokens(), first)


def test_sampled_speculation_is_refused(models):
    decoder = SpeculativeDecoder(models["random"], 2, SamplingConfig(temperature=1.0))
    with pytest.raises(ValueError, match="greedy"):
        GraphedSpeculation(decoder, prompt(0), 4)


WRONG_POSITIONS = '''
import pytest
from impl.speculative import SpeculativeDecoder

_verify_pass = SpeculativeDecoder.verify_pass


def _shifted(self, state, draft, verify_at=None):
    state.n += 1  # the verify pass looks its positions up from n: one too far
    try:
        return _verify_pass(self, state, draft)
    finally:
        state.n -= 1


@pytest.fixture(scope="session", autouse=True)
def _plant():
    SpeculativeDecoder.verify_pass = _shifted
'''


@pytest.mark.parametrize("planted", [False, True], ids=["unmodified", "wrong-verify-positions"])
def test_agreement_check_catches_a_wrong_verify_pass(pytester, planted):
    if planted:
        pytester.makeconftest(WRONG_POSITIONS)
    pytester.makepyfile(test_spec_bench=(ROOT / "suites" / "test_spec_bench.py").read_text())
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "--moe-bench", "--moe-freeze",
                                           "--moe-baselines", str(pytester.path / "baselines"),
                                           "test_spec_bench.py::test_mtp_greedy_agreement", timeout=300)
    if planted:
        result.assert_outcomes(failed=1)
        result.stdout.fnmatch_lines(["*fp32 speculative output differs from plain greedy*"])
    else:
        result.assert_outcomes(passed=1)


def test_a_reused_state_that_does_not_fit_is_refused(models):
    from impl.generate import prefill
    model = models["random"]
    state = prefill(model, prompt(0), 4)
    with pytest.raises(ValueError, match="DecodeState holds tokens of shape"):
        prefill(model, prompt(0), 8, state=state)
    decoder = SpeculativeDecoder(model, 2)
    spec_state = decoder.start(prompt(0), 4)
    with pytest.raises(ValueError, match="SpecState holds .* token positions, this generation needs"):
        decoder.start(prompt(0), 40, state=spec_state)


@pytest.mark.parametrize("model,mode", [("tiny-gsm", "to the end of each answer"), ("tiny", "fixed length")])
def test_speed_suite_times_answers_or_fixed_runs(pytester, model, mode):
    """suites/test_spec_bench.py's speed test end to end on CPU: on the trained byte-level checkpoint each
    run stops at its answer's end; on a random-weight preset (no answers) runs have fixed lengths."""
    pytester.makepyfile(test_spec_bench=(ROOT / "suites" / "test_spec_bench.py").read_text())
    # Three timing samples, the fewest the gate takes: this checks the run's mode and its report,
    # not its figure (ten took 166 s of CI on the trained checkpoint).
    # Not the host's contention either: on a contended CI host the freeze would wait and measure
    # again (over the 300 s limit, seen under `pytest -n`), which says nothing about the mode.
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-s", "--moe-bench", "--moe-freeze",
                                           "--moe-host-stall", "off", "--moe-samples", "3", "--moe-model", model,
                                           "--moe-baselines", str(pytester.path / "baselines"),
                                           "test_spec_bench.py::test_mtp_speedup", timeout=300)
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines([f"mtp k=3: * tokens per speculative step over * ({mode}); per step (ms):*"])
