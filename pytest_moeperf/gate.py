"""The gate: a metric's samples against this device's frozen figure, with a verdict.

Verdicts: "pass"; "regression" (the test fails); "refreeze" (better beyond tolerance: the test
passes with a warning so the improvement is recorded rather than silently absorbed);
"no-baseline" (skipped, saying how to freeze); "frozen" (recorded under --moe-freeze).
"""

from __future__ import annotations

import statistics
import warnings
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Callable

import pytest

from pytest_moeperf.baselines import FrozenMetric
from pytest_moeperf.stats import DIRECTIONS, compare


class RefreezeWarning(UserWarning):
    """A metric improved beyond its tolerance: refreeze so the gate protects the new level."""


@dataclass
class GateResult:
    metric_id: str
    metric: str
    unit: str
    direction: str
    current: float
    frozen: float | None = None
    ratio: float | None = None
    ci_low: float | None = None
    ci_high: float | None = None
    p_value: float | None = None
    tolerance: float | None = None
    verdict: str = ""
    message: str = ""
    samples: list[float] = field(default_factory=list)


class Gate:
    """Bound to one test; every gated figure of that test goes through `check`."""

    def __init__(self, session, nodeid: str) -> None:
        self.session = session
        self.nodeid = nodeid

    def check(self, metric: str, samples, *, unit: str, direction: str, tolerance: float,
              config: dict | None = None, remeasure: Callable[[], list[float]] | None = None) -> GateResult:
        """Gate `samples` (in `unit`); `remeasure`, if given, takes fresh samples to confirm a
        regression before failing (timings on shared machines)."""
        samples = [float(s) for s in samples]
        if not samples:
            raise ValueError(f"metric {metric!r}: no samples to gate")
        if direction not in DIRECTIONS:
            raise ValueError(f"metric {metric!r}: direction must be one of {DIRECTIONS}, got {direction!r}")
        config = {**self.session.run_config, **(config or {})}
        result = GateResult(f"{self.nodeid}::{metric}", metric, unit, direction, statistics.median(samples),
                            tolerance=tolerance, samples=samples)
        self.session.results.append(result)
        if self.session.freeze:
            self.session.to_freeze[result.metric_id] = FrozenMetric(
                result.current, samples, unit, direction, tolerance, config,
                datetime.now(timezone.utc).isoformat(timespec="seconds"))
            result.verdict, result.message = "frozen", f"frozen into {self.session.store.path}"
            return result
        frozen = self.session.store.metrics.get(result.metric_id)
        if frozen is None or frozen.config != config:
            result.verdict = "no-baseline"
            why = ("no frozen figure" if frozen is None else
                   f"the frozen figure was taken under another configuration ({_diff(frozen.config, config)})")
            result.message = (f"{metric}: {why} for device {self.session.device.key} in "
                              f"{self.session.store.path}; run with --moe-bench --moe-freeze to record one")
            pytest.skip(result.message)
        if (frozen.unit, frozen.direction) != (unit, direction):
            raise ValueError(f"{metric}: frozen as {frozen.unit!r}/{frozen.direction!r} but measured as "
                             f"{unit!r}/{direction!r}; refreeze after changing a metric's meaning")
        result.frozen, result.tolerance = frozen.value, frozen.tolerance
        self._compare(result, samples, frozen)
        if result.verdict == "regression" and remeasure is not None:
            # A burst of host noise can slow one whole measurement; a real regression survives a
            # second, independent one. The second measurement decides, and the message keeps both.
            first = result.message
            samples = [float(s) for s in remeasure()]
            result.current, result.samples = statistics.median(samples), samples
            self._compare(result, samples, frozen)
            result.message += f" (re-measured after: {first})"
        if result.verdict == "regression":
            pytest.fail(result.message, pytrace=False)
        if result.verdict == "refreeze":
            warnings.warn(RefreezeWarning(result.message + "; run --moe-freeze to record the new level"))
        return result

    @staticmethod
    def _compare(result: GateResult, samples: list[float], frozen: FrozenMetric) -> None:
        cmp = compare(samples, frozen.samples, result.direction, frozen.tolerance)
        result.ratio, result.ci_low, result.ci_high, result.p_value = cmp.ratio, cmp.ci_low, cmp.ci_high, cmp.p_value
        result.verdict = cmp.verdict
        result.message = (f"{result.metric}: {result.current:.4g} {result.unit} vs frozen {frozen.value:.4g} "
                          f"{result.unit}: x{cmp.ratio:.3f} (95% CI {cmp.ci_low:.3f}-{cmp.ci_high:.3f}, "
                          f"tolerance {frozen.tolerance:.0%}, {result.direction} is better) -> {cmp.verdict}")

    def check_ratio(self, metric: str, measure: Callable[[], tuple[list[float], list[float]]], *,
                    direction: str, tolerance: float, config: dict | None = None) -> GateResult:
        """Gate the per-round ratio of two series measured side by side (interleaved);
        `measure()` returns (numerator, denominator) and is called again to confirm a regression."""

        def ratios() -> list[float]:
            numerator, denominator = measure()
            if len(numerator) != len(denominator):
                raise ValueError(f"metric {metric!r}: paired series differ in length "
                                 f"({len(numerator)} vs {len(denominator)})")
            return [a / b for a, b in zip(numerator, denominator)]

        return self.check(metric, ratios(), unit="x", direction=direction, tolerance=tolerance,
                          config=config, remeasure=ratios)


def _diff(frozen: dict, current: dict) -> str:
    keys = sorted(set(frozen) | set(current))
    return ", ".join(f"{k}: {frozen.get(k)!r} -> {current.get(k)!r}" for k in keys
                     if frozen.get(k) != current.get(k))
