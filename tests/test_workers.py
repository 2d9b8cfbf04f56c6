"""--moe-bench over pytest-xdist workers, one GPU each (pytest_moeperf.workers): the GPU plan,
then whole runs of a synthetic timed suite on simulated GPUs (MOEPERF_SIMULATED_GPUS: workers
run on the CPU, each with its simulated GPU's name in its fingerprint) -- merge, freeze, gate,
a regression on one worker's GPU, a crashed worker, JUnit properties."""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import xml.etree.ElementTree as ET

import pytest

from pytest_moeperf.baselines import load_file
from pytest_moeperf.workers import parse_worker_gpus, visible_gpus, worker_index
from tests.pytester_runs import gate_suite

pytest.importorskip("xdist")

# Four timed figures with deterministic samples (1% spread); the one measured on GPU "1" is
# slowed by SLOW_GPU1 (a planted slowdown on that worker's GPU; SLOW_ALL on the others). Each
# test records the GPU it saw.
SUITE = gate_suite("""
@pytest.mark.parametrize("name", ["a", "b", "c", "d"])
def test_latency(moe_gate, name):
    gpu = os.environ["MOEPERF_WORKER_GPU"]
    with open(f"gpu-{name}.txt", "w") as f:
        f.write(gpu)
    slow = float(os.environ.get("SLOW_GPU1", "1")) if gpu == "1" else float(os.environ.get("SLOW_ALL", "1"))
    moe_gate.check(f"latency_{name}_us", [100 * s * slow for s in SPREAD], unit="us", direction="lower",
                   tolerance=0.10)
""")


@pytest.fixture
def xsuite(pytester, monkeypatch):
    pytester.makepyfile(test_suite=SUITE)
    monkeypatch.delenv("PYTEST_XDIST_WORKER", raising=False)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    return pytester


WORKERS_RUN = ("-p", "no:cacheprovider", "-p", "xdist", "-n", "2", "--moe-bench", "--moe-device", "cpu",
               "--moe-report", "report.json")


def run_workers(pytester, gpus: str, *args, **env):
    """A subprocess pytest run over 2 xdist workers on the simulated GPUs `gpus`."""
    pytester._monkeypatch.setenv("MOEPERF_SIMULATED_GPUS", gpus)
    for k, v in env.items():
        pytester._monkeypatch.setenv(k, v)
    return pytester.runpytest_subprocess(*WORKERS_RUN, *args)


@pytest.fixture(scope="module")
def two_h200_freeze(tmp_path_factory, worker_id):
    """(its folder, its result): the suite frozen over 2 workers on two simulated H200s, once a
    session for the tests that check that freeze or gate against it (each copies its baselines),
    also when they run in different xdist workers of this session (the folder is the session's,
    the first worker to need it runs it under a lock). Run as pytester runs it: in a subprocess
    from a folder of its own, with a home of its own."""
    root = tmp_path_factory.getbasetemp()
    root = root if worker_id == "master" else root.parent
    folder, done = root / "two-h200-freeze", root / "two-h200-freeze.json"
    with open(root / "two-h200-freeze.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not done.is_file():
            folder.mkdir()
            (folder / "test_suite.py").write_text(SUITE)
            env = {k: v for k, v in os.environ.items()
                   if k not in ("PYTEST_XDIST_WORKER", "CUDA_VISIBLE_DEVICES", "PYTEST_ADDOPTS")}
            env.update(MOEPERF_SIMULATED_GPUS="H200,H200", HOME=str(folder),
                       PYTHONPATH=os.pathsep.join(filter(None, [str(folder), env.get("PYTHONPATH", "")])))
            start = time.monotonic()
            proc = subprocess.run([sys.executable, "-m", "pytest", *WORKERS_RUN, "--moe-freeze", "--junitxml",
                                   "junit.xml"], cwd=folder, env=env, capture_output=True, text=True, timeout=600)
            done.write_text(json.dumps([proc.returncode, proc.stdout, proc.stderr, time.monotonic() - start]))
    ret, out, err, duration = json.loads(done.read_text())
    return folder, pytest.RunResult(ret, out.splitlines(), err.splitlines(), duration)


def gate_against(pytester, freeze) -> None:
    """`freeze`'s baselines (a two_h200_freeze) in pytester's folder, which must have frozen all 4."""
    folder, frozen = freeze
    frozen.assert_outcomes(passed=4)
    shutil.copytree(folder / "baselines", pytester.path / "baselines")


def entries(pytester) -> list[dict]:
    (path,) = (pytester.path / "baselines").glob("*.json")
    return load_file(path).entries


def report(pytester) -> list[dict]:
    return json.loads((pytester.path / "report.json").read_text())["metrics"]


def test_each_worker_gets_its_own_gpu():
    assert parse_worker_gpus(2, "cuda", ["0", "1", "2"]) == ["0", "1"]
    assert parse_worker_gpus(2, "auto", ["4", "6"]) == ["4", "6"]
    assert worker_index("gw12") == 12
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": "2, 3"}) == ["2", "3"]
    assert visible_gpus({"MOEPERF_SIMULATED_GPUS": "H200,H200,H100"}) == ["0", "1", "2"]


@pytest.mark.parametrize("workers, device, gpus, message", [
    (3, "cuda", ["0", "1"], "-n 3: 2 GPU(s) visible (0, 1); timed tests must not share a GPU"),
    (2, "cpu", ["0", "1"], "needs --moe-device cuda: CPU workers would time against each other"),
    (2, "auto", [], "needs --moe-device cuda: CPU workers would time against each other"),
    (2, "cuda:1", ["0", "1"], "use --moe-device cuda, not 'cuda:1'"),
    (2, "cuda", [], "no GPU is visible"),
])
def test_a_plan_that_would_share_a_device_is_refused(workers, device, gpus, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        parse_worker_gpus(workers, device, gpus)


def test_more_workers_than_gpus_is_a_usage_error(xsuite):
    xsuite._monkeypatch.setenv("MOEPERF_SIMULATED_GPUS", "H200")
    result = xsuite.runpytest_subprocess("-p", "no:cacheprovider", "-p", "xdist", "-n", "2", "--moe-bench",
                                         "--moe-device", "cpu")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*--moe-bench -n 2: 1 GPU(s) visible (0); timed tests must not share a GPU*"])


def test_two_identical_gpus_freeze_into_one_entry_then_gate_pass(xsuite, two_h200_freeze):
    folder, frozen = two_h200_freeze
    frozen.assert_outcomes(passed=4)
    # Every gated metric is a JUnit property, carried from the workers to the controller's XML.
    props = {p.get("name"): p.get("value") for p in ET.parse(folder / "junit.xml").iter("property")}
    assert float(props["moeperf:latency_a_us"]) == pytest.approx(100.1, rel=1e-3)
    assert props["moeperf:latency_a_us:unit"] == "us" and props["moeperf:latency_a_us:verdict"] == "frozen"
    frozen.stdout.fnmatch_lines(["*merged 4 figure(s) from 2 pytest-xdist worker(s)*", "*froze 4 metric(s)*"])
    gate_against(xsuite, two_h200_freeze)
    (entry,) = entries(xsuite)  # both workers' figures in one entry: nothing lost to the other's write
    assert len(entry["metrics"]) == 4 and entry["fingerprint"]["simulated_gpu"] == "H200"
    assert {(folder / f"gpu-{n}.txt").read_text() for n in "abcd"} == {"0", "1"}  # both GPUs used

    gated = run_workers(xsuite, "H200,H200")
    gated.assert_outcomes(passed=4)
    assert sorted(r["verdict"] for r in report(xsuite)) == ["pass"] * 4


def test_different_gpu_models_are_keyed_apart(xsuite):
    run_workers(xsuite, "H200,H100", "--moe-freeze").assert_outcomes(passed=4)
    names = {e["fingerprint"]["simulated_gpu"]: set(e["metrics"]) for e in entries(xsuite)}
    assert set(names) == {"H200", "H100"}
    assert sum(map(len, names.values())) == 4  # each figure under the model that measured it


def test_a_slowdown_on_one_workers_gpu_is_that_metrics_regression(xsuite, two_h200_freeze):
    gate_against(xsuite, two_h200_freeze)
    result = run_workers(xsuite, "H200,H200", SLOW_GPU1="1.5")
    assert result.ret == pytest.ExitCode.TESTS_FAILED  # a regression: exit 1
    gpu_of = {n: (xsuite.path / f"gpu-{n}.txt").read_text() for n in "abcd"}
    verdicts = {r["metric"]: (r["verdict"], r["gpu"]) for r in report(xsuite)}
    assert len(verdicts) == 4  # every worker's figures reached the merged report
    for n, gpu in gpu_of.items():
        assert verdicts[f"latency_{n}_us"] == ("regression" if gpu == "1" else "pass", gpu)
    assert "1" in gpu_of.values()


def test_a_crashed_worker_is_an_infrastructure_error(xsuite):
    xsuite.makepyfile(test_crash="import os\nimport pytest\n\n@pytest.mark.moe_bench\n"
                                 "def test_crash():\n    os._exit(9)\n")
    result = run_workers(xsuite, "H200,H200", "--moe-freeze")
    assert result.ret == pytest.ExitCode.INTERNAL_ERROR  # exit 3: not the code under test
    result.stdout.fnmatch_lines(["*infrastructure error: pytest-xdist worker gw* (GPU *) went down*"])
    assert len(entries(xsuite)[0]["metrics"]) == 4  # what the other tests measured is kept


def test_a_run_with_a_regression_exits_1_even_when_a_worker_was_lost(xsuite, two_h200_freeze):
    """Exit 3 says "infrastructure, not the code": not when the code regressed too."""
    gate_against(xsuite, two_h200_freeze)  # the four latencies, frozen without the crashing test
    xsuite.makepyfile(test_crash="import os\nimport pytest\n\n@pytest.mark.moe_bench\n"
                                 "def test_crash():\n    os._exit(9)\n")
    result = run_workers(xsuite, "H200,H200", SLOW_GPU1="1.5", SLOW_ALL="1.5")  # whichever worker goes down
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    result.stdout.fnmatch_lines(["*infrastructure error: pytest-xdist worker gw* (GPU *) went down*"])
    doc = json.loads((xsuite.path / "report.json").read_text())
    assert doc["header"]["outcome"] == "FAIL" and "test_crash.py::test_crash" not in doc["failed_tests"]


def test_a_run_stopped_by_sigterm_keeps_what_the_workers_measured(xsuite):
    """Each test's figures travel with its report, so stopping the controller part-way (a CI
    timeout) still freezes and reports them; a worker's figures used to arrive only when it
    finished, and a stopped run kept none."""
    xsuite.makepyfile(test_zz_slow="import time\nimport pytest\n\n@pytest.mark.moe_bench\n"
                                "def test_slow():\n    time.sleep(120)\n")
    env = {**os.environ, "MOEPERF_SIMULATED_GPUS": "H200,H200"}
    cmd = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-p", "xdist", "-n", "2", "--moe-bench",
           "--moe-device", "cpu", "--moe-freeze", "--moe-report", "report.json", "-p", "no:randomly"]
    proc = subprocess.Popen(cmd, cwd=xsuite.path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    try:
        deadline = time.monotonic() + 120
        while not all((xsuite.path / f"gpu-{n}.txt").exists() for n in "abcd"):
            assert time.monotonic() < deadline and proc.poll() is None, "the four timed tests did not run"
            time.sleep(0.2)
        time.sleep(3)  # their reports reach the controller as each test's call ends
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == pytest.ExitCode.INTERRUPTED, out[-3000:]
    assert len(entries(xsuite)[0]["metrics"]) == 4, out[-3000:]
    doc = json.loads((xsuite.path / "report.json").read_text())
    assert sorted(m["metric"] for m in doc["metrics"]) == [f"latency_{n}_us" for n in "abcd"]
    assert doc["header"]["status"] == "stopped part-way"
