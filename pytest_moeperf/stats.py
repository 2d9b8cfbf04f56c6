"""Noise-aware comparison of a metric's samples with its frozen samples.

A metric is compared as a ratio of medians oriented so that > 1 is better, with a bootstrap
confidence interval (scipy) and a Mann-Whitney p-value. The verdict needs both a practical
effect (beyond the tolerance) and a statistical one (the interval excludes 1).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from scipy import stats as sps

DIRECTIONS = ("higher", "lower")
CONFIDENCE = 0.95
N_RESAMPLES = 2000


@dataclass(frozen=True)
class Comparison:
    ratio: float  # goodness ratio: current / frozen for "higher", frozen / current for "lower"
    ci_low: float
    ci_high: float
    p_value: float
    verdict: str  # "pass", "regression" or "refreeze"


def _median_ratio(a, b, axis=-1):
    return np.median(a, axis=axis) / np.median(b, axis=axis)


def ratio_interval(current, frozen, confidence: float = CONFIDENCE, seed: int = 0) -> tuple[float, float, float]:
    """Ratio of medians current/frozen and its percentile-bootstrap interval (independent resampling)."""
    a, b = np.asarray(current, dtype=float), np.asarray(frozen, dtype=float)
    point = float(_median_ratio(a, b))
    if len(a) < 2 or len(b) < 2 or np.ptp(a) == 0 and np.ptp(b) == 0:
        return point, point, point
    res = sps.bootstrap((a, b), _median_ratio, n_resamples=N_RESAMPLES, confidence_level=confidence,
                        method="percentile", vectorized=True, rng=np.random.default_rng(seed))
    return point, float(res.confidence_interval.low), float(res.confidence_interval.high)


def compare(current, frozen, direction: str, tolerance: float, confidence: float = CONFIDENCE) -> Comparison:
    """Verdict for `current` samples against `frozen` ones, both positive, in the metric's units."""
    if direction not in DIRECTIONS:
        raise ValueError(f"direction must be one of {DIRECTIONS}, got {direction!r}")
    if not 0 < tolerance < 1:
        raise ValueError(f"tolerance must be a fraction in (0, 1), got {tolerance}")
    cur, ref = np.asarray(current, dtype=float), np.asarray(frozen, dtype=float)
    if cur.size == 0 or ref.size == 0:
        raise ValueError("compare needs at least one current and one frozen sample")
    if not (np.all(np.isfinite(cur)) and np.all(cur > 0)):
        # NaN, inf or a non-positive time/throughput is never a pass.
        return Comparison(math.nan, math.nan, math.nan, 0.0, "regression")
    if direction == "lower":
        cur, ref = 1 / cur, 1 / ref
    ratio, low, high = ratio_interval(cur, ref, confidence)
    if len(cur) >= 2 and len(ref) >= 2 and not (np.ptp(cur) == 0 and np.ptp(ref) == 0 and cur[0] == ref[0]):
        p = float(sps.mannwhitneyu(cur, ref, alternative="two-sided").pvalue)
    else:
        p = 0.0 if ratio != 1 else 1.0
    if ratio < 1 - tolerance and high < 1:
        verdict = "regression"
    elif ratio > 1 + tolerance and low > 1:
        verdict = "refreeze"
    else:
        verdict = "pass"
    return Comparison(ratio, low, high, p, verdict)
