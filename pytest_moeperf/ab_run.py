"""Running an A/B ladder inside a suite: serve a workload once per row, interleaved, score it, and
write the report (also when a request fails part-way); then the paired figures the suites gate."""

from __future__ import annotations

import math
import sys
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import NoReturn

import pytest

WARMUP = 2  # requests per row before timing: graphs captured, every compile of a first shape done
# The speed figures are medians of per-request paired ratios; below three there is no median to gate.
MIN_REQUESTS = 3


@dataclass
class LadderRun:
    result: dict  # pytest_moeperf.ab_report's input
    summary: dict  # ab_summary.summarize_ab(result)
    report: dict  # what write_ab_report wrote
    records: dict  # arm name -> {request id: record}
    # The host's CPU contention while the rows were served (host_load.Meter; None on a GPU, whose
    # timings do not wait for the host's CPUs): the speed figures are judged and frozen by it.
    host_load: object = None


def _progress(line: str) -> None:
    print(f"\nmoeperf ladder: {line}", file=sys.stderr, end="")


def arm_entry(arm) -> dict:
    """A row as the report takes it: its spec, what ran, and what of it contradicts the name."""
    from impl.serve import provenance_problems
    prov = arm.provenance
    if prov is None:
        return {"name": arm.name, "config": arm.config.spec_text(), **_outputs_entry(arm), "provenance": {},
                "speculative": arm.config.speculative, "provenance_error": "the row served no request"}
    shown = prov.as_dict()
    shown["draft_shares_head"] = all(prov.draft_head_is_target_head) if prov.speculative else None
    shown["drafts_per_step"] = max(prov.drafts_per_step, default=0)
    problems = provenance_problems(arm.name, arm.config, prov)
    return {"name": arm.name, "config": arm.config.spec_text(), **_outputs_entry(arm), "provenance": shown,
            "provenance_error": "; ".join(problems) or None, "speculative": arm.config.speculative}


def _outputs_entry(arm) -> dict:
    """What decides whether a row's outputs should be another row's token for token: the code it
    runs on its device, whether it decodes greedily, its head's arithmetic (an FP8 head changes the
    logits by design) and whether its acceptance is assumed (its tokens are then not the model's)."""
    c = arm.config
    return {"runs_as": arm.runs_as(), "greedy": c.sampling.greedy,
            "head": "bf16" if c.head == "bf16" else f"fp8:{c.head_backend}:{c.head_scales}",
            "assumed": c.assumed_accept is not None}


def model_entry(model, spec, tokenizer) -> dict:
    """The model every row served, as the report names it: what was asked for (`--moe-model`),
    the weights' dtype, the routed experts' format and the tokenizer that made the prompts' ids
    (the checkpoint's own, bytes, or none: token ids only)."""
    from impl.serve import expert_format
    entry = {"name": model.config.name, "spec": str(spec),
             "dtype": str(model.embed_tokens.weight.dtype).removeprefix("torch."),
             "experts": expert_format(model),
             "tokenizer": f"{type(tokenizer).__name__} {tokenizer.name!r}, {tokenizer.vocab_size} ids"}
    if model.embed_tokens.weight.device.type == "cpu":  # what a bf16 checkpoint's user would not expect
        entry["note"] = ("a CPU computes every row in float32, whatever the checkpoint stores (bf16 matmuls are "
                         "emulated there); `head=bf16` names the unquantized head")
    return entry


def prompt_entry(request) -> dict:
    """One request of the workload as the report lists it, once for every row: what the model was
    asked and what a right answer is, so its outputs can be checked by eye."""
    return {"request_id": request.request_id, "prompt": request.prompt, "prompt_tokens": len(request.prompt_ids),
            "answer": request.answer, "max_tokens": request.max_tokens, "stop": list(request.stop)}


def _failure(error: Exception, where: tuple, kind: str) -> dict:
    """Where a row stopped the ladder ("refused": a backend's Unsupported; "failed": an error of the
    row's code), as the report shows it."""
    cause = error.__cause__ if isinstance(error.__cause__, Exception) and kind == "refused" else error
    row, request = where or (None, None)
    return {"row": row, "request": request, "kind": kind, "error": f"{type(cause).__name__}: {cause}"}


def host_entry(load, threshold: float | None) -> dict:
    """The host's CPU contention while the rows were served, as the report shows it: a contended
    host slows every row, so the speed figures are the host's as much as the code's."""
    if load is None:
        return {"metered": False, "contended": False,
                "description": "not metered (GPU timings do not wait for the host's CPUs)"}
    return {"metered": True, "contended": load.contended(threshold), "threshold": threshold,
            "description": load.describe(), **load.as_dict()}


def _usage_exit(message: str) -> NoReturn:
    """Stop the session as a usage error (exit status 4), once: what the user asked for cannot run
    on this model, so every test of the ladder would fail the same way."""
    pytest.exit(f"usage error: {message}", returncode=pytest.ExitCode.USAGE_ERROR)


def report_folder_problem(folder: Path, option: str = "--moe-ab-report") -> str | None:
    """Why the ladder's report folder could not be written (None: it can be); `option` names it."""
    from impl.files import unwritable_ancestor
    if folder.exists() and not folder.is_dir():
        return f"{option} {folder}: is a file; a folder is needed"
    blocked = unwritable_ancestor(folder)
    return None if blocked is None else f"{option} {folder}: cannot be written ({blocked} is not a writable folder)"


def run_suite_ladder(session, model, rows, workload_spec, n, report_dir, warmup: int = WARMUP,
                     optional: tuple[str, ...] = ()) -> LadderRun:
    """Serve `workload_spec` (impl.data.workloads) for `n` requests (a count, or
    impl.data.workloads.AtMost for a default that a smaller file or split caps) once per row of
    `rows` (impl.serve.configs.Row), interleaved, on `model`; the report goes to `report_dir`, also
    when the run stops part-way (it holds what completed). The model's MoE backend and head are
    put back afterwards. `optional`: rows warmed up last and left out, the reason in the result's
    "dropped", where their warm-up runs out of device memory (impl.serve.runner). A workload or a
    row this model cannot run stops the session as a usage error."""
    from impl.data.gsm8k import GSM8KError
    from impl.data.text import TokenizerError, tokenizer_for
    from impl.data.workloads import FEWER_SHOTS, ContextError, WorkloadError, load_workload
    from impl.serve import ArmError, build_arms, run_ladder, where_failed
    from pytest_moeperf.ab_report import write_ab_report, write_unfinished_ab_report
    from pytest_moeperf.report import now
    from pytest_moeperf.ab_summary import failure_place, summarize_ab
    from pytest_moeperf.host_load import Meter
    opts = session.options
    workload_opt, ladder_opt = opts.named("moe_workload"), opts.named("moe_ladder")
    problem = report_folder_problem(Path(report_dir), opts.named("moe_ab_report"))
    if problem:  # found before anything is served, not after
        _usage_exit(problem)
    run = {k: v for k, v in session.run_header().items() if k in ("commit", "started")}
    try:
        write_unfinished_ab_report(report_dir, run)
    except OSError as e:  # a folder the checks above could not see is unwritable (/proc, a full disk)
        _usage_exit(f"{opts.named('moe_ab_report')} {report_dir}: cannot be written ({e})")
    reserve = max((r.config.k for r in rows if r.config.speculative), default=0)
    try:
        tokenizer = tokenizer_for(opts.model, model.config.vocab_size)
        workload = load_workload(workload_spec, tokenizer, model.config.max_seq_len - reserve, n=n, shots=opts.shots)
        workload.check()
    except ContextError as e:
        held = (f" (the model's {model.config.max_seq_len} positions less the {reserve} a speculative row writes "
                "ahead of its last token)") if reserve else ""
        shots = f" (shots: {opts.named('moe_shots')})" if FEWER_SHOTS in str(e) else ""
        _usage_exit(f"{workload_opt} {workload_spec}: {e}{held}{shots}")
    except (WorkloadError, GSM8KError, TokenizerError) as e:
        _usage_exit(f"{workload_opt} {workload_spec}: {e}")
    requests = list(workload)
    if len(requests) < MIN_REQUESTS:
        _usage_exit(f"{workload_opt} {workload_spec}: {len(requests)} request(s); the ladder's speed figures are "
                    f"medians of per-request ratios and need at least {MIN_REQUESTS}")
    if all(r.max_tokens < 2 for r in requests):
        _usage_exit(f"{workload_opt} {workload_spec}: every request ends at its first output token (max_tokens < 2): "
                    "no decode step, so no TPOT or decode speed to compare; give max_tokens >= 2")
    by_id = {r.request_id: r for r in requests}
    restore = (model.moe_backend, model.lm_head)
    try:
        arms = build_arms(model, rows, tokenizer=tokenizer)
    except ArmError as e:
        _usage_exit(f"{ladder_opt}: {e}")
    records: list[dict] = []

    def scored(record: dict) -> None:
        request = by_id[record["request_id"]]
        record.update(workload.score(request, record["text"]))  # marks and the answers each extraction read

    dropped: dict[str, str] = {}
    complete = False
    failure: dict | None = None  # the row that stopped the run, where, and why (in the report)
    meter = Meter(enabled=not session.device.is_cuda)
    try:
        try:
            with meter.measuring():
                run_ladder(arms, requests, on_record=scored, progress=_progress, records=records, warmup=warmup,
                           check=False, optional=optional, dropped=dropped)
        except ArmError as e:  # a row's backend refused the workload: the report below keeps what ran
            failure = _failure(e, where_failed(e), "refused")
            _usage_exit(f"{ladder_opt}: {e}")
        except Exception as e:
            if where_failed(e) is None:
                raise
            # A row's code failed: named once, its traceback printed once (not once a test).
            failure = _failure(e, where_failed(e), "failed")
            _progress("".join(traceback.format_exception(e)))
            pytest.fail(f"row {failure['row']!r} failed on {failure_place(failure)}: {failure['error']} (the A/B "
                        f"report in {report_dir} holds the {len(records)} record(s) served before)", pytrace=False)
        complete = True
    finally:
        model.set_moe_backend(restore[0])
        model.set_head(restore[1])
        arms = [a for a in arms if a.name not in dropped]
        host_load = meter.take()
        result = {
            "run": {**run, "finished": now()},
            "workload": {"name": str(workload_spec), "n_requests": len(requests), "shots": workload.shots or 0,
                         "digest": workload.digest, "details": {"description": workload.description}},
            "device": session.device.describe(),
            "model": model_entry(model, opts.model, tokenizer),
            "arms": [arm_entry(a) for a in arms],
            "requests": records,
            "prompts": [prompt_entry(r) for r in requests],
            "complete": complete,
            "dropped": dropped,
            "host": host_entry(host_load, opts.host_stall),
            "failure": failure,
        }
        try:
            report = write_ab_report(result, report_dir, margin=opts.margin)
            session.ab_reports.append(report["markdown"])
        except OSError as e:  # the gate still judges what was served; the run fails at its end, saying why
            report = {"markdown": f"NOT WRITTEN ({e})"}
            session.write_errors.append(f"the A/B report was NOT written: {report_dir}: {e}")
    arm_records = {a.name: {r["request_id"]: r for r in records if r["arm"] == a.name} for a in arms}
    summary = summarize_ab(result, margin=opts.margin)
    session.ab_verdicts += verdict_lines(summary)
    return LadderRun(result, summary, report, arm_records, host_load)


def verdict_lines(summary: dict) -> list[str]:
    """Each row against the first, a line each, as the terminal summary shows them: the answer to
    "is B faster than A, with the same answers" without opening the report (the gate judges
    only against frozen figures, so a first run passes whatever the verdict, unless --moe-expect)."""
    workload = summary["workload"].get("name", "workload")
    lines = []
    for c in summary["comparisons"]:
        r = c["ratios"]["decode_tokens_per_s"]
        speed = "-" if r is None else f"x{r['ratio']:.3f} [{r['ci'][0]:.3f}, {r['ci'][1]:.3f}]"
        flag = " (FLAGGED: see the report)" if c["arm"] in summary["flagged"] else ""
        lines.append(f"A/B {workload}: {c['arm']} vs {c['reference']}: decode tok/s {speed}, {c['verdict']}{flag}")
    return lines


def arm(ladder: LadderRun, name: str) -> dict:
    return next(a for a in ladder.result["arms"] if a["name"] == name)


def row_config(ladder: LadderRun, row: str, reference: str | None = None) -> dict:
    """What each gated figure of a row depends on: both rows' specs, the workload, its size."""
    ref = arm(ladder, reference) if reference else ladder.result["arms"][0]
    return {"row": arm(ladder, row)["config"], "reference": ref["config"], **workload_key(ladder)}


def workload_key(ladder: LadderRun) -> dict:
    """What the ladder's gated figures depend on of its workload: its name and size, and the
    prompts file's contents (a file edited at the same path is another workload)."""
    w = ladder.result["workload"]
    key = {"workload": w["name"], "requests": w["n_requests"]}
    if w.get("digest"):
        key["prompts"] = w["digest"]
    return key


def paired(ladder: LadderRun, row: str, key: str, reference: str | None = None) -> list[float]:
    """Per request, the row's `key` over the reference row's (default: the first row), on the
    requests both have it for."""
    mine, ref = ladder.records[row], ladder.records[reference or ladder.result["arms"][0]["name"]]
    return [mine[i][key] / ref[i][key] for i in mine if i in ref
            and mine[i][key] is not None and ref[i][key] is not None and ref[i][key] > 0 and mine[i][key] > 0]


def fail_on_provenance(ladder: LadderRun, row: str) -> None:
    """The row ran what its name says (impl.serve.provenance): else the test fails naming the part."""
    error = arm(ladder, row)["provenance_error"]
    if error:
        pytest.fail(f"row {row!r}: {error} (report: {ladder.report['markdown']})", pytrace=False)


def chunks(ids: list, count: int) -> list[list]:
    """`ids` in `count` consecutive runs (the last may be shorter)."""
    size = max(1, math.ceil(len(ids) / count))
    return [ids[j:j + size] for j in range(0, len(ids), size)]


# Scored requests a chunk needs for its fraction right to mean something: a chunk of one request
# scores 0 or 1, and the median of such chunks, frozen, could never be failed against.
MIN_CHUNK = 5


def accuracy_chunks(ids: list, count: int) -> list[list]:
    """`ids` in at most `count` chunks of at least MIN_CHUNK requests, at least three of them (the
    gate's median needs three); skips the test, saying so, with fewer than 3 * MIN_CHUNK."""
    if len(ids) < 3 * MIN_CHUNK:
        pytest.skip(f"{len(ids)} scored request(s): accuracy is gated over chunks of at least {MIN_CHUNK}, three of "
                    f"them at least, so give --moe-requests {3 * MIN_CHUNK} or more (the report has the accuracy)")
    return chunks(ids, min(count, len(ids) // MIN_CHUNK))
