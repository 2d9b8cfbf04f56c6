"""The paired statistics of the A/B ladder, each checked against a published value or a value
computed here by another route (enumeration, a hand-derived closed form, numerical optimization,
Monte Carlo)."""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy import optimize, stats as sps

from pytest_moeperf.stats import (
    SMALL_SAMPLE, PairedAccuracy, _mean_interval, connor_mdd, mcnemar_exact, mdd_floor, mean_interval, paired_accuracy,
    paired_ratio, percentiles, tango_interval, wilson_interval,
)

Z95 = float(sps.norm.ppf(0.975))


# --- Wilson ------------------------------------------------------------------------------------

# Newcombe (1998), "Two-sided confidence intervals for the single proportion: comparison of seven
# methods", Statistics in Medicine 17:857-872, the score method without continuity correction on
# his four worked examples, published to four decimals.
NEWCOMBE_WILSON = [
    (81, 263, 0.2553, 0.3662),
    (15, 148, 0.0624, 0.1605),
    (0, 20, 0.0000, 0.1611),
    (1, 29, 0.0061, 0.1718),
]


@pytest.mark.parametrize("k, n, lo, hi", NEWCOMBE_WILSON)
def test_wilson_matches_newcombes_published_examples(k, n, lo, hi):
    got = wilson_interval(k, n)
    assert got == pytest.approx((lo, hi), abs=5e-5)


def _score_test_inversion(k, n, confidence):
    # Another route to the same interval: the p where |k/n - p| = z sqrt(p (1 - p) / n), found by
    # root finding on each side of k/n instead of the closed form.
    z = float(sps.norm.ppf(1 - (1 - confidence) / 2))
    phat = k / n
    f = lambda p: abs(phat - p) - z * math.sqrt(p * (1 - p) / n)  # noqa: E731
    lo = 0.0 if k == 0 else optimize.brentq(f, 1e-15, phat - 1e-12)
    hi = 1.0 if k == n else optimize.brentq(f, phat + 1e-12, 1 - 1e-15)
    return lo, hi


@pytest.mark.parametrize("k, n, confidence", [(0, 1, 0.95), (1, 1, 0.95), (3, 7, 0.9), (50, 51, 0.99),
                                              (17, 200, 0.95), (199, 200, 0.8)])
def test_wilson_is_the_inverted_score_test(k, n, confidence):
    assert wilson_interval(k, n, confidence) == pytest.approx(_score_test_inversion(k, n, confidence), abs=1e-9)


@pytest.mark.parametrize("args", [(1, 0), (-1, 5), (6, 5), (True, 5), (1.5, 5)])
def test_wilson_rejects_bad_counts(args):
    with pytest.raises(ValueError):
        wilson_interval(*args)


# --- McNemar -------------------------------------------------------------------------------------

def _mcnemar_by_enumeration(a_only, b_only):
    # Two-sided exact test of b_only ~ Binomial(m, 1/2): the probability of every outcome no more
    # likely than the observed one, summed over all m + 1 outcomes.
    m = a_only + b_only
    if m == 0:
        return 1.0
    pmf = [math.comb(m, k) / 2 ** m for k in range(m + 1)]
    return min(1.0, sum(p for p in pmf if p <= pmf[b_only] * (1 + 1e-12)))


@pytest.mark.parametrize("a_only, b_only", [(0, 0), (1, 0), (1, 7), (7, 1), (5, 5), (3, 12), (0, 6), (20, 31)])
def test_mcnemar_exact_matches_enumeration(a_only, b_only):
    assert mcnemar_exact(a_only, b_only) == pytest.approx(_mcnemar_by_enumeration(a_only, b_only), rel=1e-12)


def test_mcnemar_on_the_airway_example():
    # Bentur et al. (2009), the worked example of Fagerland, Lydersen and Laake: 1 and 7 discordant
    # pairs. By hand: 2 * (C(8,0) + C(8,1)) / 2^8 = 18 / 256.
    assert mcnemar_exact(1, 7) == pytest.approx(18 / 256, rel=1e-12)


# --- Tango's interval ----------------------------------------------------------------------------

def _tango_stat_numeric(d, n12, n21, n):
    # Tango's score statistic with p21 maximized numerically (the profile multinomial likelihood
    # under p12 - p21 = d): a different route from the module's closed-form maximum.
    rest = n - n12 - n21
    lo, hi = max(0.0, -d), (1 - d) / 2
    nll = lambda p: -(n12 * math.log(max(p + d, 1e-300)) + n21 * math.log(max(p, 1e-300))  # noqa: E731
                      + rest * math.log(max(1 - 2 * p - d, 1e-300)))
    p21 = optimize.minimize_scalar(nll, bounds=(lo, hi), method="bounded", options={"xatol": 1e-13}).x
    return (n12 - n21 - n * d) / math.sqrt(n * (2 * p21 + d * (1 - d)))


def _tango_by_optimization(n12, n21, n, confidence, window=1.0, grid=3001):
    # The interval read off a grid of d (within `window` of the estimate) instead of root finding.
    z = float(sps.norm.ppf(1 - (1 - confidence) / 2))
    est = (n12 - n21) / n
    ds = np.linspace(max(-1 + 1e-9, est - window), min(1 - 1e-9, est + window), grid)
    inside = [d for d in ds if abs(_tango_stat_numeric(d, n12, n21, n)) <= z]
    return inside[0], inside[-1]


def test_tango_on_the_airway_example():
    # Fagerland, Lydersen and Laake report Tango's asymptotic score interval for this table (n12 = 1,
    # n21 = 7, N = 21) as -0.517 to -0.026.
    lo, hi = tango_interval(1, 7, 21)
    assert (lo, hi) == pytest.approx((-0.517, -0.026), abs=5e-4)


@pytest.mark.parametrize("n12, n21, n", [(1, 7, 21), (6, 16, 161), (0, 3, 10), (4, 0, 4), (12, 12, 40)])
def test_tango_matches_numerical_profile_likelihood(n12, n21, n):
    step = 2 / 3000
    expected = _tango_by_optimization(n12, n21, n, 0.95)
    assert tango_interval(n12, n21, n) == pytest.approx(expected, abs=step)


@pytest.mark.parametrize("n", [1, 4, 50, 1319])
def test_tango_without_discordant_pairs_is_z2_over_n_plus_z2(n):
    # Derived by hand: at n12 = n21 = 0 the constrained p21 is max(0, -d), so the statistic is
    # T^2 = n |d| / (1 - |d|), and T^2 = z^2 at |d| = z^2 / (n + z^2).
    half = Z95 ** 2 / (n + Z95 ** 2)
    assert tango_interval(0, 0, n) == pytest.approx((-half, half), abs=1e-9)


def test_tango_excludes_zero_exactly_when_the_uncorrected_mcnemar_z_test_rejects():
    # At d = 0 Tango's statistic reduces to McNemar's (n12 - n21) / sqrt(n12 + n21).
    for n12 in range(0, 25):
        for n21 in range(0, 25):
            if n12 + n21 == 0:
                continue
            lo, hi = tango_interval(n12, n21, 60)
            z = abs(n12 - n21) / math.sqrt(n12 + n21)
            if abs(z - Z95) > 1e-6:
                assert (lo > 0 or hi < 0) == (z > Z95), (n12, n21, lo, hi, z)


# --- paired_accuracy -----------------------------------------------------------------------------

def _arms(both_right, a_only, b_only, both_wrong):
    a = [True] * both_right + [True] * a_only + [False] * b_only + [False] * both_wrong
    b = [True] * both_right + [False] * a_only + [True] * b_only + [False] * both_wrong
    return a, b


def test_paired_accuracy_counts_and_accuracies():
    a, b = _arms(both_right=59, a_only=6, b_only=16, both_wrong=80)
    r = paired_accuracy(a, b)
    assert isinstance(r, PairedAccuracy)
    assert (r.n, r.both_right, r.a_only, r.b_only, r.both_wrong) == (161, 59, 6, 16, 80)
    assert r.accuracy_a == pytest.approx(65 / 161) and r.accuracy_b == pytest.approx(75 / 161)
    assert r.difference == pytest.approx(10 / 161)
    assert r.ci_a == pytest.approx(wilson_interval(65, 161)) and r.ci_b == pytest.approx(wilson_interval(75, 161))
    assert r.p_value == pytest.approx(_mcnemar_by_enumeration(6, 16))
    assert r.ci_difference[0] < r.difference < r.ci_difference[1]
    # The 90% interval of the equivalence test sits inside the 95% one.
    assert r.ci_difference[0] < r.ci_equivalence[0] < r.ci_equivalence[1] < r.ci_difference[1]


def test_pairing_matters_not_just_the_totals():
    # Same totals (60 right each), different pairing: 0 discordant pairs against 40.
    same = paired_accuracy(*_arms(60, 0, 0, 40))
    mixed = paired_accuracy(*_arms(40, 20, 20, 20))
    assert same.accuracy_a == mixed.accuracy_a == same.accuracy_b == mixed.accuracy_b == 0.6
    assert same.ci_difference[1] - same.ci_difference[0] < mixed.ci_difference[1] - mixed.ci_difference[0]


def test_all_concordant_gives_p_1_and_a_nonzero_interval():
    r = paired_accuracy(*_arms(100, 0, 0, 100))
    half = Z95 ** 2 / (200 + Z95 ** 2)
    assert r.p_value == 1.0
    assert r.ci_difference == pytest.approx((-half, half), abs=1e-9)
    # 200 agreeing answers are not enough to show equivalence within 1 point: 0.0133 > 0.01.
    assert r.verdict == "inconclusive" and not r.equivalent


def test_a_single_pair_is_defined():
    for a, b in [([True], [True]), ([True], [False]), ([False], [True]), ([False], [False])]:
        r = paired_accuracy(a, b)
        assert r.n == 1 and r.verdict == "inconclusive" and r.mdd == 1.0
        assert -1 <= r.ci_difference[0] <= r.difference <= r.ci_difference[1] <= 1


def test_verdicts():
    # Many agreeing answers with balanced disagreements: the 90% interval is about +-0.0006.
    eq = paired_accuracy(*_arms(18000, 10, 10, 1980), margin=0.01)
    assert eq.verdict == "equivalent" and eq.equivalent
    diff = paired_accuracy(*_arms(150, 30, 5, 15))
    assert diff.p_value < 0.05 and diff.verdict == "different" and diff.difference < 0
    inc = paired_accuracy(*_arms(40, 3, 2, 5))
    assert inc.verdict == "inconclusive"


def test_equivalence_is_two_one_sided_tests_at_the_margin():
    # Equivalence by the 1 - 2 alpha interval is the same as both one-sided score tests rejecting
    # at alpha: the statistic at -margin above z_{1-alpha} and at +margin below -z_{1-alpha}. The
    # statistic is computed here with the numerically maximized likelihood.
    z1 = float(sps.norm.ppf(0.95))
    margin, n = 0.02, 3000
    seen = set()
    for a_only, b_only in [(5, 5), (10, 25), (30, 10), (2, 0), (40, 40), (60, 20), (90, 20), (25, 75)]:
        r = paired_accuracy(*_arms(2000, a_only, b_only, n - 2000 - a_only - b_only), margin=margin)
        tost = (_tango_stat_numeric(-margin, b_only, a_only, n) > z1
                and _tango_stat_numeric(margin, b_only, a_only, n) < -z1)
        assert r.equivalent == tost, (a_only, b_only, r.ci_equivalence)
        lo, hi = _tango_by_optimization(b_only, a_only, n, 0.90, window=0.05, grid=2001)
        assert r.ci_equivalence == pytest.approx((lo, hi), abs=0.1 / 2000)
        seen.add(tost)
    assert seen == {True, False}  # the cases cover both outcomes


@pytest.mark.parametrize("a, b, match", [
    ([True, False], [True], "pair up"),
    ([], [], "at least one"),
    ([1, 0], [True, False], "booleans"),
    ([True, None], [True, False], "booleans"),
])
def test_paired_accuracy_rejects_bad_input(a, b, match):
    with pytest.raises(ValueError, match=match):
        paired_accuracy(a, b)


def test_paired_accuracy_accepts_numpy_booleans():
    a = np.array([True, False, True, True])
    r = paired_accuracy(a, a.copy())
    assert r.accuracy_a == 0.75 and r.a_only == r.b_only == 0


# --- minimum detectable difference ---------------------------------------------------------------

def _connor_n(psi, d, alpha=0.05, power=0.8):
    za, zb = sps.norm.ppf(1 - alpha / 2), sps.norm.ppf(power)
    return (za * math.sqrt(psi) + zb * math.sqrt(psi - d * d)) ** 2 / d ** 2


def test_connor_hand_example():
    # By hand from Connor's formula: psi = 0.3, d = 0.1, alpha 0.05, power 0.8:
    # (1.95996 * 0.54772 + 0.84162 * 0.53852)^2 / 0.01 = (1.07352 + 0.45323)^2 / 0.01 = 233.1 pairs.
    assert _connor_n(0.3, 0.1) == pytest.approx(233.1, abs=0.05)
    assert connor_mdd(234, 0.3)[0] < 0.1 < connor_mdd(233, 0.3)[0]


@pytest.mark.parametrize("n, psi", [(50, 0.4), (200, 0.1), (1319, 0.03), (5000, 0.01)])
def test_connor_mdd_round_trips_through_the_sample_size_formula(n, psi):
    d, used = connor_mdd(n, psi)
    assert used == psi
    assert _connor_n(psi, d) == pytest.approx(n, rel=1e-9)


def test_connor_mdd_has_the_stated_power_by_simulation():
    # Monte Carlo: pairs drawn with discordant cells psi/2 -+ d/2, the uncorrected McNemar z test
    # at alpha 0.05 (the test Connor's formula is for) rejects in about 80% of 20000 runs.
    n, psi = 400, 0.12
    d, _ = connor_mdd(n, psi)
    rng = np.random.default_rng(3)
    cells = rng.multinomial(n, [(psi - d) / 2, (psi + d) / 2, 1 - psi], size=20000)
    m = cells[:, 0] + cells[:, 1]
    z = np.abs(cells[:, 1] - cells[:, 0]) / np.sqrt(np.maximum(m, 1))
    assert np.mean(z > Z95) == pytest.approx(0.80, abs=0.02)


def test_mdd_floor_is_the_all_one_way_case():
    for n in (10, 200, 1319):
        f = mdd_floor(n)
        # Fixed point by construction: at psi = d the formula gives back d.
        assert connor_mdd(n, f)[0] == pytest.approx(f, rel=1e-9)
        assert _connor_n(f, f) == pytest.approx(n, rel=1e-6)
        # No discordant pair, or a handful: the floor, never 0.
        assert connor_mdd(n, 0.0) == pytest.approx((f, f))
    assert mdd_floor(3) == 1.0  # z_alpha^2 = 3.84 > 3 pairs: nothing can be detected
    # More discordant pairs above the floor make the detectable difference larger.
    assert connor_mdd(1000, 0.05)[0] < connor_mdd(1000, 0.2)[0]


def test_paired_accuracy_reports_the_floored_mdd():
    r = paired_accuracy(*_arms(100, 0, 0, 100))
    assert r.mdd == pytest.approx(mdd_floor(200)) and r.mdd_discordant == pytest.approx(mdd_floor(200))
    r = paired_accuracy(*_arms(700, 30, 30, 240))
    assert r.mdd_discordant == pytest.approx(0.06) and r.mdd == pytest.approx(connor_mdd(1000, 0.06)[0])


# --- paired_ratio --------------------------------------------------------------------------------

def test_identical_rows_give_one():
    a = np.random.default_rng(0).lognormal(0, 0.3, 50)
    assert paired_ratio(a, a.copy()) == (1.0, 1.0, 1.0)


def test_an_exact_factor_is_returned_exactly():
    a = np.random.default_rng(1).lognormal(0, 0.3, 30)
    assert paired_ratio(a, 2 * a) == pytest.approx((2.0, 2.0, 2.0), rel=1e-12)


def test_ratio_is_the_geometric_mean_and_its_interval_matches_a_t_interval():
    # With log-normal per-request ratios the bootstrap interval of the mean log ratio should be
    # close to the textbook t interval mean +- t sd / sqrt(n) on the log scale.
    rng = np.random.default_rng(2)
    a = rng.lognormal(0, 0.5, 400)
    b = a * rng.lognormal(math.log(0.8), 0.1, 400)
    ratio, lo, hi = paired_ratio(a, b)
    logs = np.log(b / a)
    assert ratio == pytest.approx(float(sps.gmean(b / a)), rel=1e-12)
    half = sps.t.ppf(0.975, len(logs) - 1) * logs.std(ddof=1) / math.sqrt(len(logs))
    t_lo, t_hi = math.exp(logs.mean() - half), math.exp(logs.mean() + half)
    assert lo == pytest.approx(t_lo, rel=2e-3) and hi == pytest.approx(t_hi, rel=2e-3)


def test_pairing_removes_the_between_request_spread():
    # Requests vary 10x in length; B is 5% faster on each. Pairing sees the 5% clearly.
    rng = np.random.default_rng(4)
    a = rng.lognormal(0, 1.0, 60)
    b = a * 0.95 * rng.lognormal(0, 0.01, 60)
    ratio, lo, hi = paired_ratio(a, b)
    assert hi < 1 and ratio == pytest.approx(0.95, rel=0.01)


def test_ratio_interval_coverage():
    # 200 runs of 40 pairs with a true geometric-mean ratio of 1.1: the 95% interval should cover it
    # in about 95% of runs (binomial sd of the rate over 200 runs: 1.5 points).
    rng = np.random.default_rng(5)
    hits = 0
    for i in range(200):
        a = rng.lognormal(0, 0.4, 40)
        b = a * 1.1 * rng.lognormal(0, 0.2, 40)
        _, lo, hi = paired_ratio(a, b, seed=i)
        hits += lo <= 1.1 <= hi
    assert 0.89 <= hits / 200 <= 0.99


def test_one_pair_has_no_interval():
    ratio, lo, hi = paired_ratio([2.0], [3.0])
    assert ratio == pytest.approx(1.5) and math.isnan(lo) and math.isnan(hi)


@pytest.mark.parametrize("a, b, match", [
    ([1.0, 2.0], [1.0], "pair up"),
    ([], [], "at least one"),
    ([1.0, 0.0], [1.0, 1.0], "positive"),
    ([1.0, 2.0], [1.0, -1.0], "positive"),
    ([1.0, float("nan")], [1.0, 1.0], "positive"),
    ([1.0, None], [1.0, 1.0], "positive|numbers"),
])
def test_paired_ratio_rejects_bad_input(a, b, match):
    with pytest.raises(ValueError, match=match):
        paired_ratio(a, b)


def test_mean_interval():
    x = np.random.default_rng(6).normal(10, 2, 300)
    m, lo, hi = mean_interval(x)
    half = Z95 * x.std(ddof=1) / math.sqrt(len(x))
    assert m == pytest.approx(x.mean()) and lo == pytest.approx(m - half, abs=0.05 * half + 0.02)
    assert hi == pytest.approx(m + half, abs=0.05 * half + 0.02)
    assert math.isnan(mean_interval([3.0])[1])


# --- percentiles ---------------------------------------------------------------------------------

def test_percentiles_linear_interpolation():
    # Type 7 by hand: position h = (n - 1) q / 100 from the first order statistic. For 1..100,
    # q = 90 gives h = 89.1, so 90 + 0.1 * (91 - 90) = 90.1; q = 99 gives 99.01; q = 50 gives 50.5.
    got = percentiles(range(1, 101))
    assert got == pytest.approx({50: 50.5, 90: 90.1, 99: 99.01})
    assert percentiles([3.0, 1.0, 2.0], qs=(0, 50, 100, 25)) == pytest.approx({0: 1.0, 50: 2.0, 100: 3.0, 25: 1.5})


@pytest.mark.parametrize("values, qs", [([], (50,)), ([1.0, float("nan")], (50,)), ([1.0], (101,)), ([1.0], (-1,))])
def test_percentiles_reject_bad_input(values, qs):
    with pytest.raises(ValueError):
        percentiles(values, qs)


def test_few_pairs_get_intervals_that_cover_as_stated():
    """An A/A comparison of 3 requests: per-request log ratios of mean 0. Student's t (below
    SMALL_SAMPLE pairs) excludes 0 in about 5% of draws; the bootstrap on 3 values, the negative
    control, excluded it several times as often (5 of 15 A/A ladders of 3 requests read as faster
    or slower)."""
    rng = np.random.default_rng(7)
    draws = [rng.normal(0, 0.05, 3) for _ in range(400)]
    t_misses = np.mean([not (lo <= 0 <= hi) for _, lo, hi in (mean_interval(d) for d in draws)])
    boot_misses = np.mean([not (lo <= 0 <= hi) for lo, hi in (_mean_interval(d, 0.95, 0) for d in draws)])
    # 400 draws: the 5% rate has a standard error of 1.1 points; 8% is nearly three of them.
    assert t_misses <= 0.08 and boot_misses >= 2 * t_misses + 0.05, (t_misses, boot_misses)
    # From SMALL_SAMPLE values on, the bootstrap's interval (it copes with skew).
    many = rng.lognormal(0, 0.3, SMALL_SAMPLE)
    assert mean_interval(many)[1:] == pytest.approx(_mean_interval(many, 0.95, 0))
