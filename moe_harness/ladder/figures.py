"""The figures of an A/B ladder's report, as PNG bytes (matplotlib's Agg canvas, no pyplot
state): throughput and TPOT per row, TTFT and TPOT distributions, accept lengths, accuracy."""

from __future__ import annotations

import io
import math

from moe_harness.ladder.summary import METRICS


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

    # tab10 without its red: red is kept for flagged rows' outlines.
    cmap = colormaps["tab10"]
    palette = [cmap(i) for i in (0, 1, 2, 4, 5, 6, 7, 8, 9)]
    return [palette[i % len(palette)] for i in range(n)]


# A row named by its whole spec can run to a hundred characters; its label on a chart is cut here
# (the Markdown's tables give it whole), so that the axes keep their room.
MAX_LABEL = 28


def _short(name: str) -> str:
    return name if len(name) <= MAX_LABEL else name[:MAX_LABEL - 1] + "…"


def _tick(s: dict) -> str:
    return _short(s["name"]) + ("\n(FLAGGED)" if s["flags"] else "")


def _set_ticks(ax, rows) -> None:
    # Long row names are slanted so that neighbours do not run into each other.
    slant = max(len(_short(s["name"])) for s in rows) > 12
    ax.set_xticks(range(len(rows)), [_tick(s) for s in rows], fontsize=9,
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
    rows = summary["rows"]
    xs = range(len(rows))
    top = 0.0
    for x, s, col in zip(xs, rows, colors):
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
    _set_ticks(ax, rows)
    ax.set_xlim(-0.6, len(rows) - 0.4)
    ax.set_ylim(0, top * 1.25 if top else 1)
    ax.set_ylabel(f"{label} ({unit}), mean with 95% CI")
    ax.set_title(f"{label} ({better} is better; x = ratio vs {summary['reference']})", fontsize=10)
    ax.grid(axis="y", alpha=0.3)


def _ladder_png(summary) -> bytes:
    rows = summary["rows"]
    colors = _colors(len(rows))
    cmp = {c["row"]: c for c in summary["comparisons"]}
    fig = _new_figure(max(9.0, 2.4 * len(rows)), 4.6)
    ax1, ax2 = fig.subplots(1, 2)
    _bars(ax1, summary, "decode_tokens_per_s", 1.0, "tok/s", colors, cmp)
    _bars(ax2, summary, "tpot_s", 1e3, "ms", colors, cmp)
    fig.suptitle(f"Configuration ladder: {_title(summary)}", fontsize=11)
    return _png(fig)


def _latency_png(summary, values) -> bytes:
    rows = summary["rows"]
    colors = _colors(len(rows))
    fig = _new_figure(max(9.0, 2.4 * len(rows)), 4.6)
    axes = fig.subplots(1, 2)
    for ax, key in zip(axes, ("ttft_s", "tpot_s")):
        label, unit, scale, _ = METRICS[key]
        data = [[v * scale for v in values[key][s["name"]]] for s in rows]
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
        _set_ticks(ax, rows)
        ax.set_xlim(-0.6, len(rows) - 0.4)
        ax.set_ylabel(f"{label} ({unit})")
        ax.set_title(f"{label} per request (box p25-p75, line p50, whiskers p1-p99)", fontsize=10)
        ax.grid(axis="y", alpha=0.3)
    fig.suptitle(f"Latency distributions: {_title(summary)}", fontsize=11)
    return _png(fig)


def _accept_png(summary) -> bytes | None:
    spec = [(i, s) for i, s in enumerate(summary["rows"]) if s["accept_length"] is not None]
    if not spec:
        return None
    colors = _colors(len(summary["rows"]))
    fig = _new_figure(10.0, 4.4)
    ax1, ax2 = fig.subplots(1, 2)
    # Every possible length, 1 .. k + 1, so that a collapse to 1 shows against the empty rest.
    # A server reports totals, not each step's length: its row has no histogram.
    per_step = [(j, (i, s)) for j, (i, s) in enumerate(spec) if s["accept_length"]["histogram"] is not None]
    longest = max([int(k) for _, (_, s) in per_step for k in s["accept_length"]["histogram"]]
                  + [1 + (s["accept_length"]["drafts_per_step"] or 0) for _, s in spec])
    lengths = list(range(1, longest + 1))
    width = 0.8 / len(spec)
    for j, (i, s) in enumerate(spec):
        a = s["accept_length"]
        label = f"{_short(s['name'])} (mean {a['mean']:.2f}{', FLAGGED' if s['flags'] else ''})"
        if a["histogram"] is not None:
            frac = [a["histogram"].get(str(k), 0) / a["verify_steps"] for k in lengths]
            xs = [k - 0.4 + width * (j + 0.5) for k in lengths]
            ax1.bar(xs, frac, width=width, color=colors[i], edgecolor="red" if s["flags"] else "black",
                    linewidth=1.5 if s["flags"] else 0.5, hatch="//" if s["flags"] else None, label=label)
        else:
            ax1.axvline(a["mean"], color=colors[i], linestyle="--", label=f"{label}: totals only, mean shown")
        per = a["acceptance_per_position"]
        if per:
            ax2.plot(range(1, len(per) + 1), per, marker="o", color=colors[i], label=_short(s["name"]))
    ax1.set_xticks(lengths)
    ax1.set_xlabel("tokens committed per verify step (accepted drafts + bonus)")
    ax1.set_ylabel("fraction of verify steps")
    ax1.set_ylim(0, 1.18 * max([p.get_height() for p in ax1.patches] + [1 / 1.18]))
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
    rows = summary["rows"]
    if all(s["accuracy"] is None for s in rows):
        return None
    colors = _colors(len(rows))
    fig = _new_figure(max(6.0, 1.6 * len(rows)), 4.2)
    ax = fig.subplots()
    ref = rows[0]["accuracy"]
    if ref is not None:
        ax.axhline(100 * ref["accuracy"], color="0.5", linestyle="--", linewidth=1,
                   label=f"{_short(rows[0]['name'])} {100 * ref['accuracy']:.1f}%")
    lows, highs = [], []
    for i, s in enumerate(rows):
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
    _set_ticks(ax, rows)
    ax.set_xlim(-0.5, len(rows) - 0.2)
    ax.set_ylim(max(0.0, min(lows, default=0.0) - 4), min(100.5, max(highs, default=100.0) + 4))
    ax.set_ylabel("accuracy (%), Wilson 95% CI")
    ax.set_title(f"Accuracy per row: {_title(summary)}", fontsize=10)
    ax.grid(axis="y", alpha=0.3)
    if ref is not None:
        ax.legend(fontsize=8, loc="lower left")
    return _png(fig)


def render_figures(summary: dict, values: dict[str, dict[str, list[float]]]) -> dict[str, bytes]:
    """PNG bytes per figure kind; `values`: {record key: {row: per-request values}}."""
    out = {"ladder": _ladder_png(summary), "latency": _latency_png(summary, values)}
    for kind, png in (("accept", _accept_png(summary)), ("accuracy", _accuracy_png(summary))):
        if png is not None:
            out[kind] = png
    return out
