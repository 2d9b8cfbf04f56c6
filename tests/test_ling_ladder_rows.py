"""suites/test_ling_ladder.py's per-row byte floor (`test_row_floor`) on the CPU: the suite itself
needs the full-depth model on a CUDA device, so its test function is called here with a ladder's
records written out by hand for ling-3.0-tiny, a gate that keeps what it is given, and the
bandwidth set. What it gates must be each request's TPOT over impl.model.roofline.tpot_floor_s of
that request, in the row's formats and, for the speculative row, over the decoded tokens a verify
step; the table beside the A/B report must say the same."""

from __future__ import annotations

import importlib.util
import json
import statistics
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from impl.model.config import get_config
from impl.model.roofline import Formats, tpot_floor_s
from impl.serve.result import Acceptance, LadderResult, RowEntry, ServedRequest

SUITE = Path(__file__).resolve().parents[1] / "suites" / "test_ling_ladder.py"
ROWS = "kernels=moe=triton,head=bf16;+fp8-head=moe=triton,head=fp8;+mtp=moe=triton,head=fp8,spec=mtp:3,accept=3.9"
BANDWIDTH = 2e12


@pytest.fixture()
def suite():
    # Another module name: a session with the suites collected may hold suites/test_ling_ladder.py.
    spec = importlib.util.spec_from_file_location("ling_ladder_rows_under_test", SUITE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module._bandwidth[:] = [BANDWIDTH]
    return module


class Gate:
    def __init__(self):
        self.checks = []

    def check(self, metric, samples, **kw):
        self.checks.append((metric, list(samples), kw))


def _acceptance(steps: int, committed: int, k: int = 3) -> Acceptance:
    """`committed` tokens over `steps` verify steps of k drafts, the accepted drafts front-loaded."""
    accepted = committed - steps
    per_position = tuple(min(steps, max(0, accepted - j * steps)) for j in range(k))
    return Acceptance(steps, accepted, per_position, source="by hand")


def ladder():
    """Three requests a row of 40 prompt tokens: plain rows 8 output tokens, the speculative row 9
    (its 8 decoded tokens in 5, 4 or 3 verify steps)."""
    rows = tuple(RowEntry(n, n, speculative=n == "+mtp", provenance={"expert_format": "mxfp4"})
                 for n in ("kernels", "+fp8-head", "+mtp"))
    tpot = {"kernels": 3e-3, "+fp8-head": 2.9e-3, "+mtp": 2.2e-3}
    served = []
    for n in tpot:
        for i in range(3):
            out = 9 if n == "+mtp" else 8
            served.append(ServedRequest(n, f"r/{i}", 40, out, 0.01, 0.01 + tpot[n] * (1 + 0.01 * i) * (out - 1),
                                        acceptance=_acceptance(5 - i, out - 1) if n == "+mtp" else None))
    result = LadderResult(rows, tuple(served), workload={"name": "w", "n_requests": 3})
    return SimpleNamespace(result=result, by_row=result.by_row())


@pytest.mark.parametrize("row,head,drafts", [("kernels", "bf16", 0), ("+fp8-head", "fp8", 0), ("+mtp", "fp8", 3)])
def test_each_request_is_gated_against_its_own_byte_floor(suite, tmp_path, row, head, drafts):
    # The suite runs on CUDA, where its rows named after presets run them (moe=triton): parsed for it.
    harness = SimpleNamespace(options=SimpleNamespace(ladder=ROWS, ab_report=str(tmp_path)),
                              core=SimpleNamespace(device=SimpleNamespace(torch_device=torch.device("cuda"))))
    config = get_config("ling-3.0-tiny")
    model = SimpleNamespace(config=config, embed_tokens=SimpleNamespace(weight=torch.empty(1)))
    run, gate = ladder(), Gate()
    suite.test_row_floor(harness, run, model, row, "1k", gate, SimpleNamespace(torch_device=torch.device("cpu")))
    formats = Formats(experts="mxfp4", projections="bf16", head=head)
    want = []
    for rec in run.by_row[row].values():
        committed = (rec.output_tokens - 1) / rec.acceptance.verify_steps if drafts else 1.0
        floor = tpot_floor_s(config, 40, rec.output_tokens, formats, BANDWIDTH, drafts=drafts,
                             committed_per_step=committed)
        want.append(rec.tpot_s / floor)
    [(metric, samples, kw)] = gate.checks
    assert metric == "row_tpot_over_floor" and kw["direction"] == "lower"
    assert samples == pytest.approx(want, rel=1e-12)
    table = json.loads((tmp_path / "rows-1k.json").read_text())
    assert table["rows"][row]["over_floor"] == pytest.approx(statistics.median(want))
    assert f"| {row}" in (tmp_path / "rows-1k.md").read_text()
    if drafts:
        # Negative control: the speculative row's floor taken as one token a step is far off.
        plain = [rec.tpot_s / tpot_floor_s(config, 40, rec.output_tokens, formats, BANDWIDTH, drafts=3)
                 for rec in run.by_row[row].values()]
        assert min(a / b for a, b in zip(samples, plain)) > 1.5
