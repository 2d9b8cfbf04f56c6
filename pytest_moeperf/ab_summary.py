"""The numbers of an A/B configuration ladder: per-arm summaries and each arm's paired
comparison with the first arm (`summarize_ab`), for the report and for the suites to gate.

Input: the serving engine's result (see `summarize_ab`): the arms in ladder order, one record per
(arm, request), arms interleaved request by request. Every comparison is paired: it uses only the
request ids present in both arms (a run stopped part-way leaves some arms with fewer), and for
each figure only the pairs where both records carry it (a 1-token output has no TPOT).
"""

from __future__ import annotations

import math
import statistics
from collections import Counter
from dataclasses import asdict

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


def verify_step_s(record: dict) -> float | None:
    """A speculative request's time per verify step (k drafts, the verify pass, the commit): its
    decode time (latency - TTFT) over its verify steps; None without verify steps. Against a
    plain row's TPOT it is the cost of speculation in plain steps, which the accept length must
    beat for the row to be faster."""
    steps = record.get("verify_steps")
    if not steps or record.get("latency_s") is None or record.get("ttft_s") is None:
        return None
    return (record["latency_s"] - record["ttft_s"]) / steps


def _arm_summary(arm: dict, records: list[dict]) -> dict:
    prov = arm.get("provenance") or {}
    out = {
        "name": arm["name"], "config": arm.get("config"), "speculative": bool(arm.get("speculative")),
        "greedy": arm.get("greedy", True), "head": arm.get("head"), "assumed": bool(arm.get("assumed")),
        "provenance": prov, "provenance_error": arm.get("provenance_error"),
        "n_requests": len(records),
        "output_tokens": sum(r.get("output_tokens") or 0 for r in records),
        # Requests that ran to their max_tokens (no EOS, no stop string), and those of them with an
        # answer: there what the model wrote after the answer may be what the scorer reads.
        "length_stops": sum(r.get("stop_reason") == "length" for r in records),
        "scored_length_stops": sum(r.get("stop_reason") == "length" for r in records if r.get("correct") is not None),
        "metrics": {key: _metric_summary([r[key] for r in records if r.get(key) is not None]) for key in METRICS},
        "accept_length": _accept_summary(records, prov.get("drafts_per_step")) if arm.get("speculative") else None,
        "verify_step_s": (_metric_summary([v for v in map(verify_step_s, records) if v is not None])
                          if arm.get("speculative") else None),
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


def _compare(ref_name: str, arm_name: str, by_arm, margin: float, same_code: bool = False) -> dict:
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
    outputs = _outputs(ref, arm, ids)
    same = "" if outputs is None else f"; outputs identical in {outputs['identical']} of {outputs['n']}"
    aa = f"A/A, the same code as {ref_name} on this device: " if same_code else ""
    return {"arm": arm_name, "reference": ref_name, "n_paired": len(ids), "ratios": ratios, "same_code": same_code,
            "speed": speed, "accuracy": acc, "outputs": outputs, "verdict": f"{aa}{speed}; {answers}{same}"}


def _same_code(ref: dict, arm: dict) -> bool:
    """Whether two rows run the same code on the run's device (their `runs_as` specs: e.g. +kernels
    on a CPU is the baseline's gather MoE), whatever their names: their comparison is an A/A one."""
    return ref.get("runs_as") is not None and ref.get("runs_as") == arm.get("runs_as")


def _outputs(ref: dict, arm: dict, ids) -> dict | None:
    """How many paired requests came out token for token as the reference's, and where the others
    first differ (the median index of the first different output token). The direct check of "the
    same answers" where none can be scored (a random-weight model, prompts without answers); for
    two greedy rows of the same arithmetic, every output is the same."""
    pairs = [(ref[i]["output_ids"], arm[i]["output_ids"]) for i in ids
             if ref[i].get("output_ids") is not None and arm[i].get("output_ids") is not None]
    if not pairs:
        return None
    firsts = [next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
              for a, b in pairs if a != b]
    return {"n": len(pairs), "identical": len(pairs) - len(firsts),
            "first_difference_p50": statistics.median(firsts) if firsts else None}


def failure_place(failure: dict, markdown: bool = False) -> str:
    """Where a row stopped the ladder, in words: on which request (its id as Python writes it, or
    as Markdown code), or while preparing its steps (before its first request)."""
    request = failure["request"]
    if request is None:
        return "preparing its steps"
    return f"request `{request}`" if markdown else f"request {request!r}"


def _same_outputs_expected(s: dict, ref: dict) -> bool:
    """Whether a row's outputs should be the reference row's token for token, up to rounding: both
    greedy, neither with its acceptance assumed, the same head arithmetic (an FP8 head against a
    bf16 one changes the logits by design, and on a random-weight model every output with them)."""
    return (s["greedy"] and ref["greedy"] and not s["assumed"] and not ref["assumed"]
            and s["head"] == ref["head"])


def _flags(s: dict, cmp: dict | None, ref: dict | None = None) -> list[str]:
    flags = []
    if s["provenance_error"]:
        flags.append(f"provenance error: {s['provenance_error']}")
    if s["n_requests"] == 0:
        flags.append("no requests recorded")
    scored = s["accuracy"]["n"] if s["accuracy"] is not None else 0
    if scored and 2 * s["scored_length_stops"] > scored:
        flags.append(f"{s['scored_length_stops']} of {scored} scored answers ran to their max_tokens: the number "
                     "the scorer reads may come after the answer (give the workload `stop` strings, or more tokens)")
    if "accept=" in (s["config"] or ""):
        flags.append("acceptance assumed (" + next(p for p in s["config"].split(",") if p.startswith("accept="))
                     + "): the drafts are forced to the target's choices at that mean; speed follows from the "
                     "assumption, accept length and answers are not the model's")
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


def summarize_ab(result: dict, margin: float = MARGIN) -> dict:
    """The numbers of the report: per-arm summaries and each arm's paired comparison with the first.

    result: {"workload": {...}, "device": str, "arms": [{"name", "config", "provenance",
    "provenance_error", "speculative", and what decides whether its outputs should be the
    reference's: "runs_as", "greedy", "head", "assumed"}, ...] (ladder order; the first is the
    reference), "requests": [{"arm", "request_id", "prompt_tokens", "output_tokens", "ttft_s",
    "latency_s", "tpot_s", "decode_tokens_per_s", "accept_lengths", "accepted_per_position",
    "verify_steps", "correct", "strict_correct", "flexible_correct", "text", "output_ids"}, ...],
    "complete": bool, optionally "run" (commit and times), "model", "prompts" (each request once),
    "dropped": {row name: why it was left out (impl.serve.runner)}, "host": the host's CPU
    contention while serving (pytest_moeperf.ab_run.host_entry), passed through as it is, and
    "failure": the row that stopped the run ({"row", "request", "kind", "error"}), whose comparison
    then has no verdict and which is flagged}.
    Missing figures are None (TPOT of a 1-token output; accuracy of a synthetic workload).

    Returns {"run", "workload", "device", "model", "complete", "reference", "arms": [per-arm
    summary], "comparisons": [one per arm after the first: "ratios" (geometric mean of B_i / A_i
    with a 95% BCa interval over requests, per figure), "speed", "accuracy" (paired_accuracy as a
    dict, or None), "outputs" (identical outputs, _outputs), "same_code" (an A/A pair), "verdict"], "steps": [each arm after the second against the arm before it: "arm",
    "reference", "ratios" as above], "flagged": {arm: [reason, ...]}}. Per-arm figures are means with 95% BCa
    intervals and p50/p90/p99, in the record's units (seconds, tokens/s).
    """
    arms, by_arm = _check(result)
    ref = arms[0]["name"]
    summaries = [_arm_summary(a, list(by_arm[a["name"]].values())) for a in arms]
    comparisons = [_compare(ref, a["name"], by_arm, margin, _same_code(arms[0], a)) for a in arms[1:]]
    # What each rung adds: every arm after the second against the arm before it (the second's
    # step is its comparison with the first).
    steps = [{"arm": b["name"], "reference": a["name"],
              "ratios": _compare(a["name"], b["name"], by_arm, margin)["ratios"]} for a, b in zip(arms[1:], arms[2:])]
    # A row is partial below the workload's size (below the longest row's, for results without one).
    total = (result.get("workload") or {}).get("n_requests") or max((s["n_requests"] for s in summaries), default=0)
    failure = result.get("failure")
    for c in comparisons:  # a comparison with a row that failed part-way gets no verdict
        if failure and failure["row"] in (c["arm"], c["reference"]):
            c["speed"] = c["verdict"] = f"{failure['kind']} part-way: no verdict"
    flagged = {}
    for i, s in enumerate(summaries):
        s["flags"] = _flags(s, comparisons[i - 1] if i else None, summaries[0])
        if failure and s["name"] == failure["row"]:
            s["flags"].insert(0, f"{failure['kind']} on {failure_place(failure)} ({failure['error']}): the run "
                                 "stopped there, and its figures are those of the requests before")
        s["partial"] = s["n_requests"] < total
        if s["flags"]:
            flagged[s["name"]] = s["flags"]
    return {"run": result.get("run"), "workload": result.get("workload") or {}, "device": result.get("device"),
            "model": result.get("model"),
            "complete": bool(result.get("complete", False)), "dropped": dict(result.get("dropped") or {}),
            "host": result.get("host"), "failure": failure,
            "reference": ref,
            "accuracy_margin": margin, "confidence": CONFIDENCE,
            "arms": summaries, "comparisons": comparisons, "steps": steps, "flagged": flagged}
