"""The summary of gated metrics: a terminal table, and JSON + Markdown files."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

from pytest_moeperf.baselines import atomic_write_text

COLUMNS = ("metric", "current", "frozen", "ratio", "95% CI", "verdict")


def _fmt(x, spec=".4g") -> str:
    return "-" if x is None else format(x, spec)


def rows(results) -> list[tuple[str, ...]]:
    out = []
    for r in results:
        ci = "-" if r.ci_low is None else f"{r.ci_low:.3f}-{r.ci_high:.3f}"
        out.append((r.metric_id, f"{_fmt(r.current)} {r.unit}", f"{_fmt(r.frozen)} {r.unit}" if r.frozen else "-",
                    _fmt(r.ratio, ".3f"), ci, r.verdict.upper()))
    return out


def table(results) -> str:
    body = [COLUMNS, *rows(results)]
    widths = [max(len(row[i]) for row in body) for i in range(len(COLUMNS))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in body]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def markdown(results, header: dict) -> str:
    head = [f"# pytest-moeperf report", ""] + [f"- {k}: {v}" for k, v in header.items()] + [""]
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(row) + " |" for row in rows(results)]
    return "\n".join(head + lines) + "\n"


def write(path: Path, results, header: dict) -> tuple[Path, Path]:
    """JSON at `path`, Markdown beside it (same stem, .md); both written atomically."""
    path = Path(path)
    doc = {"header": header, "metrics": [asdict(r) for r in results]}
    atomic_write_text(path, json.dumps(doc, indent=1, default=str) + "\n")
    md = path.with_suffix(".md")
    atomic_write_text(md, markdown(results, header))
    return path, md
