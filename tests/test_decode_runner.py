"""The captured-step runners (impl/decode_runner.py) on CPU, fp32, where a "graph" is a plain call
of the same step: plain runs equal `generate`, speculative runs equal plain greedy decoding token
for token, `reset` restarts the same run, replaying a step's parts changes nothing, and the held
step rewrites one position. Also the negative control of suites/test_spec_bench.py's agreement
check: a verify pass fed the wrong positions makes it fail."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from impl.decode_runner import PlainRunner, Run, SpecRunner
from impl.generate import generate
from impl.model import build_model
from impl.speculative import SpeculativeDecoder
from tests.helpers import echo_draft_
from tests.pytester_runs import plugin_args

ROOT = Path(__file__).resolve().parents[1]
STEPS = 12


@pytest.fixture(scope="module")
def models():
    return {"random": build_model("tiny", seed=3), "echo": echo_draft_(build_model("tiny", seed=3))}


def prompt(seed: int) -> torch.Tensor:
    return torch.randint(0, 128, (10,), generator=torch.Generator().manual_seed(seed))


def test_plain_run_equals_generate(models):
    model = models["random"]
    run = Run(PlainRunner(model), prompt(0), STEPS)
    run.reset()
    run.run()
    assert torch.equal(run.new_tokens(), generate(model, prompt(0), STEPS + 1).new_tokens[0])


@pytest.mark.parametrize("draft", ["random", "echo"])
@pytest.mark.parametrize("k", [1, 3])
def test_speculative_run_equals_plain_greedy(models, draft, k):
    model = models[draft]
    spec = Run(SpecRunner(SpeculativeDecoder(model, k)), prompt(1), STEPS)
    spec.reset()
    spec.run()
    got = spec.new_tokens()
    # The prefill's token, then 1 to k+1 tokens per step.
    assert STEPS <= len(got) - 1 <= STEPS * (k + 1)
    ref = generate(model, prompt(1), len(got)).new_tokens[0]
    assert torch.equal(got, ref), f"first divergence at {int((got != ref).int().argmax())}"


def test_a_prompt_shorter_than_k_plus_1_takes_one_eager_step(models):
    model = models["echo"]
    spec = Run(SpecRunner(SpeculativeDecoder(model, 3)), prompt(1)[:2], 4)
    spec.reset()
    assert spec.runner.eager_first
    spec.run()
    got = spec.new_tokens()
    assert torch.equal(got, generate(model, prompt(1)[:2], len(got)).new_tokens[0])


def test_reset_restarts_the_same_run_and_parts_change_nothing(models):
    spec = Run(SpecRunner(SpeculativeDecoder(models["echo"], 3)), prompt(2), STEPS)
    spec.reset()
    spec.run()
    first = spec.new_tokens()
    spec.reset()
    state = spec.runner.state
    n = int(state.n)
    for part in spec.runner.parts().values():
        part()
        part()
    assert int(state.n) == n
    spec.run()
    assert torch.equal(spec.new_tokens(), first)


def test_runs_of_two_prompts_share_a_runner(models):
    model = models["random"]
    runner = PlainRunner(model)
    a, b = Run(runner, prompt(3), STEPS), Run(runner, prompt(4), STEPS)
    for run, p in ((a, prompt(3)), (b, prompt(4)), (a, prompt(3))):
        run.reset()
        run.run()
        assert torch.equal(run.new_tokens(), generate(model, p, STEPS + 1).new_tokens[0])


def test_a_run_longer_than_the_runner_is_refused(models):
    model = models["random"]
    with pytest.raises(ValueError, match="do not fit the runner's capacity"):
        Run(PlainRunner(model), prompt(0), model.config.max_seq_len)
    run = Run(PlainRunner(model), prompt(0), 4)
    with pytest.raises(ValueError, match=r"steps must be in \[0, 4\]"):
        run.run(5)


def test_the_held_step_rewrites_one_position(models):
    """The step the decode bench times: every call decodes at the same position, from the token
    the last call wrote there; the cache before that position stays as the prefill left it."""
    model = models["random"]
    runner = PlainRunner(model)
    p = prompt(5)
    t = len(p)
    ref = generate(model, p, 2).new_tokens[0]
    with torch.inference_mode():
        runner.begin(p, 1)
        step = runner.held_step(t)
        step()
        assert int(runner.state.tokens[0, t]) == int(ref[1])  # fed the prefill's token
        step()
    # Fed ref[1] at position t: the prompt followed by ref[1], whatever came before at t.
    again = generate(model, torch.cat([p, ref[1:2]]), 1).new_tokens[0]
    assert int(runner.state.tokens[0, t]) == int(again[0])
    with pytest.raises(ValueError, match="pos must be in"):
        runner.held_step(runner.capacity)


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
    result = pytester.runpytest_subprocess(*plugin_args(), "-p", "no:cacheprovider", "--moe-bench", "--moe-freeze",
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
    result = pytester.runpytest_subprocess(*plugin_args(), "-p", "no:cacheprovider", "-s", "--moe-bench", "--moe-freeze",
                                           "--moe-host-stall", "off", "--moe-samples", "3", "--moe-model", model,
                                           "--moe-baselines", str(pytester.path / "baselines"),
                                           "test_spec_bench.py::test_mtp_speedup", timeout=300)
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines([f"mtp k=3: * tokens per speculative step over * ({mode}); per step (ms):*"])
