"""pytest wiring of the gate core: its options, markers and hooks. The work lives in `options`,
`session`, `gate`, `timing`, `report` and `xdist_hooks`; a harness (the MoE harness,
`moe_harness`) adds its own through the hooks of `hookspec`."""

from __future__ import annotations

import dataclasses

import pytest

from pytest_moeperf import workers
from pytest_moeperf.fixtures import moe_device, moe_gate, moe_host_meter, moe_sampler, moe_session  # noqa: F401
from pytest_moeperf.options import Options, add_options, parse_options
from pytest_moeperf.session import SESSION_KEY, MoePerfSession
from pytest_moeperf.xdist_hooks import ControllerHooks, WorkerHooks, is_worker, xdist_workers

BENCH_SKIP_REASON = "performance suite: run with --moe-bench to enable it"
MARKERS = (
    "moe_bench: a performance suite, gated against frozen baselines; runs only with --moe-bench",
    "gpu: needs a CUDA device; skipped (with the reason) when there is none",
    "requires_capability(major, minor): needs a CUDA device of at least this compute capability",
)


def pytest_addhooks(pluginmanager) -> None:
    from pytest_moeperf import hookspec, xdist_hooks
    pluginmanager.add_hookspecs(hookspec)
    if not pluginmanager.is_registered(xdist_hooks):  # pytest-xdist's optional hooks, from start-up on
        pluginmanager.register(xdist_hooks, "moeperf-xdist-hooks")


def pytest_addoption(parser: pytest.Parser) -> None:
    add_options(parser)


def _with_workers(config: pytest.Config, options: Options) -> Options:
    """The options with pytest-xdist's GPUs: a worker's simulated GPU name, or on the controller
    of a --moe-bench run the GPU each worker will hold."""
    if is_worker(config):
        gpu = config.workerinput.get(workers.WORKER_GPU_KEY)
        if gpu is not None and workers.simulated_gpus():
            return dataclasses.replace(options, simulated_gpu=workers.simulated_name(gpu))
    elif options.bench and xdist_workers(config):
        sim = workers.simulated_gpus()
        gpus = workers.parse_worker_gpus(int(config.option.numprocesses), options.device,
                                         workers.visible_gpus(), simulated=bool(sim))
        return dataclasses.replace(options, worker_gpus=tuple(gpus))
    return options


def _stop_on_sigterm() -> None:
    """A bench run sent SIGTERM (`timeout`, a CI job's cancel) stops as on Ctrl-C: pytest still
    finishes the session, so the figures measured so far are frozen (with --moe-freeze) and
    reported instead of lost. Only where SIGTERM still has its default action."""
    import signal
    import threading
    if threading.current_thread() is not threading.main_thread():
        return
    if signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
        def stop(signum, frame):
            raise KeyboardInterrupt(f"signal {signum} (SIGTERM): stopping, keeping what was measured")
        signal.signal(signal.SIGTERM, stop)
        _restore_on_unconfigure.append(lambda: signal.signal(signal.SIGTERM, signal.SIG_DFL))


_restore_on_unconfigure: list = []  # undone when the session ends (pytester runs many in one process)


_restore_on_unconfigure: list = []  # undone when the session ends (pytester runs many in one process)


def pytest_configure(config: pytest.Config) -> None:
    for marker in MARKERS:
        config.addinivalue_line("markers", marker)
    gpu = config.workerinput.get(workers.WORKER_GPU_KEY) if is_worker(config) else None
    if gpu is not None:
        workers.pin_worker_gpu(gpu)  # before anything below can initialize CUDA in this worker
    try:
        options = _with_workers(config, parse_options(config))
        session = MoePerfSession(options, config)
        session.rootdir = config.rootpath
        config.stash[SESSION_KEY] = session
        config.hook.pytest_moeperf_configure(config=config, session=session)
    except ValueError as e:
        raise pytest.UsageError(str(e)) from None
    if options.bench:
        _bench_preflight(config, session)
    if not is_worker(config):
        config.pluginmanager.register(ControllerHooks(session), "moeperf-controller-hooks")
    else:
        config.pluginmanager.register(WorkerHooks(session, gpu or ""), "moeperf-worker-hooks")
    if config.pluginmanager.hasplugin("benchmark"):
        config.pluginmanager.register(_BenchmarkHooks(session), "moeperf-benchmark-hooks")


def _bench_preflight(config: pytest.Config, session: MoePerfSession) -> None:
    """What a --moe-bench run would otherwise find after measuring: an unwritable report or
    baselines folder, a malformed baseline, a device that does not exist. Then a SIGTERM stops
    the run as Ctrl-C does, keeping what it measured."""
    from pytest_moeperf import report
    from pytest_moeperf.baselines import BaselineError, BaselineStore
    from pytest_moeperf.timing import pin_heap_allocations
    options = session.options
    pin_heap_allocations()
    problem = _unwritable(options) if not is_worker(config) else None
    if problem:  # found before anything is measured, not after
        raise pytest.UsageError(problem)
    if options.report is not None and not is_worker(config):
        report.write_unfinished(options.report, session.run_header())
    try:
        BaselineStore.validate_folder(options.baselines)
    except BaselineError as e:
        raise pytest.UsageError(f"malformed baseline: {e}") from None
    if options.device != "auto":
        try:
            session.device.torch_device
        except ValueError as e:
            raise pytest.UsageError(str(e)) from None
    _stop_on_sigterm()


class _BenchmarkHooks:
    """Registered only when pytest-benchmark is installed: puts the fingerprint in its machine info."""

    def __init__(self, session: MoePerfSession) -> None:
        self.session = session

    @pytest.hookimpl
    def pytest_benchmark_update_machine_info(self, config, machine_info) -> None:
        machine_info["moeperf"] = {"fingerprint": self.session.device.fingerprint, "key": self.session.device.key}


def _unwritable(options: Options) -> str | None:
    """Why what this run writes at its end could not be written (None: it can be): the baselines
    folder under --moe-freeze, the --moe-report file."""
    targets = [("--moe-report", options.report)] if options.report is not None else []
    if options.freeze:
        targets.append(("--moe-baselines", options.baselines / "x.json"))
    from pytest_moeperf.files import unwritable_ancestor
    for flag, path in targets:
        if path.is_dir():
            return f"{flag} {path}: is a folder; a file path is needed"
        blocked = unwritable_ancestor(path.parent)
        if blocked is not None:
            return f"{flag} {path.parent}: cannot be written ({blocked} is not a writable folder)"
    return None


def _gpu_skip_reason(session: MoePerfSession, item: pytest.Item) -> str | None:
    if not session.device.is_cuda:
        return f"needs a CUDA device; the device under test is {session.device.torch_device}"
    cap = item.get_closest_marker("requires_capability")
    if cap is not None:
        import torch
        have = torch.cuda.get_device_capability(session.device.torch_device)
        need = tuple(cap.args)
        if have < need:
            return f"needs compute capability >= {need[0]}.{need[1]}, the device has {have[0]}.{have[1]}"
    return None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    session = config.stash[SESSION_KEY]
    if session.options.bench:
        # Timed suites first, in a fresh process: what correctness suites leave behind (heap
        # fragmentation, caches, hypothesis' objects) slowed a CPU MoE layer by up to 35%.
        items.sort(key=lambda item: item.get_closest_marker("moe_bench") is None)
    for item in items:
        if item.get_closest_marker("moe_bench") and not session.options.bench:
            item.add_marker(pytest.mark.skip(reason=BENCH_SKIP_REASON))
        elif item.get_closest_marker("gpu") or item.get_closest_marker("requires_capability"):
            reason = _gpu_skip_reason(session, item)
            if reason:
                item.add_marker(pytest.mark.skip(reason=reason))


def pytest_report_header(config: pytest.Config) -> list[str] | None:
    session = config.stash.get(SESSION_KEY, None)
    if session is None or not session.options.bench:
        return None
    h = session.header()
    harness = "".join(f"{k} {v}, " for k, v in session.harness_header().items() if k != "planted")
    freezing = " (freezing)" if session.freeze else ""
    if session.options.worker_gpus:  # the controller of an xdist run times nothing itself
        gpus = session.options.worker_gpus
        return [f"moeperf: {len(gpus)} pytest-xdist worker(s), one GPU each ({', '.join(gpus)}); "
                f"{harness}baselines {session.options.baselines}{freezing}"]
    lines = [f"moeperf: {h['device']} [fingerprint {h['fingerprint']}]", f"moeperf: {harness}baselines {h['baselines']}"
             + freezing]
    if session.options.trust or "planted" in h:
        lines.append(f"moeperf: GATE-TRUST RUN: {session.options.trust or 1} evaluation(s) per timed figure, "
                     f"planted slowdown: {h.get('planted', 'none')}")
    return lines


def pytest_sessionfinish(session: pytest.Session) -> None:
    state = session.config.stash.get(SESSION_KEY, None)
    if state is None:
        return
    if is_worker(session.config) and state.options.bench:
        # The controller merges every worker's figures, freezes and reports once; most came with
        # the test reports (_WorkerHooks), the rest (a session fixture's teardown) come here.
        gpu = session.config.workerinput.get(workers.WORKER_GPU_KEY, "")
        session.config.workeroutput[workers.OUTPUT_KEY] = workers.worker_payload(state, gpu)
        return
    state.finish_lines = state.finish(interrupted=session.exitstatus == pytest.ExitCode.INTERRUPTED)
    if state.worker_errors and not (state.failed_tests or state.run_failures()):
        # Exit 3, not 1: a lost worker says nothing about the code under test. A run that also
        # found a regression or a failed check exits 1, the lost worker named in its summary.
        session.exitstatus = pytest.ExitCode.INTERNAL_ERROR
    elif (state.failed_tests or state.run_failures()) and session.exitstatus in (
            pytest.ExitCode.OK, pytest.ExitCode.NO_TESTS_COLLECTED, pytest.ExitCode.INTERNAL_ERROR):
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_unconfigure(config: pytest.Config) -> None:
    while _restore_on_unconfigure:
        _restore_on_unconfigure.pop()()


def pytest_terminal_summary(terminalreporter, config: pytest.Config) -> None:
    from pytest_moeperf import report
    session = config.stash.get(SESSION_KEY, None)
    if session is None or not (session.results or session.finish_lines):
        return
    terminalreporter.write_sep("=", "moeperf gate")
    if session.results:
        terminalreporter.write_line(report.table(session.results))
        for line in report.legend(session.results):
            terminalreporter.write_line(line)
    if session.options.trust:
        terminalreporter.write_sep("-", "gate-trust evaluations")
        terminalreporter.write_line(report.trust_table(session.results))
    for line in session.finish_lines:
        loud = line.startswith(("HOST-CONTENDED", "the freeze is incomplete", "ERROR:"))
        terminalreporter.write_line(line, yellow=loud, bold=loud)
