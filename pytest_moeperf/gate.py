"""The gate: a metric's samples against this device's frozen figure, with a verdict.

Verdicts: "pass"; "regression" (the test fails); "refreeze" (better beyond tolerance: the test
passes with a warning so the improvement is recorded rather than silently absorbed);
"no-baseline" (skipped, saying how to freeze; under --moe-strict it fails); "frozen" (recorded
under --moe-freeze); "host-contended" (below: not judged, or not frozen); "reported" (a figure
given `Reported` instead of a tolerance: shown with its reason, never judged, frozen or looked up,
because its level moves between machines more than a change worth catching).

Which frozen figure: an absolute figure only the one frozen on this exact fingerprint; a
`portable` one (a ratio measured side by side in one run, or a count such as an accept length)
also one frozen on another machine of the same class. Each result says which (`scope`).

Under --moe-trust N (gate-trust runs) each timed figure is gated N times in the run (its first
measurement, then N-1 re-measurements), each by the same rule, confirmation included; the
verdicts are recorded, not acted on.

A contended host (timings on a CPU, measured through the test's host_load.Meter): when the
measurement that decides a regression ran while the host's CPU stall exceeded --moe-host-stall,
the gate waits up to --moe-host-wait seconds for the host to quiet and measures once more; that
measurement decides if the host was quiet during it, otherwise the verdict is "host-contended"
(the test passes, loudly; the run fails only under --moe-strict). A freeze never stores a figure
measured on a contended host ("host-contended": not frozen, the old figure kept, the run fails).
"""

from __future__ import annotations

import math
import statistics
import warnings
from dataclasses import dataclass, field
from typing import Callable

import pytest

from pytest_moeperf import report
from pytest_moeperf.baselines import FrozenMetric
from pytest_moeperf.device import short_key
from pytest_moeperf.host_load import HostLoad, Meter, wait_for_quiet
from pytest_moeperf.stats import DIRECTIONS, compare


class RefreezeWarning(UserWarning):
    """A metric improved beyond its tolerance: refreeze so the gate protects the new level."""


class HostContendedWarning(UserWarning):
    """A figure was not judged (or not frozen): the host's CPUs were contended while it was measured."""


@dataclass(frozen=True)
class Reported:
    """In place of a tolerance: a figure measured and shown beside the gate table but never
    judged, frozen or looked up; `reason` says why (its spread across machines) and what gates
    instead."""

    reason: str

    def __post_init__(self) -> None:
        if not self.reason.strip():
            raise ValueError("Reported needs a reason: why the figure is not gated, and what gates instead")


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
    portable: bool = False
    scope: str | None = None  # "exact" or "class": the key the frozen figure was found under
    baseline: str | None = None  # short key of the fingerprint it was frozen on
    config: dict = field(default_factory=dict)
    evaluations: list[dict] = field(default_factory=list)  # every verdict this run reached (--moe-trust)
    gpu: str | None = None  # the GPU of the pytest-xdist worker that measured it (pytest_moeperf.workers)
    # The host's CPU contention during the measurement that decided the verdict (HostLoad.as_dict;
    # None: not measured, e.g. synthetic samples or a GPU), and during each measurement taken.
    host_load: dict | None = None
    host_loads: list[dict] = field(default_factory=list)


MIN_SAMPLES = 3  # what a bootstrap interval of a ratio of medians is taken from (--moe-samples' minimum too)


def _check_input(metric_id: str, samples: list[float], direction: str, tolerance: "float | Reported") -> None:
    """What the gate cannot judge, or a baseline file could not hold, refused before it is
    recorded: a freeze must never write a figure its next run refuses to load."""
    if len(samples) < MIN_SAMPLES:
        raise ValueError(f"metric {metric_id!r}: {len(samples)} sample(s); the gate needs at least {MIN_SAMPLES} "
                         "to take an interval (one measurement cannot tell a change from noise)")
    if direction not in DIRECTIONS:
        raise ValueError(f"metric {metric_id!r}: direction must be one of {DIRECTIONS}, got {direction!r}")
    if isinstance(tolerance, Reported):
        return
    if isinstance(tolerance, bool) or not isinstance(tolerance, (int, float)) or not (
            math.isfinite(tolerance) and 0 < tolerance < 1):
        raise ValueError(f"metric {metric_id!r}: tolerance must be a fraction in (0, 1) or Reported(reason), "
                         f"got {tolerance!r}")


def _check_freezable(result: GateResult) -> None:
    """A frozen figure is what every later run is gated against: finite and positive (a fraction
    of answers may be 0), or no later measurement could pass against it."""
    zero_ok = _zero_ok(result.unit, result.direction)
    bad = [s for s in result.samples if not math.isfinite(s) or s < 0 or (s == 0 and not zero_ok)]
    if bad:
        raise ValueError(f"metric {result.metric_id!r}: cannot freeze samples {bad[:3]}: a frozen figure must be "
                         "finite and positive (a higher-is-better fraction may be 0)")


def _zero_ok(unit: str, direction: str) -> bool:
    # A fraction of answers can be 0 (a model that gets every answer wrong, and did when frozen).
    return unit == "fraction" and direction == "higher"


class Gate:
    """Bound to one test; every gated figure of that test goes through `check`."""

    def __init__(self, session, nodeid: str, properties: list | None = None, meter: Meter | None = None) -> None:
        self.session = session
        self.nodeid = nodeid
        self.meter = meter  # the test's host_load.Meter, which its sampler measures through
        # The test's user_properties: each verdict is published there, so JUnit XML (and
        # pytest-xdist, which carries them to the controller) has the metrics as properties.
        self.properties = properties

    def _publish(self, result: GateResult) -> None:
        if self.properties is None:
            return
        name = f"moeperf:{result.metric}"
        self.properties += [(name, f"{result.current:.6g}"), (f"{name}:unit", result.unit),
                            (f"{name}:verdict", result.verdict)]
        if result.ratio is not None:
            self.properties.append((f"{name}:ratio", f"{result.ratio:.4f}"))
        if result.host_load is not None and result.host_load["stall"] is not None:
            self.properties.append((f"{name}:host_stall", f"{result.host_load['stall']:.4f}"))

    # -- the host's CPU contention ---------------------------------------------------------------
    def _load(self, result: GateResult) -> HostLoad | None:
        """What the meter saw since it was last read (None: nothing timed through it), recorded."""
        load = self.meter.take() if self.meter is not None else None
        if load is not None:
            result.host_loads.append(load.as_dict())
        return load

    def _measure(self, result: GateResult, measure: Callable[[], list[float]]) -> tuple[list[float], HostLoad | None]:
        if self.meter is not None:
            self.meter.take()  # whatever was timed outside this measurement is not its load
        samples = [float(s) for s in measure()]
        return samples, self._load(result)

    def _contended(self, load: HostLoad | None) -> bool:
        return load is not None and load.contended(self.session.options.host_stall)

    def _quiet_remeasure(self, result: GateResult, measure: Callable[[], list[float]]
                         ) -> tuple[list[float], HostLoad | None, str]:
        """Wait (bounded) for the host to quiet, then measure again; with a note saying what was done."""
        opts = self.session.options
        waited, window = wait_for_quiet(opts.host_stall, opts.host_wait)
        samples, load = self._measure(result, measure)
        note = (f"waited {waited:.1f} s for the host to quiet (last window: {window.describe()}), "
                f"re-measured at {load.describe() if load else 'an unmeasured host load'}")
        return samples, load, note

    def check(self, metric: str, samples, *, unit: str, direction: str, tolerance: "float | Reported",
              config: dict | None = None, remeasure: Callable[[], list[float]] | None = None,
              portable: bool = False, host_load: HostLoad | None = None) -> GateResult:
        """Gate `samples` (in `unit`) at `tolerance` (a fraction; `Reported(reason)`: shown, never
        judged); `remeasure`, if given, takes fresh samples to confirm a
        regression before failing (timings on shared machines). `portable`: the figure does not
        depend on the machine's speed (a ratio of two series measured side by side, a count), so
        a figure frozen on another machine of this device's class may gate it. `host_load`: the
        host's contention while `samples` were measured outside this test's meter (a run shared by
        several tests, host_load.Meter.take of it), judged as the meter's reading would be."""
        samples = [float(s) for s in samples]
        metric_id = f"{self.nodeid}::{metric}"
        _check_input(metric_id, samples, direction, tolerance)
        if any(r.metric_id == metric_id for r in self.session.results):
            raise ValueError(f"metric {metric_id!r} was already checked in this run: one figure, one check "
                             "(give each figure its own name)")
        config = {**self.session.run_config, **(config or {})}
        reported = isinstance(tolerance, Reported)
        result = GateResult(metric_id, metric, unit, direction, statistics.median(samples),
                            tolerance=None if reported else tolerance, samples=samples, portable=portable,
                            config=config)
        if not (self.session.freeze or reported):
            found = self.session.store.lookup(result.metric_id, config, portable)
            if found.match is not None and (found.match.metric.unit, found.match.metric.direction) != (unit, direction):
                frozen = found.match.metric
                raise ValueError(f"metric {metric_id!r}: frozen as {frozen.unit!r}/{frozen.direction!r} but "
                                 f"measured as {unit!r}/{direction!r}; refreeze after changing a metric's meaning")
        self.session.results.append(result)
        load = self._load(result)  # during the measurement of `samples`, taken before this call
        if host_load is not None:
            load = host_load
            result.host_loads.append(load.as_dict())
        result.host_load = None if load is None else load.as_dict()
        if reported:  # shown with its reason: not judged, not frozen, not looked up
            result.verdict, result.message = "reported", f"{metric}: {tolerance.reason}"
            self._publish(result)
            return result
        if self.session.freeze:
            if self._contended(load):
                note = f"measured at {load.describe()}"
                if remeasure is not None:
                    samples, load, note = self._quiet_remeasure(result, remeasure)
                    result.current, result.samples = statistics.median(samples), samples
                result.host_load = None if load is None else load.as_dict()
                if self._contended(load):
                    result.verdict = "host-contended"
                    result.message = (f"{metric}: NOT FROZEN: the host's CPUs were contended while it was measured "
                                      f"({note}; threshold {self.session.options.host_stall:.0%}); the figure "
                                      "frozen before, if any, is kept: freeze again on a quiet host")
                    self._publish(result)
                    warnings.warn(HostContendedWarning(result.message))
                    return result
            _check_freezable(result)
            self.session.to_freeze[result.metric_id] = FrozenMetric(
                result.current, samples, unit, direction, tolerance, config,
                report.now(), self.session.commit or "")
            result.verdict, result.message = "frozen", f"frozen into {self.session.store.path}"
            self._publish(result)
            return result
        found = self.session.store.lookup(result.metric_id, config, portable)
        if found.match is None:
            result.verdict = "no-baseline"
            result.message = f"{metric}: {found.reason}; run with --moe-bench --moe-freeze to record one"
            self._publish(result)
            if self.session.options.strict:
                pytest.fail(f"--moe-strict: {result.message}", pytrace=False)
            pytest.skip(result.message)
        frozen = found.match.metric
        result.frozen, result.tolerance = frozen.value, frozen.tolerance
        result.scope, result.baseline = found.match.scope, short_key(found.match.fingerprint)
        trust = self.session.options.trust
        for i in range(max(trust, 1) if remeasure is not None else 1):
            if i:
                samples, load = self._measure(result, remeasure)
            result.evaluations.append(self._evaluate(result, samples, load, frozen, remeasure))
        if trust:
            first = result.evaluations[0]  # the table shows the first evaluation; the rest are counted
            result.verdict, result.ratio, result.ci_low, result.ci_high, result.host_load = (
                first["verdict"], first["ratio"], first["ci_low"], first["ci_high"], first["host_load"])
            self._publish(result)
            return result
        self._publish(result)
        if result.verdict == "regression":
            pytest.fail(result.message, pytrace=False)
        if result.verdict == "host-contended":
            warnings.warn(HostContendedWarning(result.message))
        if result.verdict == "refreeze":
            warnings.warn(RefreezeWarning(result.message + "; run --moe-freeze to record the new level"))
        return result

    def _evaluate(self, result: GateResult, samples: list[float], load: HostLoad | None, frozen: FrozenMetric,
                  remeasure: Callable[[], list[float]] | None) -> dict:
        """One verdict: `samples` (taken at host `load`) against the frozen figure; a regression
        is confirmed by a second, independent measurement when `remeasure` is given, and is only
        a regression when the measurement that decides it ran on a quiet host."""
        self._compare(result, samples, frozen)
        # The first measurement's reading, in the same form whether or not a second one decided.
        first = {"verdict": result.verdict, "ratio": result.ratio, "ci_high": result.ci_high}
        confirmed = False
        if result.verdict == "regression" and remeasure is not None:
            # A burst of host noise can slow one whole measurement; a real regression survives a
            # second, independent one. The second measurement decides, and the message keeps both.
            first_message = result.message
            samples, load = self._measure(result, remeasure)
            self._compare(result, samples, frozen)
            result.message += f" (re-measured after: {first_message})"
            confirmed = True
        if result.verdict == "regression" and self._contended(load):
            # Another job waiting for the same cores slows whatever is timed (a ratio too: its two
            # sides are not slowed alike); such a measurement cannot tell the code from the host.
            contended = f"{result.message} [measured at {load.describe()}]"
            if remeasure is not None:
                samples, load, note = self._quiet_remeasure(result, remeasure)
                self._compare(result, samples, frozen)
                result.message += f" ({note}, after: {contended})"
            if result.verdict == "regression" and self._contended(load):
                result.verdict = "host-contended"
                result.message = (f"{result.metric}: NOT JUDGED, HOST CONTENDED: it read as a regression while "
                                  f"the host's CPUs were contended ({load.describe()}, threshold "
                                  f"{self.session.options.host_stall:.0%}): {result.message}")
        result.host_load = None if load is None else load.as_dict()
        return {"verdict": result.verdict, "current": result.current, "ratio": result.ratio,
                "ci_low": result.ci_low, "ci_high": result.ci_high, "remeasured": confirmed, "first": first,
                "host_load": result.host_load}

    @staticmethod
    def _compare(result: GateResult, samples: list[float], frozen: FrozenMetric) -> None:
        cmp = compare(samples, frozen.samples, result.direction, frozen.tolerance,
                      zero_ok=_zero_ok(result.unit, result.direction))
        result.current, result.samples = statistics.median(samples), samples
        result.ratio, result.ci_low, result.ci_high, result.p_value = cmp.ratio, cmp.ci_low, cmp.ci_high, cmp.p_value
        result.verdict = cmp.verdict
        result.message = (f"{result.metric}: {result.current:.4g} {result.unit} vs frozen {frozen.value:.4g} "
                          f"{result.unit}{_change(result.current, frozen.value, result.direction)}: "
                          f"x{cmp.ratio:.3f} as fast (95% CI {cmp.ci_low:.3f}-{cmp.ci_high:.3f}, "
                          f"tolerance {frozen.tolerance:.0%}, {result.direction} is better, "
                          f"{result.scope} baseline{_frozen_when(frozen)}) -> {cmp.verdict}")

    def check_ratio(self, metric: str, measure: Callable[[], tuple[list[float], list[float]]], *,
                    direction: str, tolerance: "float | Reported", config: dict | None = None) -> GateResult:
        """Gate the per-round ratio of two series measured side by side (interleaved);
        `measure()` returns (numerator, denominator) and is called again to confirm a regression.
        Such a ratio is portable: the machine's speed cancels in it."""

        def ratios() -> list[float]:
            numerator, denominator = measure()
            if len(numerator) != len(denominator):
                raise ValueError(f"metric {metric!r}: paired series differ in length "
                                 f"({len(numerator)} vs {len(denominator)})")
            return [a / b for a, b in zip(numerator, denominator)]

        return self.check(metric, ratios(), unit="x", direction=direction, tolerance=tolerance,
                          config=config, remeasure=ratios, portable=True)


def _change(current: float, frozen: float, direction: str) -> str:
    """" (43.7% higher: worse)": the figure's own change, beside the speed ratio whose x0.696 would
    otherwise read as "30% less" of a figure that grew by 44%."""
    if not frozen or not math.isfinite(current / frozen) or current == frozen:
        return ""
    change = current / frozen - 1
    worse = (change > 0) == (direction == "lower")
    return f" ({abs(change):.1%} {'higher' if change > 0 else 'lower'}: {'worse' if worse else 'better'})"


def _frozen_when(frozen: FrozenMetric) -> str:
    when = ", ".join(x for x in (frozen.frozen_at, f"at {frozen.commit}" if frozen.commit else "") if x)
    return f", frozen {when}" if when else ""
