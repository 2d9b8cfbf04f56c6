"""The numbers of an A/B configuration ladder: per-row summaries and each row's paired
comparison with the first row (`summarize_ab`), for the report and for the suites to gate.

Input: a ladder's result (impl.serve.result.LadderResult): the rows in ladder order, one served
request per (row, request), rows interleaved request by request. Every comparison is paired: it
uses only the request ids present in both rows (a run stopped part-way leaves some rows with
fewer), and for each figure only the pairs where both requests carry it (a 1-token output has no
TPOT). A failed request (its `error`) has no figures and is counted apart.
"""

from __future__ import annotations

import math
import statistics
from collections import Counter
from dataclasses import asdict

from impl.serve.result import SCORE_KEYS, LadderResult, RowEntry, ServedRequest

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
ACCURACY_KEYS = SCORE_KEYS
# A speculative row whose mean accept length is below this is flagged. A draft that is never
# accepted commits exactly 1 token per verify step (the bonus); the draft reading the head's FP8
# bytes as bf16 lands there. 1.5 is half a draft token accepted per step, far below what a working
# MTP draft does on this project's model (about 3.9 at k = 3) yet above run-to-run noise around 1.
ACCEPT_LENGTH_FLOOR = 1.5
MARGIN = 0.01  # accuracy equivalence margin (+-1 point), paired_accuracy's default


# --- per-row summaries -------------------------------------------------------------------------

def _metric_summary(values: list[float]) -> dict | None:
    if not values:
        return None
    mean, lo, hi = mean_interval(values, CONFIDENCE)
    return {"n": len(values), "mean": mean, "ci": [lo, hi],
            **{f"p{q}": v for q, v in percentiles(values, QS).items()}}


def _accuracy_summary(served: list[ServedRequest], key) -> dict | None:
    marks = [r.mark(key) for r in served if r.mark(key) is not None]
    if not marks:
        return None
    k = sum(marks)
    lo, hi = wilson_interval(k, len(marks), CONFIDENCE)
    return {"n": len(marks), "correct": k, "accuracy": k / len(marks), "ci": [lo, hi]}


def _accept_summary(served: list[ServedRequest], drafts_per_step) -> dict | None:
    """Accept length over every verify step (tokens committed per step), acceptance per draft
    position, and the histogram of lengths where the rows report them per step."""
    counts = [r.acceptance for r in served if r.acceptance is not None and r.acceptance.verify_steps]
    if not counts:
        return None
    steps = sum(a.verify_steps for a in counts)
    with_pos = [a for a in counts if a.per_position is not None]
    k = max((len(a.per_position) for a in with_pos), default=0)
    pos_steps = sum(a.verify_steps for a in with_pos)
    per_pos = ([sum(a.per_position[j] for a in with_pos if j < len(a.per_position)) / pos_steps for j in range(k)]
               if pos_steps else None)
    lengths = [n for a in counts for n in (a.lengths or ())]
    hist = Counter(lengths)
    return {"mean": (sum(a.accepted for a in counts) + steps) / steps, "verify_steps": steps,
            "histogram": {str(n): hist[n] for n in sorted(hist)} if all(a.lengths is not None for a in counts)
            else None,
            "acceptance_per_position": per_pos, "drafts_per_step": drafts_per_step or k or None,
            "sources": sorted({a.source for a in counts})}


def verify_step_s(served: ServedRequest) -> float | None:
    """A speculative request's time per verify step (k drafts, the verify pass, the commit): its
    decode time (latency - TTFT) over its verify steps; None without verify steps. Against a
    plain row's TPOT it is the cost of speculation in plain steps, which the accept length must
    beat for the row to be faster."""
    a = served.acceptance
    if a is None or not a.verify_steps or served.latency_s is None or served.ttft_s is None:
        return None
    return (served.latency_s - served.ttft_s) / a.verify_steps


def _row_summary(row: RowEntry, served: list[ServedRequest]) -> dict:
    prov = row.provenance or {}
    ok = [r for r in served if r.error is None]
    out = {
        "name": row.name, "config": row.config, "speculative": row.speculative,
        "greedy": row.greedy, "head": row.head, "assumed": row.assumed, "server": row.server,
        "provenance": dict(prov), "provenance_error": row.provenance_error,
        "n_requests": len(served), "failed_requests": len(served) - len(ok),
        "output_tokens": sum(r.output_tokens for r in ok),
        # Requests that ran to their max_tokens (no EOS, no stop string), and those of them with an
        # answer: there what the model wrote after the answer may be what the scorer reads.
        "length_stops": sum(r.stop_reason == "length" for r in ok),
        "scored_length_stops": sum(r.stop_reason == "length" for r in ok if r.mark("correct") is not None),
        "metrics": {key: _metric_summary([v for v in (getattr(r, key) for r in ok) if v is not None])
                    for key in METRICS},
        "accept_length": _accept_summary(ok, prov.get("drafts_per_step")) if row.speculative else None,
        "verify_step_s": (_metric_summary([v for v in map(verify_step_s, ok) if v is not None])
                          if row.speculative else None),
    }
    for key in ACCURACY_KEYS:
        out["accuracy" if key == "correct" else key.replace("_correct", "_accuracy")] = _accuracy_summary(ok, key)
    return out


# --- comparisons against the first row ---------------------------------------------------------

def _ratio(ref: dict, row: dict, ids, key) -> dict | None:
    pairs = [(a, b) for a, b in ((getattr(ref[i], key), getattr(row[i], key)) for i in ids)
             if a is not None and b is not None]
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


def _compare(ref_name: str, name: str, by_row, margin: float, same_code: bool = False) -> dict:
    ref, row = by_row[ref_name], by_row[name]
    ids = sorted(set(ref) & set(row), key=lambda i: (str(type(i)), i))
    ratios = {key: _ratio(ref, row, ids, key) for key in METRICS}
    speed = _speed_verdict(ratios[SPEED_METRIC], METRICS[SPEED_METRIC][3])
    acc_ids = [i for i in ids if ref[i].mark("correct") is not None and row[i].mark("correct") is not None]
    acc = None
    if acc_ids:
        acc = asdict(paired_accuracy([ref[i].mark("correct") for i in acc_ids],
                                     [row[i].mark("correct") for i in acc_ids], margin=margin))
    answers = "no accuracy data" if acc is None else {
        "equivalent": "answers equivalent", "different": "answers differ",
        "inconclusive": "answers inconclusive"}[acc["verdict"]]
    outputs = _outputs(ref, row, ids)
    same = "" if outputs is None else f"; outputs identical in {outputs['identical']} of {outputs['n']}"
    aa = f"A/A, the same code as {ref_name} on this device: " if same_code else ""
    return {"row": name, "reference": ref_name, "n_paired": len(ids), "ratios": ratios, "same_code": same_code,
            "speed": speed, "accuracy": acc, "outputs": outputs, "verdict": f"{aa}{speed}; {answers}{same}"}


def _same_code(ref: RowEntry, row: RowEntry) -> bool:
    """Whether two rows run the same code on the run's device (their `runs_as` specs: e.g. +kernels
    on a CPU is the baseline's gather MoE), whatever their names: their comparison is an A/A one."""
    return ref.runs_as is not None and ref.runs_as == row.runs_as


def _outputs(ref: dict, row: dict, ids) -> dict | None:
    """How many paired requests came out token for token as the reference's (by their ids, or by
    their text where a row gives text only), and where the others first differ (the median index
    of the first different token or character). The direct check of "the same answers" where none
    can be scored (a random-weight model, prompts without answers); for two greedy rows of the
    same arithmetic, every output is the same."""
    def sequence(a: ServedRequest, b: ServedRequest):
        if a.output_ids is not None and b.output_ids is not None:
            return a.output_ids, b.output_ids
        return a.text, b.text

    pairs = [sequence(ref[i], row[i]) for i in ids if ref[i].error is None and row[i].error is None]
    if not pairs:
        return None
    firsts = [next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
              for a, b in pairs if a != b]
    return {"n": len(pairs), "identical": len(pairs) - len(firsts),
            "first_difference_p50": statistics.median(firsts) if firsts else None}


def _same_outputs_expected(s: dict, ref: dict) -> bool:
    """Whether a row's outputs should be the reference row's token for token, up to rounding: both
    greedy, neither with its acceptance assumed, the same head arithmetic (an FP8 head against a
    bf16 one changes the logits by design, and on a random-weight model every output with them)."""
    return (s["greedy"] and ref["greedy"] and not s["assumed"] and not ref["assumed"]
            and s["head"] == ref["head"])


def _unmet_claims(s: dict) -> list[str]:
    """What says the row does not run what it declares (the reference result's trap: a speculative
    row whose drafts are not running or never accepted, a backend that did not run): such a row
    fails its provenance test and `--moe-expect`, whatever its speed."""
    flags = []
    if s["provenance_error"]:
        flags.append(f"provenance error: {s['provenance_error']}")
    if s["speculative"]:
        acc = s["accept_length"]
        prov = s["provenance"]
        if acc is None and s["n_requests"]:
            flags.append("speculative row reported no acceptance (no verify steps counted)")
        elif acc is not None and acc["mean"] < ACCEPT_LENGTH_FLOOR:
            flags.append(f"mean accept length {acc['mean']:.2f} on a speculative row (below {ACCEPT_LENGTH_FLOOR}): "
                         "the drafts are almost never accepted")
        if prov.get("draft_shares_head") is False:
            flags.append("the draft does not share the target's head module")
        if prov.get("drafts_per_step") == 0:
            flags.append("speculative row drafts 0 tokens per step")
    return flags


def _flags(s: dict, cmp: dict | None, ref: dict | None = None) -> list[str]:
    flags = list(s["unmet_claims"])
    if s["n_requests"] == 0:
        flags.append("no requests recorded")
    if s["failed_requests"]:
        flags.append(f"{s['failed_requests']} of {s['n_requests']} request(s) failed (each one's error is in the "
                     "report's JSON); its figures are those of the others")
    scored = s["accuracy"]["n"] if s["accuracy"] is not None else 0
    if scored and 2 * s["scored_length_stops"] > scored:
        flags.append(f"{s['scored_length_stops']} of {scored} scored answers ran to their max_tokens: the number "
                     "the scorer reads may come after the answer (give the workload `stop` strings, or more tokens)")
    if "accept=" in (s["config"] or ""):
        flags.append("acceptance assumed (" + next(p for p in s["config"].split(",") if p.startswith("accept="))
                     + "): the drafts are forced to the target's choices at that mean; speed follows from the "
                     "assumption, accept length and answers are not the model's")
    if cmp is not None:
        r = cmp["ratios"][SPEED_METRIC]
        if cmp["speed"] == "slower":
            flags.append(f"slower than {cmp['reference']}: decode tokens/s x{r['ratio']:.3f} "
                         f"[{r['ci'][0]:.3f}, {r['ci'][1]:.3f}]")
        o = cmp["outputs"]
        if o is not None and _same_outputs_expected(s, ref) and 2 * o["identical"] < o["n"]:
            flags.append(f"greedy outputs differ from {cmp['reference']}'s in {o['n'] - o['identical']} of {o['n']} "
                         f"requests (the first different token at index {o['first_difference_p50']:g}, median): "
                         "check that the row computes what the reference does")
        a = cmp["accuracy"]
        if a is not None and a["verdict"] == "different":
            flags.append(f"answers differ from {cmp['reference']}: accuracy {100 * a['difference']:+.1f} points "
                         f"(McNemar p = {a['p_value']:.3g}, {a['a_only']} lost, {a['b_only']} gained)")
    return flags


def summarize_ab(result: LadderResult, margin: float = MARGIN) -> dict:
    """The numbers of the report: per-row summaries and each row's paired comparison with the first.

    `result`: impl.serve.result.LadderResult (rows in ladder order, the first the reference; a
    `failure`'s row gets no verdict and is flagged). Missing figures are None (TPOT of a 1-token
    output; accuracy of a synthetic workload).

    Returns {"run", "workload", "device", "model", "complete", "dropped", "host", "failure",
    "reference", "rows": [per-row summary], "comparisons": [one per row after the first: "ratios"
    (geometric mean of B_i / A_i with a 95% BCa interval over requests, per figure), "speed",
    "accuracy" (paired_accuracy as a dict, or None), "outputs" (identical outputs, _outputs),
    "same_code" (an A/A pair), "verdict"], "steps": [each row after the second against the row
    before it: "row", "reference", "ratios" as above], "flagged": {row: [reason, ...]}}; each
    row's "flags" lead with its "unmet_claims" (what says it does not run what it declares). Per-row
    figures are means with 95% BCa intervals and p50/p90/p99, in seconds and tokens/s.
    """
    rows, by_row = result.rows, result.by_row()
    ref = rows[0].name
    summaries = [_row_summary(r, list(by_row[r.name].values())) for r in rows]
    comparisons = [_compare(ref, r.name, by_row, margin, _same_code(rows[0], r)) for r in rows[1:]]
    # What each rung adds: every row after the second against the row before it (the second's
    # step is its comparison with the first).
    steps = [{"row": b.name, "reference": a.name, "ratios": _compare(a.name, b.name, by_row, margin)["ratios"]}
             for a, b in zip(rows[1:], rows[2:])]
    # A row is partial below the workload's size (below the longest row's, for results without one).
    total = result.workload.get("n_requests") or max((s["n_requests"] for s in summaries), default=0)
    failure = result.failure
    for c in comparisons:  # a comparison with a row that failed part-way gets no verdict
        if failure and failure.row in (c["row"], c["reference"]):
            c["speed"] = c["verdict"] = f"{failure.kind} part-way: no verdict"
    flagged = {}
    for i, s in enumerate(summaries):
        s["unmet_claims"] = _unmet_claims(s)
        s["flags"] = _flags(s, comparisons[i - 1] if i else None, summaries[0])
        if failure and s["name"] == failure.row:
            s["flags"].insert(0, f"{failure.kind} {failure.at()} ({failure.error}): the run "
                                 "stopped there, and its figures are those of the requests before")
        s["partial"] = s["n_requests"] < total
        if s["flags"]:
            flagged[s["name"]] = s["flags"]
    return {"run": result.run, "workload": dict(result.workload), "device": result.device,
            "model": result.model, "complete": result.complete, "dropped": dict(result.dropped),
            "host": result.host, "failure": None if failure is None else asdict(failure),
            "reference": ref, "accuracy_margin": margin, "confidence": CONFIDENCE,
            "rows": summaries, "comparisons": comparisons, "steps": steps, "flagged": flagged}
