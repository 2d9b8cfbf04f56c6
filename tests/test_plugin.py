"""The plugin end to end, through pytester: gate verdicts, freezing, baselines, options, report.

Most cases gate synthetic samples (a fixed spread scaled by a planted factor) so that each
verdict is deterministic; one case times real work with a planted slowdown.
"""

from __future__ import annotations

import json

import pytest

from pytest_moeperf.baselines import SCHEMA, BaselineStore, load_file
from pytest_moeperf.device import DeviceInfo
from pytester_runs import ONE_THREAD, REMEASURE_SUITE, frozen, quiet_host, run_inner, this_device_store

# Latencies with a 1% spread, like the CPU decode step's per-sample CV measured on this machine kind.
SUITE = """
import os
import pytest

pytestmark = pytest.mark.moe_bench
SPREAD = [1.0, 1.004, 0.996, 1.01, 0.99, 1.002, 0.998, 1.006, 0.994, 1.0]

def test_latency(moe_gate):
    factor = float(os.environ.get("PLANTED_FACTOR", "1"))
    moe_gate.check("latency_us", [100 * s * factor for s in SPREAD], unit="us", direction="lower",
                   tolerance=0.10)
"""


@pytest.fixture
def suite(pytester):
    pytester.makepyfile(test_suite=SUITE)
    return pytester


def _run(pytester, *args, factor=1.0, monkeypatch=None):
    return run_inner(pytester, *args, factor=factor, monkeypatch=monkeypatch)


@pytest.fixture
def run(suite, monkeypatch):
    return lambda *args, factor=1.0: _run(suite, *args, factor=factor, monkeypatch=monkeypatch)


_this_device_store = this_device_store


def test_bench_suites_skip_without_the_flag_and_say_how_to_enable(run):
    result = run()
    result.assert_outcomes(skipped=1)
    result.stdout.fnmatch_lines(["*performance suite: run with --moe-bench to enable it*"])


def test_without_a_frozen_figure_the_gate_skips_and_says_how_to_freeze(run):
    result = run("--moe-bench")
    result.assert_outcomes(skipped=1)
    result.stdout.fnmatch_lines(["*latency_us: no frozen figure*--moe-freeze*"])


def test_unchanged_run_passes_after_freezing(run, suite):
    frozen = run("--moe-bench", "--moe-freeze")
    frozen.assert_outcomes(passed=1)
    frozen.stdout.fnmatch_lines(["*latency_us*FROZEN*", "*froze 1 metric(s)*"])
    assert list(_this_device_store(suite).metrics) == ["test_suite.py::test_latency::latency_us"]
    again = run("--moe-bench")
    again.assert_outcomes(passed=1)
    again.stdout.fnmatch_lines(["*moeperf gate*", "*latency_us*100 us*100 us*1.000*PASS*"])


FRACTION_SUITE = """
import os
import pytest

pytestmark = pytest.mark.moe_bench

def test_accuracy(moe_gate):
    correct = float(os.environ.get("PLANTED_ACCURACY", "0"))
    moe_gate.check("accuracy", [correct] * 4, unit="fraction", direction="higher", tolerance=0.05)
"""


@pytest.mark.parametrize("now, verdict, outcome", [("0", "PASS", "passed"), ("0.5", "REFREEZE", "passed")])
def test_a_fraction_frozen_at_zero_gates_without_a_false_regression(pytester, monkeypatch, now, verdict, outcome):
    """A model that got no answer right when frozen: the same again passes (it read as a
    regression with a ratio of 0/0), any right answer now asks for a refreeze."""
    pytester.makepyfile(test_fraction=FRACTION_SUITE)
    monkeypatch.setenv("PLANTED_ACCURACY", "0")
    run_inner(pytester, "--moe-bench", "--moe-freeze", monkeypatch=monkeypatch).assert_outcomes(passed=1)
    monkeypatch.setenv("PLANTED_ACCURACY", now)
    result = run_inner(pytester, "--moe-bench", monkeypatch=monkeypatch)
    result.assert_outcomes(**{outcome: 1})
    result.stdout.fnmatch_lines([f"*accuracy*0 fraction*{verdict}*"])


def test_planted_20_percent_slowdown_fails(run):
    run("--moe-bench", "--moe-freeze").assert_outcomes(passed=1)
    result = run("--moe-bench", factor=1.2)
    result.assert_outcomes(failed=1)
    # The figure's own change beside the speed ratio, and when the frozen figure was frozen.
    result.stdout.fnmatch_lines(["*latency_us: 120 us vs frozen 100 us (20.0% higher: worse): x0.833 as fast*"
                                 "baseline, frozen 20*-> regression*",
                                 "*REGRESSION*"])


def test_slowdown_within_tolerance_passes(run):
    run("--moe-bench", "--moe-freeze").assert_outcomes(passed=1)
    run("--moe-bench", factor=1.05).assert_outcomes(passed=1)




@pytest.mark.parametrize("factors, outcome", [
    ("1.3,1.0", "passed"),   # a transient: the second measurement clears it
    ("1.3,1.25", "failed"),  # a real regression: confirmed
])
def test_a_regression_must_survive_a_second_measurement(pytester, monkeypatch, factors, outcome):
    pytester.makepyfile(test_suite=REMEASURE_SUITE)
    _run(pytester, "--moe-bench", "--moe-freeze", monkeypatch=monkeypatch).assert_outcomes(passed=2)
    monkeypatch.setenv("PLANTED_FACTORS", factors)
    result = _run(pytester, "--moe-bench", monkeypatch=monkeypatch)
    result.assert_outcomes(**{outcome: 2})
    if outcome == "failed":
        result.stdout.fnmatch_lines(["*latency_us: 125 us vs frozen 100 us*-> regression (re-measured after: "
                                     "latency_us: 130 us*-> regression)*"])


def test_improvement_beyond_tolerance_says_refreeze(run):
    run("--moe-bench", "--moe-freeze").assert_outcomes(passed=1)
    result = run("--moe-bench", factor=0.7)
    result.assert_outcomes(passed=1, warnings=1)
    result.stdout.fnmatch_lines(["*RefreezeWarning*latency_us*run --moe-freeze*", "*REFREEZE*"])


@pytest.mark.parametrize("content, problem", [
    ("{not json", "not valid JSON"),
    (json.dumps({"schema": "other/9", "entries": []}), "expected schema"),
    (json.dumps({"schema": SCHEMA, "entries": [{"fingerprint": {}, "metrics": {"m": {
        "value": 1.0, "samples": [1.0], "unit": "us", "direction": "lower", "tolerance": 1.5}}}]}),
     "'tolerance' must be a fraction"),
    (json.dumps({"schema": SCHEMA, "entries": [{"fingerprint": {}, "metrics": {"m": {
        "value": 1.0, "unit": "us", "direction": "lower", "tolerance": 0.1}}}]}), "missing field(s)*samples"),
    (json.dumps({"schema": SCHEMA, "entries": [{"fingerprint": {}, "metrics": {"m": {
        "value": 1.0, "samples": [1.0, None], "unit": "us", "direction": "lower", "tolerance": 0.1}}}]}),
     "'samples' must be a non-empty list of finite numbers"),
    (json.dumps({"schema": SCHEMA, "entries": [{"fingerprint": {}, "metrics": {"m": {
        "value": 1.0, "samples": [1.0], "unit": "us", "direction": "sideways", "tolerance": 0.1}}}]}),
     "'direction' must be one of"),
])
def test_malformed_baseline_is_a_usage_error_naming_file_and_problem(run, suite, content, problem):
    (suite.path / "baselines").mkdir()
    (suite.path / "baselines" / "broken.json").write_text(content)
    result = run("--moe-bench")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines([f"*malformed baseline:*broken.json*{problem}*"])


def test_a_figure_frozen_on_another_fingerprint_is_never_used(run, suite):
    store = _this_device_store(suite)
    other = {**store.fingerprint, "torch": "0.0.1-other"}
    BaselineStore(store.folder, other, store.path.stem).freeze({
        "test_suite.py::test_latency::latency_us": _frozen(value=50.0)})
    # A 2x slower run would fail against that figure; it must be skipped instead.
    result = run("--moe-bench", factor=1.0)
    result.assert_outcomes(skipped=1)
    result.stdout.fnmatch_lines(["*no frozen figure*"])


def test_freeze_keeps_other_devices_entries_and_metrics_not_remeasured(run, suite):
    store = _this_device_store(suite)
    other = {**store.fingerprint, "name": "Some Other CPU"}
    BaselineStore(store.folder, other, store.path.stem).freeze({"elsewhere::m": _frozen(value=7.0)})
    store.freeze({"not_run::m": _frozen(value=3.0)})
    run("--moe-bench", "--moe-freeze").assert_outcomes(passed=1)
    entries = {json.dumps(e["fingerprint"], sort_keys=True): e["metrics"] for e in load_file(store.path).entries}
    assert set(entries[json.dumps(other, sort_keys=True)]) == {"elsewhere::m"}
    assert set(entries[json.dumps(store.fingerprint, sort_keys=True)]) == {
        "not_run::m", "test_suite.py::test_latency::latency_us"}


def test_a_freeze_under_another_configuration_keeps_the_figures_of_the_first(run, suite):
    """A quick freeze with another MoE backend used to replace the default configuration's figure,
    so the next default run had no baseline (and failed under --moe-strict)."""
    run("--moe-bench", "--moe-freeze").assert_outcomes(passed=1)
    run("--moe-bench", "--moe-freeze", "--moe-backend", "reference").assert_outcomes(passed=1)
    for args in ((), ("--moe-backend", "reference")):
        result = run("--moe-bench", "--moe-strict", *args, factor=1.0)
        result.assert_outcomes(passed=1)
        result.stdout.fnmatch_lines(["*latency_us*PASS*"])
    # Both configurations' figures are in this device's entries; a third freeze of the first
    # configuration replaces its own figure and adds no entry.
    run("--moe-bench", "--moe-freeze", factor=1.05).assert_outcomes(passed=1)
    figures = _this_device_store(suite).figures()
    assert sorted(m.config["moe_backend"] for _, m in figures) == ["gather", "reference"]
    assert len(load_file(_this_device_store(suite).path).entries) == 2
    # A regression of the first configuration still fails against its own figure.
    run("--moe-bench", factor=1.5).assert_outcomes(failed=1)


def test_freeze_is_atomic_when_the_write_fails(tmp_path, monkeypatch):
    store = BaselineStore(tmp_path, {"kind": "cpu", "name": "x"}, "dev")
    store.freeze({"a::m": _frozen(value=1.0)})
    before = store.path.read_bytes()

    def broken_replace(src, dst):
        raise OSError("disk full")

    monkeypatch.setattr("pytest_moeperf.files.os.replace", broken_replace)
    with pytest.raises(OSError, match="disk full"):
        store.freeze({"b::m": _frozen(value=2.0)})
    assert store.path.read_bytes() == before
    # No temporary file left behind (the lock file is the only other entry).
    assert sorted(p.name for p in tmp_path.iterdir()) == [".dev.json.lock", "dev.json"]


def test_a_freeze_keeps_the_baseline_files_permissions(tmp_path):
    """Rewritten through a private temporary file, the file still has the mode it had (a shared
    baselines folder stays readable), and a new one the mode the umask gives."""
    import os
    import stat
    store = BaselineStore(tmp_path, {"kind": "cpu", "name": "x"}, "dev")
    store.freeze({"a::m": _frozen(value=1.0)})
    mask = os.umask(0o022)
    os.umask(mask)
    assert stat.S_IMODE(store.path.stat().st_mode) == 0o666 & ~mask
    store.path.chmod(0o644)
    store.freeze({"b::m": _frozen(value=2.0)})
    assert stat.S_IMODE(store.path.stat().st_mode) == 0o644


FREEZES_PER_WORKER = 40


def _freeze_many(folder: str, worker: int, start) -> None:
    store = BaselineStore(folder, {"kind": "cpu", "name": "x"}, "dev")
    start.wait()  # both workers begin together, so their read-modify-writes overlap
    for i in range(FREEZES_PER_WORKER):
        store.freeze({f"w{worker}::m{i}": _frozen(value=1.0 + i)})


def test_concurrent_freezes_all_survive(tmp_path):
    """Two processes (like xdist workers) freezing at once: the lock keeps every metric."""
    import multiprocessing
    ctx = multiprocessing.get_context("spawn")
    start = ctx.Barrier(2)
    procs = [ctx.Process(target=_freeze_many, args=(str(tmp_path), w, start)) for w in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    (entry,) = load_file(tmp_path / "dev.json").entries
    assert set(entry["metrics"]) == {f"w{w}::m{i}" for w in range(2) for i in range(FREEZES_PER_WORKER)}


def test_a_figure_frozen_under_another_configuration_is_not_compared(run, suite):
    run("--moe-bench", "--moe-freeze").assert_outcomes(passed=1)
    # The frozen figure was taken with --moe-model tiny-gsm (the default); ling-3.0-flash differs.
    result = run("--moe-bench", "--moe-model", "ling-3.0-flash", factor=2.0)
    result.assert_outcomes(skipped=1)
    result.stdout.fnmatch_lines(["*another configuration (model: 'tiny-gsm' -> 'ling-3.0-flash')*"])


# One bad value of each plugin's options, and a rule between options: a whole run stops as a usage
# error naming it. Every parse_* function's own refusals: tests/test_options.py.
@pytest.mark.parametrize("args, message", [
    (["--moe-freeze"], "--moe-freeze needs --moe-bench"),
    (["--moe-device", "tpu"], "--moe-device must be auto, cpu, cuda or cuda:N, got 'tpu'"),
    (["--moe-head", "int4"], "--moe-head must be one of bf16, fp8, got 'int4'"),
])
def test_bad_options_are_usage_errors(run, args, message):
    result = run(*args)
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines([f"*{message}*"])


def test_a_model_folder_that_is_no_checkpoint_is_a_usage_error(run, suite):
    (suite.path / "weights").mkdir()
    result = run("--moe-model", "weights")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*--moe-model 'weights': */weights has no config.json; expected a "
                                 "transformers-format checkpoint folder*"])
    (suite.path / "weights" / "config.json").write_text('{"model_type": "mixtral"}')
    result = run("--moe-model", "weights")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*--moe-model 'weights': */config.json: architecture 'mixtral' is not supported*"])
    (suite.path / "weights" / "config.json").write_text("[]")
    result = run("--moe-model", "weights")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*--moe-model 'weights': */config.json: expected a JSON object*"])


def test_a_relative_model_folder_not_found_names_where_it_looked(run, suite):
    result = run("--moe-model", "../elsewhere")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines([f"*nor a folder (looked for {suite.path.parent / 'elsewhere'}: a relative folder "
                                 "is taken from rootdir)*"])


def test_a_prompts_file_with_a_bad_line_is_a_usage_error_naming_file_and_line(run, suite):
    (suite.path / "mine.jsonl").write_text('{"prompt": "2+2="}\n\n{"prompt": "3+3=", "answr": "6"}\n')
    result = run("--moe-workload", "jsonl:mine.jsonl")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*--moe-workload: */mine.jsonl:3: unknown field 'answr'; "
                                 "allowed fields: prompt, answer,*"])
    (suite.path / "mine.jsonl").write_text('{"prompt": "2+2="}\n')
    run("--moe-workload", "jsonl:mine.jsonl").assert_outcomes(skipped=1)


def test_bench_under_xdist_workers_on_the_cpu_is_a_usage_error(run):
    """Timings from several worker processes on one CPU would measure each other."""
    pytest.importorskip("xdist")
    result = run("--moe-bench", "--moe-device", "cpu", "-n", "2")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*--moe-bench with -n needs --moe-device cuda: CPU workers would time against*"])
    run("-n", "2").assert_outcomes(skipped=1)  # without --moe-bench the suites may spread over workers


def test_options_fall_back_to_ini_keys(suite, monkeypatch):
    suite.makeini("[pytest]\nmoe_bench = true\nmoe_model = no-such-model\n")
    result = _run(suite, monkeypatch=monkeypatch)
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*--moe-model 'no-such-model'*"])


def test_relative_report_paths_are_taken_from_rootdir_wherever_pytest_starts(suite, monkeypatch):
    """One rule for every path option (as for ini values): started from a subfolder, the report
    still lands under rootdir."""
    suite.makeini("[pytest]\n")
    sub = suite.mkdir("sub")
    monkeypatch.chdir(sub)
    result = run_inner(suite, "--moe-bench", "--moe-freeze", "--moe-report", "out/gate.json",
                       str(suite.path / "test_suite.py"), monkeypatch=monkeypatch)
    result.assert_outcomes(passed=1)
    assert (suite.path / "out" / "gate.json").is_file() and not (sub / "out").exists()
    assert (suite.path / "baselines").is_dir()


def test_report_is_written_as_json_and_markdown(run, suite):
    run("--moe-bench", "--moe-freeze").assert_outcomes(passed=1)
    run("--moe-bench", "--moe-report", "out/report.json", factor=1.2).assert_outcomes(failed=1)
    doc = json.loads((suite.path / "out" / "report.json").read_text())
    (metric,) = doc["metrics"]
    assert metric["verdict"] == "regression" and metric["ratio"] == pytest.approx(1 / 1.2, rel=1e-3)
    assert doc["header"]["fingerprint"] == DeviceInfo("auto").key
    assert "| test_suite.py::test_latency::latency_us | 120 us | 100 us | 0.833 |" in \
        (suite.path / "out" / "report.md").read_text()


def test_the_report_gives_the_runs_outcome_its_failed_tests_and_its_commit(run, suite):
    """A report read alone (a nightly job's artifact) says whether the run passed: a failed check
    that gates no figure fails it too, and the code it measured is named."""
    run("--moe-bench", "--moe-freeze").assert_outcomes(passed=1)
    suite.makepyfile(test_check="def test_parity():\n    assert 1.0 == 2.0\n")
    run("--moe-bench", "--moe-report", "out/report.json").assert_outcomes(passed=1, failed=1)
    doc = json.loads((suite.path / "out" / "report.json").read_text())
    assert [m["verdict"] for m in doc["metrics"]] == ["pass"]
    assert doc["header"]["outcome"] == "FAIL" and doc["header"]["status"] == "complete"
    assert doc["failed_tests"] == ["test_check.py::test_parity"]
    assert doc["header"]["commit"] == "unknown (not a git checkout)" and doc["header"]["finished"]
    assert "**1 test(s) failed:** `test_check.py::test_parity`" in (suite.path / "out" / "report.md").read_text()
    (suite.path / "test_check.py").unlink()
    run("--moe-bench", "--moe-report", "out/report.json").assert_outcomes(passed=1)
    assert json.loads((suite.path / "out" / "report.json").read_text())["header"]["outcome"] == "PASS"


def test_a_run_that_does_not_finish_leaves_no_earlier_report_behind(run, suite):
    """Here a usage error found after the report's path was checked (a malformed baseline); a
    killed run leaves the same: the report written at start-up."""
    run("--moe-bench", "--moe-freeze", "--moe-report", "out/report.json").assert_outcomes(passed=1)
    (suite.path / "baselines" / "broken.json").write_text("{")
    assert run("--moe-bench", "--moe-report", "out/report.json").ret == pytest.ExitCode.USAGE_ERROR
    doc = json.loads((suite.path / "out" / "report.json").read_text())
    assert doc["metrics"] == [] and doc["header"]["outcome"] == "NONE: no verdict"
    assert doc["header"]["status"].startswith("did not finish")
    assert "the run did not finish" in (suite.path / "out" / "report.md").read_text()


def test_gpu_markers_skip_with_their_reason_on_a_cpu(pytester, monkeypatch):
    pytester.makepyfile("""
        import pytest

        @pytest.mark.gpu
        def test_needs_gpu():
            pass

        @pytest.mark.requires_capability(9, 0)
        def test_needs_hopper():
            pass
    """)
    result = _run(pytester, "--moe-device", "cpu", monkeypatch=monkeypatch)
    result.assert_outcomes(skipped=2)
    result.stdout.fnmatch_lines(["*needs a CUDA device; the device under test is cpu*"])


def test_benchmark_json_carries_the_device_fingerprint(pytester, monkeypatch):
    pytester.makepyfile("""
        import pytest

        @pytest.mark.moe_bench
        def test_timed(moe_sampler):
            samples = moe_sampler.sample(lambda: sum(range(1000)), inner=10)
            assert len(samples) == 10 and all(s > 0 for s in samples)
    """)
    result = _run(pytester, "--moe-bench", "--benchmark-json", "bench.json", monkeypatch=monkeypatch)
    result.assert_outcomes(passed=1)
    doc = json.loads((pytester.path / "bench.json").read_text())
    assert doc["machine_info"]["moeperf"]["key"] == DeviceInfo("auto").key
    (bench,) = doc["benchmarks"]
    assert bench["stats"]["rounds"] == 10 and bench["stats"]["iterations"] == 10


REAL_WORK_SUITE = """
import os
import pytest
import torch

pytestmark = pytest.mark.moe_bench

""" + ONE_THREAD + """
def chain(steps, a):
    x = a
    for _ in range(steps):
        x = torch.tanh(x @ a)
    return x

def test_matmul_chain(moe_sampler, moe_gate):
    extra = float(os.environ.get("PLANTED_FACTOR", "1"))
    a = torch.randn(128, 128)
    steps = round(20 * extra)  # the planted defect: more work per call

    def side_by_side():
        s = moe_sampler.interleaved({"new": lambda: chain(steps, a), "old": lambda: chain(20, a)}, inner=5)
        return s["new"], s["old"]

    moe_gate.check_ratio("chain_new_over_old", side_by_side, direction="lower", tolerance=0.10)
"""


def test_real_timing_catches_a_planted_slowdown(pytester, monkeypatch):
    """Timed work, not synthetic samples, as a ratio measured side by side (A B A B), which host
    noise that slows both sides alike cannot move: the same code passes, 50% more work per call
    fails. (20% more was read as 10.5% slower, interval 0.741-0.941 against a 10% tolerance, in a
    CI run whose other worker kept both cores busy: contention does not slow the two sides alike.)"""
    pytester.makepyfile(test_real=REAL_WORK_SUITE)
    quiet_host(monkeypatch)  # what the ratio shows, not whether the host was contended
    samples = ("--moe-samples", "25")  # a ~0.5 s measurement: enough for a tight interval under noise
    _run(pytester, "--moe-bench", "--moe-freeze", *samples, monkeypatch=monkeypatch).assert_outcomes(passed=1)
    _run(pytester, "--moe-bench", *samples, monkeypatch=monkeypatch).assert_outcomes(passed=1)
    slow = _run(pytester, "--moe-bench", *samples, factor=1.5, monkeypatch=monkeypatch)
    slow.assert_outcomes(failed=1)
    slow.stdout.fnmatch_lines(["*chain_new_over_old*-> regression*"])


_frozen = frozen


def test_pin_heap_allocations_takes_effect_on_glibc():
    import platform

    from pytest_moeperf.timing import pin_heap_allocations
    if platform.libc_ver()[0] != "glibc":
        pytest.skip("glibc only")
    assert pin_heap_allocations()


def test_interleaved_setup_runs_untimed_before_each_sample_and_names_are_checked():
    from pytest_moeperf.timing import Sampler
    calls: list[str] = []
    sampler = Sampler(None, rounds=3, warmup=1, warmup_s=0)
    samples = sampler.interleaved({"a": lambda: calls.append("a"), "b": lambda: calls.append("b")},
                                  setup={"a": lambda: calls.append("reset a")})
    assert {k: len(v) for k, v in samples.items()} == {"a": 3, "b": 3}
    assert calls == ["reset a", "a", "b"] * 4  # one warm-up round, then three
    with pytest.raises(ValueError, match=r"setup names \['c'\] are not among the timed callables"):
        sampler.interleaved({"a": lambda: None}, setup={"c": lambda: None})


def test_warm_up_lasts_its_rounds_and_its_time():
    import time

    from pytest_moeperf.timing import Sampler
    calls = []
    sampler = Sampler(None, rounds=2, warmup=1, warmup_s=0.05)
    sampler.sample(lambda: (calls.append(time.perf_counter()), time.sleep(0.005)))
    # Warm-up rounds until 0.05 s had passed (however long a sleep takes on a loaded host), not one
    # round: the first timed round starts at least 0.05 s after the first warm-up round did.
    assert len(calls) > 3 and calls[-2] - calls[0] >= 0.05, calls
    calls.clear()
    Sampler(None, rounds=2, warmup=3, warmup_s=0).sample(lambda: calls.append(1))
    assert len(calls) == 3 + 2


def test_a_freeze_stopped_part_way_names_the_figures_it_did_not_renew(pytester, monkeypatch):
    """Both figures frozen, then a freeze stopped by SIGTERM after the first: the second keeps its
    earlier value, and the run says so by name instead of nothing."""
    pytester.makepyfile(test_stopped="""
import os, signal
import pytest

pytestmark = pytest.mark.moe_bench

def test_a_measured(moe_gate):
    moe_gate.check("latency_us", [100.0, 101.0, 99.0], unit="us", direction="lower", tolerance=0.1)
    if os.environ.get("STOP"):
        os.kill(os.getpid(), signal.SIGTERM)

def test_b_not_reached(moe_gate):
    moe_gate.check("other_us", [50.0, 51.0, 49.0], unit="us", direction="lower", tolerance=0.1)
""")
    args = ("-p", "no:cacheprovider", "--moe-bench", "--moe-freeze", "--moe-device", "cpu")
    pytester.runpytest_subprocess(*args).assert_outcomes(passed=2)
    monkeypatch.setenv("STOP", "1")
    result = pytester.runpytest_subprocess(*args)
    result.stdout.fnmatch_lines(["*the run stopped part-way: 1 figure(s) frozen for this device and configuration "
                                 "were not re-measured and keep their earlier values: "
                                 "test_stopped.py::test_b_not_reached::other_us*"])


def test_a_run_stopped_before_any_figure_says_so_and_passes_nothing(pytester):
    """Before: the report of a run stopped part-way read `outcome: PASS` over an empty table, and a
    freeze stopped before its first figure said nothing of freezing."""
    pytester.makepyfile(test_stopped="""
import os, signal
import pytest

pytestmark = pytest.mark.moe_bench

def test_a_stopped():
    os.kill(os.getpid(), signal.SIGTERM)

def test_b_never_runs(moe_gate):
    moe_gate.check("latency_us", [100.0, 101.0, 99.0], unit="us", direction="lower", tolerance=0.1)
""")
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "--moe-bench", "--moe-freeze",
                                           "--moe-device", "cpu", "--moe-report", "out/report.json")
    result.stdout.fnmatch_lines(["*nothing was frozen: no figure was measured before the run stopped*"])
    header = json.loads((pytester.path / "out" / "report.json").read_text())["header"]
    assert header["status"] == "stopped part-way" and header["outcome"].startswith("STOPPED: no verdict"), header
    assert not (pytester.path / "baselines").exists() or not list((pytester.path / "baselines").glob("*.json"))


def test_a_run_stopped_by_sigterm_still_freezes_what_it_measured(pytester):
    """`timeout` or a cancelled CI job sends SIGTERM: the session ends as on Ctrl-C, and the
    figure gated before the signal is frozen (a separate process: the signal is real)."""
    pytester.makepyfile(test_stopped="""
import os, signal
import pytest

pytestmark = pytest.mark.moe_bench

def test_a_measured(moe_gate):
    moe_gate.check("latency_us", [100.0, 101.0, 99.0], unit="us", direction="lower", tolerance=0.1)

def test_b_stopped():
    os.kill(os.getpid(), signal.SIGTERM)

def test_c_never_runs():
    pass
""")
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "--moe-bench", "--moe-freeze",
                                           "--moe-device", "cpu")
    result.stdout.fnmatch_lines(["*KeyboardInterrupt*SIGTERM*"])
    files = list((pytester.path / "baselines").glob("*.json"))
    assert len(files) == 1
    metrics = load_file(files[0]).entries[0]["metrics"]
    assert list(metrics) == ["test_stopped.py::test_a_measured::latency_us"]


def test_a_server_row_frozen_under_other_flags_names_only_the_flags_that_changed(tmp_path):
    """A server row's configuration is its whole definition as JSON; the NO-BASELINE reason says
    which of its words changed, not both JSON texts."""
    def row(max_len: str, version: str) -> str:
        return "server:" + json.dumps({"server": {"command": ["vllm", "--max-model-len", max_len, "--dtype", "float32"],
                                                  "env": {"BIND": "0"}}, "version": version}, sort_keys=True)
    store = BaselineStore(tmp_path, {"kind": "cpu", "name": "x"}, "dev")
    store.freeze({"a::m": frozen(value=1.0, config={"row": row("384", "0.32.0"), "dtype": "fp32"})})
    lookup = store.lookup("a::m", {"row": row("320", "0.33.0"), "dtype": "fp32"}, portable=True)
    assert lookup.match is None
    assert ("another configuration (row: server.command after '--max-model-len': '384' -> '320', "
            "version: '0.32.0' -> '0.33.0')") in lookup.reason, lookup.reason
