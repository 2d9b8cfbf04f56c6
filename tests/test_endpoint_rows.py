"""The ladder suite with rows that are real servers, through pytester in a subprocess each:
this project's engine over HTTP (python -m impl.serve --http) beside its in-process rows, and
vLLM's CPU build (.venv-vllm: `scripts/setup-env --vllm`, as .ci/run runs it) serving the
embedded checkpoint declared speculative without a speculative config, with MTP, and with a
scrambled NEXTN layer. Each run's report (JSON) is read for what the rows served."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from tests.broken_checkpoints import scrambled_nextn_copy

ROOT = Path(__file__).resolve().parents[1]
SUITE = ROOT / "suites" / "test_ab_ladder.py"
CHECKPOINT = ROOT / "checkpoints" / "tiny-gsm"
VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"
SECRET = "moeperf-planted-secret-7f3a9c"

HTTP_ROW = """
[[server]]
name = "{name}"
command = ["{{python}}", "-m", "impl.serve", "--http", "{{port}}", "--model", "{model}", "--row", "{row}",
           "--device", "cpu", "--threads", "1"]
speculative = {k}
api_key_env = "MOEPERF_TEST_KEY"
startup_timeout_s = 120
"""


@pytest.fixture(autouse=True)
def _key(monkeypatch):
    monkeypatch.setenv("MOEPERF_TEST_KEY", SECRET)


def _run(pytester, servers: str, *args, conftest: str | None = None):
    (pytester.path / "servers.toml").write_text(servers)
    if conftest:
        pytester.makeconftest(conftest)
    pytester.makepyfile(test_ab_ladder=SUITE.read_text())
    report = pytester.path / "ab"
    result = pytester.runpytest_subprocess(
        "-p", "no:cacheprovider", "-rA", "--moe-bench", "--moe-baselines", str(pytester.mkdir("baselines")),
        "--moe-ab-report", str(report), "--moe-servers", str(pytester.path / "servers.toml"), "--moe-model", str(CHECKPOINT), *args,
        "test_ab_ladder.py", timeout=600)
    path = report / "ab-report.json"
    doc = json.loads(path.read_text()) if path.is_file() else None
    return result, doc


def _rows(doc) -> dict:
    return {r["name"]: r for r in doc["summary"]["rows"]}


def test_this_engine_over_http_serves_what_it_serves_in_process_and_never_writes_its_key(pytester):
    servers = HTTP_ROW.format(name="http-mtp", model=CHECKPOINT, row="+mtp", k=3)
    result, doc = _run(pytester, servers, "--moe-ladder", "+mtp;http-mtp", "--moe-requests", "8")
    assert result.ret == 0, result.stdout.str()[-3000:]
    (c,) = doc["summary"]["comparisons"]
    assert c["outputs"] == {"n": 8, "identical": 8, "first_difference_p50": None}, c["outputs"]
    rows = _rows(doc)
    local, http = rows["+mtp"]["accept_length"], rows["http-mtp"]["accept_length"]
    # The same drafts over HTTP, read from the server's counters (the client cuts each stream at
    # its own stop, before the last chunk). The step the server was running when the client went
    # away is not counted, so most requests have as many verify steps as in process: one more in
    # every request before that was so; a client slow to close on a loaded host can still add one.
    assert http["sources"] == ["moeperf /metrics"] and abs(http["mean"] - local["mean"]) < 0.3, (local, http)
    steps = {(r["row"], r["request_id"]): r["verify_steps"] for r in doc["requests"]}
    alike = [i for (row, i), n in steps.items() if row == "+mtp" and steps[("http-mtp", i)] == n]
    assert len(alike) >= 4, steps
    # Flagged for nothing it computes. Reading slower than in process is allowed: each token crosses
    # a stream from another process, and on a loaded 2-core host that read x0.88 [0.81, 0.96].
    unexpected = [f for f in rows["http-mtp"]["flags"] if not f.startswith("slower than +mtp:")]
    assert len(http["acceptance_per_position"]) == 3 and not unexpected, unexpected
    server = rows["http-mtp"]["server"]
    assert (server["engine"], server["model"]) == ("moeperf", str(CHECKPOINT)) and server["speculative"]["k"] == 3
    written = [p for p in pytester.path.rglob("*") if p.is_file()]
    assert any(p.name == "server-http-mtp.log" for p in written)
    leaked = [str(p) for p in written if SECRET.encode() in p.read_bytes()]
    assert not leaked and SECRET not in result.stdout.str() + result.stderr.str(), leaked


def test_a_row_serving_another_model_is_refused(pytester):
    servers = HTTP_ROW.format(name="other", model="tiny", row="baseline", k=0)  # random weights, another model
    result, _ = _run(pytester, servers, "--moe-ladder", "baseline;other", "--moe-requests", "3")
    assert result.ret == pytest.ExitCode.USAGE_ERROR, result.stdout.str()[-3000:]
    assert "the rows serve different models" in result.stdout.str() + result.stderr.str()


KILL_AFTER_THREE = """
import os, signal
from moe_harness.ladder.endpoints.server_row import ServerRow

_serve = ServerRow.serve
_calls = []


def _killing(row, request):
    _calls.append(request.request_id)
    if len(_calls) == 3 + 1:  # warm-up (2), then one served: the server dies before the second
        os.killpg(row.server.process.pid, signal.SIGKILL)
    return _serve(row, request)


ServerRow.serve = _killing
"""


def test_a_managed_server_killed_mid_run_stops_the_ladder_with_a_clear_error_and_keeps_what_completed(pytester):
    servers = HTTP_ROW.format(name="http", model=CHECKPOINT, row="baseline", k=0)
    result, doc = _run(pytester, servers, "--moe-ladder", "baseline;http", "--moe-requests", "6",
                       conftest=KILL_AFTER_THREE)
    out = result.stdout.str()
    assert result.ret == 1 and "row 'http' failed on request" in out, out[-3000:]
    assert "the managed server 'http' is no longer running (exit status -9)" in out, out[-3000:]
    assert not doc["summary"]["complete"] and doc["summary"]["failure"]["row"] == "http"
    served = [(r["row"], r["error"] is None) for r in doc["requests"]]
    assert ("http", True) in served and ("http", False) in served  # what completed, and the failed request


def test_a_server_that_exits_at_start_is_named_with_its_logs_last_lines(pytester):
    servers = """
[[server]]
name = "broken"
command = ["{python}", "-c", "print('no such model: planted'); raise SystemExit(3)"]
"""
    result, _ = _run(pytester, servers, "--moe-ladder", "baseline;broken", "--moe-requests", "3")
    out = result.stdout.str()
    assert result.ret == 1 and "server 'broken' exited (status 3) before it became healthy" in out, out[-3000:]
    assert "no such model: planted" in out


VLLM_ROW = """
[[server]]
name = "{name}"
command = ["{vllm}", "-m", "vllm.entrypoints.openai.api_server", "--model", "{model}", "--port", "{{port}}",
           "--host", "127.0.0.1", "--dtype", "float32", "--enforce-eager", "--max-model-len", "384"{extra}]
env = {{ VLLM_CPU_KVCACHE_SPACE = "1", VLLM_CPU_OMP_THREADS_BIND = "{core}", VLLM_SERVER_DEV_MODE = "1" }}
speculative = {k}
startup_timeout_s = 400
"""
MTP = ', "--speculative-config", \'{"method":"mtp","num_speculative_tokens":3}\''


@pytest.mark.skipif(not VLLM_PYTHON.is_file(), reason=f"no vLLM CPU build at {VLLM_PYTHON}: run scripts/setup-env "
                                                      "--vllm (.ci/run does)")
def test_vllm_serves_the_checkpoint_with_mtp_and_the_trap_rows_are_flagged(pytester, tmp_path):
    """Three vLLM servers on the embedded checkpoint beside this engine's plain row (the ladder's
    reference, which costs no server start): declared speculative but started without a
    speculative config (so a plain server), MTP k=3, and MTP on a copy whose NEXTN layer is
    scrambled. The MTP row accepts most drafts (about 3.8 of 4 tokens a step) with the plain
    row's outputs; the two trap rows are flagged and fail their provenance and `--moe-expect
    faster`."""
    broken = scrambled_nextn_copy(CHECKPOINT, tmp_path / "tiny-gsm-scrambled-nextn")
    row = lambda name, model, core, k, extra="": VLLM_ROW.format(name=name, vllm=VLLM_PYTHON, model=model,  # noqa: E731
                                                                 core=core, k=k, extra=extra)
    servers = (row("mtp-without-config", CHECKPOINT, 0, 3) + row("mtp", CHECKPOINT, 1, 3, MTP)
               + row("mtp-scrambled", broken, 0, 3, MTP))
    result, doc = _run(pytester, servers, "--moe-ladder", "baseline;mtp-without-config;mtp;mtp-scrambled",
                       "--moe-requests", "8", "--moe-expect", "faster",
                       "--moe-allow-different-models")  # the scrambled copy is another folder: the same target
    out = result.stdout.str()
    assert doc is not None, out[-4000:] + result.stderr.str()[-3000:]
    rows = _rows(doc)
    mtp = rows["mtp"]
    assert mtp["accept_length"]["mean"] > 3.0 and mtp["accept_length"]["sources"] == ["vllm /metrics"], mtp
    # Flagged for nothing it serves. vLLM's CPU build beside this engine's in-process row may read
    # slower (three servers share two cores with the other test worker): speed is not the claim here.
    unexpected = [f for f in mtp["flags"] if not f.startswith("slower than baseline:")]
    assert len(mtp["accept_length"]["acceptance_per_position"]) == 3 and not unexpected, mtp["flags"]
    by = {c["row"]: c for c in doc["summary"]["comparisons"]}
    assert by["mtp"]["outputs"]["identical"] == by["mtp"]["outputs"]["n"] == 8
    assert rows["mtp"]["server"]["speculative"] == {"method": "mtp", "k": 3}
    flags = " | ".join(rows["mtp-without-config"]["flags"])
    assert "no speculative decoding" in flags and "no acceptance was reported" in flags, flags
    scrambled = rows["mtp-scrambled"]
    assert scrambled["accept_length"]["mean"] < 1.5, scrambled["accept_length"]
    assert any("almost never accepted" in f for f in scrambled["flags"]), scrambled["flags"]
    # -rA lines: "OUTCOME <path>::<test>[ - message]" (the path varies with the rootdir)
    outcomes = {rest.split(" - ")[0].split("::", 1)[1]: outcome for outcome, rest in
                (line.split(" ", 1) for line in out.splitlines() if line.startswith(("PASSED ", "FAILED ")))}
    for trap in ("mtp-without-config", "mtp-scrambled"):
        assert outcomes[f"test_row_provenance[{trap}]"] == outcomes[f"test_row_as_expected[{trap}]"] == "FAILED", (
            outcomes)
        assert f"row {trap!r} is expected faster than 'baseline' (--moe-expect faster) but does not run what it " \
               "declares" in out, out[-4000:]
    assert outcomes["test_row_provenance[mtp]"] == "PASSED", outcomes
