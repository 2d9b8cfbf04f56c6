"""scripts/gate_trust.py end to end on a small timed suite: a freeze, A/A runs, a planted phase,
and the table that counts false failures and detections."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

from pytester_runs import PLANTED_SUITE

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "gate_trust.py"


def _script():
    spec = importlib.util.spec_from_file_location("gate_trust", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_gate_trust_counts_false_failures_and_detections(tmp_path, monkeypatch):
    monkeypatch.delenv("PYTEST_XDIST_WORKER", raising=False)
    suite = tmp_path / "test_planted.py"
    suite.write_text(PLANTED_SUITE)
    out = tmp_path / "trust"
    rc = _script().main(["--out", str(out), "--paths", str(suite), "--aa-runs", "1", "--repeats", "2",
                         "--plant", "head:bf16=1.0", "--plant-runs", "1", "--", "--moe-samples", "15",
                         # what the script counts, not the host: a contended CI host would refuse the freeze
                         "--moe-host-stall", "off"])
    assert rc == 0, (out / "freeze.log").read_text()[-2000:]
    doc = json.loads((out / "trust.json").read_text())
    (row,) = doc["metrics"].values()
    aa, planted = row["phases"]["aa"], row["phases"]["head:bf16=1.0"]
    assert (aa["n"], aa["regression"]) == (2, 0)
    assert (planted["n"], planted["regression"]) == (2, 2)
    assert planted["effective_slowdown"] > 0.3  # the head call doubled; the ratio also counts F.linear
    text = (out / "trust.md").read_text()
    assert "A/A: 0 false failure(s) in 2 evaluation(s)" in text and "head:bf16=1.0: 2, 2 (100%)" in text


def test_gate_trust_refuses_a_used_output_folder(tmp_path, capsys):
    (tmp_path / "baselines").mkdir()
    (tmp_path / "baselines" / "x.json").write_text("{}")
    with pytest.raises(SystemExit):
        _script().main(["--out", str(tmp_path)])
    assert "is not empty: give a fresh --out" in capsys.readouterr().err
