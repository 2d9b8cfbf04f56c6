"""The report of an A/B configuration ladder, written as JSON (the summary, and every request),
Markdown and PNG figures, each file atomically: `write_ab_report(result, summary, out_dir) ->
{kind: Path}`. The numbers come from moe_harness.ladder.summary (computed once by the caller), the
figures from moe_harness.ladder.figures.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from moe_harness.ladder.figures import render_figures
from impl.serve.result import Failure, LadderResult
from moe_harness.ladder.summary import METRICS, QS, SPEED_METRIC
from pytest_moeperf.files import atomic_write_bytes
from pytest_moeperf.stats import SMALL_SAMPLE

SCHEMA = "pytest-moeperf/ab-report/1"
PROVENANCE_HEADS = {"requests": "requests (with warm-up)"}
FILES = {
    "json": "ab-report.json",
    "markdown": "ab-report.md",
    "ladder": "ab-ladder.png",
    "latency": "ab-latency.png",
    "accept": "ab-accept.png",
    "accuracy": "ab-accuracy.png",
}


# --- writing -----------------------------------------------------------------------------------

def _jsonable(x):
    if isinstance(x, float):
        return x if math.isfinite(x) else None  # JSON has no NaN
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if hasattr(x, "item") and callable(x.item):  # numpy scalars
        return _jsonable(x.item())
    if x is None or isinstance(x, (bool, int, str)):
        return x
    return str(x)


def write_ab_report(result: LadderResult, summary: dict, out_dir) -> dict[str, Path]:
    """Write ab-report.json, ab-report.md and the figures into out_dir, each atomically; `summary`
    is summary.summarize_ab(result).

    Returns {kind: path} for what was written: "json", "markdown", "ladder", "latency", and
    "accept" (only with a speculative row that reported acceptance) and "accuracy" (only when
    some answers were scored). A figure of an earlier report in the same folder that this one has
    no data for is removed, so the folder never shows a figure of another run.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    written: dict[str, Path] = {}
    for kind, png in render_figures(summary, {key: _values(result, key) for key in METRICS}).items():
        path = out / FILES[kind]
        atomic_write_bytes(path, png)
        written[kind] = path
    _remove_figures(out, keep=written)
    # The rows and every request too: a reader can redo any statistic from the file.
    full = result.as_json()
    doc = {"schema": SCHEMA, "summary": summary, "figures": {k: p.name for k, p in written.items()},
           "rows": full["rows"], "prompts": full["prompts"], "requests": full["requests"]}
    path = out / FILES["json"]
    atomic_write_bytes(path, (json.dumps(_jsonable(doc), indent=1, allow_nan=False) + "\n").encode())
    written["json"] = path
    path = out / FILES["markdown"]
    atomic_write_bytes(path, markdown(summary, {k: p.name for k, p in written.items()}).encode())
    written["markdown"] = path
    return written


def write_unfinished_ab_report(out_dir, run: dict) -> None:
    """What the folder holds while a ladder runs: whatever stops it before its report is written (a
    usage error found in the workload or a row, a kill), the previous run's report and figures are
    gone and the folder says this run did not finish. `run`: when, and at which commit."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    _remove_figures(out)
    doc = {"schema": SCHEMA, "status": "did not finish", "run": run}
    atomic_write_bytes(out / FILES["json"], (json.dumps(_jsonable(doc), indent=1) + "\n").encode())
    atomic_write_bytes(out / FILES["markdown"], (
        "# A/B ladder: did not finish\n\n" + f"- run: {_run_line(run)}\n\n"
        "The run was stopped, killed or refused (a usage error) before its report was written: no figure "
        "here. Its terminal output says why.\n").encode())


def _remove_figures(out: Path, keep=()) -> None:
    """Remove the figures of an earlier report from `out`, but those of kinds in `keep`."""
    for kind, name in FILES.items():
        if kind not in keep and kind not in ("json", "markdown"):
            (out / name).unlink(missing_ok=True)


def _run_line(run: dict) -> str:
    parts = [f"commit {run.get('commit', '-')}", f"started {run.get('started', '-')}"]
    if run.get("finished"):
        parts.append(f"report written {run['finished']}")
    return ", ".join(parts)


def _values(result: LadderResult, key: str) -> dict[str, list[float]]:
    out: dict[str, list[float]] = {r.name: [] for r in result.rows}
    for r in result.requests:
        value = getattr(r, key)
        if value is not None:
            out[r.row].append(float(value))
    return out


# --- Markdown ----------------------------------------------------------------------------------

def _f(x, spec=".3g") -> str:
    return "-" if x is None or (isinstance(x, float) and not math.isfinite(x)) else format(x, spec)


def _ci(ci, spec=".3g", scale=1.0) -> str:
    if ci is None or any(v is None or not math.isfinite(v) for v in ci):
        return "-"
    return f"[{ci[0] * scale:{spec}}, {ci[1] * scale:{spec}}]"


def _pcts(m, scale) -> str:
    return "-" if m is None else " / ".join(_f(m[f"p{q}"] * scale) for q in QS)


def _cell(x) -> str:
    return str(x).replace("|", "\\|").replace("\n", " ")


def _table(header, rows) -> list[str]:
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header),
            *["| " + " | ".join(_cell(c) for c in row) + " |" for row in rows]]


def markdown(summary: dict, figures: dict[str, str]) -> str:
    """The Markdown report of `summarize_ab`'s summary; `figures`: {kind: file name beside it}."""
    ref = summary["reference"]
    w = summary["workload"]
    cmp = {c["row"]: c for c in summary["comparisons"]}
    lines = [f"# A/B ladder: {w.get('name', 'workload')}", ""]
    if summary.get("run"):
        lines.append(f"- run: {_run_line(summary['run'])}")
        if summary["run"].get("schedule"):
            lines.append(f"- rows served: {summary['run']['schedule']}")
    lines += [f"- device: {summary['device'] or '-'}"]
    model = summary.get("model")
    if model:
        note = f" ({model['note']})" if model.get("note") else ""
        lines.append(f"- model: {model['name']} (`{model['spec']}`), {model['dtype']} weights{note}, "
                     f"{model['experts']} experts, tokenizer {model['tokenizer']}")
    digest = f" (contents {w['digest']})" if w.get("digest") else ""
    lines += [f"- workload: {w.get('name', '-')}{digest}, {w.get('n_requests', '-')} requests, "
              f"{w.get('shots', 0)}-shot",
              f"- reference row: `{ref}` (every ratio is row / {ref}, per request)"]
    if not summary["complete"]:
        failure = summary.get("failure")
        why = "" if not failure else (f" Row `{failure['row']}` {failure['kind']} on "
                                      f"{Failure(**failure).place(markdown=True)}: {failure['error']}.")
        lines.append(f"- **PARTIAL RESULT: the run stopped part-way.**{why} Arms may hold different numbers of "
                     "requests; paired figures use only the requests present in both rows.")
    host = summary.get("host")
    if host and host.get("contended"):
        lines.append(f"- **HOST-CONTENDED**: {host['description']}, over the threshold of {host['threshold']:.0%}: "
                     "other work held the CPUs while the rows were served, so the speed figures below are "
                     "the host's as much as the code's (the gate does not fail a regression read from them, "
                     "nor freeze them)")
    elif host:
        lines.append(f"- host: {host['description']}")
    for name, why in summary.get("dropped", {}).items():
        lines.append(f"- **row `{name}` dropped**: {why}")
    if summary["flagged"]:
        lines.append(f"- **{len(summary['flagged'])} row(s) flagged** (marked ⚠ below)")
    lines += ["", "## Ladder", ""]
    rows = []
    for s in summary["rows"]:
        m = s["metrics"]
        tps, lat = m["decode_tokens_per_s"], m["latency_s"]
        acc = s["accept_length"]
        a = s["accuracy"]
        c = cmp.get(s["name"])
        r = c["ratios"][SPEED_METRIC] if c else None
        name = f"⚠ **{s['name']}**" if s["flags"] else s["name"]
        n = f"{s['n_requests']}" + (f" of {w.get('n_requests', '-')}" if s["partial"] else "")
        verdict = "reference" if c is None else c["verdict"]
        if s["flags"]:
            verdict = f"**FLAGGED**: {verdict}"
        rows.append([
            name, n,
            "-" if tps is None else f"{tps['mean']:.4g} {_ci(tps['ci'], '.4g')}",
            _pcts(m["tpot_s"], 1e3), _pcts(m["ttft_s"], 1e3),
            "-" if lat is None else f"{lat['mean']:.3g}",
            "-" if acc is None else f"{acc['mean']:.2f}",
            "-" if a is None else f"{100 * a['accuracy']:.1f}% {_ci(a['ci'], '.1f', 100)}",
            "-" if r is None else f"x{r['ratio']:.3f} {_ci(r['ci'], '.3f')}",
            verdict])
    lines += _table(["row", "requests", "decode tok/s (95% CI)", "TPOT p50/p90/p99 (ms)",
                     "TTFT p50/p90/p99 (ms)", "latency mean (s)", "accept length", "accuracy (95% CI)",
                     f"tok/s vs {ref} (95% CI)", "verdict"], rows)
    scored = [s for s in summary["rows"] if s.get("strict_accuracy") and s.get("flexible_accuracy")]
    if scored:  # both extractions, where the workload scores both (gsm8k, jsonl answers)
        lines += ["", "Accuracy by answer extraction (the table's column is the workload's own score: strict for "
                  "gsm8k, flexible for jsonl): " + "; ".join(
                      f"`{s['name']}` strict {100 * s['strict_accuracy']['accuracy']:.1f}%, flexible "
                      f"{100 * s['flexible_accuracy']['accuracy']:.1f}%" for s in scored)]
    for s in summary["rows"]:
        v = s.get("verify_step_s")
        if v is not None:
            lines += ["", f"- `{s['name']}`: {1e3 * v['mean']:.3g} ms a verify step {_ci(v['ci'], '.3g', 1e3)} "
                      f"(drafts, verify pass, commit; p50 {1e3 * v['p50']:.3g} ms)"]
    if summary["flagged"]:
        lines += ["", "### Flags", ""]
        for name, reasons in summary["flagged"].items():
            lines += [f"- ⚠ **{name}**: " + "; ".join(reasons)]
    lines += ["", "Per-row figures are means with a 95% interval (BCa bootstrap; Student's t below "
              f"{SMALL_SAMPLE} requests, where resampling sees too few values), or percentiles. Ratios are the "
              "geometric mean of the per-request ratios row / reference with such an interval over requests; "
              "\"faster\"/\"slower\" means that interval for decode tokens/s excludes 1. "
              f"Accuracy: Wilson intervals; the paired difference has Tango's score interval, exact McNemar "
              f"test, and equivalence by two one-sided tests at +-{100 * summary['accuracy_margin']:g} points."]
    if figures:
        lines += ["", "## Figures", ""]
        captions = {"ladder": "Decode throughput and TPOT per row (means, 95% intervals)",
                    "latency": "TTFT and TPOT distributions per row",
                    "accept": "Accept lengths and acceptance per draft position (speculative rows)",
                    "accuracy": "Accuracy per row (Wilson 95% intervals)"}
        for kind in ("ladder", "latency", "accept", "accuracy"):
            if kind in figures:
                lines += [f"![{captions[kind]}]({figures[kind]})", ""]
    if summary["comparisons"]:
        lines += ["", f"## Paired comparisons against {ref}", ""]
    for c in summary["comparisons"]:
        lines += [f"### {c['row']} vs {ref} ({c['n_paired']} paired requests)", ""]
        rows = []
        for key, (label, unit, _, better) in METRICS.items():
            r = c["ratios"][key]
            rows.append([f"{label} ({better} is better)", "-" if r is None else r["n"],
                         "-" if r is None else f"x{r['ratio']:.4f}", "-" if r is None else _ci(r["ci"], ".4f")])
        lines += _table(["figure", "pairs", "ratio", "95% CI"], rows) + [""]
        o = c.get("outputs")
        if o is not None:
            differ = "" if o["identical"] == o["n"] else (
                f"; the others' first different token is at index {o['first_difference_p50']:g} (median)")
            lines += [f"Outputs token for token as {ref}'s: {o['identical']} of {o['n']} requests{differ}.", ""]
        a = c["accuracy"]
        if a is None:
            lines += ["No scored answers on both rows: accuracy not compared.", ""]
            continue
        lines += [f"McNemar table ({a['n']} questions answered by both):", ""]
        lines += _table(["", f"{c['row']} right", f"{c['row']} wrong"],
                        [[f"{ref} right", a["both_right"], a["a_only"]],
                         [f"{ref} wrong", a["b_only"], a["both_wrong"]]]) + [""]
        lines += [f"- accuracy {100 * a['accuracy_a']:.2f}% -> {100 * a['accuracy_b']:.2f}%, difference "
                  f"{100 * a['difference']:+.2f} points, {100 * (1 - a['alpha']):g}% CI "
                  f"{_ci(a['ci_difference'], '+.2f', 100)} ({100 * (1 - 2 * a['alpha']):g}% CI, for the "
                  f"equivalence test: {_ci(a['ci_equivalence'], '+.2f', 100)})",
                  f"- exact McNemar p = {a['p_value']:.3g}; verdict **{a['verdict']}** "
                  f"(margin +-{100 * a['margin']:g} points)",
                  f"- smallest difference this run could detect (alpha {a['alpha']:g}, power {a['power']:g}): "
                  f"{100 * a['mdd']:.2f} points", ""]
    if summary.get("steps"):
        lines += ["", "## Each rung against the one before it", "",
                  "Paired as above, each row / the row listed before it in the ladder: what that rung adds.", ""]
        rows = []
        for c in summary["steps"]:
            for key, (label, unit, _, better) in METRICS.items():
                r = c["ratios"][key]
                rows.append([f"{c['row']} / {c['reference']}", f"{label} ({better} is better)",
                             "-" if r is None else r["n"], "-" if r is None else f"x{r['ratio']:.4f}",
                             "-" if r is None else _ci(r["ci"], ".4f")])
        lines += _table(["rung", "figure", "pairs", "ratio", "95% CI"], rows)
    lines += ["", "## Provenance", ""]
    keys = []  # what provenance recorded, past the columns already shown (its own "speculative")
    for s in summary["rows"]:
        keys += [k for k in s["provenance"] if k not in keys and k != "speculative"]
    rows = [[s["name"], f"`{s['config']}`" if s["config"] else "-", "yes" if s["speculative"] else "no",
             *[_f(s["provenance"].get(k), "") if not isinstance(s["provenance"].get(k), bool)
               else str(s["provenance"][k]) for k in keys],
             f"⚠ {s['provenance_error']}" if s["provenance_error"] else "-"] for s in summary["rows"]]
    # Provenance counts every request the row served, its warm-up requests too.
    heads = [PROVENANCE_HEADS.get(k, k) for k in keys]
    lines += _table(["row", "config", "speculative", *heads, "provenance error"], rows)
    return "\n".join(lines) + "\n"
