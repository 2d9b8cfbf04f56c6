"""The hooks of a run's test outcomes and of pytest-xdist: one GPU per worker (the controller hands
them out), each worker's figures sent with its test reports and merged on the controller, tests
that failed on their own kept apart from those a crashed worker took down. The work itself
(which GPUs, the payloads) is in `workers`."""

from __future__ import annotations

import pytest

from pytest_moeperf import workers
from pytest_moeperf.options import option
from pytest_moeperf.session import SESSION_KEY, MoePerfSession


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_auto_num_workers(config: pytest.Config) -> int | None:
    """`-n auto` with --moe-bench: one worker per visible GPU (None: xdist's own rule)."""
    if not option(config, "moe_bench"):
        return None
    return len(workers.visible_gpus()) or None


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node) -> None:
    """Controller: give a starting worker a GPU no live worker holds (a restarted worker gets the
    one its predecessor freed)."""
    state = node.config.stash.get(SESSION_KEY, None)
    if state is None or not state.options.worker_gpus:
        return
    held = set(state.gpu_of_worker.values())
    gpu = next(g for g in state.options.worker_gpus if g not in held)
    state.gpu_of_worker[node.gateway.id] = gpu
    node.workerinput[workers.WORKER_GPU_KEY] = gpu


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error) -> None:
    """Controller: merge what a finished worker measured; a crashed one is an infrastructure error."""
    state = node.config.stash.get(SESSION_KEY, None)
    if state is None or not state.options.bench:
        return
    gpu = state.gpu_of_worker.pop(node.gateway.id, "?")
    payload = getattr(node, "workeroutput", {}).get(workers.OUTPUT_KEY)
    if payload is not None:
        workers.merge_payload(state, payload, node.gateway.id)
    if error:
        state.worker_errors.append(f"pytest-xdist worker {node.gateway.id} (GPU {gpu}) went down: {error}")


class ControllerHooks:
    """On the controller of a pytest-xdist run, or a plain run: the tests that failed on their
    own (not one pytest-xdist failed because its worker went down under it), and the figures each
    worker sends with its test reports (WorkerHooks)."""

    def __init__(self, session: MoePerfSession) -> None:
        self.session = session

    @pytest.hookimpl
    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        if (report.failed and "crashed while running" not in str(report.longrepr)
                and report.nodeid not in self.session.failed_tests):  # once, whichever phases failed
            self.session.failed_tests.append(report.nodeid)
        payload = getattr(report, "moeperf_figures", None)  # a worker's figures, sent with its report
        if payload is not None and self.session.options.bench:
            node = getattr(report, "node", None)  # set by pytest-xdist on the controller
            workers.merge_payload(self.session, payload, node.gateway.id if node else payload["gpu"])


class WorkerHooks:
    """On a pytest-xdist worker: what each test measured travels with its report, which xdist
    sends to the controller as the test ends."""

    def __init__(self, session: MoePerfSession, gpu: str) -> None:
        self.session, self.gpu = session, gpu

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_makereport(self, item, call):
        outcome = yield
        report = outcome.get_result()
        if self.session.options.bench:  # every phase: xdist holds a worker's last teardown back
            report.moeperf_figures = workers.worker_payload(self.session, self.gpu)


def is_worker(config: pytest.Config) -> bool:
    return hasattr(config, "workerinput")


def xdist_workers(config: pytest.Config) -> bool:
    """Whether pytest-xdist was asked for worker processes (`-n N` or `-n auto`; 0 runs in process)."""
    n = getattr(config.option, "numprocesses", None)
    return n not in (None, 0, "0") and getattr(config.option, "dist", "no") != "no"
