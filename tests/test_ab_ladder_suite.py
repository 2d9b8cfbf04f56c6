"""The A/B ladder suite (suites/test_ab_ladder.py) end to end through pytester, on CPU:

- GSM8K: a random transformers Qwen3-MoE checkpoint with a BPE tokenizer trained on GSM8K train
  text (tests/gsm8k_checkpoint.py), the 5-shot `gsm8k` workload from ../shared/data/gsm8k, three
  questions: every per-request figure is in the report and every answer is scored (strict and
  flexible);
- a run stopped part-way (the serving loop raising at the fifth request): the report still holds
  the records that completed, marked incomplete;
- an unknown row name is a usage error naming it and the presets.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from tests.gsm8k_checkpoint import GSM8K_DIR, build_checkpoint
from tests.pytester_runs import ONE_THREAD_CONFTEST

ROOT = Path(__file__).resolve().parents[1]
SUITE = ROOT / "suites" / "test_ab_ladder.py"
CHECKPOINT = ROOT / "checkpoints" / "tiny-gsm"
FIGURES = ("ttft_s", "latency_s", "tpot_s", "decode_tokens_per_s", "output_tokens", "prompt_tokens")

STOPS_AT_FIFTH = ONE_THREAD_CONFTEST + '''
from impl.serve.engine import EngineRow

_serve = EngineRow.serve
_calls = []


def _stopping(row, request):
    _calls.append(request.request_id)
    if len(_calls) == 2 * 2 + 5:  # two warm-up requests for each of the two rows, then five served
        raise RuntimeError("planted: the serving loop stops here")
    return _serve(row, request)


EngineRow.serve = _stopping
'''


def _run(pytester, conftest, *args):
    pytester.makeconftest(conftest)
    pytester.makepyfile(test_ab_ladder=SUITE.read_text())
    report = pytester.path / "ab"
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "--moe-bench", "--moe-baselines",
                                           str(pytester.mkdir("no-baselines")), "--moe-ab-report", str(report),
                                           "-rA", *args, "test_ab_ladder.py", timeout=600)
    path = report / "ab-report.json"
    return result, json.loads(path.read_text()) if path.is_file() else None


@pytest.fixture(scope="module")
def qwen3_checkpoint(tmp_path_factory) -> Path:
    """Built outside any test that uses `pytester`: pytester drops the modules first imported
    during its test, and transformers' import registers torch libraries (c10d_functional) that
    cannot be registered twice in one process, as a later import would."""
    return build_checkpoint(tmp_path_factory.mktemp("ab-ckpt") / "qwen3-moe")


@pytest.mark.skipif(not (GSM8K_DIR / "test.jsonl").is_file(), reason=f"GSM8K data not found at {GSM8K_DIR}")
def test_gsm8k_five_shot_on_a_checkpoint_with_its_own_tokenizer_reports_every_figure(pytester, qwen3_checkpoint):
    ckpt = qwen3_checkpoint
    result, report = _run(pytester, ONE_THREAD_CONFTEST, "--moe-model", str(ckpt), "--moe-workload",
                          f"gsm8k:{GSM8K_DIR}", "--moe-requests", "3", "--moe-ladder", "a=baseline;b=baseline",
                          "-k", "provenance")
    assert result.ret == 0, result.stdout.str()[-3000:]
    assert report["summary"]["workload"]["shots"] == 5
    # The report names the tokenizer that made the prompts (the checkpoint's own, not bytes) and the weights.
    model = report["summary"]["model"]
    assert model["tokenizer"].startswith(f"HFTokenizer '{ckpt.name}'") and model["spec"] == str(ckpt), model
    assert (model["dtype"], model["experts"]) == ("float32", "fp32"), model
    assert "a CPU computes every row in float32" in model["note"], model
    assert f"tokenizer {model['tokenizer']}" in (pytester.path / "ab" / "ab-report.md").read_text()
    records = report["requests"]
    assert len(records) == 6 and {r["row"] for r in records} == {"a", "b"}
    for r in records:
        assert all(r[f] is not None for f in FIGURES), r
        assert r["ttft_s"] <= r["latency_s"] and r["output_tokens"] > 1
        assert all(isinstance(r[k], bool) for k in ("correct", "strict_correct", "flexible_correct")), r


def test_the_default_ladder_leaves_out_mtp_for_a_checkpoint_without_a_nextn_layer(pytester, qwen3_checkpoint):
    """Before: the default rows named +mtp, so every checkpoint without MTP weights (most Qwen3-MoE
    ones) stopped the whole main job with a usage error it had not asked for."""
    ckpt = qwen3_checkpoint
    result, report = _run(pytester, ONE_THREAD_CONFTEST, "--moe-model", str(ckpt), "--moe-requests", "3",
                          "-k", "provenance")
    assert result.ret == 0, result.stdout.str()[-3000:] + result.stderr.str()[-2000:]
    assert [a["name"] for a in report["rows"]] == ["baseline", "+fp8-head"]
    result.stdout.fnmatch_lines(["A/B: the default ladder leaves out +mtp: model '*qwen3-moe' has no MTP (NEXTN) "
                                 "layer to draft with"])


@pytest.mark.skipif(not (CHECKPOINT / "model.safetensors").is_file(), reason=f"no trained checkpoint at {CHECKPOINT}")
def test_a_run_stopped_part_way_keeps_what_completed_in_its_report(pytester):
    result, report = _run(pytester, STOPS_AT_FIFTH, "--moe-model", str(CHECKPOINT), "--moe-ladder", "baseline;+mtp",
                          "--moe-requests", "8")
    assert result.ret == 1 and "planted: the serving loop stops here" in result.stdout.str(), \
        result.stdout.str()[-3000:]
    assert report is not None and report["summary"]["complete"] is False
    assert len(report["requests"]) == 4 and all(r["text"] is not None for r in report["requests"])
    # What the host did while the completed requests were served is kept too (a CPU run is metered).
    host = report["summary"]["host"]
    assert host["metered"] is True and host["wall_s"] > 0, host
    # The row and request that failed are named once: in the report, which flags that row and gives
    # it no verdict, and in one short failure (the traceback printed once, not once a test).
    failure = report["summary"]["failure"]
    assert failure["kind"] == "failed" and failure["error"] == "RuntimeError: planted: the serving loop stops here"
    row = failure["row"]
    (comparison,) = report["summary"]["comparisons"]
    assert row in ("baseline", "+mtp") and comparison["verdict"] == "failed part-way: no verdict"
    assert report["summary"]["flagged"][row][0].startswith(f"failed on request {failure['request']!r}")
    out = result.stdout.str()
    assert f"row '{row}' failed on request {failure['request']!r}: RuntimeError: planted" in out
    assert (out + result.stderr.str()).count("Traceback (most recent call last)") == 1


def test_an_unknown_row_is_a_usage_error_naming_it(pytester):
    pytester.makepyfile(test_ab_ladder=SUITE.read_text())
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "--moe-bench", "--moe-ladder",
                                           "baseline;+turbo", "test_ab_ladder.py", timeout=300)
    assert result.ret == 4, result.stdout.str()[-2000:] + result.stderr.str()[-2000:]
    result.stderr.fnmatch_lines(["*--moe-ladder*+turbo*"])


def test_a_ladder_is_checked_without_moe_bench_and_its_tests_say_why_they_skip(pytester):
    """A typo in --moe-ladder is named at once, with or without --moe-bench; without it, every
    test of the suite skips for want of --moe-bench, not for an empty parameter set."""
    pytester.makepyfile(test_ab_ladder=SUITE.read_text())
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "--moe-ladder", "baseline;+turbo",
                                           "test_ab_ladder.py", timeout=300)
    assert result.ret == 4, result.stdout.str()[-2000:] + result.stderr.str()[-2000:]
    result.stderr.fnmatch_lines(["*--moe-ladder*+turbo*"])
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-rs", "test_ab_ladder.py", timeout=300)
    out = result.stdout.str()
    assert result.ret == pytest.ExitCode.OK and "empty parameter set" not in out, out[-3000:]
    skipped = re.findall(r"SKIPPED \[(\d+)\] .*?: (.*)", out)
    assert skipped and all("--moe-bench" in why for _, why in skipped), skipped


def _usage_exit(result) -> str:
    out = result.stdout.str() + result.stderr.str()
    assert result.ret == 4, out[-3000:]
    return out


def test_a_row_the_model_cannot_run_stops_the_session_once_as_a_usage_error(pytester):
    """A layer backend named for layers tiny-gsm does not have: one usage error (exit 4) naming
    the row and the key, instead of the same error in every test of the ladder."""
    result, _ = _run(pytester, ONE_THREAD_CONFTEST, "--moe-model", "tiny", "--moe-workload", "synthetic:8:4",
                     "--moe-ladder", "baseline;ta=attention=torch")
    out = _usage_exit(result)
    assert "usage error: --moe-ladder: ta: attention: model 'tiny' has no KDA or MLA layers" in out
    assert "ERROR at setup" not in out


def test_a_workload_the_model_cannot_serve_stops_the_session_once_as_a_usage_error(pytester):
    prompts = pytester.path / "long.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": "word " * 400, "max_tokens": 8}) + "\n" for _ in range(4)))
    result, _ = _run(pytester, ONE_THREAD_CONFTEST, "--moe-model", "tiny", "--moe-workload", f"jsonl:{prompts}",
                     "--moe-ladder", "baseline;+fp8-head")
    out = _usage_exit(result)
    assert f"usage error: --moe-workload jsonl:{prompts}" in out and "more than the model's context" in out


def test_a_run_that_stops_before_its_report_leaves_no_earlier_report_behind(pytester):
    """Before: a usage error found in the workload left the previous run's report and figures in the
    folder, undated, as if they were this run's."""
    old = pytester.mkdir("ab")
    (old / "ab-report.md").write_text("# A/B ladder: arith\n\nthe previous run's verdicts\n")
    (old / "ab-ladder.png").write_bytes(b"old figure")
    prompts = pytester.path / "long.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": "word " * 400, "max_tokens": 8}) + "\n" for _ in range(4)))
    result, report = _run(pytester, ONE_THREAD_CONFTEST, "--moe-model", "tiny", "--moe-workload", f"jsonl:{prompts}",
                          "--moe-ladder", "baseline;+fp8-head")
    _usage_exit(result)
    assert sorted(p.name for p in old.iterdir()) == ["ab-report.json", "ab-report.md"]
    md = (old / "ab-report.md").read_text()
    assert md.startswith("# A/B ladder: did not finish") and "- run: commit " in md and "started 20" in md
    assert report["status"] == "did not finish" and set(report["run"]) == {"commit", "started"}


FULL_DISK = ONE_THREAD_CONFTEST + '''
import errno
import moe_harness.ladder.report as ab_report


def _full(path, data):
    raise OSError(errno.ENOSPC, "No space left on device", str(path))


ab_report.atomic_write_bytes = _full
'''


def test_a_report_folder_that_refuses_files_is_a_usage_error_before_serving(pytester):
    """A folder whose permissions look writable but whose writes fail (a full disk, /proc) is found
    when the did-not-finish report is written, before any request is served. Before: the whole
    ladder ran, and only then was its report NOT written."""
    result, _ = _run(pytester, FULL_DISK, "--moe-model", "tiny", "--moe-workload", "synthetic:8:4",
                     "--moe-ladder", "baseline;+fp8-head")
    out = _usage_exit(result)
    assert "usage error: --moe-ab-report" in out and "cannot be written" in out and "No space left" in out, out
    assert "moeperf ladder:" not in out  # nothing served


@pytest.mark.parametrize("lines, outcome", [(4, "served"), (2, "too few")])
def test_without_a_request_count_a_small_prompts_file_is_served_whole(pytester, lines, outcome):
    """The default count (60 on a CPU) is capped by the file's size; a file of fewer prompts than a
    median needs is a usage error, not a failure of every speed test."""
    prompts = pytester.path / "mine.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"{i} + {i} =", "max_tokens": 4}) + "\n" for i in range(lines)))
    result, report = _run(pytester, ONE_THREAD_CONFTEST, "--moe-model", "tiny", "--moe-workload", f"jsonl:{prompts}",
                          "--moe-ladder", "baseline;+fp8-head", "-k", "provenance")
    if outcome == "served":
        assert result.ret == 0, result.stdout.str()[-3000:]
        assert report["summary"]["workload"]["n_requests"] == 4 and len(report["requests"]) == 8
        # What the report holds to check the outputs by, and what decides whether they should agree.
        assert [p["prompt"] for p in report["prompts"]] == [f"{i} + {i} =" for i in range(4)]
        assert all({"output_ids", "strict_answer", "flexible_answer"} <= set(r) for r in report["requests"])
        base, fp8 = report["rows"]
        assert (base["runs_as"], base["greedy"], base["head"], base["assumed"]) == (base["config"], True, "bf16", False)
        assert fp8["head"].startswith("fp8:") and report["summary"]["workload"]["digest"]
        md = (pytester.path / "ab" / "ab-report.md").read_text()
        assert f"(contents {report['summary']['workload']['digest']})" in md
        result.stdout.fnmatch_lines([f"A/B ladder report: {pytester.path / 'ab' / 'ab-report.md'} (every request*"])
    else:
        assert "2 request(s); the ladder's speed figures are medians of per-request ratios and need at least 3" \
            in _usage_exit(result)


def test_fewer_requests_than_a_median_needs_is_a_usage_error(pytester):
    pytester.makepyfile(test_ab_ladder=SUITE.read_text())
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "--moe-bench", "--moe-requests", "2",
                                           "test_ab_ladder.py", timeout=300)
    assert "--moe-requests must be a whole number in [3, 100000], got '2'" in _usage_exit(result)


def test_a_ladder_of_one_row_is_a_usage_error(pytester):
    """Every figure compares a row with the first: one row would compare nothing and pass."""
    pytester.makepyfile(test_ab_ladder=SUITE.read_text())
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "--moe-bench", "--moe-ladder", "baseline",
                                           "test_ab_ladder.py", timeout=300)
    assert "--moe-ladder 'baseline': one row; the ladder compares each row with its first" in _usage_exit(result)


@pytest.mark.parametrize("where", ["a file", "under a file"])
def test_a_report_folder_that_cannot_be_written_is_a_usage_error_before_serving(pytester, where):
    """Not found after every row was served (then every test of the ladder erred and nothing was gated)."""
    (pytester.path / "afile").write_text("x")
    target = pytester.path / "afile" if where == "a file" else pytester.path / "afile" / "sub"
    pytester.makeconftest(ONE_THREAD_CONFTEST)
    pytester.makepyfile(test_ab_ladder=SUITE.read_text())
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "--moe-bench", "--moe-model", "tiny",
                                           "--moe-workload", "synthetic:8:4", "--moe-ladder", "baseline;+fp8-head",
                                           "--moe-ab-report", str(target), "test_ab_ladder.py", timeout=300)
    out = _usage_exit(result)
    assert f"--moe-ab-report {target}:" in out and "rows served" not in out.lower()


def test_a_workload_of_one_token_answers_is_a_usage_error(pytester):
    """max_tokens 1 everywhere: no decode step, so no TPOT to compare (every speed figure would
    fail with a misleading message)."""
    prompts = pytester.path / "one.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"{i} + {i} =", "max_tokens": 1}) + "\n" for i in range(4)))
    result, _ = _run(pytester, ONE_THREAD_CONFTEST, "--moe-model", "tiny", "--moe-workload", f"jsonl:{prompts}",
                     "--moe-ladder", "baseline;+fp8-head")
    assert "every request ends at its first output token (max_tokens < 2)" in _usage_exit(result)


def test_a_checkpoint_whose_tokenizer_cannot_load_is_a_usage_error(pytester):
    folder = pytester.mkdir("tokbad")
    for name in ("config.json", "model.safetensors"):
        (folder / name).write_bytes((CHECKPOINT / name).read_bytes())
    (folder / "tokenizer.json").write_text("{}")
    result, _ = _run(pytester, ONE_THREAD_CONFTEST, "--moe-model", str(folder), "--moe-ladder", "baseline;+fp8-head")
    out = _usage_exit(result)
    assert "could not load its tokenizer" in out and "ERROR at setup" not in out


def test_a_usage_error_found_during_the_run_names_the_ini_key_it_came_from(pytester):
    """The workload set in pytest.ini, not on the command line: the message says where to look,
    and that the context it gives is the model's less what a speculative row writes ahead."""
    pytester.makeini("[pytest]\nmoe_workload = synthetic:380:3\n")
    result, _ = _run(pytester, ONE_THREAD_CONFTEST, "--moe-model", "tiny", "--moe-ladder", "baseline;+mtp")
    out = _usage_exit(result)
    assert "usage error: ini key moe_workload (--moe-workload) synthetic:380:3:" in out
    assert "the model's 384 positions less the 3 a speculative row writes ahead" in out


def test_figures_frozen_on_a_prompts_file_are_not_gated_against_another_file_at_its_path(pytester):
    """Before: the file's path was its identity, so prompts edited in place were gated against the
    figures of the old ones (their TTFT ratio read as a 45% regression)."""
    prompts = pytester.path / "mine.jsonl"

    def write(prefix):
        prompts.write_text("".join(json.dumps({"prompt": f"{prefix}{i} + {i} =", "max_tokens": 4}) + "\n"
                                   for i in range(6)))

    pytester.makeconftest(ONE_THREAD_CONFTEST)
    pytester.makepyfile(test_ab_ladder=SUITE.read_text())
    baselines = pytester.mkdir("baselines")

    def run(*extra):
        return pytester.runpytest_subprocess(
            "-p", "no:cacheprovider", "--moe-bench", "--moe-baselines", str(baselines), "--moe-model", "tiny",
            "--moe-workload", f"jsonl:{prompts}", "--moe-ladder", "baseline;+fp8-head", "-k", "speed", "-rs",
            "--moe-host-stall", "off", *extra, "test_ab_ladder.py", timeout=600)  # the freeze must not be refused

    write("")
    frozen = run("--moe-freeze")
    assert frozen.ret == 0, frozen.stdout.str()[-3000:]
    write("Some other question: ")
    edited = run()
    out = edited.stdout.str()
    assert edited.ret == 0 and "regression" not in out, out[-3000:]
    assert out.count("taken under another configuration") == 3 and "prompts" in out, out[-3000:]
    write("")
    again = run()
    assert "taken under another configuration" not in again.stdout.str(), again.stdout.str()[-3000:]
    assert "3 figure(s) compared" in again.stdout.str(), again.stdout.str()[-3000:]
