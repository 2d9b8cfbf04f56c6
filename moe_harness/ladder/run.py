"""Running an A/B ladder inside a suite: serve a workload once per row, interleaved, score it, and
write the report (also when a request fails part-way); then the paired figures the suites gate."""

from __future__ import annotations

import dataclasses
import functools
import math
import sys
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import NoReturn

import pytest

from impl.serve.result import Failure, LadderResult, LadderStopped

WARMUP = 2  # requests per row before timing: graphs captured, every compile of a first shape done
# The speed figures are medians of per-request paired ratios; below three there is no median to gate.
MIN_REQUESTS = 3


@dataclass(frozen=True)
class LadderRun:
    result: LadderResult  # what every row served (impl.serve.result)
    summary: dict  # summary.summarize_ab(result), computed once for the report, verdicts and gate
    report: dict  # what write_ab_report wrote
    # The host's CPU contention while the rows were served (host_load.Meter; None on a GPU, whose
    # timings do not wait for the host's CPUs): the speed figures are judged and frozen by it.
    host_load: object = None

    @functools.cached_property
    def by_row(self) -> dict:
        """{row: {request id: ServedRequest}}."""
        return self.result.by_row()


def _progress(line: str) -> None:
    print(f"\nmoeperf ladder: {line}", file=sys.stderr, end="")


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
    from pytest_moeperf.files import unwritable_ancestor
    if folder.exists() and not folder.is_dir():
        return f"{option} {folder}: is a file; a folder is needed"
    blocked = unwritable_ancestor(folder)
    return None if blocked is None else f"{option} {folder}: cannot be written ({blocked} is not a writable folder)"


def run_suite_ladder(harness, model, rows, workload_spec, n, report_dir, warmup: int = WARMUP,
                     optional: tuple[str, ...] = ()) -> LadderRun:
    """Serve `workload_spec` (impl.data.workloads) for `n` requests (a count, or
    impl.data.workloads.AtMost for a default that a smaller file or split caps) once per row of
    `rows` (impl.serve.rows.Row), interleaved, on `model`; the report goes to `report_dir`, also
    when the run stops part-way (it holds what completed). The model's MoE backend and head are
    put back afterwards. `optional`: rows warmed up last and left out, the reason in the result's
    "dropped", where their warm-up runs out of device memory (impl.serve.ladder). A workload or a
    row this model cannot run stops the session as a usage error."""
    from impl.data.gsm8k import GSM8KError
    from impl.data.text import TokenizerError, tokenizer_for
    from impl.data.workloads import FEWER_SHOTS, ContextError, WorkloadError, load_workload
    from impl.serve import Ladder, LadderStopped, RowError
    from moe_harness.ladder.endpoints.server_row import ServerRow
    from moe_harness.ladder.report import write_ab_report, write_unfinished_ab_report
    from pytest_moeperf.report import now
    from moe_harness.ladder.summary import summarize_ab
    from pytest_moeperf.host_load import Meter
    opts, session = harness.options, harness.core  # the harness's options; the gate core's session
    workload_opt, ladder_opt = opts.named("moe_workload"), opts.named("moe_ladder")
    problem = report_folder_problem(Path(report_dir), opts.named("moe_ab_report"))
    if problem:  # found before anything is served, not after
        _usage_exit(problem)
    run = {k: v for k, v in session.run_header().items() if k in ("commit", "started")}
    try:
        write_unfinished_ab_report(report_dir, run)
    except OSError as e:  # a folder the checks above could not see is unwritable (/proc, a full disk)
        _usage_exit(f"{opts.named('moe_ab_report')} {report_dir}: cannot be written ({e})")
    reserve = max((_drafts(r) for r in rows), default=0)
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
        rows = _build_rows(model, rows, tokenizer, harness, Path(report_dir))
    except RowError as e:
        _usage_exit(f"{ladder_opt}: {e}")

    def scored(served):  # marks and the answers each extraction read
        return dataclasses.replace(served, marks=workload.score(by_id[served.request_id], served.text))

    ladder = Ladder(rows, requests, warmup=warmup, check=False, optional=optional, progress=_progress,
                    stop_on_error=opts.server_errors == "stop", block=getattr(opts.servers, "block", None),
                    one_at_a_time=getattr(opts.servers, "one_at_a_time", False))
    complete = False
    failure = None  # the row that stopped the run, where, and why (in the report)
    meter = Meter(enabled=not session.device.is_cuda)
    try:
        try:
            _same_model(rows, model, opts)
            with meter.measuring():
                ladder.run(on_request=scored)
        except LadderStopped as e:
            failure = e.failure
            if failure.kind == "refused":  # a row's backend refused the workload: the report below keeps what ran
                _usage_exit(f"{ladder_opt}: {e}")
            # A row's code failed: named once, its traceback printed once (not once a test).
            _progress("".join(traceback.format_exception(e.__cause__ or e)))
            pytest.fail(f"row {failure.row!r} failed {failure.at()}: {failure.error} (the A/B report in "
                        f"{report_dir} holds the {len(e.served)} record(s) served before)", pytrace=False)
        complete = True
    finally:
        model.set_moe_backend(restore[0])
        model.set_head(restore[1])
        for row in rows:
            if isinstance(row, ServerRow):
                row.stop()
        host_load = meter.take()
        result = LadderResult(
            rows=tuple(r.entry() for r in rows if r.name not in ladder.dropped),
            requests=tuple(ladder.served),
            workload={"name": str(workload_spec), "n_requests": len(requests), "shots": workload.shots or 0,
                      "digest": workload.digest, "details": {"description": workload.description}},
            device=session.device.describe(), model=model_entry(model, opts.model, tokenizer), complete=complete,
            run={**run, "finished": now(), "schedule": ladder.schedule}, prompts=tuple(prompt_entry(r) for r in requests),
            dropped=dict(ladder.dropped), host=host_entry(host_load, session.options.host_stall), failure=failure)
        summary = summarize_ab(result, margin=opts.margin)
        try:
            report = write_ab_report(result, summary, report_dir)
            harness.ab_reports.append(report["markdown"])
        except OSError as e:  # the gate still judges what was served; the run fails at its end, saying why
            report = {"markdown": f"NOT WRITTEN ({e})"}
            session.write_errors.append(f"the A/B report was NOT written: {report_dir}: {e}")
    harness.ab_verdicts += verdict_lines(summary)
    return LadderRun(result, summary, report, host_load)


def _drafts(row) -> int:
    """Drafts a step of a ladder row (0: not speculative): positions it writes past its last token."""
    config = getattr(row, "config", None)
    return (config.k if config.speculative else 0) if config is not None else row.speculative


def _build_rows(model, rows, tokenizer, harness, report_dir: Path) -> list:
    """The rows the ladder interleaves: this engine's built rows (impl.serve.engine.EngineRow) on
    `model`, and servers (moe_harness.ladder.endpoints.server_row.ServerRow), their logs beside the report."""
    from impl.model.config import EMBEDDED
    from impl.serve import EngineRow, build_rows
    from impl.serve.rows import Row
    from moe_harness.ladder.endpoints.server_row import ServerRow
    local = [r for r in rows if isinstance(r, Row)]
    built = {b.name: EngineRow(b) for b in build_rows(model, local, tokenizer=tokenizer)} if local else {}
    spec = harness.options.model
    folder = str(EMBEDDED.get(spec, Path(spec)))
    return [built[r.name] if isinstance(r, Row) else
            ServerRow(r, tokenizer=tokenizer, log_dir=report_dir, model=folder, rootdir=harness.core.rootdir or Path.cwd())
            for r in rows]


def _same_model(rows, model, opts) -> None:
    """Start the server rows and refuse a ladder whose rows serve different models (unless
    --moe-allow-different-models): their outputs and answers could not be compared. A server's
    model is where it loaded it from (`root`), else the id it serves it under."""
    from impl.model.config import EMBEDDED
    from moe_harness.ladder.endpoints.server_row import ServerRow
    servers = [r for r in rows if isinstance(r, ServerRow)]
    alone = getattr(opts.servers, "one_at_a_time", False)
    for row in servers if not alone else ():  # side by side: their start-ups overlap
        try:
            row.start()
        except Exception as e:
            raise LadderStopped(Failure(row.name, None, "failed", f"{type(e).__name__}: {e}"), (), {}) from e
    for row in servers:
        try:
            row.prepare()
            if alone:
                row.suspend()  # the ladder brings each back for its blocks
        except Exception as e:  # a server that would not start or answer: the row's failure, named
            raise LadderStopped(Failure(row.name, None, "failed", f"{type(e).__name__}: {e}"), (), {}) from e
    if opts.allow_different_models or not servers:
        return
    served = {r.name: r.info.root or r.info.model for r in servers}
    if len(servers) < len(rows):  # this engine's rows serve --moe-model
        served["this engine"] = str(EMBEDDED.get(opts.model, Path(opts.model)))
    if len({str(Path(v).resolve()) if Path(v).exists() else v for v in served.values()}) > 1:
        raise LadderStopped(Failure(servers[0].name, None, "refused", "the rows serve different models: " + "; ".join(
            f"{k}: {v}" for k, v in served.items()) + " (--moe-allow-different-models to compare them anyway)"),
            (), {})


def verdict_lines(summary: dict) -> list[str]:
    """Each row against the first, a line each, as the terminal summary shows them: the answer to
    "is B faster than A, with the same answers" without opening the report (the gate judges
    only against frozen figures, so a first run passes whatever the verdict, unless --moe-expect)."""
    workload = summary["workload"].get("name", "workload")
    lines = []
    for c in summary["comparisons"]:
        r = c["ratios"]["decode_tokens_per_s"]
        speed = "-" if r is None else f"x{r['ratio']:.3f} [{r['ci'][0]:.3f}, {r['ci'][1]:.3f}]"
        flag = " (FLAGGED: see the report)" if c["row"] in summary["flagged"] else ""
        lines.append(f"A/B {workload}: {c['row']} vs {c['reference']}: decode tok/s {speed}, {c['verdict']}{flag}")
    return lines


def row_config(ladder: LadderRun, row: str, reference: str | None = None) -> dict:
    """What each gated figure of a row depends on: both rows' specs, the workload, its size."""
    ref = ladder.result.row(reference) if reference else ladder.result.rows[0]
    return {"row": ladder.result.row(row).config, "reference": ref.config, **workload_key(ladder)}


def workload_key(ladder: LadderRun) -> dict:
    """What the ladder's gated figures depend on of its workload: its name and size, and the
    prompts file's contents (a file edited at the same path is another workload)."""
    w = ladder.result.workload
    key = {"workload": w["name"], "requests": w["n_requests"]}
    if w.get("digest"):
        key["prompts"] = w["digest"]
    return key


def paired(ladder: LadderRun, row: str, key: str, reference: str | None = None) -> list[float]:
    """Per request, the row's figure `key` (a ServedRequest attribute) over the reference row's
    (default: the first row), on the requests both have it for."""
    mine, ref = ladder.by_row[row], ladder.by_row[reference or ladder.result.rows[0].name]
    pairs = [(getattr(mine[i], key), getattr(ref[i], key)) for i in mine if i in ref]
    return [a / b for a, b in pairs if a is not None and b is not None and a > 0 and b > 0]


def fail_on_provenance(ladder: LadderRun, row: str) -> None:
    """The row ran what its name says (impl.serve.provenance): else the test fails naming the part."""
    error = ladder.result.row(row).provenance_error
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
