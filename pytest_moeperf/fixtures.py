"""The gate core's fixtures: the session, the device under test, the host meter, the gate and the
sampler (the model and backends under test are the MoE harness's: moe_harness.fixtures)."""

from __future__ import annotations

import pytest

from pytest_moeperf.gate import Gate
from pytest_moeperf.host_load import Meter
from pytest_moeperf.session import SESSION_KEY, MoePerfSession
from pytest_moeperf.timing import Sampler


@pytest.fixture(scope="session")
def moe_session(pytestconfig) -> MoePerfSession:
    return pytestconfig.stash[SESSION_KEY]


@pytest.fixture(scope="session")
def moe_device(moe_session):
    """The device under test (`--moe-device`), with `.torch_device`, `.fingerprint`, `.key`."""
    return moe_session.device


@pytest.fixture
def moe_host_meter(moe_session) -> Meter:
    """The host's CPU contention during this test's timed rounds (host_load.Meter), shared by its
    sampler (which measures through it) and its gate (which reads it per measurement). Disabled
    on a GPU: device-event timings of graph replays do not wait for the host's CPUs."""
    return Meter(enabled=not moe_session.device.is_cuda)


@pytest.fixture
def moe_gate(moe_session, moe_host_meter, request) -> Gate:
    """Gate figures of this test against the frozen baseline: `moe_gate.check(metric, samples, ...)`.
    Only under --moe-bench: a figure gated in an ordinary run (beside other tests, other workers)
    would fail for the host, so a test that asks for the gate without it is skipped, saying why."""
    if not moe_session.options.bench:
        pytest.skip("moe_gate gates performance figures: run with --moe-bench (mark the test moe_bench)")
    return Gate(moe_session, request.node.nodeid, request.node.user_properties, meter=moe_host_meter)


@pytest.fixture
def moe_sampler(moe_session, moe_host_meter, request) -> Sampler:
    """Timing samples on the device; the first `sample` call goes through pytest-benchmark when active."""
    # pytest-benchmark's fixture is requested only when `sample` uses it: it warns when left unused.
    bench_session = getattr(request.config, "_benchmarksession", None)
    use_benchmark = bench_session is not None and not bench_session.disabled
    device = moe_session.device
    return Sampler(device.torch_device if device.is_cuda else "cpu", moe_session.options.samples,
                   benchmark=(lambda: request.getfixturevalue("benchmark")) if use_benchmark else None,
                   meter=moe_host_meter)
