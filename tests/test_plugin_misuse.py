"""The plugin under misuse, through pytester: a gated figure the gate cannot judge or a baseline
could not hold, outputs that cannot be written, runs without --moe-bench near a damaged baselines
folder, and option values that are not what they name. Each case fails the code before its mend."""

from __future__ import annotations

import json

import pytest

from pytester_runs import run_inner

# One figure, checked as CASE says; 5 samples with a 1% spread unless the case changes them.
CASES = """
import math, os
import pytest

pytestmark = pytest.mark.moe_bench
CASE = os.environ.get("CASE", "")
SAMPLES = [100.0, 101.0, 99.0, 100.5, 99.5]

def test_case(moe_gate):
    kw = dict(unit="us", direction="lower", tolerance=0.1)
    if CASE == "tolerance":
        kw["tolerance"] = 0.0
    if CASE == "twice":
        moe_gate.check("m", SAMPLES, **kw)
    samples = {"nan": [math.nan] * 5, "one": [100.0], "zero": [0.0] * 5}.get(CASE, SAMPLES)
    if CASE == "unit":
        samples, kw["unit"] = [s / 1000 for s in SAMPLES], "ms"
    moe_gate.check("m", samples, **kw)
"""


@pytest.fixture
def run(pytester, monkeypatch):
    pytester.makepyfile(test_cases=CASES)

    def go(*args, case=""):
        monkeypatch.setenv("CASE", case)
        return run_inner(pytester, *args, monkeypatch=monkeypatch)
    return go


def _baseline_files(pytester) -> list:
    return sorted((pytester.path / "baselines").glob("*.json"))


@pytest.mark.parametrize("case, problem", [
    ("tolerance", "tolerance must be a fraction in (0, 1) or Reported(reason), got 0.0"),
    ("nan", "cannot freeze samples ?nan, nan, nan?"),
    ("zero", "cannot freeze samples ?0.0, 0.0, 0.0?"),
    ("one", "1 sample(s); the gate needs at least 3"),
])
def test_a_figure_no_later_run_could_load_or_judge_is_never_frozen(run, pytester, case, problem):
    """Before: each froze, and the next run refused the whole baselines folder (or gated every
    later figure against a zero or a single sample)."""
    result = run("--moe-bench", "--moe-freeze", case=case)
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines([f"*test_cases.py::test_case::m*{problem}*"])
    assert _baseline_files(pytester) == []
    run("--moe-bench").assert_outcomes(skipped=1)  # the folder still loads: nothing to gate against


def test_a_figure_checked_twice_in_one_test_is_an_error_and_the_first_stands(run, pytester):
    """Before: both rows were recorded under one id, and the second silently replaced the first."""
    result = run("--moe-bench", "--moe-freeze", case="twice")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*metric 'test_cases.py::test_case::m' was already checked in this run*"])
    run("--moe-bench").assert_outcomes(passed=1)  # gated against the first check's figure


def test_a_unit_changed_since_the_freeze_is_an_error_with_no_blank_row(run, pytester):
    """Before: the row was recorded before the check raised, with an empty verdict in the table
    and the report, and counted as compared."""
    run("--moe-bench", "--moe-freeze").assert_outcomes(passed=1)
    result = run("--moe-bench", "--moe-report", "out/r.json", case="unit")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*test_cases.py::test_case::m*frozen as 'us'/'lower' but measured as 'ms'/'lower'*"])
    doc = json.loads((pytester.path / "out" / "r.json").read_text())
    assert doc["metrics"] == []


def test_a_run_without_moe_bench_never_reads_the_baselines(pytester, monkeypatch):
    """Before: any pytest run beside a folder holding a JSON file that is no baseline failed at
    its end with a traceback, and so did one naming a CUDA device the host lacks."""
    pytester.makepyfile(test_plain="def test_plain():\n    assert True\n")
    (pytester.path / "baselines").mkdir()
    (pytester.path / "baselines" / "notes.json").write_text('{"foo": 1}')
    result = run_inner(pytester, monkeypatch=monkeypatch)
    result.assert_outcomes(passed=1)
    assert result.ret == pytest.ExitCode.OK
    result = run_inner(pytester, "--moe-device", "cuda:7", monkeypatch=monkeypatch)
    assert result.ret == pytest.ExitCode.OK


def test_the_gate_outside_moe_bench_skips_saying_why(pytester, monkeypatch):
    """A test that asks for the gate without the marker is not gated in an ordinary run (beside
    other workers its timing would fail for the host)."""
    pytester.makepyfile(test_unmarked="""
def test_unmarked(moe_gate):
    moe_gate.check("m", [100.0, 101.0, 99.0], unit="us", direction="lower", tolerance=0.1)
""")
    result = run_inner(pytester, monkeypatch=monkeypatch)
    result.assert_outcomes(skipped=1)
    result.stdout.fnmatch_lines(["*moe_gate gates performance figures: run with --moe-bench*"])


@pytest.mark.parametrize("args, message", [
    (["--moe-bench", "--moe-report", "out"], "--moe-report */out: is a folder; a file path is needed"),
    (["--moe-bench", "--moe-baselines", "afile"], "afile: not a folder"),
    (["--moe-bench", "--moe-freeze", "--moe-baselines", "afile/sub"], "--moe-baselines */afile/sub: cannot be "
     "written (*/afile is not a writable folder)"),
])
def test_outputs_that_cannot_be_written_are_usage_errors_before_measuring(run, pytester, args, message):
    (pytester.path / "out").mkdir()
    (pytester.path / "afile").write_text("x")
    result = run(*args)
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines([f"*{message}*"])


def test_a_bool_ini_key_that_is_no_bool_is_named(run, pytester):
    pytester.makeini("[pytest]\nmoe_strict = maybe\n")
    result = run("--moe-bench")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*ini key moe_strict: *maybe*"])


@pytest.mark.parametrize("key, value, message", [
    ("moe_margin", "-2", "--moe-margin must be in (0, 50]*"),
    ("moe_samples", "2", "--moe-samples must be at least 3*"),
    ("moe_ladder", "baseline;nosuchpreset", "--moe-ladder: *nosuchpreset*"),
    ("moe_plant", "moe=abc", "--moe-plant: *"),
])
def test_a_bad_string_ini_key_is_named_as_the_ini_key(run, pytester, key, value, message):
    pytester.makeini(f"[pytest]\n{key} = {value}\n")
    result = run("--moe-bench")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines([f"*ini key {key}: {message}"])


def test_a_bad_flag_is_not_blamed_on_the_ini_file(run, pytester):
    result = run("--moe-bench", "--moe-margin", "-2")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*--moe-margin must be in (0, 50]*"])
    assert "ini key" not in result.stderr.str()


def test_a_baseline_file_that_is_not_utf8_is_a_usage_error(run, pytester):
    (pytester.path / "baselines").mkdir()
    (pytester.path / "baselines" / "x.json").write_bytes(b"\xff\xfe")
    result = run("--moe-bench")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*malformed baseline: */x.json: not valid JSON*"])


def test_a_freeze_that_cannot_be_written_keeps_the_table_and_report_and_fails_the_run(run, pytester, monkeypatch):
    """Before: a traceback at the end of the run, and neither the table nor the report."""
    def refuse(store, metrics):
        raise PermissionError(13, "Permission denied", str(store.path))

    monkeypatch.setattr("pytest_moeperf.baselines.BaselineStore.freeze", refuse)  # the inner run is in-process
    result = run("--moe-bench", "--moe-freeze", "--moe-report", "out/r.json")
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    result.stdout.fnmatch_lines(["*test_cases.py::test_case::m*FROZEN*",
                                 "*ERROR: the figures were NOT frozen: */baselines/*Permission denied*"])
    doc = json.loads((pytester.path / "out" / "r.json").read_text())
    assert doc["metrics"][0]["verdict"] == "frozen"
    assert any("NOT frozen" in why for why in doc["run_failures"])


def test_a_strict_run_that_measured_nothing_fails_and_rewrites_its_report(run, pytester):
    """Before: exit 5, and the last run's report left in place for a nightly job to publish."""
    run("--moe-bench", "--moe-freeze").assert_outcomes(passed=1)
    run("--moe-bench", "--moe-report", "out/r.json").assert_outcomes(passed=1)
    result = run("--moe-bench", "--moe-strict", "--moe-report", "out/r.json", "-k", "nomatch")
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    doc = json.loads((pytester.path / "out" / "r.json").read_text())
    assert doc["metrics"] == [] and "no figure was compared with a frozen one" in doc["run_failures"]
    assert "**The run fails:**" in (pytester.path / "out" / "r.md").read_text()


def test_a_freeze_of_part_of_the_suite_names_the_figures_it_kept(run, pytester):
    """A freeze under -k, -x or a failing test renews part of the figures: the run says which
    keep their earlier values, as a freeze stopped by a signal does."""
    pytester.makepyfile(test_more="""
import pytest

pytestmark = pytest.mark.moe_bench

def test_other(moe_gate):
    moe_gate.check("o", [50.0, 51.0, 49.0], unit="us", direction="lower", tolerance=0.1)
""")
    run("--moe-bench", "--moe-freeze").assert_outcomes(passed=2)
    result = run("--moe-bench", "--moe-freeze", "-k", "test_case")
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines(["*1 figure(s) frozen for this device and configuration were not re-measured and "
                                 "keep their earlier values: test_more.py::test_other::o*"])
    assert "stopped part-way" not in result.stdout.str()


def test_the_report_gives_the_first_measurement_in_one_form_when_a_second_decided(pytester, monkeypatch):
    """Before: a confirmed regression's first measurement was its message (a string), any other
    verdict's a {ratio, ci_high} object."""
    pytester.makepyfile(test_slow="""
import os
import pytest

pytestmark = pytest.mark.moe_bench

def test_slow(moe_gate):
    factor = float(os.environ.get("FACTOR", "1"))
    measure = lambda: [100.0 * factor, 101.0 * factor, 99.0 * factor]
    moe_gate.check("m", measure(), unit="us", direction="lower", tolerance=0.1, remeasure=measure)
""")
    run_inner(pytester, "--moe-bench", "--moe-freeze", monkeypatch=monkeypatch).assert_outcomes(passed=1)
    monkeypatch.setenv("FACTOR", "2")
    result = run_inner(pytester, "--moe-bench", "--moe-report", "r.json", monkeypatch=monkeypatch)
    result.assert_outcomes(failed=1)
    (evaluation,) = json.loads((pytester.path / "r.json").read_text())["metrics"][0]["evaluations"]
    assert evaluation["remeasured"] and evaluation["first"]["verdict"] == "regression"
    assert evaluation["first"]["ratio"] == pytest.approx(0.5)


def test_a_relative_workload_file_is_taken_from_rootdir_not_the_working_folder(tmp_path, monkeypatch):
    """One rule for every path option: `jsonl:prompts/p.jsonl` in an ini file means the same file
    whichever folder pytest was started from; a GSM8K source naming no folder there stays a hub id."""
    from moe_harness.options import parse_workload_option
    (tmp_path / "prompts").mkdir()
    (tmp_path / "prompts" / "p.jsonl").write_text('{"prompt": "1 + 1 ="}\n')
    (tmp_path / "sub").mkdir()
    monkeypatch.chdir(tmp_path / "sub")
    spec = parse_workload_option("jsonl:prompts/p.jsonl", tmp_path)
    assert spec.source == str(tmp_path / "prompts" / "p.jsonl")
    assert parse_workload_option("gsm8k:openai/gsm8k", tmp_path).source == "openai/gsm8k"
    with pytest.raises(ValueError, match=str(tmp_path / "missing.jsonl")):
        parse_workload_option("jsonl:missing.jsonl", tmp_path)


def test_a_backend_that_does_not_take_the_models_experts_skips_the_model_suites_saying_why(pytester, monkeypatch):
    """Before: `--moe-backend` naming a backend that declares bf16 experts only ran (and was timed)
    on the CPU model's fp32 experts; the ladder refused the same pairing."""
    pytester.makeconftest('''
from impl import backends
from impl.moe import moe_gather

backends.register(backends.Backend("moe", "bf16-only", lambda x, w, i, gu, d, shared=None: moe_gather(x, w, i, gu, d),
                                   formats=("bf16",)), replace=True)
''')
    pytester.makepyfile(test_uses_model="def test_step(moe_model):\n    assert moe_model is not None\n")
    result = run_inner(pytester, "--moe-backend", "bf16-only", "--moe-model", "tiny", monkeypatch=monkeypatch)
    result.assert_outcomes(skipped=1)
    result.stdout.fnmatch_lines(["*the MoE backend under test: the 'bf16-only' MoE backend takes bf16 experts, and "
                                 "model 'tiny' holds fp32 (Backend.formats)*"])
