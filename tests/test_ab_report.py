"""The A/B ladder report: its numbers (summarize_ab) against the statistics recomputed from the
records, its flags, partial and unscored runs, and the files it writes."""

from __future__ import annotations

import copy
import warnings
import json
import math
import os
import re

import numpy as np
import pytest

from pytest_moeperf import files
from impl.serve.result import SCORE_KEYS, Acceptance, Failure, LadderResult, RowEntry, ServedRequest
from moe_harness.ladder import summary as ab_summary
from moe_harness.ladder.report import write_ab_report
from moe_harness.ladder.summary import ACCEPT_LENGTH_FLOOR, summarize_ab
from pytest_moeperf.stats import paired_accuracy, paired_ratio

K = 3  # drafts per verify step of the synthetic speculative row


def _row(name, speculative=False, **prov):
    return {"name": name, "config": f"spec={name}", "speculative": speculative, "provenance_error": None,
            "provenance": {"moe": "triton", "head": "bf16", "draft_shares_head": True if speculative else None,
                           "drafts_per_step": K if speculative else 0, **prov}}


def typed(r: dict) -> LadderResult:
    """A result the tests build as the report's JSON writes it (easy to edit) as the typed result
    the summary and the report take; every value is checked on the way."""
    rows = tuple(RowEntry(a["name"], a["config"], speculative=a["speculative"], greedy=a.get("greedy", True),
                          head=a.get("head"), assumed=a.get("assumed", False), runs_as=a.get("runs_as"),
                          provenance=a["provenance"], provenance_error=a["provenance_error"]) for a in r["rows"])
    served = tuple(ServedRequest(
        x["row"], x.get("request_id"), x["prompt_tokens"], x["output_tokens"], x["ttft_s"], x["latency_s"],
        text=x.get("text", ""), output_ids=None if x.get("output_ids") is None else tuple(x["output_ids"]),
        stop_reason=x.get("stop_reason"),
        acceptance=None if x.get("accept_lengths") is None else Acceptance.from_lengths(x["accept_lengths"], K),
        marks={k: x.get(k) for k in SCORE_KEYS}) for x in r["requests"])
    failure = r.get("failure")
    return LadderResult(rows, served, workload=r.get("workload", {}), device=r.get("device"), model=r.get("model"),
                        complete=r.get("complete", False), run=r.get("run"), prompts=tuple(r.get("prompts", ())),
                        dropped=r.get("dropped", {}), host=r.get("host"),
                        failure=None if failure is None else Failure(**failure))


def summarize(r: dict, **kw) -> dict:
    return summarize_ab(typed(r), **kw)


def write(r: dict, out):
    result = typed(r)
    return write_ab_report(result, summarize_ab(result), out)


def synthetic(n=120, seed=0, scored=True, speedups=None, accept_p=(0.85, 0.7, 0.55), flip=0.03):
    """A ladder result as the report's JSON writes it: rows interleaved request by request.

    Each row's TPOT is the baseline's divided by its speedup, with 4% per-request noise; answers of
    later rows flip with probability `flip`; the speculative row accepts draft position j with
    probability accept_p[j] given the previous one was accepted.
    """
    rng = np.random.default_rng(seed)
    speedups = speedups or {"baseline": 1.0, "+kernels": 1.09, "+fp8-head": 1.2, "+mtp": 2.5}
    entries = [_row(name, speculative=name == "+mtp") for name in speedups]
    truth = rng.random(n) < 0.85
    reqs = []
    for i in range(n):
        prompt = int(rng.integers(40, 200))
        out = 1 if i % 25 == 0 else int(rng.integers(2, 60))  # every 25th has one token: no TPOT
        ttft0 = 0.0008 * prompt
        for entry in entries:
            name = entry["name"]
            tpot = 0.006 / speedups[name] * rng.lognormal(0, 0.04)
            ttft = ttft0 * rng.lognormal(0, 0.03)
            rec = {"row": name, "request_id": i, "prompt_tokens": prompt, "output_tokens": out,
                   "ttft_s": ttft, "latency_s": ttft + tpot * (out - 1),
                   "tpot_s": tpot if out > 1 else None, "decode_tokens_per_s": 1 / tpot if out > 1 else None,
                   "accept_lengths": None, "accepted_per_position": None, "verify_steps": None,
                   "correct": None, "strict_correct": None, "flexible_correct": None, "text": "7"}
            if entry["speculative"]:
                steps = max(1, out // 3)
                accepted = rng.random((steps, K)) < np.array(accept_p)
                lengths = [1 + int(np.argmin(np.append(row, False))) for row in accepted]
                rec.update(accept_lengths=lengths, verify_steps=steps,
                           accepted_per_position=[sum(L - 1 > j for L in lengths) for j in range(K)])
            if scored:
                c = bool(truth[i]) ^ bool(name != "baseline" and rng.random() < flip)
                rec.update(correct=c, strict_correct=c, flexible_correct=c)
            reqs.append(rec)
    return {"workload": {"name": "arith", "n_requests": n, "shots": 0, "details": {}},
            "device": "cpu", "rows": entries, "requests": reqs, "complete": True}


@pytest.fixture(scope="module")
def full():
    return synthetic()


@pytest.fixture(scope="module")
def full_summary(full):
    return summarize(full)


def _records(result, name):
    return {r["request_id"]: r for r in result["requests"] if r["row"] == name}


def _row_summary(summary, name):
    return next(s for s in summary["rows"] if s["name"] == name)


def _cmp(summary, name):
    return next(c for c in summary["comparisons"] if c["row"] == name)


# --- the numbers --------------------------------------------------------------------------------

def test_per_row_figures_are_those_of_the_records(full, full_summary):
    for name in ("baseline", "+mtp"):
        recs = list(_records(full, name).values())
        s = _row_summary(full_summary, name)
        assert s["n_requests"] == len(recs)
        tpot = [r["tpot_s"] for r in recs if r["tpot_s"] is not None]
        m = s["metrics"]["tpot_s"]
        # One-token outputs have no TPOT and are left out, not counted as zero.
        assert m["n"] == len(tpot) == len(recs) - sum(r["output_tokens"] == 1 for r in recs)
        assert m["mean"] == pytest.approx(np.mean(tpot))
        assert m["p50"] == pytest.approx(np.percentile(tpot, 50)) and m["p99"] == pytest.approx(np.percentile(tpot, 99))
        assert m["ci"][0] < m["mean"] < m["ci"][1]
        lat = [r["latency_s"] for r in recs]
        assert s["metrics"]["latency_s"]["mean"] == pytest.approx(np.mean(lat))
        acc = s["accuracy"]
        assert acc["correct"] == sum(r["correct"] for r in recs) and acc["n"] == len(recs)


def test_comparisons_are_the_paired_statistics_of_the_matched_requests(full, full_summary):
    ref = _records(full, "baseline")
    for name in ("+kernels", "+mtp"):
        mine = _records(full, name)
        c = _cmp(full_summary, name)
        ids = sorted(set(ref) & set(mine))
        assert c["n_paired"] == len(ids) and c["reference"] == "baseline"
        both = [i for i in ids if ref[i]["tpot_s"] is not None]
        expected = paired_ratio([ref[i]["tpot_s"] for i in both], [mine[i]["tpot_s"] for i in both])
        got = c["ratios"]["tpot_s"]
        assert got["n"] == len(both)
        assert (got["ratio"], *got["ci"]) == pytest.approx(expected)
        pa = paired_accuracy([ref[i]["correct"] for i in ids], [mine[i]["correct"] for i in ids])
        assert c["accuracy"]["p_value"] == pytest.approx(pa.p_value)
        assert c["accuracy"]["a_only"] == pa.a_only and c["accuracy"]["b_only"] == pa.b_only
        assert tuple(c["accuracy"]["ci_difference"]) == pytest.approx(pa.ci_difference)


def test_the_ladder_reads_faster_where_it_is_faster(full_summary):
    # Synthetic speedups of 9%, 20% and 2.5x with 4% noise per request on each row: the log ratio
    # has sd 0.057 over ~115 pairs, a standard error of 0.5%, so each is resolved and within 3%.
    for name, speedup in (("+kernels", 1.09), ("+fp8-head", 1.2), ("+mtp", 2.5)):
        c = _cmp(full_summary, name)
        r = c["ratios"]["decode_tokens_per_s"]
        assert c["speed"] == "faster" and r["ratio"] == pytest.approx(speedup, rel=0.03)
        assert 1 < r["ci"][0] < r["ratio"] < r["ci"][1]
    assert not full_summary["flagged"]


def test_each_rung_is_paired_with_the_one_before_it(full, full_summary):
    """steps: +fp8-head / +kernels and +mtp / +fp8-head, the paired statistics of those two rows
    (synthetic rungs of 1.2 / 1.09 = 1.101 and 2.5 / 1.2 = 2.083, each resolved)."""
    steps = {c["row"]: c for c in full_summary["steps"]}
    assert [(c["reference"], c["row"]) for c in full_summary["steps"]] == [("+kernels", "+fp8-head"),
                                                                            ("+fp8-head", "+mtp")]
    for name, prev, rung in (("+fp8-head", "+kernels", 1.2 / 1.09), ("+mtp", "+fp8-head", 2.5 / 1.2)):
        a, b = _records(full, prev), _records(full, name)
        ids = [i for i in sorted(set(a) & set(b)) if a[i]["tpot_s"] is not None]
        expected = paired_ratio([a[i]["decode_tokens_per_s"] for i in ids], [b[i]["decode_tokens_per_s"] for i in ids])
        got = steps[name]["ratios"]["decode_tokens_per_s"]
        assert (got["ratio"], *got["ci"]) == pytest.approx(expected)
        assert 1 < got["ci"][0] and got["ratio"] == pytest.approx(rung, rel=0.03)


def test_a_speculative_row_reports_its_time_per_verify_step(full, full_summary):
    """verify_step_s: per request, decode time over verify steps; only speculative rows have it."""
    recs = [r for r in full["requests"] if r["row"] == "+mtp" and r["verify_steps"]]
    want = np.mean([(r["latency_s"] - r["ttft_s"]) / r["verify_steps"] for r in recs])
    assert _row_summary(full_summary, "+mtp")["verify_step_s"]["mean"] == pytest.approx(want)
    assert _row_summary(full_summary, "+kernels")["verify_step_s"] is None
    assert ab_summary.verify_step_s(ServedRequest("r", 0, 1, 2, 0.1, 1.0, acceptance=Acceptance(0, 0, (0, 0, 0)))) is None


def test_aa_comparison_shows_no_difference():
    r = synthetic(n=60, speedups={"baseline": 1.0, "copy": 1.0})
    copy_recs = [dict(x, row="copy") for x in r["requests"] if x["row"] == "baseline"]
    r["requests"] = [x for x in r["requests"] if x["row"] == "baseline"] + copy_recs
    c = summarize(r)["comparisons"][0]
    for key in ab_summary.METRICS:
        assert c["ratios"][key]["ratio"] == pytest.approx(1.0)
        assert c["ratios"][key]["ci"][0] <= 1.0 <= c["ratios"][key]["ci"][1]
    assert c["speed"] == "no detectable difference"
    assert c["accuracy"]["a_only"] == c["accuracy"]["b_only"] == 0 and c["accuracy"]["p_value"] == 1.0


def test_a_slower_row_is_flagged():
    r = synthetic(n=80, speedups={"baseline": 1.0, "+kernels": 0.9})
    s = summarize(r)
    assert _cmp(s, "+kernels")["speed"] == "slower"
    assert any(f.startswith("slower than baseline") for f in s["flagged"]["+kernels"])


def test_accept_length_summary_by_hand():
    r = synthetic(n=4, speedups={"baseline": 1.0, "+mtp": 2.0})
    recs = [x for x in r["requests"] if x["row"] == "+mtp"]
    hand = [([4, 1, 2], [2, 1, 1]), ([3, 3], [2, 2, 0]), ([1], [0, 0, 0]), ([4, 4], [2, 2, 2])]
    for rec, (lengths, per) in zip(recs, hand):
        rec.update(accept_lengths=lengths, accepted_per_position=per, verify_steps=len(lengths))
    a = _row_summary(summarize(r), "+mtp")["accept_length"]
    # 8 verify steps committing 4+1+2+3+3+1+4+4 = 22 tokens; position 1 accepted in 6 of the 8
    # steps, position 2 in 5, position 3 in 3.
    assert a["mean"] == pytest.approx(22 / 8) and a["verify_steps"] == 8
    assert a["histogram"] == {"1": 2, "2": 1, "3": 2, "4": 3}
    assert a["acceptance_per_position"] == pytest.approx([6 / 8, 5 / 8, 3 / 8])


# --- flags --------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def broken():
    """+kernels: its provenance contradicts it; +mtp: the draft reads the FP8 head as bf16, so
    nothing is accepted and the row is slower than the baseline."""
    r = synthetic(n=80, speedups={"baseline": 1.0, "+kernels": 1.09, "+mtp": 0.7})
    r["rows"][1]["provenance_error"] = "asked for moe=triton, the reference backend ran"
    r["rows"][2]["provenance"]["draft_shares_head"] = False
    for rec in r["requests"]:
        if rec["row"] == "+mtp":
            rec["accept_lengths"] = [1] * len(rec["accept_lengths"])
            rec["accepted_per_position"] = [0] * K
    return r


def test_flags(broken):
    s = summarize(broken)
    assert set(s["flagged"]) == {"+kernels", "+mtp"}
    assert any("provenance error" in f for f in s["flagged"]["+kernels"])
    mtp = " | ".join(s["flagged"]["+mtp"])
    assert "accept length 1.00" in mtp and "head module" in mtp and "slower than baseline" in mtp
    assert _row_summary(s, "+mtp")["accept_length"]["mean"] == 1.0 < ACCEPT_LENGTH_FLOOR


def test_an_assumed_acceptance_row_is_labelled():
    r = synthetic(n=20, speedups={"baseline": 1.0, "+kernels": 1.5, "+mtp": 2.5})
    r["rows"][2]["config"] = "moe=triton,experts=bf16,head=bf16,spec=mtp:3,accept=3.9"
    flags = " | ".join(_row_summary(summarize(r), "+mtp")["flags"])
    assert "acceptance assumed (accept=3.9)" in flags and "not the model's" in flags


def test_a_healthy_speculative_row_is_not_flagged(full_summary):
    a = _row_summary(full_summary, "+mtp")
    assert a["accept_length"]["mean"] > ACCEPT_LENGTH_FLOOR and not a["flags"]


def test_answers_that_differ_are_flagged():
    r = synthetic(n=150, speedups={"baseline": 1.0, "+fp8-head": 1.2}, flip=0.25)
    s = summarize(r)
    assert _cmp(s, "+fp8-head")["accuracy"]["verdict"] == "different"
    assert any(f.startswith("answers differ") for f in s["flagged"]["+fp8-head"])


# --- partial and unscored runs ------------------------------------------------------------------

@pytest.fixture(scope="module")
def partial():
    """Stopped part-way: +fp8-head holds 50 of 120 requests, +mtp none, and the baseline lost
    request 3 (so pairs are the intersection, not the shorter row's ids)."""
    r = synthetic()
    r["complete"] = False
    r["requests"] = [x for x in r["requests"]
                     if not (x["row"] == "+fp8-head" and x["request_id"] >= 50) and x["row"] != "+mtp"
                     and not (x["row"] == "baseline" and x["request_id"] == 3)]
    return r


def test_partial_run_pairs_only_common_requests(partial):
    s = summarize(partial)
    assert not s["complete"]
    c = _cmp(s, "+fp8-head")
    assert c["n_paired"] == 49 and c["accuracy"]["n"] == 49
    ref, mine = _records(partial, "baseline"), _records(partial, "+fp8-head")
    ids = [i for i in sorted(set(ref) & set(mine)) if ref[i]["latency_s"] and mine[i]["latency_s"]]
    expected = paired_ratio([ref[i]["latency_s"] for i in ids], [mine[i]["latency_s"] for i in ids])
    assert (c["ratios"]["latency_s"]["ratio"], *c["ratios"]["latency_s"]["ci"]) == pytest.approx(expected)
    assert _row_summary(s, "+fp8-head")["partial"] and not _row_summary(s, "+kernels")["partial"]
    empty = _cmp(s, "+mtp")
    assert empty["n_paired"] == 0 and empty["speed"] == "no data" and empty["accuracy"] is None
    assert all(v is None for v in empty["ratios"].values())
    assert "no requests recorded" in s["flagged"]["+mtp"]


def test_unscored_workload_has_no_accuracy():
    s = summarize(synthetic(n=40, scored=False))
    assert all(a["accuracy"] is None for a in s["rows"])
    assert all(c["accuracy"] is None and "; no accuracy data" in c["verdict"] for c in s["comparisons"])


# --- input checks -------------------------------------------------------------------------------

def _mutated(change):
    r = synthetic(n=6, speedups={"baseline": 1.0, "B": 1.1})
    change(r)
    return r


@pytest.mark.parametrize("change, match", [
    (lambda r: r["requests"][0].update(row="nope"), "not among the rows"),
    (lambda r: r["requests"].append(dict(r["requests"][0])), "two requests with id"),
    (lambda r: r["requests"][1].update(latency_s=-0.1), "latency_s"),
    (lambda r: r["requests"][1].update(ttft_s=float("nan")), "ttft_s"),
    (lambda r: r["requests"][1].update(correct=1), "correct"),
    (lambda r: r["requests"][1].pop("request_id"), "no request id"),
    (lambda r: r.update(rows=[]), "at least one row"),
    (lambda r: r["rows"].append(dict(r["rows"][0])), "unique"),
    (lambda r: r["requests"][1].update(accept_lengths=[2, 0]), "integers >= 1"),
])
def test_bad_results_are_refused_clearly(change, match):
    with pytest.raises(ValueError, match=match):
        summarize(_mutated(change))


# --- the files ----------------------------------------------------------------------------------

def _strict_json(path):
    def no_constants(name):
        raise AssertionError(f"{path.name} holds {name}, which is not JSON")
    return json.loads(path.read_text(), parse_constant=no_constants)


def _png_size(path):
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", f"{path.name} is not a PNG"
    return int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")


def test_write_full_report(tmp_path, full):
    paths = write(full, tmp_path)
    assert set(paths) == {"json", "markdown", "ladder", "latency", "accept", "accuracy"}
    doc = _strict_json(paths["json"])
    assert [a["name"] for a in doc["summary"]["rows"]] == ["baseline", "+kernels", "+fp8-head", "+mtp"]
    assert doc["summary"]["comparisons"][2]["ratios"]["decode_tokens_per_s"]["ratio"] == pytest.approx(
        _cmp(summarize(full), "+mtp")["ratios"]["decode_tokens_per_s"]["ratio"])
    md = paths["markdown"].read_text()
    embedded = re.findall(r"!\[[^\]]*\]\(([^)]+)\)", md)
    assert sorted(embedded) == sorted(p.name for k, p in paths.items() if p.suffix == ".png")
    for name in embedded:
        w, h = _png_size(tmp_path / name)
        assert w >= 600 and h >= 400
    # The McNemar table carries the discordant counts of the comparison.
    a = _cmp(summarize(full), "+kernels")["accuracy"]
    assert f"| baseline right | {a['both_right']} | {a['a_only']} |" in md
    assert f"| baseline wrong | {a['b_only']} | {a['both_wrong']} |" in md
    assert "PARTIAL" not in md and "⚠" not in md
    v = _row_summary(summarize(full), "+mtp")["verify_step_s"]
    assert f"- `+mtp`: {1e3 * v['mean']:.3g} ms a verify step" in md
    step = summarize(full)["steps"][1]["ratios"]["tpot_s"]
    assert f"| +mtp / +fp8-head | TPOT (lower is better) | {step['n']} | x{step['ratio']:.4f} |" in md
    assert not [p for p in os.listdir(tmp_path) if p.endswith(".tmp")]


def test_a_report_written_over_an_earlier_one_leaves_none_of_its_figures(tmp_path, full, partial):
    """The folder is reused from run to run: figures this report has no data for (no scored
    answers, no accept lengths) go, instead of showing the earlier run's."""
    write(full, tmp_path)
    r = copy.deepcopy(partial)
    for rec in r["requests"]:
        rec.update(correct=None, strict_correct=None, flexible_correct=None)
    paths = write(r, tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(p.name for p in paths.values())
    assert not (tmp_path / "ab-accuracy.png").exists() and not (tmp_path / "ab-accept.png").exists()


def test_a_row_named_by_a_long_spec_keeps_the_figures_laid_out(tmp_path, full):
    """A row named by its whole spec: its chart labels are cut, so matplotlib still lays the
    figures out (it warned "constrained_layout not applied" and the labels overlapped)."""
    r = copy.deepcopy(full)
    long = "moe=reference,head=fp8:dequant,head_scales=row,spec=mtp:2,temperature=0.7,top_p=0.9,seed=1"
    old = r["rows"][1]["name"]
    r["rows"][1]["name"] = long
    for rec in r["requests"]:
        if rec["row"] == old:
            rec["row"] = long
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        paths = write(r, tmp_path)
    assert {"ladder", "latency"} <= set(paths)
    assert long in paths["markdown"].read_text()  # whole in the tables


def test_the_provenance_table_names_each_column_once(tmp_path, full):
    r = copy.deepcopy(full)
    for entry in r["rows"]:
        entry["provenance"].update(speculative=entry["speculative"], requests=12)
    md = write(r, tmp_path)["markdown"].read_text()
    header = next(line for line in md.splitlines() if line.startswith("| row | config |"))
    assert header.count("speculative") == 1 and "requests (with warm-up)" in header


def test_write_partial_flagged_unscored_report(tmp_path, partial, broken):
    r = copy.deepcopy(partial)
    for rec in r["requests"]:
        rec.update(correct=None, strict_correct=None, flexible_correct=None)
    r["rows"][1]["provenance_error"] = "head kernel is torch.matmul, asked for fp8"
    r["dropped"] = {"humming": "out of device memory in its warm-up (CUDA out of memory.)"}
    paths = write(r, tmp_path / "partial")
    assert "accuracy" not in paths and "accept" not in paths  # nothing scored; +mtp ran nothing
    md = paths["markdown"].read_text()
    assert "PARTIAL RESULT" in md
    assert "- **row `humming` dropped**: out of device memory in its warm-up" in md
    row = next(line for line in md.splitlines() if line.startswith("| ⚠ **+kernels**"))
    assert "FLAGGED" in row and "head kernel is torch.matmul" in md
    assert "| +fp8-head | 50 of 120 |" in md
    assert "No scored answers" in md
    _strict_json(paths["json"])
    paths = write(broken, tmp_path / "broken")
    assert _png_size(paths["accept"])[0] >= 600
    assert "accept length 1.00" in paths["markdown"].read_text()


def test_writes_are_atomic(tmp_path, monkeypatch):
    r = synthetic(n=30, speedups={"baseline": 1.0, "B": 1.1})
    paths = write(r, tmp_path)
    before = {k: p.read_bytes() for k, p in paths.items()}
    with open(paths["json"], "rb") as held:
        # A failure at the rename leaves every old file whole and no temporary file behind.
        def failing_replace(src, dst):
            raise OSError("disk full")
        monkeypatch.setattr(files.os, "replace", failing_replace)
        r2 = synthetic(n=30, seed=9, speedups={"baseline": 1.0, "B": 1.3})
        with pytest.raises(OSError, match="disk full"):
            write(r2, tmp_path)
        assert {k: p.read_bytes() for k, p in paths.items()} == before
        assert not [p for p in os.listdir(tmp_path) if p.endswith(".tmp")]
        monkeypatch.undo()
        # A successful write replaces the file (a new inode): a reader holding the old one still
        # reads the whole old document.
        write(r2, tmp_path)
        assert held.read() == before["json"]
    assert paths["json"].read_bytes() != before["json"]
    assert math.isfinite(_strict_json(paths["json"])["summary"]["comparisons"][0]["ratios"]["tpot_s"]["ratio"])


@pytest.mark.parametrize("stall, other, threshold, contended", [
    (0.30, 0.60, 0.05, True),   # others held the CPUs: the speed figures are the host's
    (0.30, 0.01, 0.05, False),  # the run's own threads stalled it: the code's, judged as measured
    (0.01, 0.60, 0.05, False),  # busy but nobody waited
    (0.30, 0.60, None, False),  # metering off (--moe-host-stall off)
])
def test_the_report_says_how_contended_the_host_was_while_the_rows_were_served(tmp_path, full, stall, other,
                                                                                threshold, contended):
    from moe_harness.ladder.run import host_entry
    from pytest_moeperf.host_load import HostLoad
    r = copy.deepcopy(full)
    r["host"] = host_entry(HostLoad(stall, 42.0, "psi:cgroup", 3.1, other), threshold)
    assert r["host"]["contended"] is contended
    paths = write(r, tmp_path)
    md = paths["markdown"].read_text()
    assert f"CPU stall {stall:.0%} of 42 s, other work {other:.0%} of the CPUs (psi:cgroup)" in md
    assert ("HOST-CONTENDED" in md) is contended
    host = _strict_json(paths["json"])["summary"]["host"]
    assert (host["stall"], host["other_work"], host["contended"]) == (stall, other, contended)


def test_a_gpu_ladder_says_its_host_was_not_metered(tmp_path, full):
    from moe_harness.ladder.run import host_entry
    r = copy.deepcopy(full)
    r["host"] = host_entry(None, 0.05)
    md = write(r, tmp_path)["markdown"].read_text()
    assert "- host: not metered (GPU timings do not wait for the host's CPUs)" in md
    assert "HOST-CONTENDED" not in md


def test_a_row_that_failed_part_way_is_named_flagged_and_given_no_verdict(tmp_path, full):
    r = copy.deepcopy(full)
    r["complete"] = False
    r["failure"] = {"row": "+kernels", "request": 7, "kind": "failed", "error": "RuntimeError: illegal memory access"}
    summary = summarize(r)
    assert _cmp(summary, "+kernels")["verdict"] == "failed part-way: no verdict"
    assert _cmp(summary, "+mtp")["verdict"] != "failed part-way: no verdict"  # a comparison without that row keeps it
    assert summary["flagged"]["+kernels"][0].startswith("failed on request 7 (RuntimeError: illegal memory access)")
    md = write(r, tmp_path)["markdown"].read_text()
    assert ("**PARTIAL RESULT: the run stopped part-way.** Row `+kernels` failed on request `7`: "
            "RuntimeError: illegal memory access.") in md


def test_the_report_gives_both_answer_extractions_where_the_workload_scores_both(tmp_path, full):
    r = copy.deepcopy(full)
    for rec in r["requests"]:  # a model that runs on past its answer: the last number is another
        if rec["correct"] is not None:
            rec["flexible_correct"] = rec["correct"] = False
    summary = summarize(r)
    md = write(r, tmp_path)["markdown"].read_text()
    base = next(s for s in summary["rows"] if s["name"] == "baseline")
    assert (f"`baseline` strict {100 * base['strict_accuracy']['accuracy']:.1f}%, flexible 0.0%" in md
            and base["strict_accuracy"]["accuracy"] > 0.5)


@pytest.mark.parametrize("scored, chunk_sizes", [(60, [6] * 10), (20, [5] * 4), (15, [5] * 3)])
def test_accuracy_is_gated_over_chunks_of_at_least_five(scored, chunk_sizes):
    from moe_harness.ladder.run import accuracy_chunks
    assert [len(c) for c in accuracy_chunks(list(range(scored)), 10)] == chunk_sizes


def test_too_few_scored_requests_skip_the_accuracy_gate_saying_how_many_it_needs():
    """Chunks of one request score 0 or 1: their median, frozen, could never be failed against."""
    from moe_harness.ladder.run import accuracy_chunks
    with pytest.raises(pytest.skip.Exception, match=r"3 scored request\(s\).*--moe-requests 15 or more"):
        accuracy_chunks([0, 1, 2], 10)


def test_answers_that_mostly_run_to_max_tokens_are_flagged():
    r = synthetic(n=40)
    for rec in r["requests"]:
        rec["stop_reason"] = "length" if rec["row"] == "+kernels" else "stop"
    flagged = summarize(r)["flagged"]
    assert any("40 of 40 scored answers ran to their max_tokens" in f for f in flagged["+kernels"])
    assert "baseline" not in flagged


def test_requests_without_answers_do_not_count_towards_the_max_tokens_flag():
    """Before: every request that ran to its max_tokens was counted as a scored answer, so a
    workload mixing prompts with and without answers flagged every row."""
    r = synthetic(n=40)
    for rec in r["requests"]:
        unscored = rec["request_id"] % 4 != 0  # 10 of 40 carry an answer
        rec["stop_reason"] = "length" if unscored else "stop"
        if unscored:
            rec.update(correct=None, strict_correct=None, flexible_correct=None)
    assert summarize(r)["flagged"] == {}
    for rec in r["requests"]:
        if rec["request_id"] % 4 == 0 and rec["row"] == "+kernels":
            rec["stop_reason"] = "length"
    flagged = summarize(r)["flagged"]
    assert any("10 of 10 scored answers ran to their max_tokens" in f for f in flagged["+kernels"])


def _with_outputs(r, changed: dict[str, int], at: int = 3):
    """Give every record output ids, the rows in `changed` a different token at index `at` in that
    many requests."""
    for rec in r["requests"]:
        ids = list(range(10))
        if rec["request_id"] < changed.get(rec["row"], 0):
            ids[at] = 99
        rec["output_ids"] = ids
    return r


def test_outputs_are_compared_token_for_token_with_the_first_rows():
    """A broken row on a model or prompts that score nothing (all rows wrong alike) still shows:
    its outputs are not the reference's."""
    r = _with_outputs(synthetic(n=40, scored=False), {"+kernels": 30, "+fp8-head": 5})
    s = summarize(r)
    by_row = {c["row"]: c for c in s["comparisons"]}
    assert by_row["+kernels"]["outputs"] == {"n": 40, "identical": 10, "first_difference_p50": 3}
    assert by_row["+fp8-head"]["outputs"]["identical"] == 35
    assert by_row["+mtp"]["outputs"] == {"n": 40, "identical": 40, "first_difference_p50": None}
    assert "outputs identical in 10 of 40" in by_row["+kernels"]["verdict"]
    assert any("greedy outputs differ from baseline's in 30 of 40 requests" in f and "index 3" in f
               for f in s["flagged"]["+kernels"])
    assert "+fp8-head" not in s["flagged"]  # 5 of 40 differ: numerics, not a broken row


def test_outputs_of_a_sampling_row_differ_without_a_flag():
    r = _with_outputs(synthetic(n=40, scored=False), {"+kernels": 30})
    r["rows"][1]["greedy"] = False
    s = summarize(r)
    assert next(c for c in s["comparisons"] if c["row"] == "+kernels")["outputs"]["identical"] == 10
    assert "+kernels" not in s["flagged"]


def test_the_report_lists_each_prompt_once_and_the_outputs_compared(tmp_path, full):
    r = _with_outputs(copy.deepcopy(full), {"+kernels": 7})
    r["prompts"] = [{"request_id": i, "prompt": f"q{i}", "prompt_tokens": 3, "answer": "7", "max_tokens": 10,
                     "stop": []} for i in range(r["workload"]["n_requests"])]
    written = write(r, tmp_path)
    doc = json.loads(written["json"].read_text())
    assert [p["prompt"] for p in doc["prompts"]][:2] == ["q0", "q1"]
    assert doc["requests"][0]["output_ids"] == list(range(10))
    md = written["markdown"].read_text()
    assert "Outputs token for token as baseline's: 113 of 120 requests; the others' first different token is at " \
           "index 3 (median)." in md


def test_the_report_says_when_and_at_which_commit_it_was_measured(tmp_path, full):
    r = dict(full, run={"commit": "0123456789ab+changes", "started": "2026-12-05T14:00:00+00:00",
                        "finished": "2026-12-05T14:05:00+00:00"})
    written = write(r, tmp_path)
    assert ("- run: commit 0123456789ab+changes, started 2026-12-05T14:00:00+00:00, report written "
            "2026-12-05T14:05:00+00:00") in written["markdown"].read_text()
    assert json.loads(written["json"].read_text())["summary"]["run"]["commit"] == "0123456789ab+changes"


def test_rows_that_run_the_same_code_are_called_an_a_a_comparison():
    """+kernels on a CPU runs the baseline's gather MoE; a row naming attention=torch there runs
    the torch form the default runs too: their comparison is labelled, not read as a rung."""
    r = synthetic(n=30)
    for entry in r["rows"]:
        entry["runs_as"] = "moe=gather" if entry["name"] in ("baseline", "+kernels") else entry["config"]
    by_row = {c["row"]: c for c in summarize(r)["comparisons"]}
    assert by_row["+kernels"]["same_code"] and by_row["+kernels"]["verdict"].startswith(
        "A/A, the same code as baseline on this device: ")
    assert not by_row["+fp8-head"]["same_code"] and not by_row["+fp8-head"]["verdict"].startswith("A/A")


def test_outputs_an_fp8_head_or_assumed_acceptance_changes_are_not_flagged():
    """An FP8 head changes the logits by design (on a random-weight model, every output), and an
    assumed-acceptance row's tokens are not the model's: their differences are reported, not
    flagged; a row with the reference's head whose outputs differ still is."""
    r = _with_outputs(synthetic(n=40, scored=False), {"+kernels": 40, "+fp8-head": 40, "+mtp": 40})
    heads = {"baseline": "bf16", "+kernels": "bf16", "+fp8-head": "fp8:fp8-triton:row", "+mtp": "bf16"}
    for entry in r["rows"]:
        entry["head"] = heads[entry["name"]]
        entry["assumed"] = entry["name"] == "+mtp"
    s = summarize(r)
    assert all(c["outputs"]["identical"] == 0 for c in s["comparisons"])
    assert set(s["flagged"]) == {"+kernels"}
