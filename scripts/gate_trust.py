#!/usr/bin/env python3
"""How far to trust the gate on this machine: false alarms when nothing changed, detections of a
planted slowdown, per gated figure.

    python scripts/gate_trust.py --aa-runs 3 --repeats 5 \
        --plant moe=0.1@suites/test_decode_bench.py --plant decoder:mtp=0.1@suites/test_spec_bench.py \
        --out trust-cpu -- [pytest args, e.g. --moe-device cuda]

1. Freeze: the timed suites (`-m moe_bench`) frozen into a fresh baselines folder under --out.
2. A/A: --aa-runs new pytest processes, unchanged, each gating every timed figure --repeats times
   against that freeze (`--moe-trust`): a regression here is a false alarm. `--aa-alone PATHS` adds
   A/A runs of just those suites (does a figure depend on what ran before it?).
3. Planted: for each --plant SPEC[@PATHS], --plant-runs processes with that slowdown planted in
   the backend (`--moe-plant`; over PATHS only, if given): a regression here is a detection.

Each verdict is the gate's own (tolerance, 95% interval, confirmation by a second measurement).
The table gives, per figure: its tolerance, A/A evaluations and how many came out REGRESSION
(false failure), REFREEZE or HOST-CONTENDED (not judged: the host's CPUs were busy with other
work; counted apart, never as a pass, their ratios left out), the range of A/A ratios, and per plant the evaluations,
detections and the effective slowdown (1 - median planted ratio / median A/A ratio). Everything is written
to --out as trust.json and trust.md, with each run's report and log.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from importlib.metadata import entry_points
from pathlib import Path

from pytest_moeperf.baselines import atomic_write_text

ROOT = Path(__file__).resolve().parents[1]  # the checkout whose suites are run
DEFAULT_PATHS = ["suites"]


@dataclass
class Phase:
    name: str  # "freeze", "aa", "aa-alone:<paths>", or the plant spec
    kind: str  # "freeze", "aa" or "plant"
    paths: list[str]
    plant: str | None = None
    runs: list[dict] = field(default_factory=list)  # {"rc", "seconds", "report"}


def parse_plant(value: str) -> tuple[str, list[str] | None]:
    """`SPEC[@PATH,PATH]` -> (SPEC, [PATH, ...] or None)."""
    spec, _, paths = value.partition("@")
    if not spec:
        raise argparse.ArgumentTypeError(f"--plant {value!r}: expected KIND[:NAME]=FRACTION[@PATHS]")
    return spec, [p for p in paths.split(",") if p] or None


def parse_count(value: str) -> int:
    n = int(value)
    if n < 1:
        raise argparse.ArgumentTypeError(f"expected a count of at least 1, got {value}")
    return n


def _plugin_args() -> list[str]:
    """The gate core's and the MoE harness's plugins, named where the package is not installed (a
    bare GPU image with the repository on PYTHONPATH)."""
    installed = any(ep.value == "pytest_moeperf.plugin" for ep in entry_points(group="pytest11"))
    return [] if installed else ["-p", "pytest_moeperf.plugin", "-p", "moe_harness.plugin"]


def gpu_state() -> str | None:
    """SM and memory clocks, temperature and power of the GPUs, as nvidia-smi reads them (None
    without one): what a figure that depends on what ran before may be following."""
    try:
        done = subprocess.run(["nvidia-smi", "--query-gpu=clocks.sm,clocks.mem,temperature.gpu,power.draw",
                               "--format=csv,noheader"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def run_pytest(out: Path, tag: str, args: list[str]) -> dict:
    report = out / f"{tag}.json"
    cmd = [sys.executable, "-m", "pytest", *_plugin_args(), "-q", "-p", "no:cacheprovider", "--moe-bench",
           "-m", "moe_bench", *args]
    if "--moe-freeze" not in args:
        cmd += ["--moe-report", str(report)]
    before, start = gpu_state(), time.perf_counter()
    with open(out / f"{tag}.log", "w") as log:
        rc = subprocess.run(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT).returncode
    seconds = time.perf_counter() - start
    print(f"  {tag}: rc {rc}, {seconds:.0f} s", flush=True)
    return {"rc": rc, "seconds": seconds, "report": report.name if report.exists() else None,
            "gpu_before": before, "gpu_after": gpu_state()}


def metrics_of(out: Path, run: dict) -> list[dict]:
    if not run["report"]:
        return []
    return json.loads((out / run["report"]).read_text())["metrics"]


def summarize(phases: list[tuple[Path, Phase]]) -> dict:
    """Per metric: A/A and per-plant evaluation counts, verdicts and ratios (phases of one name
    from several output folders are pooled)."""
    table: dict[str, dict] = {}
    for out, phase in phases:
        if phase.kind == "freeze":
            continue
        for run in phase.runs:
            for m in metrics_of(out, run):
                row = table.setdefault(m["metric_id"], {"tolerance": m["tolerance"], "portable": m["portable"],
                                                        "unit": m["unit"], "phases": {}})
                evals = m["evaluations"] or ([] if m["verdict"] in ("no-baseline", "frozen") else [
                    {"verdict": m["verdict"], "ratio": m["ratio"]}])
                p = row["phases"].setdefault(phase.name, {"kind": phase.kind, "ratios": [], "verdicts": []})
                # A ratio measured on a contended host says how busy the host was, not the code.
                p["ratios"] += [e["ratio"] for e in evals if e["verdict"] != "host-contended"]
                p["verdicts"] += [e["verdict"] for e in evals]
    for row in table.values():
        aa = [r for p in row["phases"].values() if p["kind"] == "aa" for r in p["ratios"]]
        aa_median = statistics.median(aa) if aa else None
        for p in row["phases"].values():
            p["n"] = len(p["verdicts"])
            p["regression"] = p["verdicts"].count("regression")
            p["refreeze"] = p["verdicts"].count("refreeze")
            p["contended"] = p["verdicts"].count("host-contended")  # not judged: the host's CPUs were contended
            p["median"] = statistics.median(p["ratios"]) if p["ratios"] else None
            if p["kind"] == "plant" and aa_median and p["median"]:
                p["effective_slowdown"] = 1 - p["median"] / aa_median
    return table


def render(table: dict, phases: list[tuple[Path, Phase]], header: list[str]) -> str:
    lines = [*header, "", "| figure | tol | A/A: n | false failures | refreeze | host-contended | A/A ratios | "
             "planted: phase, n, caught, effective slowdown |", "|---|---|---|---|---|---|---|---|"]
    for mid, row in sorted(table.items()):
        aa = [p for p in row["phases"].values() if p["kind"] == "aa"]
        n = sum(p["n"] for p in aa)
        ratios = [r for p in aa for r in p["ratios"]]
        rng = f"{min(ratios):.3f}-{max(ratios):.3f}" if ratios else "-"
        planted = "; ".join(
            f"{name}: {p['n']}, {p['regression']} ({p['regression'] / p['n']:.0%}), "
            f"{p.get('effective_slowdown', float('nan')):+.1%}"
            + (f", {p['contended']} host-contended" if p.get("contended") else "")
            for name, p in row["phases"].items() if p["kind"] == "plant" and p["n"])
        lines.append(f"| {mid} | {row['tolerance']:.0%} | {n} | {sum(p['regression'] for p in aa)} | "
                     f"{sum(p['refreeze'] for p in aa)} | {sum(p.get('contended', 0) for p in aa)} | {rng} | "
                     f"{planted or '-'} |")
    aa_phases = [p for row in table.values() for p in row["phases"].values() if p["kind"] == "aa"]
    total = sum(p["n"] for p in aa_phases)
    false = sum(p["regression"] for p in aa_phases)
    # An evaluation on a contended host was not judged: it is neither a pass nor a false failure.
    contended = sum(p.get("contended", 0) for p in aa_phases)
    judged = total - contended
    summary = (f"A/A: {false} false failure(s) in {judged} judged evaluation(s) ({false / judged:.1%})" if judged
               else "A/A: no judged evaluations")
    if contended:
        summary += f"; {contended} more not judged (host-contended: the host's CPUs were busy with other work)"
    lines += ["", summary if total else "A/A: no evaluations"]
    for out, phase in phases:
        refused = sorted({m["metric_id"] for run in phase.runs for m in metrics_of(out, run)
                          if phase.kind == "freeze" and m["verdict"] == "host-contended"})
        if refused:
            lines.append(f"{phase.name}: {len(refused)} figure(s) NOT FROZEN (the host's CPUs were contended), so "
                         f"no later phase gates them: {', '.join(refused)}; freeze again on a quiet host")
    for _, phase in phases:
        bad = [r for r in phase.runs if r["rc"] not in (0, 1)]
        if bad:
            lines.append(f"{phase.name}: {len(bad)} run(s) ended with an error (see the logs)")
    return "\n".join(lines) + "\n"


def load_phases(out: Path) -> list[tuple[Path, Phase]]:
    doc = json.loads((out / "trust.json").read_text())
    return [(out, Phase(**p)) for p in doc["phases"]]


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    ours, pytest_args = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True, help="folder for baselines, reports, logs and the table")
    ap.add_argument("--paths", nargs="+", default=DEFAULT_PATHS, help="suites to freeze and re-run (default: suites)")
    ap.add_argument("--aa-runs", type=parse_count, default=3, help="A/A processes (default 3)")
    ap.add_argument("--no-aa", action="store_true", help="no A/A runs of --paths (only --aa-alone and plants)")
    ap.add_argument("--repeats", type=parse_count, default=5, help="evaluations per figure per process (default 5)")
    ap.add_argument("--aa-alone", action="append", default=[], metavar="PATHS",
                    help="an extra A/A run of only these suites (comma-separated); repeatable")
    ap.add_argument("--plant", action="append", default=[], type=parse_plant, metavar="SPEC[@PATHS]",
                    help="a planted-slowdown phase, e.g. moe=0.1@suites/test_moe_bench.py; repeatable")
    ap.add_argument("--plant-runs", type=parse_count, default=2, help="processes per plant (default 2)")
    ap.add_argument("--reuse-freeze", type=Path, metavar="DIR",
                    help="gate against this baselines folder (an earlier run's OUT/baselines) instead of freezing")
    ap.add_argument("--combine", type=Path, nargs="+", metavar="OUT",
                    help="run nothing: one table from earlier runs' output folders (their phases pooled)")
    args = ap.parse_args(ours)
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    if args.combine:
        phases = [ph for folder in args.combine for ph in load_phases(folder.resolve())]
        text = render(summarize(phases), phases, [f"# gate trust: {len(args.combine)} output folder(s) combined",
                                                  "", *[f"- {f}" for f in args.combine]])
        (out / "trust.md").write_text(text)
        print(text)
        return 0
    baselines = out / "baselines"
    if baselines.exists() and any(baselines.iterdir()):
        ap.error(f"{baselines} is not empty: give a fresh --out (an A/A run must start from its own freeze)")
    if args.reuse_freeze:
        shutil.copytree(args.reuse_freeze, baselines, dirs_exist_ok=True)
    common = ["--moe-baselines", str(baselines), *pytest_args]
    trust = ["--moe-trust", str(args.repeats)]
    phases = [] if args.reuse_freeze else [Phase("freeze", "freeze", args.paths)]
    phases += [] if args.no_aa else [Phase("aa", "aa", args.paths)]
    phases += [Phase(f"aa-alone:{p}", "aa", p.split(",")) for p in args.aa_alone]
    phases += [Phase(spec, "plant", paths or args.paths, plant=spec) for spec, paths in args.plant]
    started = time.strftime("%Y-%m-%d %H:%M:%S")
    for i, phase in enumerate(phases):
        print(f"{phase.name} ({' '.join(phase.paths)})", flush=True)
        if phase.kind == "freeze":
            phase.runs.append(run_pytest(out, "freeze", [*phase.paths, *common, "--moe-freeze"]))
            if phase.runs[0]["rc"] not in (0, 1):
                print(f"the freeze failed (rc {phase.runs[0]['rc']}); see {out / 'freeze.log'}")
                return 3
            continue
        runs = args.aa_runs if phase.name == "aa" else 1 if phase.kind == "aa" else args.plant_runs
        for r in range(runs):
            extra = ["--moe-plant", phase.plant] if phase.plant else []
            phase.runs.append(run_pytest(out, f"p{i}-r{r}", [*phase.paths, *common, *trust, *extra]))
        write_outputs(out, phases, argv, started, args.repeats)  # a run stopped part-way keeps what it measured
    text = write_outputs(out, phases, argv, started, args.repeats)
    print(text)
    return 0 if all(r["rc"] in (0, 1) for p in phases for r in p.runs) else 3


def write_outputs(out: Path, phases: list[Phase], argv: list[str], started: str, repeats: int) -> str:
    located = [(out, p) for p in phases]
    header = [f"# gate trust: {started}", "",
              f"- command: scripts/gate_trust.py {' '.join(argv)}",
              "- phases: " + "; ".join(f"{p.name} x{len(p.runs)} ({' '.join(p.paths)}, "
                                       f"{sum(r['seconds'] for r in p.runs):.0f} s)" for p in phases),
              f"- evaluations per figure per process: {repeats}"]
    text = render(summarize(located), located, header)
    atomic_write_text(out / "trust.md", text)
    atomic_write_text(out / "trust.json", json.dumps({"phases": [p.__dict__ for p in phases],
                                                      "metrics": summarize(located)}, indent=1, default=str) + "\n")
    return text


if __name__ == "__main__":
    sys.exit(main())
