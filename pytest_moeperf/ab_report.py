"""The report of an A/B configuration ladder: paired statistics per arm against the first arm,
written as JSON, Markdown and PNG figures.

Input: the serving engine's result (see `summarize_ab`): the arms in ladder order, one record per
(arm, request), arms interleaved request by request. Every comparison is paired: it uses only the
request ids present in both arms (a run stopped part-way leaves some arms with fewer), and for
each figure only the pairs where both records carry it (a 1-token output has no TPOT).

    summarize_ab(result) -> dict            the numbers, for suites to gate on
    write_ab_report(result, out_dir) -> {kind: Path}   ab-report.json, ab-report.md, ab-*.png
"""

from __future__ import annotations

import io
import json
import math
from collections import Counter
from dataclasses import asdict
from pathlib import Path

from pytest_moeperf.baselines import atomic_write_bytes
from pytest_moeperf.stats import (
    CONFIDENCE, mean_interval, paired_accuracy, paired_ratio, percentiles, wilson_interval,
)

# Per-request timing figures: (record key, label, unit shown, scale from the record's unit, better).
METRICS = {
    "decode_tokens_per_s": ("decode throughput", "tok/s", 1.0, "higher"),
    "tpot_s": ("TPOT", "ms", 1e3, "lower"),
    "ttft_s": ("TTFT", "ms", 1e3, "lower"),
    "latency_s": ("latency", "s", 1.0, "lower"),
}
# Which ratio decides "faster" / "slower": decode throughput, the figure the ladder is about.
SPEED_METRIC = "decode_tokens_per_s"
QS = (50, 90, 99)
ACCURACY_KEYS = ("correct", "strict_correct", "flexible_correct")
# A speculative arm whose mean accept length is below this is flagged. A draft that is never
# accepted commits exactly 1 token per verify step (the bonus); the draft reading the head's FP8
# bytes as bf16 lands there. 1.5 is half a draft token accepted per step, far below what a working
# MTP draft does on this project's model (about 3.9 at k = 3) yet above run-to-run noise around 1.
ACCEPT_LENGTH_FLOOR = 1.5
MARGIN = 0.01  # accuracy equivalence margin (+-1 point), paired_accuracy's default

FILES = {
    "json": "ab-report.json",
    "markdown": "ab-report.md",
    "ladder": "ab-ladder.png",
    "latency": "ab-latency.png",
    "accept": "ab-accept.png",
    "accuracy": "ab-accuracy.png",
}


# --- input checks ------------------------------------------------------------------------------

def _check(result) -> tuple[list[dict], dict[str, dict[object, dict]]]:
    """The arms and {arm: {request_id: record}}, or a ValueError saying what is wrong."""
    if not isinstance(result, dict):
        raise ValueError(f"result must be a dict, got {type(result).__name__}")
    arms = result.get("arms")
    if not isinstance(arms, list) or not arms:
        raise ValueError("result['arms'] must be a non-empty list of arms in ladder order")
    names = []
    for i, arm in enumerate(arms):
        if not isinstance(arm, dict) or not isinstance(arm.get("name"), str) or not arm["name"]:
            raise ValueError(f"result['arms'][{i}] must be a dict with a non-empty 'name'")
        names.append(arm["name"])
    dup = [n for n, c in Counter(names).items() if c > 1]
    if dup:
        raise ValueError(f"arm names must be unique; repeated: {', '.join(dup)}")
    requests = result.get("requests")
    if not isinstance(requests, list):
        raise ValueError("result['requests'] must be a list of per-request records")
    by_arm: dict[str, dict[object, dict]] = {n: {} for n in names}
    for i, rec in enumerate(requests):
        where = f"result['requests'][{i}]"
        if not isinstance(rec, dict):
            raise ValueError(f"{where} must be a dict")
        arm = rec.get("arm")
        if arm not in by_arm:
            raise ValueError(f"{where} names arm {arm!r}, which is not in result['arms'] ({', '.join(names)})")
        rid = rec.get("request_id")
        if rid is None:
            raise ValueError(f"{where} (arm {arm!r}) has no request_id")
        if rid in by_arm[arm]:
            raise ValueError(f"arm {arm!r} has two records for request_id {rid!r}")
        where = f"arm {arm!r} request {rid!r}"
        for key in METRICS:
            v = rec.get(key)
            if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float))
                                  or not math.isfinite(v) or v <= 0):
                raise ValueError(f"{where}: {key} = {v!r}; it must be a positive finite number or None")
        for key in ACCURACY_KEYS:
            v = rec.get(key)
            if v is not None and not isinstance(v, bool):
                raise ValueError(f"{where}: {key} = {v!r}; it must be True, False or None")
        for key in ("accept_lengths", "accepted_per_position"):
            v = rec.get(key)
            if v is not None and (not isinstance(v, (list, tuple))
                                  or not all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in v)):
                raise ValueError(f"{where}: {key} must be a list of non-negative integers or None")
        if rec.get("accept_lengths") and min(rec["accept_lengths"]) < 1:
            raise ValueError(f"{where}: an accept length below 1 (every verify step commits at least the bonus token)")
        by_arm[arm][rid] = rec
    return arms, by_arm


# --- per-arm summaries -------------------------------------------------------------------------

def _metric_summary(values: list[float]) -> dict | None:
    if not values:
        return None
    mean, lo, hi = mean_interval(values, CONFIDENCE)
    return {"n": len(values), "mean": mean, "ci": [lo, hi],
            **{f"p{q}": v for q, v in percentiles(values, QS).items()}}


def _accuracy_summary(records, key) -> dict | None:
    marks = [r[key] for r in records if r.get(key) is not None]
    if not marks:
        return None
    k = sum(marks)
    lo, hi = wilson_interval(k, len(marks), CONFIDENCE)
    return {"n": len(marks), "correct": k, "accuracy": k / len(marks), "ci": [lo, hi]}


def _accept_summary(records, drafts_per_step) -> dict | None:
    lengths = [x for r in records for x in (r.get("accept_lengths") or ())]
    if not lengths:
        return None
    per_pos, steps = None, 0
    with_pos = [r for r in records if r.get("accepted_per_position") is not None]
    if with_pos:
        k = max(len(r["accepted_per_position"]) for r in with_pos)
        counts = [0] * k
        for r in with_pos:
            for j, c in enumerate(r["accepted_per_position"]):
                counts[j] += c
            # verify_steps when given, else one verify step per accept length
            steps += r["verify_steps"] if r.get("verify_steps") is not None else len(r.get("accept_lengths") or ())
        per_pos = [c / steps for c in counts] if steps else None
    hist = Counter(lengths)
    return {"mean": sum(lengths) / len(lengths), "verify_steps": len(lengths),
            "histogram": {str(k): hist[k] for k in sorted(hist)},
            "acceptance_per_position": per_pos,
            "drafts_per_step": drafts_per_step or (len(per_pos) if per_pos else max(lengths) - 1)}


def _arm_summary(arm: dict, records: list[dict]) -> dict:
    prov = arm.get("provenance") or {}
    out = {
        "name": arm["name"], "config": arm.get("config"), "speculative": bool(arm.get("speculative")),
        "provenance": prov, "provenance_error": arm.get("provenance_error"),
        "n_requests": len(records),
        "output_tokens": sum(r.get("output_tokens") or 0 for r in records),
        "metrics": {key: _metric_summary([r[key] for r in records if r.get(key) is not None]) for key in METRICS},
        "accept_length": _accept_summary(records, prov.get("drafts_per_step")) if arm.get("speculative") else None,
    }
    for key in ACCURACY_KEYS:
        out["accuracy" if key == "correct" else key.replace("_correct", "_accuracy")] = _accuracy_summary(records, key)
    return out


# --- comparisons against the first arm ---------------------------------------------------------

def _ratio(ref: dict, arm: dict, ids, key) -> dict | None:
    pairs = [(ref[i][key], arm[i][key]) for i in ids if ref[i].get(key) is not None and arm[i].get(key) is not None]
    if not pairs:
        return None
    ratio, lo, hi = paired_ratio([p[0] for p in pairs], [p[1] for p in pairs], CONFIDENCE)
    return {"n": len(pairs), "ratio": ratio, "ci": [lo, hi]}


def _speed_verdict(r: dict | None, better: str) -> str:
    if r is None:
        return "no data"
    lo, hi = r["ci"]
    if not (math.isfinite(lo) and math.isfinite(hi)):
        return "too few pairs"
    up, down = ("faster", "slower") if better == "higher" else ("slower", "faster")
    return up if lo > 1 else down if hi < 1 else "no detectable difference"


def _compare(ref_name: str, arm_name: str, by_arm, margin: float) -> dict:
    ref, arm = by_arm[ref_name], by_arm[arm_name]
    ids = sorted(set(ref) & set(arm), key=lambda i: (str(type(i)), i))
    ratios = {key: _ratio(ref, arm, ids, key) for key in METRICS}
    speed = _speed_verdict(ratios[SPEED_METRIC], METRICS[SPEED_METRIC][3])
    acc_ids = [i for i in ids if ref[i].get("correct") is not None and arm[i].get("correct") is not None]
    acc = None
    if acc_ids:
        acc = asdict(paired_accuracy([ref[i]["correct"] for i in acc_ids], [arm[i]["correct"] for i in acc_ids],
                                     margin=margin))
    answers = "no accuracy data" if acc is None else {
        "equivalent": "answers equivalent", "different": "answers differ",
        "inconclusive": "answers inconclusive"}[acc["verdict"]]
    return {"arm": arm_name, "reference": ref_name, "n_paired": len(ids), "ratios": ratios,
            "speed": speed, "accuracy": acc, "verdict": f"{speed}; {answers}"}


def _flags(s: dict, cmp: dict | None) -> list[str]:
    flags = []
    if s["provenance_error"]:
        flags.append(f"provenance error: {s['provenance_error']}")
    if s["n_requests"] == 0:
        flags.append("no requests recorded")
    if s["speculative"]:
        acc = s["accept_length"]
        prov = s["provenance"]
        if acc is None and s["n_requests"]:
            flags.append("speculative arm reported no accept lengths")
        elif acc is not None and acc["mean"] < ACCEPT_LENGTH_FLOOR:
            flags.append(f"mean accept length {acc['mean']:.2f} on a speculative arm (below {ACCEPT_LENGTH_FLOOR}): "
                         "the drafts are almost never accepted")
        if prov.get("draft_shares_head") is False:
            flags.append("the draft does not share the target's head module")
        if prov.get("drafts_per_step") == 0:
            flags.append("speculative arm drafts 0 tokens per step")
    if cmp is not None:
        r = cmp["ratios"][SPEED_METRIC]
        if cmp["speed"] == "slower":
            flags.append(f"slower than {cmp['reference']}: decode tokens/s x{r['ratio']:.3f} "
                         f"[{r['ci'][0]:.3f}, {r['ci'][1]:.3f}]")
        a = cmp["accuracy"]
        if a is not None and a["verdict"] == "different":
            flags.append(f"answers differ from {cmp['reference']}: accuracy {100 * a['difference']:+.1f} points "
                         f"(McNemar p = {a['p_value']:.3g}, {a['a_only']} lost, {a['b_only']} gained)")
    return flags


def summarize_ab(result: dict, margin: float = MARGIN) -> dict:
    """The numbers of the report: per-arm summaries and each arm's paired comparison with the first.

    result: {"workload": {...}, "device": str, "arms": [{"name", "config", "provenance",
    "provenance_error", "speculative"}, ...] (ladder order; the first is the reference),
    "requests": [{"arm", "request_id", "prompt_tokens", "output_tokens", "ttft_s", "latency_s",
    "tpot_s", "decode_tokens_per_s", "accept_lengths", "accepted_per_position", "verify_steps",
    "correct", "strict_correct", "flexible_correct", "text"}, ...], "complete": bool}.
    Missing figures are None (TPOT of a 1-token output; accuracy of a synthetic workload).

    Returns {"workload", "device", "complete", "reference", "arms": [per-arm summary],
    "comparisons": [one per arm after the first: "ratios" (geometric mean of B_i / A_i with a 95%
    BCa interval over requests, per figure), "speed", "accuracy" (paired_accuracy as a dict, or
    None), "verdict"], "flagged": {arm: [reason, ...]}}. Per-arm figures are means with 95% BCa
    intervals and p50/p90/p99, in the record's units (seconds, tokens/s).
    """
    arms, by_arm = _check(result)
    ref = arms[0]["name"]
    summaries = [_arm_summary(a, list(by_arm[a["name"]].values())) for a in arms]
    comparisons = [_compare(ref, a["name"], by_arm, margin) for a in arms[1:]]
    max_n = max((s["n_requests"] for s in summaries), default=0)
    flagged = {}
    for i, s in enumerate(summaries):
        s["flags"] = _flags(s, comparisons[i - 1] if i else None)
        s["partial"] = s["n_requests"] < max_n
        if s["flags"]:
            flagged[s["name"]] = s["flags"]
    return {"workload": result.get("workload") or {}, "device": result.get("device"),
            "complete": bool(result.get("complete", False)), "reference": ref,
            "accuracy_margin": margin, "confidence": CONFIDENCE,
            "arms": summaries, "comparisons": comparisons, "flagged": flagged}


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


def write_ab_report(result: dict, out_dir, margin: float = MARGIN) -> dict[str, Path]:
    """Write ab-report.json, ab-report.md and the figures into out_dir, each atomically.

    Returns {kind: path} for what was written: "json", "markdown", "ladder", "latency", and
    "accept" (only with a speculative arm that reported accept lengths) and "accuracy" (only when
    some answers were scored).
    """
    summary = summarize_ab(result, margin)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    written: dict[str, Path] = {}
    for kind, png in render_figures(summary, {key: _values(result, key) for key in METRICS}).items():
        path = out / FILES[kind]
        atomic_write_bytes(path, png)
        written[kind] = path
    # The rows and every per-request record too: a reader can redo any statistic from the file.
    doc = {"schema": "pytest-moeperf/ab-report/1", "summary": summary,
           "figures": {k: p.name for k, p in written.items()},
           "arms": result.get("arms", []), "requests": result.get("requests", [])}
    path = out / FILES["json"]
    atomic_write_bytes(path, (json.dumps(_jsonable(doc), indent=1, allow_nan=False) + "\n").encode())
    written["json"] = path
    path = out / FILES["markdown"]
    atomic_write_bytes(path, markdown(summary, {k: p.name for k, p in written.items()}).encode())
    written["markdown"] = path
    return written


def _values(result: dict, key: str) -> dict[str, list[float]]:
    out: dict[str, list[float]] = {a["name"]: [] for a in result["arms"]}
    for r in result["requests"]:
        if r.get(key) is not None:
            out[r["arm"]].append(float(r[key]))
    return out


# --- figures -----------------------------------------------------------------------------------

def _new_figure(width, height):
    # A bare Figure on the Agg canvas: no pyplot, so no global backend or figure state is touched
    # in the process that imports the plugin.
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), dpi=110, layout="constrained")
    FigureCanvasAgg(fig)
    return fig


def _png(fig) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    return buf.getvalue()


def _colors(n):
    from matplotlib import colormaps

    # tab10 without its red: red is kept for flagged arms' outlines.
    cmap = colormaps["tab10"]
    palette = [cmap(i) for i in (0, 1, 2, 4, 5, 6, 7, 8, 9)]
    return [palette[i % len(palette)] for i in range(n)]


def _tick(s: dict) -> str:
    return s["name"] + ("\n(FLAGGED)" if s["flags"] else "")


def _set_ticks(ax, arms) -> None:
    # Long arm names are slanted so that neighbours do not run into each other.
    slant = max(len(s["name"]) for s in arms) > 12
    ax.set_xticks(range(len(arms)), [_tick(s) for s in arms], fontsize=9,
                  rotation=20 if slant else 0, ha="right" if slant else "center", rotation_mode="anchor")


def _title(summary: dict) -> str:
    w = summary["workload"]
    # The device's name alone (its full description, with software versions, is in the Markdown):
    # a figure title wider than the figure is cut off.
    device = (summary["device"] or "-").split(" (")[0]
    t = f"{w.get('name', 'workload')} on {device}"
    return t if summary["complete"] else t + " (PARTIAL run)"


def _bars(ax, summary, key, scale, unit, colors, cmp):
    label, _, _, better = METRICS[key]
    arms = summary["arms"]
    xs = range(len(arms))
    top = 0.0
    for x, s, col in zip(xs, arms, colors):
        m = s["metrics"][key]
        if m is None:
            ax.text(x, 0.5, "no data", ha="center", transform=ax.get_xaxis_transform(), fontsize=8, color="0.4")
            continue
        mean = m["mean"] * scale
        lo, hi = (v * scale if v is not None and math.isfinite(v) else mean for v in m["ci"])
        ax.bar(x, mean, color=col, alpha=0.85, edgecolor="red" if s["flags"] else "black",
               linewidth=2 if s["flags"] else 0.6, hatch="//" if s["flags"] else None)
        ax.errorbar(x, mean, yerr=[[mean - lo], [hi - mean]], color="black", capsize=5, linewidth=1.2)
        r = cmp.get(s["name"], {}).get("ratios", {}).get(key) if s["name"] in cmp else None
        note = f"{mean:.4g}" + ("" if r is None else f"\nx{r['ratio']:.3f}") + (
            f"\nn={m['n']}" if s["partial"] else "")
        ax.annotate(note, (x, hi), xytext=(0, 4), textcoords="offset points", ha="center", va="bottom", fontsize=8)
        top = max(top, hi)
    _set_ticks(ax, arms)
    ax.set_xlim(-0.6, len(arms) - 0.4)
    ax.set_ylim(0, top * 1.25 if top else 1)
    ax.set_ylabel(f"{label} ({unit}), mean with 95% CI")
    ax.set_title(f"{label} ({better} is better; x = ratio vs {summary['reference']})", fontsize=10)
    ax.grid(axis="y", alpha=0.3)


def _ladder_png(summary) -> bytes:
    arms = summary["arms"]
    colors = _colors(len(arms))
    cmp = {c["arm"]: c for c in summary["comparisons"]}
    fig = _new_figure(max(9.0, 2.4 * len(arms)), 4.6)
    ax1, ax2 = fig.subplots(1, 2)
    _bars(ax1, summary, "decode_tokens_per_s", 1.0, "tok/s", colors, cmp)
    _bars(ax2, summary, "tpot_s", 1e3, "ms", colors, cmp)
    fig.suptitle(f"Configuration ladder: {_title(summary)}", fontsize=11)
    return _png(fig)


def _latency_png(summary, values) -> bytes:
    arms = summary["arms"]
    colors = _colors(len(arms))
    fig = _new_figure(max(9.0, 2.4 * len(arms)), 4.6)
    axes = fig.subplots(1, 2)
    for ax, key in zip(axes, ("ttft_s", "tpot_s")):
        label, unit, scale, _ = METRICS[key]
        data = [[v * scale for v in values[key][s["name"]]] for s in arms]
        present = [i for i, d in enumerate(data) if d]
        if present:
            bp = ax.boxplot([data[i] for i in present], positions=present, whis=(1, 99), widths=0.55,
                            patch_artist=True, flierprops={"markersize": 2, "alpha": 0.5},
                            medianprops={"color": "black"})
            for patch, i in zip(bp["boxes"], present):
                patch.set_facecolor(colors[i])
                patch.set_alpha(0.8)
            flat = [v for i in present for v in data[i]]
            if min(flat) > 0 and max(flat) / min(flat) > 30:
                ax.set_yscale("log")
        for i, d in enumerate(data):
            if not d:
                ax.text(i, 0.5, "no data", ha="center", transform=ax.get_xaxis_transform(), fontsize=8, color="0.4")
        _set_ticks(ax, arms)
        ax.set_xlim(-0.6, len(arms) - 0.4)
        ax.set_ylabel(f"{label} ({unit})")
        ax.set_title(f"{label} per request (box p25-p75, line p50, whiskers p1-p99)", fontsize=10)
        ax.grid(axis="y", alpha=0.3)
    fig.suptitle(f"Latency distributions: {_title(summary)}", fontsize=11)
    return _png(fig)


def _accept_png(summary) -> bytes | None:
    spec = [(i, s) for i, s in enumerate(summary["arms"]) if s["accept_length"] is not None]
    if not spec:
        return None
    colors = _colors(len(summary["arms"]))
    fig = _new_figure(10.0, 4.4)
    ax1, ax2 = fig.subplots(1, 2)
    # Every possible length, 1 .. k + 1, so that a collapse to 1 shows against the empty rest.
    longest = max(max(int(k) for k in s["accept_length"]["histogram"]) for _, s in spec)
    longest = max(longest, 1 + max(s["accept_length"]["drafts_per_step"] or 0 for _, s in spec))
    lengths = list(range(1, longest + 1))
    width = 0.8 / len(spec)
    for j, (i, s) in enumerate(spec):
        a = s["accept_length"]
        total = a["verify_steps"]
        frac = [a["histogram"].get(str(k), 0) / total for k in lengths]
        xs = [k - 0.4 + width * (j + 0.5) for k in lengths]
        ax1.bar(xs, frac, width=width, color=colors[i], edgecolor="red" if s["flags"] else "black",
                linewidth=1.5 if s["flags"] else 0.5, hatch="//" if s["flags"] else None,
                label=f"{s['name']} (mean {a['mean']:.2f}{', FLAGGED' if s['flags'] else ''})")
        per = a["acceptance_per_position"]
        if per:
            ax2.plot(range(1, len(per) + 1), per, marker="o", color=colors[i], label=s["name"])
    ax1.set_xticks(lengths)
    ax1.set_xlabel("tokens committed per verify step (accepted drafts + bonus)")
    ax1.set_ylabel("fraction of verify steps")
    ax1.set_ylim(0, 1.18 * max(p.get_height() for p in ax1.patches))
    ax1.set_title("Accept-length histogram", fontsize=10)
    ax1.legend(fontsize=8, loc="upper right")
    ax1.grid(axis="y", alpha=0.3)
    positions = max((len(s["accept_length"]["acceptance_per_position"] or ()) for _, s in spec), default=0)
    if positions:
        ax2.set_xticks(range(1, positions + 1))
        ax2.legend(fontsize=8)
    else:
        ax2.text(0.5, 0.5, "no per-position counts reported", ha="center", transform=ax2.transAxes, color="0.4")
    ax2.set_ylim(-0.03, 1.05)  # below 0 so that a line at 0 (nothing accepted) stays visible
    ax2.set_xlabel("draft position")
    ax2.set_ylabel("fraction of verify steps accepting it")
    ax2.set_title("Acceptance per draft position", fontsize=10)
    ax2.grid(alpha=0.3)
    fig.suptitle(f"Speculative decoding: {_title(summary)}", fontsize=11)
    return _png(fig)


def _accuracy_png(summary) -> bytes | None:
    arms = summary["arms"]
    if all(s["accuracy"] is None for s in arms):
        return None
    colors = _colors(len(arms))
    fig = _new_figure(max(6.0, 1.6 * len(arms)), 4.2)
    ax = fig.subplots()
    ref = arms[0]["accuracy"]
    if ref is not None:
        ax.axhline(100 * ref["accuracy"], color="0.5", linestyle="--", linewidth=1,
                   label=f"{arms[0]['name']} {100 * ref['accuracy']:.1f}%")
    lows, highs = [], []
    for i, s in enumerate(arms):
        a = s["accuracy"]
        if a is None:
            ax.text(i, 0.5, "not scored", ha="center", transform=ax.get_xaxis_transform(), fontsize=8, color="0.4")
            continue
        y, (lo, hi) = 100 * a["accuracy"], (100 * v for v in a["ci"])
        ax.errorbar(i, y, yerr=[[y - lo], [hi - y]], fmt="o", color=colors[i], capsize=6, markersize=7,
                    markeredgecolor="red" if s["flags"] else colors[i])
        ax.annotate(f"{y:.1f}%\nn={a['n']}", (i, y), xytext=(10, 0), textcoords="offset points",
                    va="center", fontsize=8)
        lows.append(lo)
        highs.append(hi)
    _set_ticks(ax, arms)
    ax.set_xlim(-0.5, len(arms) - 0.2)
    ax.set_ylim(max(0.0, min(lows, default=0.0) - 4), min(100.5, max(highs, default=100.0) + 4))
    ax.set_ylabel("accuracy (%), Wilson 95% CI")
    ax.set_title(f"Accuracy per arm: {_title(summary)}", fontsize=10)
    ax.grid(axis="y", alpha=0.3)
    if ref is not None:
        ax.legend(fontsize=8, loc="lower left")
    return _png(fig)


def render_figures(summary: dict, values: dict[str, dict[str, list[float]]]) -> dict[str, bytes]:
    """PNG bytes per figure kind; `values`: {record key: {arm: per-request values}}."""
    out = {"ladder": _ladder_png(summary), "latency": _latency_png(summary, values)}
    for kind, png in (("accept", _accept_png(summary)), ("accuracy", _accuracy_png(summary))):
        if png is not None:
            out[kind] = png
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
    cmp = {c["arm"]: c for c in summary["comparisons"]}
    n_max = max((s["n_requests"] for s in summary["arms"]), default=0)
    lines = [f"# A/B ladder: {w.get('name', 'workload')}", ""]
    lines += [f"- device: {summary['device'] or '-'}",
              f"- workload: {w.get('name', '-')}, {w.get('n_requests', '-')} requests, {w.get('shots', 0)}-shot",
              f"- reference arm: `{ref}` (every ratio is arm / {ref}, per request)"]
    if not summary["complete"]:
        lines.append("- **PARTIAL RESULT: the run stopped part-way.** Arms may hold different numbers of "
                     "requests; paired figures use only the requests present in both arms.")
    if summary["flagged"]:
        lines.append(f"- **{len(summary['flagged'])} arm(s) flagged** (marked ⚠ below)")
    lines += ["", "## Ladder", ""]
    rows = []
    for s in summary["arms"]:
        m = s["metrics"]
        tps, lat = m["decode_tokens_per_s"], m["latency_s"]
        acc = s["accept_length"]
        a = s["accuracy"]
        c = cmp.get(s["name"])
        r = c["ratios"][SPEED_METRIC] if c else None
        name = f"⚠ **{s['name']}**" if s["flags"] else s["name"]
        n = f"{s['n_requests']}" + (f" of {n_max}" if s["partial"] else "")
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
    lines += _table(["arm", "requests", "decode tok/s (95% CI)", "TPOT p50/p90/p99 (ms)",
                     "TTFT p50/p90/p99 (ms)", "latency mean (s)", "accept length", "accuracy (95% CI)",
                     f"tok/s vs {ref} (95% CI)", "verdict"], rows)
    if summary["flagged"]:
        lines += ["", "### Flags", ""]
        for arm, reasons in summary["flagged"].items():
            lines += [f"- ⚠ **{arm}**: " + "; ".join(reasons)]
    lines += ["", "Per-arm figures are means with a 95% BCa bootstrap interval, or percentiles. Ratios are the "
              "geometric mean of the per-request ratios arm / reference with a 95% BCa bootstrap interval "
              "over requests; \"faster\"/\"slower\" means that interval for decode tokens/s excludes 1. "
              f"Accuracy: Wilson intervals; the paired difference has Tango's score interval, exact McNemar "
              f"test, and equivalence by two one-sided tests at +-{100 * summary['accuracy_margin']:g} points."]
    if figures:
        lines += ["", "## Figures", ""]
        captions = {"ladder": "Decode throughput and TPOT per arm (means, 95% intervals)",
                    "latency": "TTFT and TPOT distributions per arm",
                    "accept": "Accept lengths and acceptance per draft position (speculative arms)",
                    "accuracy": "Accuracy per arm (Wilson 95% intervals)"}
        for kind in ("ladder", "latency", "accept", "accuracy"):
            if kind in figures:
                lines += [f"![{captions[kind]}]({figures[kind]})", ""]
    if summary["comparisons"]:
        lines += ["", f"## Paired comparisons against {ref}", ""]
    for c in summary["comparisons"]:
        lines += [f"### {c['arm']} vs {ref} ({c['n_paired']} paired requests)", ""]
        rows = []
        for key, (label, unit, _, better) in METRICS.items():
            r = c["ratios"][key]
            rows.append([f"{label} ({better} is better)", "-" if r is None else r["n"],
                         "-" if r is None else f"x{r['ratio']:.4f}", "-" if r is None else _ci(r["ci"], ".4f")])
        lines += _table(["figure", "pairs", "ratio", "95% CI"], rows) + [""]
        a = c["accuracy"]
        if a is None:
            lines += ["No scored answers on both arms: accuracy not compared.", ""]
            continue
        lines += [f"McNemar table ({a['n']} questions answered by both):", ""]
        lines += _table(["", f"{c['arm']} right", f"{c['arm']} wrong"],
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
    lines += ["", "## Provenance", ""]
    keys = []
    for s in summary["arms"]:
        keys += [k for k in s["provenance"] if k not in keys]
    rows = [[s["name"], f"`{s['config']}`" if s["config"] else "-", "yes" if s["speculative"] else "no",
             *[_f(s["provenance"].get(k), "") if not isinstance(s["provenance"].get(k), bool)
               else str(s["provenance"][k]) for k in keys],
             f"⚠ {s['provenance_error']}" if s["provenance_error"] else "-"] for s in summary["arms"]]
    lines += _table(["arm", "config", "speculative", *keys, "provenance error"], rows)
    return "\n".join(lines) + "\n"
