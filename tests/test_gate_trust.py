"""scripts/gate_trust.py end to end on a small timed suite: a freeze, A/A runs, a planted phase,
and the table that counts false failures and detections."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

from tests.pytester_runs import PLANTED_SUITE

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "gate_trust.py"


def _script():
    spec = importlib.util.spec_from_file_location("gate_trust", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_gate_trust_counts_false_failures_and_detections(tmp_path, monkeypatch):
    """The script end to end on real timings. What it counts is under test, not the host: under
    `pytest -n` on 2 cores the other worker can hide the doubled head call in a ratio of two
    interleaved timings (seen once in four runs beside two busy loops), so a run whose counts the
    host spoiled is run again, at most three times. The plant quadruples the head call: a doubled
    one was caught once in two evaluations in all three attempts on a 2-core host running three
    pytest processes."""
    monkeypatch.delenv("PYTEST_XDIST_WORKER", raising=False)
    suite = tmp_path / "test_planted.py"
    suite.write_text(PLANTED_SUITE)
    for attempt in range(3):
        out = tmp_path / f"trust{attempt}"
        rc = _script().main(["--out", str(out), "--paths", str(suite), "--aa-runs", "1", "--repeats", "2",
                             "--plant", "head:bf16=3.0", "--plant-runs", "1", "--", "--moe-samples", "15",
                             # a contended CI host would refuse the freeze
                             "--moe-host-stall", "off"])
        assert rc == 0, (out / "freeze.log").read_text()[-2000:]
        doc = json.loads((out / "trust.json").read_text())
        (row,) = doc["metrics"].values()
        aa, planted = row["phases"]["aa"], row["phases"]["head:bf16=3.0"]
        if (aa["n"], aa["regression"], planted["n"], planted["regression"]) == (2, 0, 2, 2):
            break
    assert (aa["n"], aa["regression"]) == (2, 0)
    assert (planted["n"], planted["regression"]) == (2, 2)
    assert planted["effective_slowdown"] > 0.6  # 1 - 1/4 for the head call quadrupled (the frozen ratio over the planted)
    text = (out / "trust.md").read_text()
    assert "A/A: 0 false failure(s) in 2 judged evaluation(s)" in text and "head:bf16=3.0: 2, 2 (100%)" in text


def test_gate_trust_refuses_a_used_output_folder(tmp_path, capsys):
    (tmp_path / "baselines").mkdir()
    (tmp_path / "baselines" / "x.json").write_text("{}")
    with pytest.raises(SystemExit):
        _script().main(["--out", str(tmp_path)])
    assert "is not empty: give a fresh --out" in capsys.readouterr().err


def test_gate_trust_counts_host_contended_evaluations_apart_from_false_failures(tmp_path):
    """An A/A evaluation the gate did not judge (the host was contended) counts neither as a pass
    nor as a false failure; a planted one is named beside the detections. Reports written as a
    `--moe-trust` run writes them, one per process."""
    gt = _script()

    def run(name, evaluations):
        (tmp_path / name).write_text(json.dumps({"metrics": [dict(
            metric_id="m", tolerance=0.05, portable=False, unit="us", verdict="pass", ratio=1.0,
            evaluations=[{"verdict": v, "ratio": r} for v, r in evaluations])]}))
        return {"rc": 0, "seconds": 1.0, "report": name}
    aa = gt.Phase("aa", "aa", ["suites"], runs=[run("aa0.json", [("pass", 1.0), ("regression", 0.9)]),
                                                run("aa1.json", [("host-contended", 0.7), ("pass", 1.01)])])
    plant = gt.Phase("moe=0.5", "plant", ["suites"],
                     runs=[run("p0.json", [("regression", 0.6), ("host-contended", 0.5)])])
    (tmp_path / "freeze.json").write_text(json.dumps({"metrics": [dict(
        metric_id="n", tolerance=0.05, portable=False, unit="us", verdict="host-contended", ratio=None,
        evaluations=[])]}))
    freeze = gt.Phase("freeze", "freeze", ["suites"], runs=[{"rc": 1, "seconds": 1.0, "report": "freeze.json"}])
    phases = [(tmp_path, freeze), (tmp_path, aa), (tmp_path, plant)]
    table = gt.summarize(phases)
    assert table["m"]["phases"]["aa"]["contended"] == 1 and table["m"]["phases"]["aa"]["regression"] == 1
    assert sorted(table["m"]["phases"]["aa"]["ratios"]) == [0.9, 1.0, 1.01]  # the contended 0.7 left out
    text = gt.render(table, phases, ["# t"])
    assert "freeze: 1 figure(s) NOT FROZEN (the host's CPUs were contended), so no later phase gates them: n" in text
    assert "| m | 5% | 4 | 1 | 0 | 1 | 0.900-1.010 |" in text
    assert "A/A: 1 false failure(s) in 3 judged evaluation(s) (33.3%); 1 more not judged (host-contended" in text
    assert "moe=0.5: 2, 1 (50%)" in text and "1 host-contended" in text
