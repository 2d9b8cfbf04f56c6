"""The summary of gated metrics: a terminal table, and JSON + Markdown files."""

from __future__ import annotations

import datetime
import json
import statistics
import subprocess
from dataclasses import asdict
from pathlib import Path

from pytest_moeperf.files import atomic_write_text

COLUMNS = ("metric", "current", "frozen", "ratio", "95% CI", "key", "verdict", "CPU stall")
TRUST_COLUMNS = ("metric", "evaluations", "regression", "refreeze", "host-contended", "ratio median",
                 "ratio range")


def _fmt(x, spec=".4g") -> str:
    return "-" if x is None else format(x, spec)


def rows(results) -> list[tuple[str, ...]]:
    out = []
    for r in results:
        ci = "-" if r.ci_low is None else f"{r.ci_low:.3f}-{r.ci_high:.3f}"
        frozen = "-" if r.frozen is None else f"{_fmt(r.frozen)} {r.unit}"
        out.append((r.metric_id, f"{_fmt(r.current)} {r.unit}", frozen,
                    _fmt(r.ratio, ".3f"), ci, r.scope or "-", r.verdict.upper(), _stall(r.host_load)))
    return out


def _stall(load: dict | None) -> str:
    """The host's CPU stall during the deciding measurement: "-" not measured (synthetic
    samples, a GPU), "?" unknown (no PSI)."""
    if load is None:
        return "-"
    return "?" if load["stall"] is None else f"{load['stall']:.1%}"


def trust_rows(results) -> list[tuple[str, ...]]:
    out = []
    for r in results:
        if not r.evaluations:
            continue
        ratios = sorted(e["ratio"] for e in r.evaluations)
        out.append((r.metric_id, str(len(r.evaluations)),
                    str(sum(e["verdict"] == "regression" for e in r.evaluations)),
                    str(sum(e["verdict"] == "refreeze" for e in r.evaluations)),
                    str(sum(e["verdict"] == "host-contended" for e in r.evaluations)),
                    f"{statistics.median(ratios):.3f}", f"{ratios[0]:.3f}-{ratios[-1]:.3f}"))
    return out


def _aligned(columns, body_rows) -> str:
    body = [columns, *body_rows]
    widths = [max(len(row[i]) for row in body) for i in range(len(columns))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in body]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def table(results) -> str:
    return _aligned(COLUMNS, rows(results))


def legend(results) -> list[str]:
    """What the table's rows can and cannot say, for the kinds of figure this run has: each
    REPORTED figure's reason, and the reach of absolute CPU timings."""
    lines = [f"REPORTED, not gated: {r.message}" for r in results if r.verdict == "reported"]
    absolute = [r for r in results if not r.portable and r.host_load is not None and r.verdict != "reported"]
    if absolute:
        tolerances = sorted({r.tolerance for r in absolute if r.tolerance is not None})
        at = f" at +-{', '.join(f'{t:.0%}' for t in tolerances)}" if tolerances else ""
        lines.append(f"Absolute CPU figures ({', '.join(sorted({r.metric for r in absolute}))}) are judged only on "
                     f"the exact fingerprint they were frozen on{at}: a shared CPU host's speed moves such figures "
                     "by tens of percent from one process to the next, so they catch a slowdown larger than that "
                     "drift and their tolerance, not one of 10-25%; ratios timed side by side in one run (unit x) "
                     "catch those.")
    return lines


def trust_table(results) -> str:
    """Per timed figure of a gate-trust run: how often each verdict came out."""
    return _aligned(TRUST_COLUMNS, trust_rows(results))


def now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def checkout_commit(folder: Path) -> str | None:
    """The git commit checked out at `folder` (with "+changes" when the tree differs from it),
    or None outside a git checkout: which code a report's figures came from."""
    def git(*args) -> str:
        return subprocess.run(["git", "-C", str(folder), *args], capture_output=True, text=True, timeout=10,
                              check=True).stdout.strip()
    try:
        commit = git("rev-parse", "--short=12", "HEAD")
        return commit + ("+changes" if git("status", "--porcelain", "--untracked-files=no") else "")
    except (OSError, subprocess.SubprocessError):
        return None


def markdown(results, header: dict, run_failures: list[str] = (), failed_tests: list[str] = ()) -> str:
    head = [f"# pytest-moeperf report", ""] + [f"- {k}: {v}" for k, v in header.items()] + [""]
    head += [f"**The run fails:** {why}" for why in run_failures] + ([""] if run_failures else [])
    if failed_tests:
        head += [f"**{len(failed_tests)} test(s) failed:** " + ", ".join(f"`{t}`" for t in failed_tests), ""]
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(row) + " |" for row in rows(results)]
    notes = legend(results)
    lines += [""] + [f"- {line}" for line in notes] if notes else []
    return "\n".join(head + lines) + "\n"


def write(path: Path, results, header: dict, run_failures: list[str] = (),
          failed_tests: list[str] = ()) -> tuple[Path, Path]:
    """JSON at `path`, Markdown beside it (same stem, .md); each written atomically, the JSON last.
    `run_failures`: why the run fails though no test did (--moe-strict's reasons, a write that
    failed); `failed_tests`: the tests that failed."""
    path = Path(path)
    doc = {"header": header, "run_failures": list(run_failures), "failed_tests": list(failed_tests),
           "metrics": [asdict(r) for r in results]}
    md = path.with_suffix(".md")
    atomic_write_text(md, markdown(results, header, run_failures, failed_tests))
    atomic_write_text(path, json.dumps(doc, indent=1, default=str) + "\n")
    return path, md


def write_unfinished(path: Path, header: dict) -> None:
    """The report a run leaves until it finishes: whatever stops it (a usage error found later, a
    kill, a crash), the previous run's report is gone and this one says the run did not finish."""
    header = {**header, "status": "did not finish (stopped, killed or refused before its end)",
              "outcome": "NONE: no verdict"}
    write(path, [], header, ["the run did not finish: no figure here was judged"])
