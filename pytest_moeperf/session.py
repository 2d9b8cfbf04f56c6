"""Run state of one pytest session: the core's parsed options, the device, the baseline store,
results, and the stash key the plugin keeps it under. What a harness adds (the configuration its
figures are frozen under, header fields, summary lines) comes through the hooks of `hookspec`."""

from __future__ import annotations

from functools import cached_property
from pathlib import Path

import pytest

from pytest_moeperf import report
from pytest_moeperf.baselines import BaselineStore
from pytest_moeperf.device import DeviceInfo, short_key
from pytest_moeperf.options import Options


class MoePerfSession:
    """The run state, kept in pytest's config stash under SESSION_KEY (set by the plugin's
    pytest_configure, read by its hooks and the fixtures)."""

    def __init__(self, options: Options, config: pytest.Config | None = None) -> None:
        self.options = options
        self.config = config  # where a harness keeps its state (its stash)
        # pytest's hook caller: the harnesses' pytest_moeperf_* hooks (None: no harness)
        self.hook = config.hook if config is not None else None
        self.results: list = []
        self.to_freeze: dict = {}
        self.finish_lines: list[str] = []  # what finish() wrote, for the terminal summary
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

    def _merged(self, hook_name: str) -> dict:
        """The harnesses' answers to a pytest_moeperf_* hook, merged into one dict."""
        merged: dict = {}
        for part in (getattr(self.hook, hook_name)(session=self) if self.hook is not None else []):
            merged.update(part or {})
        return merged

    @property
    def run_config(self) -> dict:
        """What every gated figure of this run depends on besides the device (hookspec)."""
        return self._merged("pytest_moeperf_run_config")

    def harness_header(self) -> dict:
        """The harnesses' fields of the run's header (hookspec), e.g. the model under test."""
        return self._merged("pytest_moeperf_header")

    def scope_keys(self) -> list[str]:
        """The run configuration's keys that name a configuration (hookspec)."""
        if self.hook is None:
            return []
        return [k for keys in self.hook.pytest_moeperf_scope_keys(session=self) for k in keys or ()]

    @cached_property
    def commit(self) -> str | None:
        return report.checkout_commit(self.rootdir) if self.rootdir is not None else None

    def run_header(self) -> dict:
        """What the report says of the run before any device is looked at: the code, the model,
        the baselines, when it started."""
        return {"commit": self.commit or "unknown (not a git checkout)", "started": self.started,
                **self.harness_header(), "baselines": str(self.options.baselines)}

    def header(self) -> dict:
        h = self.run_header()  # the code, the harnesses' fields, the baselines (named per device below)
        if self.workers:  # the controller of an xdist run: the workers' devices
            h.update(device="; ".join(f"GPU {w['gpu']}: {w['device']}" for w in self.workers),
                     fingerprint=", ".join(sorted({short_key(w["fingerprint"]) for w in self.workers})),
                     baselines=", ".join(sorted({str(s.path) for s, _ in self._stores()})))
        else:
            h.update(device=self.device.describe(), fingerprint=self.device.key, baselines=str(self.store.path))
        if not self.device.is_cuda:  # CPU timings are judged with the host's CPU stall beside them
            stall = self.options.host_stall
            h["host_stall_threshold"] = "off" if stall is None else stall
            h["host_wait_s"] = self.options.host_wait
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
        keys = self.scope_keys()
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
        if self.hook is not None:
            lines += [line for part in self.hook.pytest_moeperf_summary_lines(session=self) for line in part or ()]
        return lines


SESSION_KEY = pytest.StashKey[MoePerfSession]()
