"""The gate's statistic: calibrated on simulated noise, so its error rates are measured, not assumed."""

from __future__ import annotations

import math

import numpy as np
import pytest

from pytest_moeperf.stats import compare, ratio_interval

TRIALS = 200
N = 10  # samples per side, the plugin's default --moe-samples


def _noisy(rng, value, cv, n=N):
    return value * rng.lognormal(0.0, cv, n)


def _verdicts(rng, factor, cv, direction="lower", tolerance=0.10):
    out = []
    for _ in range(TRIALS):
        frozen = _noisy(rng, 100.0, cv)
        current = _noisy(rng, 100.0 * factor, cv)
        out.append(compare(current, frozen, direction, tolerance).verdict)
    return out


def test_identical_distributions_almost_never_flag():
    # CV 2%: about three times the per-sample CV measured on the CI machine kind.
    verdicts = _verdicts(np.random.default_rng(0), 1.0, 0.02)
    assert verdicts.count("pass") / TRIALS >= 0.99


def test_a_20_percent_slowdown_is_caught_at_realistic_noise():
    verdicts = _verdicts(np.random.default_rng(1), 1.2, 0.02)
    assert verdicts.count("regression") / TRIALS >= 0.99


def test_a_30_percent_speedup_asks_for_a_refreeze():
    verdicts = _verdicts(np.random.default_rng(2), 0.7, 0.02)
    assert verdicts.count("refreeze") / TRIALS >= 0.99


def test_noise_larger_than_the_effect_does_not_fail_the_gate_often():
    # CV 40%: a 12% slowdown cannot be told from noise with 10 samples; failing on it would be a
    # coin toss, so the interval must keep the false-alarm rate low.
    verdicts = _verdicts(np.random.default_rng(3), 1.12, 0.40)
    assert verdicts.count("regression") / TRIALS <= 0.20


def test_the_interval_covers_the_true_ratio():
    # Percentile bootstrap of a median ratio with 10 samples per side under-covers somewhat;
    # 85% for a nominal 95% is what it achieves on lognormal noise (measured), far from useless.
    rng = np.random.default_rng(4)
    covered = 0
    for _ in range(TRIALS):
        a, b = _noisy(rng, 120.0, 0.05), _noisy(rng, 100.0, 0.05)
        _, low, high = ratio_interval(a, b)
        covered += low <= 1.2 <= high
    assert covered / TRIALS >= 0.85


def test_direction_orients_the_ratio():
    slow = [120.0] * 5 + [121.0] * 5
    base = [100.0] * 5 + [101.0] * 5
    assert compare(slow, base, "lower", 0.1).verdict == "regression"
    assert compare(slow, base, "higher", 0.1).verdict == "refreeze"
    assert compare(slow, base, "lower", 0.1).ratio == pytest.approx(100.5 / 120.5, rel=1e-3)


@pytest.mark.parametrize("bad", [math.nan, math.inf, 0.0, -1.0])
def test_non_finite_or_non_positive_samples_never_pass(bad):
    assert compare([100.0] * 9 + [bad], [100.0] * 10, "higher", 0.1).verdict == "regression"


def test_a_fraction_of_answers_may_be_zero_on_either_side():
    """A model that got every answer wrong when frozen and again now passes; rising from zero asks
    for a refreeze; falling to zero is a regression. Only fractions (zero_ok) may be zero."""
    none, some = [0.0] * 5, [0.4, 0.5, 0.5, 0.6, 0.5]
    same = compare(none, none, "higher", 0.05, zero_ok=True)
    assert (same.verdict, same.ratio) == ("pass", 1.0)
    assert compare(some, none, "higher", 0.05, zero_ok=True).verdict == "refreeze"
    fell = compare(none, some, "higher", 0.05, zero_ok=True)
    assert (fell.verdict, fell.ratio) == ("regression", 0.0)
    assert compare(none, none, "higher", 0.05).verdict == "regression"  # a zero rate is never a pass
    with pytest.raises(ValueError, match="zero_ok is for higher-is-better"):
        compare(none, none, "lower", 0.05, zero_ok=True)


@pytest.mark.parametrize("kwargs, message", [
    (dict(direction="up", tolerance=0.1), "direction must be one of"),
    (dict(direction="lower", tolerance=0.0), "tolerance must be a fraction"),
    (dict(direction="lower", tolerance=1.5), "tolerance must be a fraction"),
])
def test_bad_arguments_are_named(kwargs, message):
    with pytest.raises(ValueError, match=message):
        compare([1.0, 2.0], [1.0, 2.0], **kwargs)


def test_empty_samples_are_rejected():
    with pytest.raises(ValueError, match="at least one current and one frozen sample"):
        compare([], [1.0], "lower", 0.1)
