"""Run state of one pytest session: parsed options, the device, the baseline store, results, and
the stash key the plugin keeps it under."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

import pytest

from pytest_moeperf import report
from pytest_moeperf.baselines import BaselineStore
from pytest_moeperf.device import DeviceInfo, short_key
from pytest_moeperf.host_load import DEFAULT_STALL_THRESHOLD, DEFAULT_WAIT_S


@dataclass(frozen=True)
class Options:
    bench: bool
    device: str
    model: str
    backend: str
    head: str
    baselines: Path
    freeze: bool
    report: Path | None
    samples: int
    strict: bool = False
    trust: int = 0  # evaluations per timed figure in a gate-trust run (0: an ordinary run)
    plants: tuple = ()  # impl.plant.Plant: planted slowdowns of a gate-trust run
    # The A/B ladder suite (suites/test_ab_ladder.py): rows (None: the device's default), the
    # workload (impl.data.workloads.WorkloadSpec), requests per row and shots (None: defaults),
    # the accuracy equivalence margin (a fraction) and the report folder.
    ladder: str | None = None
    workload: object = None
    requests: int | None = None
    shots: int | None = None
    margin: float = 0.01
    # What each row after the first must show against it, else its test fails (None: no demand;
    # the gate then judges only against frozen figures): "faster", "not-slower" (EXPECTATIONS).
    expect: str | None = None
    ab_report: Path | None = None
    # Server rows (moe_harness.ladder.endpoints.servers.ServerDef) the ladder may name, from
    # --moe-servers; whether a server's failed request stops the ladder ("stop") or is kept as
    # failed while it goes on ("continue"); whether rows may serve different models.
    servers: tuple = ()
    server_errors: str = "stop"
    allow_different_models: bool = False
    # A CPU timing measured while the host's CPU stall (host_load) exceeded host_stall (None: off)
    # is not judged a regression, nor frozen; the gate first waits up to host_wait s for quiet.
    host_stall: float | None = DEFAULT_STALL_THRESHOLD
    host_wait: float = DEFAULT_WAIT_S
    # pytest-xdist (pytest_moeperf.workers): on the controller, the GPU of each worker; on a worker
    # of a simulated run, the name of the GPU it stands for (put in its fingerprint).
    worker_gpus: tuple[str, ...] = ()
    simulated_gpu: str | None = None
    # Options whose value came from their ini key, not the command line: an error found during the
    # run names the key (`named`), where the user has to look.
    from_ini: frozenset = frozenset()

    def named(self, name: str) -> str:
        """How a message names option `name` (e.g. moe_workload): its flag, or its ini key and flag."""
        flag = "--" + name.replace("_", "-")
        return f"ini key {name} ({flag})" if name in self.from_ini else flag


class MoePerfSession:
    """The run state, kept in pytest's config stash under SESSION_KEY (set by the plugin's
    pytest_configure, read by its hooks and the fixtures)."""

    def __init__(self, options: Options) -> None:
        self.options = options
        self.results: list = []
        self.to_freeze: dict = {}
        self.finish_lines: list[str] = []  # what finish() wrote, for the terminal summary
        self.ab_reports: list = []  # the A/B ladder reports the suites wrote (their Markdown files)
        self.ab_verdicts: list[str] = []  # each ladder row's verdict against the first, for the terminal
        # On the controller of an xdist run: each finished worker's GPU, device and figures to
        # freeze (workers.merge_payload), the GPU each live worker holds, and workers that crashed.
        self.workers: list[dict] = []
        # On a worker: how much of results and to_freeze it has sent (workers.worker_payload).
        self.sent_results = 0
        self.sent_freezes: dict = {}
        self.gpu_of_worker: dict[str, str] = {}
        self.worker_errors: list[str] = []
        self.write_errors: list[str] = []  # frozen figures or the report that could not be written
        self.failed_tests: list[str] = []  # tests that failed on their own (not by a worker going down)
        self.rootdir: Path | None = None  # pytest's rootdir: the checkout whose commit the report names
        self.started = report.now()

    @property
    def freeze(self) -> bool:
        return self.options.freeze

    @cached_property
    def device(self) -> DeviceInfo:
        return DeviceInfo(self.options.device, self.options.simulated_gpu)

    @cached_property
    def store(self) -> BaselineStore:
        return BaselineStore(self.options.baselines, self.device.fingerprint, self.device.slug)

    @property
    def dtype_name(self) -> str:
        # bf16 is what a GPU decodes in; fp32 on CPU, where bf16 matmuls are emulated and slow.
        return "bfloat16" if self.device.is_cuda else "float32"

    @property
    def moe_backend(self) -> str:
        """The MoE backend under test; `auto` is Triton on a GPU and gather on a CPU, where
        Triton only runs in its (slow) interpreter."""
        if self.options.backend != "auto":
            return self.options.backend
        return "triton" if self.device.is_cuda else "gather"

    def backends_under_test(self) -> list[str]:
        """The MoE backends a correctness suite checks: the one under test and, when it was left
        to `auto` on a CPU, `triton` as well (in Triton's interpreter), so that a CPU-only CI
        checks the kernel source the GPU runs."""
        names = [self.moe_backend]
        if self.options.backend == "auto" and "triton" not in names:
            names.append("triton")
        return names

    @property
    def run_config(self) -> dict:
        """What every gated figure of this run depends on besides the device."""
        config = {"model": self.options.model, "dtype": self.dtype_name, "moe_backend": self.moe_backend}
        if self.checkpoint_digest is not None:  # a checkpoint replaced at the same path is another model
            config["checkpoint"] = self.checkpoint_digest
        if self.options.head != "bf16":  # figures frozen before the option existed stay comparable
            config["head"] = self.options.head
        return config

    @cached_property
    def checkpoint_digest(self) -> str | None:
        """impl.digests.folder_digest of the model's folder, when --moe-model names one (a preset or an
        embedded checkpoint is named by the code)."""
        from impl.digests import folder_digest
        path = Path(self.options.model)
        return folder_digest(path) if path.is_absolute() and path.is_dir() else None  # parse_model: folders absolute

    @cached_property
    def commit(self) -> str | None:
        return report.checkout_commit(self.rootdir) if self.rootdir is not None else None

    def run_header(self) -> dict:
        """What the report says of the run before any device is looked at: the code, the model,
        the baselines, when it started."""
        return {"commit": self.commit or "unknown (not a git checkout)", "started": self.started,
                "model": self.options.model, "baselines": str(self.options.baselines)}

    def header(self) -> dict:
        if self.workers:  # the controller of an xdist run: the workers' devices
            h = {"device": "; ".join(f"GPU {w['gpu']}: {w['device']}" for w in self.workers),
                 "fingerprint": ", ".join(sorted({short_key(w["fingerprint"]) for w in self.workers})),
                 "model": self.options.model, "moe_backend": self.moe_backend,
                 "baselines": ", ".join(sorted({str(s.path) for s, _ in self._stores()}))}
        else:
            h = {"device": self.device.describe(), "fingerprint": self.device.key, "model": self.options.model,
                 "moe_backend": self.moe_backend, "baselines": str(self.store.path)}
        if not self.device.is_cuda:  # CPU timings are judged with the host's CPU stall beside them
            stall = self.options.host_stall
            h["host_stall_threshold"] = "off" if stall is None else stall
            h["host_wait_s"] = self.options.host_wait
        h = {**self.run_header(), **h}
        if self.options.plants:
            h["planted"] = ", ".join(map(str, self.options.plants))
        if self.options.trust:
            h["trust_evaluations"] = self.options.trust
        return h

    def _stores(self) -> list[tuple[BaselineStore, dict]]:
        """Each device of the run with the figures it froze: this process's, or on the controller
        of an xdist run one per distinct worker fingerprint (identical GPUs share one)."""
        if not self.workers:
            return [(self.store, self.to_freeze)]
        by_key: dict[str, tuple[BaselineStore, dict]] = {}
        for w in self.workers:
            key = short_key(w["fingerprint"])
            if key not in by_key:
                by_key[key] = (BaselineStore(self.options.baselines, w["fingerprint"], w["slug"]), {})
            by_key[key][1].update(w["to_freeze"])
        return list(by_key.values())

    def unmeasured(self) -> list[str]:
        """Figures frozen for this run's device(s) under this run's model, dtype and MoE backend
        that no test measured (a renamed or deleted test leaves its figure so)."""
        measured = {r.metric_id for r in self.results}
        keys = ("model", "dtype", "moe_backend")
        run = self.run_config
        return sorted({mid for store, _ in self._stores() for mid, m in store.figures()
                       if mid not in measured and all(m.config.get(k) == run[k] for k in keys)})

    def strict_failures(self) -> list[str]:
        """Why --moe-strict fails this run (empty: it does not). A figure with no baseline has
        already failed its own test; these are the run-level reasons."""
        if not (self.options.strict and self.options.bench) or self.freeze:
            return []
        problems = []
        missing = self.unmeasured()
        if missing:
            problems.append(f"{len(missing)} frozen figure(s) not measured")
        if not any(r.verdict not in ("no-baseline", "frozen", "reported") for r in self.results):
            problems.append("no figure was compared with a frozen one")
        contended = self.contended()
        if contended:
            # Strict means every frozen figure is judged; one read on a contended host was not.
            problems.append(f"{len(contended)} figure(s) not judged: the host's CPUs were contended")
        return problems

    def contended(self) -> list:
        """Results not judged (or, under --moe-freeze, not frozen) for a contended host."""
        return [r for r in self.results if r.verdict == "host-contended"]

    def run_failures(self) -> list[str]:
        """Why the run fails though no test did: --moe-strict's reasons, figures or a report that
        could not be written, and a freeze that refused figures measured on a contended host (the
        freeze asked for was not done)."""
        problems = self.strict_failures() + self.write_errors
        if self.freeze and self.contended():
            problems.append(f"{len(self.contended())} figure(s) not frozen: the host's CPUs were contended")
        return problems

    def counts(self) -> str:
        """How many figures were compared, and under which key, or had no baseline."""
        by = {v: sum(r.verdict == v for r in self.results) for v in ("no-baseline", "frozen", "reported")}
        scopes = {s: sum(r.scope == s for r in self.results if r.verdict not in by) for s in ("exact", "class")}
        compared = sum(scopes.values())
        line = (f"{compared} figure(s) compared ({scopes['exact']} against this device's fingerprint, "
                f"{scopes['class']} against its class), {by['no-baseline']} without a baseline")
        line += f", {by['frozen']} frozen" if by["frozen"] else ""
        line += f", {by['reported']} reported, not gated (see below)" if by["reported"] else ""
        contended = len(self.contended())
        if contended:
            line += f", {contended} {'NOT FROZEN' if self.freeze else 'NOT JUDGED'} (host contended)"
        return line

    def finish(self, interrupted: bool = False) -> list[str]:
        """Write frozen figures and the report; returns lines for the terminal. `interrupted`: the
        run was stopped part-way (Ctrl-C, SIGTERM)."""
        lines = [self.counts()] if self.options.bench else []
        if self.workers:
            lines.append(f"merged {len(self.results)} figure(s) from {len(self.workers)} pytest-xdist worker(s) on "
                         f"GPU(s) {', '.join(w['gpu'] for w in self.workers)}")
        # The stores only when there is something to freeze: a run that measured nothing (no
        # --moe-bench) never reads the baselines or resolves the device.
        for store, metrics in (self._stores() if self.workers or self.to_freeze else []):
            if metrics:
                try:
                    path = store.freeze(metrics)
                except OSError as e:  # the table and report below are still written
                    self.write_errors.append(f"the figures were NOT frozen: {store.path}: {e}")
                    continue
                lines.append(f"froze {len(metrics)} metric(s) for {short_key(store.fingerprint)} into {path}")
        for error in self.worker_errors:
            lines.append(f"infrastructure error: {error}")
        if self.freeze and not self.results:  # (figures measured but refused say so below)
            when = " before the run stopped" if interrupted else ""
            lines.append(f"nothing was frozen: no figure was measured{when}")
        missing = self.unmeasured() if self.options.bench else []
        if missing and self.freeze:  # say which figures the freeze did not renew (stopped part-way, -k, -x)
            why = "the run stopped part-way: " if interrupted else ""
            lines.append(f"{why}{len(missing)} figure(s) frozen for this device and configuration were not "
                         "re-measured and keep their earlier values: " + ", ".join(missing))
        elif missing:
            lines.append(f"{len(missing)} figure(s) frozen for this device and configuration were not measured: "
                         + ", ".join(missing))
        for r in self.contended():
            lines.append(f"HOST-CONTENDED: {r.message}")
        failures = self.strict_failures()
        if failures:
            lines.append("--moe-strict fails this run: " + "; ".join(failures))
        if self.freeze and self.contended():
            lines.append(f"the freeze is incomplete: {len(self.contended())} figure(s) measured on a contended host "
                         "were not frozen; this run fails")
        if self.options.report is not None and self.options.bench:
            # Written whenever the gate ran; the plugin wrote a stub saying "did not finish" at
            # start-up, so a nightly job never publishes the last run's report.
            failed = self.failed_tests or self.run_failures() or self.worker_errors
            # A run stopped part-way passes nothing: what it did not measure was not judged.
            verdict = ("FAIL" if failed else "STOPPED: no verdict (not every figure was measured)" if interrupted
                       else "PASS")
            outcome = {"status": "stopped part-way" if interrupted else "complete", "outcome": verdict,
                       "finished": report.now()}
            try:
                json_path, md_path = report.write(self.options.report, self.results, {**self.header(), **outcome},
                                                  self.run_failures() + [f"infrastructure error: {e}"
                                                                         for e in self.worker_errors],
                                                  failed_tests=self.failed_tests)
                lines.append(f"report written to {json_path} and {md_path}")
            except OSError as e:
                self.write_errors.append(f"the report was NOT written: {self.options.report}: {e}")
        lines += [f"ERROR: {e}" for e in self.write_errors]
        for md_path in self.ab_reports:
            lines.append(f"A/B ladder report: {md_path} (every request in the JSON beside it, figures as PNG)")
        lines += self.ab_verdicts
        return lines


SESSION_KEY = pytest.StashKey[MoePerfSession]()
