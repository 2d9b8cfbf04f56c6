"""How the plugin's pytester tests run an inner pytest session, shared by their modules."""

from __future__ import annotations

from pytest_moeperf.baselines import BaselineStore, FrozenMetric
from pytest_moeperf.device import DeviceInfo


# For timed suites: one thread is less exposed to whatever else runs on a 2-core machine.
def plugin_args() -> list[str]:
    """What a pytest subprocess needs to load the gate core and the MoE harness: nothing where the
    package is installed (its entry points load them), else both plugins by name (a bare GPU image
    with the repository on PYTHONPATH)."""
    from importlib.metadata import entry_points
    installed = any(e.value == "pytest_moeperf.plugin" for e in entry_points(group="pytest11"))
    return [] if installed else ["-p", "pytest_moeperf.plugin", "-p", "moe_harness.plugin"]


def one_thread(scope: str = "function") -> str:
    """An autouse fixture (source) that runs each test of its `scope` on one torch thread and
    gives the previous count back (an in-process inner run shares the outer process's torch)."""
    return f"""
@pytest.fixture(scope="{scope}", autouse=True)
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
"""


ONE_THREAD = one_thread()  # for a suite's own text (it imports pytest and torch itself)
# A whole inner session on one thread: an inner run's conftest.py, or the head of one.
ONE_THREAD_CONFTEST = "import pytest\nimport torch\n" + one_thread("session")

# Samples with a 1% spread, like the CPU decode step's per-sample CV measured on this machine kind.
SPREAD = [1.0, 1.004, 0.996, 1.01, 0.99, 1.002, 0.998, 1.006, 0.994, 1.0]


def gate_suite(*tests: str, imports: tuple[str, ...] = ()) -> str:
    """A synthetic timed suite for an inner run: `tests` (the source of test functions that hand
    made-up samples, scaled from SPREAD, to `moe_gate`) under one head: marked moe_bench, `os`,
    `pytest`, the `imports` lines and SPREAD in scope."""
    head = "\n".join(("import os", "import pytest", *imports, "", "pytestmark = pytest.mark.moe_bench",
                      f"SPREAD = {SPREAD!r}"))
    return head + "\n" + "".join("\n" + test.strip("\n") + "\n" for test in tests)


# 100 us, scaled by the PLANTED_FACTOR run_inner sets.
LATENCY_TEST = """
def test_latency(moe_gate):
    factor = float(os.environ.get("PLANTED_FACTOR", "1"))
    moe_gate.check("latency_us", [100 * s * factor for s in SPREAD], unit="us", direction="lower", tolerance=0.10)
"""

# Synthetic latencies and ratios; each measurement takes its factor from the next entry of
# PLANTED_FACTORS.
REMEASURE_SUITE = gate_suite("""
def test_latency(moe_gate):
    factors = iter(float(f) for f in os.environ.get("PLANTED_FACTORS", "1,1").split(","))

    def measure():
        f = next(factors)
        return [100 * s * f for s in SPREAD]

    moe_gate.check("latency_us", measure(), unit="us", direction="lower", tolerance=0.10, remeasure=measure)
""", """
def test_ratio(moe_gate):
    factors = iter(float(f) for f in os.environ.get("PLANTED_FACTORS", "1,1").split(","))

    def side_by_side():
        f = next(factors)
        return [2.0 * s * f for s in SPREAD], [1.0 * s for s in SPREAD]

    moe_gate.check_ratio("new_over_old", side_by_side, direction="lower", tolerance=0.10)
""")

# A ratio of the "bf16" head backend (the backend a gate-trust run plants) over a plain F.linear,
# measured side by side; 25% tolerance: one thread, 15 samples on a 2-core VM.
PLANTED_SUITE = """
import pytest
import torch
import torch.nn.functional as F

from impl import backends

pytestmark = pytest.mark.moe_bench

""" + ONE_THREAD + """
def test_head_over_linear(moe_sampler, moe_gate):
    head = backends.get("head", "bf16")  # the backend under test: planted in a gate-trust run
    x, w = torch.randn(4, 256), torch.randn(2048, 256)

    def side_by_side():
        s = moe_sampler.interleaved({"head": lambda: head.fn(x, w, x.dtype), "linear": lambda: F.linear(x, w)},
                                    inner=20)
        return s["head"], s["linear"]

    moe_gate.check_ratio("head_over_linear", side_by_side, direction="lower", tolerance=0.25)
"""


def quiet_host(monkeypatch) -> None:
    """The host's CPU stall reads 0 in an inner run: for tests about what a real timing shows,
    not about the host. Under `pytest -n` on a 2-core CI machine the other worker keeps the host
    contended, and the gate would (rightly) not freeze or judge their figures there;
    tests/test_gate_host_contention.py covers that rule."""
    monkeypatch.setattr("pytest_moeperf.host_load.read_counter", lambda: (0, "psi"))


def run_inner(pytester, *args, monkeypatch, factor: float = 1.0):
    """An in-process pytest run in `pytester`'s folder, its suites' PLANTED_FACTOR set to `factor`."""
    monkeypatch.setenv("PLANTED_FACTOR", str(factor))
    # The inner run is one plain process even when this test runs in an xdist worker: without
    # this, it (and pytest-benchmark) would take itself for that worker.
    monkeypatch.delenv("PYTEST_XDIST_WORKER", raising=False)
    # In-process (fast); the plugin is already imported here, so assertion rewriting of it is moot.
    return pytester.runpytest("-p", "no:cacheprovider", "-rsw", "-W", "ignore::pytest.PytestAssertRewriteWarning",
                              *args)


def this_device_store(pytester) -> BaselineStore:
    dev = DeviceInfo("auto")
    return BaselineStore(pytester.path / "baselines", dev.fingerprint, dev.slug)


def frozen(value: float, unit: str = "us", config: dict | None = None) -> FrozenMetric:
    return FrozenMetric(value, [value] * 3, unit, "lower", 0.1,
                        config if config is not None else {"model": "tiny", "dtype": "float32"})
