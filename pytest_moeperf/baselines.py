"""Frozen baselines: one JSON file per device, entries per full fingerprint inside it.

    baselines/<device slug>.json
    {"schema": "pytest-moeperf/baseline/1",
     "entries": [{"fingerprint": {...}, "metrics": {"<metric id>": {<FrozenMetric fields>}}}]}

A figure is frozen under the configuration it was measured in (FrozenMetric.config: model,
backend, workload, ...) and gated only against a run of that configuration. One fingerprint may
have several entries: a metric frozen under a second configuration goes into another entry
beside the first, so a freeze of another configuration never replaces the figures of the first.

Files are validated when loaded (errors name the file and the problem). A metric is gated against
the entry whose fingerprint is this device's (or a schema-1 entry `device.schema1_match`
accepts); a figure measured side by side in one run (`portable`) may also come from another
machine of the same class (`device.class_of`), the newest such. Freezing rewrites a file
atomically while keeping every other entry and every metric that was not re-measured.
"""

from __future__ import annotations

import difflib
import fcntl
import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path

from pytest_moeperf.files import atomic_write_text
from pytest_moeperf.device import class_of, schema1_match, short_key
from pytest_moeperf.stats import DIRECTIONS

SCHEMA = "pytest-moeperf/baseline/1"


class BaselineError(Exception):
    """A baseline file that cannot be used; the message names the file and the problem."""


@dataclass(frozen=True)
class FrozenMetric:
    value: float  # median of the samples
    samples: list[float]
    unit: str
    direction: str  # "higher" or "lower" is better
    tolerance: float  # practical threshold, a fraction of the value
    config: dict = field(default_factory=dict)
    frozen_at: str = ""
    commit: str = ""  # the checkout the figure was measured on (report.checkout_commit), when known

    @classmethod
    def from_json(cls, raw, where: str) -> "FrozenMetric":
        if not isinstance(raw, dict):
            raise BaselineError(f"{where}: expected an object, got {type(raw).__name__}")
        missing = {"value", "samples", "unit", "direction", "tolerance"} - set(raw)
        if missing:
            raise BaselineError(f"{where}: missing field(s) {sorted(missing)}")
        unknown = set(raw) - {f for f in cls.__dataclass_fields__}
        if unknown:
            raise BaselineError(f"{where}: unknown field(s) {sorted(unknown)}")
        samples = raw["samples"]
        if not isinstance(samples, list) or not samples or not all(_finite(s) for s in samples):
            raise BaselineError(f"{where}: 'samples' must be a non-empty list of finite numbers")
        if not _finite(raw["value"]):
            raise BaselineError(f"{where}: 'value' must be a finite number, got {raw['value']!r}")
        if raw["direction"] not in DIRECTIONS:
            raise BaselineError(f"{where}: 'direction' must be one of {DIRECTIONS}, got {raw['direction']!r}")
        if not _finite(raw["tolerance"]) or not 0 < raw["tolerance"] < 1:
            raise BaselineError(f"{where}: 'tolerance' must be a fraction in (0, 1), got {raw['tolerance']!r}")
        if not isinstance(raw.get("config", {}), dict):
            raise BaselineError(f"{where}: 'config' must be an object")
        return cls(**raw)


def _finite(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


@dataclass
class BaselineFile:
    path: Path
    entries: list[dict]  # each {"fingerprint": dict, "metrics": {id: FrozenMetric}}


@dataclass(frozen=True)
class Match:
    """The frozen figure a metric is gated against, and which key found it."""

    metric: FrozenMetric
    scope: str  # "exact": this device's fingerprint; "class": another machine of its class (ratios)
    fingerprint: dict  # the fingerprint of the entry it came from
    path: Path


@dataclass(frozen=True)
class Lookup:
    match: Match | None
    reason: str = ""  # why there is no match, for the no-baseline message


def load_file(path: Path) -> BaselineFile:
    try:
        raw = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise BaselineError(f"{path}: not valid JSON ({e})") from None
    except OSError as e:
        raise BaselineError(f"{path}: cannot be read ({e})") from None
    if not isinstance(raw, dict) or raw.get("schema") != SCHEMA:
        found = raw.get("schema") if isinstance(raw, dict) else type(raw).__name__
        raise BaselineError(f"{path}: expected schema {SCHEMA!r}, found {found!r}")
    if not isinstance(raw.get("entries"), list):
        raise BaselineError(f"{path}: 'entries' must be a list")
    entries = []
    for i, e in enumerate(raw["entries"]):
        if not (isinstance(e, dict) and isinstance(e.get("fingerprint"), dict)
                and isinstance(e.get("metrics"), dict)):
            raise BaselineError(f"{path}: entries[{i}] needs a 'fingerprint' object and a 'metrics' object")
        metrics = {mid: FrozenMetric.from_json(m, f"{path}: entries[{i}].metrics[{mid!r}]")
                   for mid, m in e["metrics"].items()}
        entries.append({"fingerprint": e["fingerprint"], "metrics": metrics})
    return BaselineFile(path, entries)


class BaselineStore:
    """The folder of baseline files, as seen from one device: its own file (`<slug>.json`) holds
    its exact entries; every file may hold entries of its class (`device.class_of`)."""

    def __init__(self, folder: Path, fingerprint: dict, slug: str) -> None:
        self.folder = Path(folder)
        self.fingerprint = fingerprint
        self.path = self.folder / f"{slug}.json"
        self._files = self._load_all()

    def _load_all(self) -> dict[Path, BaselineFile]:
        files = {p: load_file(p) for p in self.validate_folder(self.folder)}
        files.setdefault(self.path, BaselineFile(self.path, []))
        return files

    @staticmethod
    def validate_folder(folder: Path) -> list[Path]:
        """Load every file in `folder` so that a malformed one is reported before any test runs
        (a folder not there yet holds nothing; a file in its place is an error)."""
        if Path(folder).exists() and not Path(folder).is_dir():
            raise BaselineError(f"{folder}: not a folder (--moe-baselines names the folder of baseline files)")
        paths = sorted(Path(folder).glob("*.json")) if Path(folder).is_dir() else []
        for p in paths:
            load_file(p)
        return paths

    def _exact_entries(self) -> list[dict]:
        """This device's entries, most specific first: its own fingerprint, then a schema-1 entry
        that `schema1_match` accepts (figures frozen before schema 2, not yet refrozen)."""
        entries = self._files[self.path].entries
        return ([e for e in entries if e["fingerprint"] == self.fingerprint]
                + [e for e in entries if schema1_match(e["fingerprint"], self.fingerprint)])

    @property
    def metrics(self) -> dict[str, FrozenMetric]:
        """A figure per metric frozen for this exact device (a schema-2 entry's over a schema-1
        one's; of a metric frozen under several configurations, the first entry's)."""
        merged: dict[str, FrozenMetric] = {}
        for entry in reversed(self._exact_entries()):
            merged.update(entry["metrics"])
        return merged

    def figures(self) -> list[tuple[str, FrozenMetric]]:
        """Every figure frozen for this exact device, under every configuration."""
        return [(mid, m) for entry in self._exact_entries() for mid, m in entry["metrics"].items()]

    def lookup(self, metric_id: str, config: dict, portable: bool) -> Lookup:
        """The frozen figure for `metric_id` under `config`: from this device's exact entries, or,
        when `portable` (measured side by side in one run), from the newest entry of another
        machine of the same class. Without one, the reason names what was found instead."""
        mismatch = None
        for entry in self._exact_entries():
            frozen = entry["metrics"].get(metric_id)
            if frozen is not None and frozen.config == config:
                return Lookup(Match(frozen, "exact", entry["fingerprint"], self.path))
            mismatch = mismatch or frozen
        mine = class_of(self.fingerprint)
        same_class, elsewhere, schema1 = [], 0, 0
        exact = [e["fingerprint"] for e in self._exact_entries()]
        for path, f in self._files.items():
            for entry in f.entries:
                frozen = entry["metrics"].get(metric_id)
                if frozen is None or entry["fingerprint"] in exact:
                    continue
                if mine is not None and class_of(entry["fingerprint"]) == mine:
                    if frozen.config == config:
                        same_class.append((frozen.frozen_at, Match(frozen, "class", entry["fingerprint"], path)))
                elif "schema" not in entry["fingerprint"] and entry["fingerprint"].get("kind") == "cpu":
                    schema1 += 1
                else:
                    elsewhere += 1
        if portable and same_class:
            return Lookup(max(same_class, key=lambda t: t[0])[1])
        if mismatch is not None:
            return Lookup(None, f"the figure frozen for this device was taken under another configuration "
                                f"({_diff(mismatch.config, config)})")
        if same_class:
            return Lookup(None, f"frozen only on {len(same_class)} other machine(s) of this device's class "
                                f"({_describe_class(mine)}); an absolute figure is gated only on the exact "
                                f"fingerprint it was frozen on")
        if schema1:
            return Lookup(None, "frozen only under a schema-1 CPU fingerprint (model name and core count), which "
                                "cannot tell machines apart, so it is never used")
        where = f" ({elsewhere} figure(s) frozen on other devices)" if elsewhere else ""
        return Lookup(None, f"no frozen figure for this device (fingerprint {short_key(self.fingerprint)}) in "
                            f"{self.path}{where}")

    def freeze(self, metrics: dict[str, FrozenMetric]) -> Path:
        """Record `metrics` for this fingerprint. The read-modify-write runs under an exclusive
        lock and re-reads the file, so concurrent freezes (two pytest processes, e.g. CI jobs sharing a
        checkout) all survive."""
        self.folder.mkdir(parents=True, exist_ok=True)
        with open(self.path.with_name(f".{self.path.name}.lock"), "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            return self._freeze_locked(metrics)

    def _freeze_locked(self, metrics: dict[str, FrozenMetric]) -> Path:
        current = load_file(self.path) if self.path.exists() else BaselineFile(self.path, [])
        mine = [e for e in current.entries if e["fingerprint"] == self.fingerprint]
        for mid, m in metrics.items():  # what the loader would refuse is never written
            FrozenMetric.from_json(asdict(m), f"{mid} (not frozen)")
        for mid, m in metrics.items():
            # The figure frozen before under the same configuration is replaced; one frozen under
            # another configuration is kept, this one going to an entry without that metric.
            entry = (next((e for e in mine if mid in e["metrics"] and e["metrics"][mid].config == m.config), None)
                     or next((e for e in mine if mid not in e["metrics"]), None))
            if entry is None:
                entry = {"fingerprint": self.fingerprint, "metrics": {}}
                current.entries.append(entry)
                mine.append(entry)
            entry["metrics"][mid] = m
        doc = {"schema": SCHEMA, "entries": [
            {"fingerprint": e["fingerprint"],
             "metrics": {mid: asdict(m) for mid, m in sorted(e["metrics"].items())}}
            for e in current.entries]}
        atomic_write_text(self.path, json.dumps(doc, indent=1, sort_keys=False) + "\n")
        self._files[self.path] = current
        return self.path


def _describe_class(cls: dict | None) -> str:
    return ", ".join(f"{k} {v}" for k, v in (cls or {}).items() if k != "kind")


def _diff(frozen: dict, current: dict) -> str:
    keys = sorted(set(frozen) | set(current))
    return "; ".join(f"{k}: {_change(frozen.get(k), current.get(k))}" for k in keys
                     if frozen.get(k) != current.get(k))


def _as_json(value) -> tuple[str, object] | None:
    """`PREFIX:{json}` (a server row's configuration) as (prefix, parsed), else None."""
    if not isinstance(value, str) or ":" not in value:
        return None
    prefix, _, body = value.partition(":")
    try:
        return prefix, json.loads(body)
    except ValueError:
        return None


def _leaves(value, path: str = ""):
    """(dotted path, value) of every leaf; a list of strings (a command line) is one leaf."""
    if isinstance(value, dict):
        for k, v in value.items():
            yield from _leaves(v, f"{path}.{k}" if path else str(k))
    elif isinstance(value, list) and not all(isinstance(x, str) for x in value):
        for i, v in enumerate(value):
            yield from _leaves(v, f"{path}[{i}]")
    else:
        yield path, value


def _words_change(a: list[str], b: list[str]) -> str:
    """What changed between two command lines, each change after the word before it."""
    parts = []
    for op, i1, i2, j1, j2 in difflib.SequenceMatcher(a=a, b=b, autojunk=False).get_opcodes():
        if op != "equal":
            after = f"after {a[i1 - 1]!r}: " if i1 else ""
            parts.append(f"{after}{' '.join(a[i1:i2]) or '(nothing)'!r} -> {' '.join(b[j1:j2]) or '(nothing)'!r}")
    return ", ".join(parts)


def _change(frozen, current) -> str:
    """A changed configuration value, said briefly: for two JSON configurations, only the leaves
    that differ (a changed server flag reads `server.command after '--max-model-len': '384' -> '320'`)."""
    a, b = _as_json(frozen), _as_json(current)
    if a is None or b is None or a[0] != b[0]:
        return f"{frozen!r} -> {current!r}"
    old, new = dict(_leaves(a[1])), dict(_leaves(b[1]))
    changes = []
    for path in sorted(set(old) | set(new)):
        x, y = old.get(path), new.get(path)
        if x == y:
            continue
        if isinstance(x, list) and isinstance(y, list):
            changes.append(f"{path} {_words_change(x, y)}")
        else:
            changes.append(f"{path}: {x!r} -> {y!r}")
    return ", ".join(changes)
