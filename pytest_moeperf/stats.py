"""Noise-aware comparison of a metric's samples with its frozen samples.

A metric is compared as a ratio of medians oriented so that > 1 is better, with a bootstrap
confidence interval (scipy) and a Mann-Whitney p-value. The verdict needs both a practical
effect (beyond the tolerance) and a statistical one (the interval excludes 1).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

DIRECTIONS = ("higher", "lower")
CONFIDENCE = 0.95
N_RESAMPLES = 2000
# Below this many values a mean's interval is Student's t, not the bootstrap: resampling 3 to 19
# values sees too few distinct samples, and its intervals come out narrow (an A/A ladder of 3
# requests a row read "faster" or "slower" in 5 of 15 runs through BCa).
SMALL_SAMPLE = 20


def _sps():
    """scipy.stats, imported on first use: it takes about a second, which every pytest process
    loading the plugin (each xdist worker, each inner run) would otherwise pay at start."""
    from scipy import stats
    return stats


def _brentq():
    from scipy.optimize import brentq
    return brentq


@dataclass(frozen=True)
class Comparison:
    ratio: float  # goodness ratio: current / frozen for "higher", frozen / current for "lower"
    ci_low: float
    ci_high: float
    p_value: float
    verdict: str  # "pass", "regression" or "refreeze"


def _median_ratio(a, b, axis=-1):
    """median(a) / median(b); 0 / 0 is 1 (a fraction of answers can be 0 on both sides)."""
    num, den = np.median(a, axis=axis), np.median(b, axis=axis)
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where((num == 0) & (den == 0), 1.0, num / den)


def ratio_interval(current, frozen, confidence: float = CONFIDENCE, seed: int = 0) -> tuple[float, float, float]:
    """Ratio of medians current/frozen and its percentile-bootstrap interval (independent resampling)."""
    a, b = np.asarray(current, dtype=float), np.asarray(frozen, dtype=float)
    point = float(_median_ratio(a, b))
    if len(a) < 2 or len(b) < 2 or np.ptp(a) == 0 and np.ptp(b) == 0 or np.median(b) == 0:
        return point, point, point  # nothing to resample, or (a zero frozen fraction) no scale to resample on
    res = _sps().bootstrap((a, b), _median_ratio, n_resamples=N_RESAMPLES, confidence_level=confidence,
                        method="percentile", vectorized=True, rng=np.random.default_rng(seed))
    return point, float(res.confidence_interval.low), float(res.confidence_interval.high)


def compare(current, frozen, direction: str, tolerance: float, confidence: float = CONFIDENCE,
            zero_ok: bool = False) -> Comparison:
    """Verdict for `current` samples against `frozen` ones in the metric's units, all positive.
    `zero_ok` (a fraction of answers, higher is better): zero is a value too; a zero frozen median
    is matched by a zero current one and beaten by anything above it."""
    if direction not in DIRECTIONS:
        raise ValueError(f"direction must be one of {DIRECTIONS}, got {direction!r}")
    if not 0 < tolerance < 1:
        raise ValueError(f"tolerance must be a fraction in (0, 1), got {tolerance}")
    cur, ref = np.asarray(current, dtype=float), np.asarray(frozen, dtype=float)
    if cur.size == 0 or ref.size == 0:
        raise ValueError("compare needs at least one current and one frozen sample")
    if zero_ok and direction != "higher":
        raise ValueError("zero_ok is for higher-is-better fractions")
    if not np.all(np.isfinite(cur)) or np.any(cur < 0) or (not zero_ok and np.any(cur == 0)):
        # NaN, inf, a negative figure or a zero time or rate is never a pass.
        return Comparison(math.nan, math.nan, math.nan, 0.0, "regression")
    if direction == "lower":
        cur, ref = 1 / cur, 1 / ref
    ratio, low, high = ratio_interval(cur, ref, confidence)
    if len(cur) >= 2 and len(ref) >= 2 and not (np.ptp(cur) == 0 and np.ptp(ref) == 0 and cur[0] == ref[0]):
        p = float(_sps().mannwhitneyu(cur, ref, alternative="two-sided").pvalue)
    else:
        p = 0.0 if ratio != 1 else 1.0
    if ratio < 1 - tolerance and high < 1:
        verdict = "regression"
    elif ratio > 1 + tolerance and low > 1:
        verdict = "refreeze"
    else:
        verdict = "pass"
    return Comparison(ratio, low, high, p, verdict)


# ---------------------------------------------------------------------------------------------
# Paired statistics of an A/B configuration ladder: both rows answer the same prompts, so each
# request is a pair and every comparison below is per request (paired), never two pooled samples.
# ---------------------------------------------------------------------------------------------

def _z(confidence: float) -> float:
    if not 0 < confidence < 1:
        raise ValueError(f"confidence must be in (0, 1), got {confidence}")
    return float(_sps().norm.ppf(1 - (1 - confidence) / 2))


def wilson_interval(successes: int, n: int, confidence: float = CONFIDENCE) -> tuple[float, float]:
    """Wilson score interval for a binomial proportion successes/n.

    It inverts the score test (|p_hat - p| <= z sqrt(p (1 - p) / n)), so it stays inside [0, 1]
    and keeps a non-zero width at 0 or n successes, unlike the Wald interval.
    """
    if isinstance(successes, bool) or isinstance(n, bool):
        raise ValueError("wilson_interval takes counts, not booleans")
    if int(successes) != successes or int(n) != n:
        raise ValueError(f"successes and n must be integers, got {successes!r} and {n!r}")
    if n < 1:
        raise ValueError(f"wilson_interval needs n >= 1, got {n}")
    if not 0 <= successes <= n:
        raise ValueError(f"successes must be in [0, n={n}], got {successes}")
    z = _z(confidence)
    p = successes / n
    denom = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / denom
    half = z / denom * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
    # Clip rounding noise only: the exact bounds are 0 at 0 successes and 1 at n.
    lo = 0.0 if successes == 0 else max(0.0, centre - half)
    hi = 1.0 if successes == n else min(1.0, centre + half)
    return lo, hi


def mcnemar_exact(a_only: int, b_only: int) -> float:
    """Exact McNemar p-value: two-sided binomial test of the discordant pairs against 1/2."""
    m = a_only + b_only
    if m == 0:
        return 1.0  # no discordant pair: no evidence of any difference
    return float(_sps().binomtest(b_only, m, 0.5, alternative="two-sided").pvalue)


def _tango_statistic(delta0: float, n12: int, n21: int, n: int) -> float:
    # Tango's (1998) score statistic for H0: p12 - p21 = delta0, with p21 at its maximum-likelihood
    # value under H0 (the positive root of 2n p^2 + B p + C = 0).
    b = -n12 - n21 + (2 * n - n12 + n21) * delta0
    c = -n21 * delta0 * (1 - delta0)
    p21 = (math.sqrt(max(b * b - 8 * n * c, 0.0)) - b) / (4 * n)
    var = n * (2 * p21 + delta0 * (1 - delta0))
    num = n12 - n21 - n * delta0
    if var <= 0:
        return math.copysign(math.inf, num) if num else 0.0
    return num / math.sqrt(var)


def tango_interval(n12: int, n21: int, n: int, confidence: float = CONFIDENCE) -> tuple[float, float]:
    """Tango's score interval for the paired difference (n12 - n21) / n.

    n12: pairs right on the first member only, n21: right on the second only, n: all pairs. The
    interval is every delta0 that the score test does not reject; it depends only on the discordant
    counts and n, and at n12 = n21 = 0 it is +-z^2 / (n + z^2), not a point.
    """
    if n < 1 or n12 < 0 or n21 < 0 or n12 + n21 > n:
        raise ValueError(f"need 0 <= n12 + n21 <= n and n >= 1, got n12={n12}, n21={n21}, n={n}")
    z = _z(confidence)
    est = (n12 - n21) / n
    eps = 1e-12
    # The statistic decreases in delta0: the lower limit is where it falls to +z, the upper to -z.

    def limit(target: float, bound: float) -> float:
        f = lambda d: _tango_statistic(d, n12, n21, n) - target  # noqa: E731
        inner, outer = est, bound - math.copysign(eps, bound)
        if f(outer) * f(inner) > 0:
            return bound  # the test rejects nowhere on this side: the limit is the boundary
        return float(_brentq()(f, min(inner, outer), max(inner, outer), xtol=1e-12))

    lo = -1.0 if est <= -1 else limit(z, -1.0)
    hi = 1.0 if est >= 1 else limit(-z, 1.0)
    return lo, hi


def _connor_d(n: int, psi: float, za: float, zb: float) -> float:
    # Connor's n = [za sqrt(psi) + zb sqrt(psi - d^2)]^2 / d^2 solved for d: the positive root of
    # (n + zb^2) d^2 - 2 za sqrt(n psi) d + (za^2 - zb^2) psi = 0.
    return math.sqrt(psi) * (math.sqrt(n) * za + zb * math.sqrt(n + zb * zb - za * za)) / (n + zb * zb)


def mdd_floor(n: int, alpha: float = 0.05, power: float = 0.8) -> float:
    """The smallest paired difference that n pairs can detect at all: every discordant pair goes
    one way (d = psi), i.e. the root of n d = [za + zb sqrt(1 - d)]^2; 1.0 when none is below 1."""
    za, zb = float(_sps().norm.ppf(1 - alpha / 2)), float(_sps().norm.ppf(power))
    g = lambda d: n * d - (za + zb * math.sqrt(1 - d)) ** 2  # noqa: E731  (increasing in d)
    if g(1.0) <= 0:
        return 1.0
    return float(_brentq()(g, 1e-15, 1.0, xtol=1e-14))


def connor_mdd(n: int, discordant: float, alpha: float = 0.05, power: float = 0.8) -> tuple[float, float]:
    """Minimum detectable paired difference |p_B - p_A| at n pairs: (mdd, discordant proportion used).

    Connor's (1987) sample size for McNemar's test, n = [za sqrt(psi) + zb sqrt(psi - d^2)]^2 / d^2
    (psi: the discordant proportion, za two-sided at alpha, zb at power), solved for d. A
    difference can never exceed psi, so below a discordant proportion of mdd_floor(n) the formula
    has no valid answer (it returns d > psi); psi is floored there, which gives mdd_floor(n): the
    best case of this n, reached when every discordant pair goes one way. Without the floor a run
    with no discordant pair would claim to detect a difference of 0.
    """
    if n < 1:
        raise ValueError(f"connor_mdd needs n >= 1, got {n}")
    if not 0 <= discordant <= 1:
        raise ValueError(f"discordant proportion must be in [0, 1], got {discordant}")
    if not 0 < alpha < 1 or not 0 < power < 1:
        raise ValueError(f"alpha and power must be in (0, 1), got {alpha} and {power}")
    floor = mdd_floor(n, alpha, power)
    if floor >= 1.0:
        return 1.0, 1.0
    psi = max(discordant, floor)
    za, zb = float(_sps().norm.ppf(1 - alpha / 2)), float(_sps().norm.ppf(power))
    return min(1.0, _connor_d(n, psi, za, zb)), psi


VERDICTS = ("equivalent", "different", "inconclusive")


@dataclass(frozen=True)
class PairedAccuracy:
    """Accuracy of row B against row A on the same questions (B - A throughout)."""
    n: int
    accuracy_a: float
    accuracy_b: float
    ci_a: tuple[float, float]  # Wilson, 1 - alpha
    ci_b: tuple[float, float]
    a_only: int  # A right, B wrong
    b_only: int  # A wrong, B right
    both_right: int
    both_wrong: int
    p_value: float  # exact McNemar
    difference: float  # accuracy_b - accuracy_a
    ci_difference: tuple[float, float]  # Tango score interval, 1 - alpha
    ci_equivalence: tuple[float, float]  # Tango score interval, 1 - 2 alpha (two one-sided tests)
    margin: float
    alpha: float
    power: float
    equivalent: bool
    verdict: str  # one of VERDICTS
    mdd: float  # minimum detectable difference at this n (Connor), as a proportion
    mdd_discordant: float  # the discordant proportion the MDD was computed with (observed or floor)


def _booleans(name: str, values) -> list[bool]:
    out = list(values)
    for i, v in enumerate(out):
        if not isinstance(v, (bool, np.bool_)):
            raise ValueError(f"{name}[{i}] is {v!r} ({type(v).__name__}): paired_accuracy takes booleans "
                             "(drop unscored answers before calling)")
    return [bool(v) for v in out]


def paired_accuracy(correct_a, correct_b, margin: float = 0.01, alpha: float = 0.05,
                    power: float = 0.8) -> PairedAccuracy:
    """Paired comparison of two rows' per-question correctness (index i = the same question).

    Interval for B - A: Tango's score interval. Newcombe's hybrid score interval (his method 10)
    was the other candidate; it collapses to a single point when there is no discordant pair and
    both rows score 50% (its two Wilson half-widths cancel), which would declare equivalence from
    four questions. Tango's depends on the discordant counts and n only and keeps a width of about
    z^2 / n then.

    Verdict: "equivalent" when the 1 - 2 alpha interval lies inside (-margin, +margin) (two
    one-sided tests at alpha), checked first because the margin is the user's own statement of a
    difference that matters; otherwise "different" when the exact McNemar p < alpha; otherwise
    "inconclusive".

    MDD: Connor's formula solved for the difference at the observed discordant proportion, with the
    floor of connor_mdd (the best case of this n: every discordant pair one way), so that a run
    with no or very few discordant pairs does not claim to detect arbitrarily small differences.
    """
    a, b = _booleans("correct_a", correct_a), _booleans("correct_b", correct_b)
    if len(a) != len(b):
        raise ValueError(f"correct_a and correct_b must pair up: {len(a)} and {len(b)} answers")
    if not a:
        raise ValueError("paired_accuracy needs at least one pair of answers")
    if not 0 < margin < 1:
        raise ValueError(f"margin must be in (0, 1), got {margin}")
    if not 0 < alpha < 0.5 or not 0 < power < 1:
        raise ValueError(f"alpha must be in (0, 0.5) and power in (0, 1), got {alpha} and {power}")
    n = len(a)
    both_right = sum(x and y for x, y in zip(a, b))
    both_wrong = sum(not x and not y for x, y in zip(a, b))
    a_only = sum(x and not y for x, y in zip(a, b))
    b_only = n - both_right - both_wrong - a_only
    sa, sb = both_right + a_only, both_right + b_only
    p = mcnemar_exact(a_only, b_only)
    ci_diff = tango_interval(b_only, a_only, n, 1 - alpha)
    ci_eq = tango_interval(b_only, a_only, n, 1 - 2 * alpha)
    equivalent = -margin < ci_eq[0] and ci_eq[1] < margin
    verdict = "equivalent" if equivalent else "different" if p < alpha else "inconclusive"
    mdd, psi = connor_mdd(n, (a_only + b_only) / n, alpha, power)
    return PairedAccuracy(
        n=n, accuracy_a=sa / n, accuracy_b=sb / n,
        ci_a=wilson_interval(sa, n, 1 - alpha), ci_b=wilson_interval(sb, n, 1 - alpha),
        a_only=a_only, b_only=b_only, both_right=both_right, both_wrong=both_wrong,
        p_value=p, difference=(b_only - a_only) / n, ci_difference=ci_diff, ci_equivalence=ci_eq,
        margin=margin, alpha=alpha, power=power, equivalent=equivalent, verdict=verdict,
        mdd=mdd, mdd_discordant=psi)


def _positive(name: str, values) -> np.ndarray:
    try:
        arr = np.asarray(values, dtype=float)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{name} must be numbers (drop missing values before calling): {exc}") from None
    if arr.ndim != 1:
        raise ValueError(f"{name} must be one-dimensional, got shape {arr.shape}")
    bad = ~np.isfinite(arr) | (arr <= 0)
    if bad.any():
        i = int(np.argmax(bad))
        raise ValueError(f"{name}[{i}] = {arr[i]!r}: paired_ratio needs finite positive values "
                         f"({int(bad.sum())} of {arr.size} are not)")
    return arr


def _mean_interval(x: np.ndarray, confidence: float, seed: int) -> tuple[float, float]:
    # BCa bootstrap of a mean; percentile where BCa is undefined (a jackknife with no spread).
    rng = np.random.default_rng(seed)
    res = _sps().bootstrap((x,), np.mean, n_resamples=N_RESAMPLES, confidence_level=confidence,
                        method="BCa", vectorized=True, rng=rng)
    lo, hi = float(res.confidence_interval.low), float(res.confidence_interval.high)
    if not (math.isfinite(lo) and math.isfinite(hi)):
        res = _sps().bootstrap((x,), np.mean, n_resamples=N_RESAMPLES, confidence_level=confidence,
                            method="percentile", vectorized=True, rng=np.random.default_rng(seed))
        lo, hi = float(res.confidence_interval.low), float(res.confidence_interval.high)
    return lo, hi


def mean_interval(values, confidence: float = CONFIDENCE, seed: int = 0) -> tuple[float, float, float]:
    """Mean of `values` and its interval: BCa bootstrap from SMALL_SAMPLE values on, Student's t
    below (the values taken as about normal, as per-request log ratios are); (mean, nan, nan)
    below two values."""
    x = np.asarray(values, dtype=float)
    if x.ndim != 1 or x.size == 0 or not np.all(np.isfinite(x)):
        raise ValueError("mean_interval needs a non-empty 1-D array of finite numbers")
    point = float(np.mean(x))
    if x.size < 2:
        return point, math.nan, math.nan
    if np.ptp(x) == 0:
        return point, point, point
    if x.size < SMALL_SAMPLE:
        half = float(_sps().t.ppf((1 + confidence) / 2, x.size - 1) * np.std(x, ddof=1) / math.sqrt(x.size))
        return point, point - half, point + half
    lo, hi = _mean_interval(x, confidence, seed)
    return point, lo, hi


def paired_ratio(a, b, confidence: float = CONFIDENCE, seed: int = 0) -> tuple[float, float, float]:
    """Geometric mean of the per-request ratios b_i / a_i with a bootstrap interval over requests.

    The ratios are averaged on the log scale (a 2x and a 0.5x request cancel, as they should for a
    rate and its reciprocal), and the interval resamples requests, i.e. pairs, with BCa (it corrects
    the bias and skew of the resampled means; percentile only where BCa is undefined); below
    SMALL_SAMPLE pairs it is Student's t on the log ratios. Below two pairs there is no interval:
    (ratio, nan, nan).
    """
    x, y = _positive("a", a), _positive("b", b)
    if x.size != y.size:
        raise ValueError(f"a and b must pair up request by request: {x.size} and {y.size} values")
    if x.size == 0:
        raise ValueError("paired_ratio needs at least one pair")
    logs = np.log(y) - np.log(x)
    point, lo, hi = mean_interval(logs, confidence, seed)
    return math.exp(point), math.exp(lo) if math.isfinite(lo) else math.nan, \
        math.exp(hi) if math.isfinite(hi) else math.nan


def percentiles(values, qs=(50, 90, 99)) -> dict:
    """{q: the q-th percentile of values} with linear interpolation between order statistics
    (numpy's default, Hyndman and Fan's type 7)."""
    x = np.asarray(values, dtype=float)
    if x.ndim != 1 or x.size == 0:
        raise ValueError("percentiles needs a non-empty 1-D sequence of numbers")
    if not np.all(np.isfinite(x)):
        raise ValueError("percentiles needs finite values (drop missing ones before calling)")
    qs = tuple(qs)
    if not all(0 <= q <= 100 for q in qs):
        raise ValueError(f"percentiles must lie in [0, 100], got {qs}")
    return {q: float(np.percentile(x, q)) for q in qs}
