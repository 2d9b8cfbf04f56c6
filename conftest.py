"""Repo-root conftest: hypothesis profiles, and each xdist worker's torch threads (the plugin
itself loads via its entry point)."""

import os
import sys

from hypothesis import HealthCheck, settings

from pytest_moeperf.options import parse_count


def parse_fuzz_examples(text: str | None) -> int:
    """MOEPERF_FUZZ_EXAMPLES, the `fuzz` profile's example count (each property takes its share)."""
    return parse_count("MOEPERF_FUZZ_EXAMPLES", text, 1) or 2000


# "ci": derandomized and bounded, so the default run is reproducible and fast on 2 cores;
# "fuzz": many more examples (tox -e fuzz; MOEPERF_FUZZ_EXAMPLES sets how many). A failure prints
# its @reproduce_failure blob, and the example database (.hypothesis/) replays it first next run.
settings.register_profile("ci", derandomize=True, max_examples=30, deadline=None, print_blob=True,
                          suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("fuzz", max_examples=parse_fuzz_examples(os.environ.get("MOEPERF_FUZZ_EXAMPLES")),
                          deadline=None, print_blob=True, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


def worker_threads(cores: int, workers: str | None) -> int | None:
    """Torch threads for one of `workers` xdist workers (PYTEST_XDIST_WORKER_COUNT) on `cores`:
    the cores shared out, at least one; None outside xdist."""
    return max(1, cores // parse_count("PYTEST_XDIST_WORKER_COUNT", workers, 1)) if workers else None


# Under `pytest -n auto`, every worker's torch took all the cores: on 2 cores two workers ran 4
# spinning threads, and a test's pytest subprocess (which inherits this environment) ran about 4x
# slower than alone (the scrambled-draft control: 142 s against 35 s).
_threads = worker_threads(len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1,
                          os.environ.get("PYTEST_XDIST_WORKER_COUNT"))
if _threads is not None and "OMP_NUM_THREADS" not in os.environ:
    os.environ["OMP_NUM_THREADS"] = str(_threads)
    if "torch" in sys.modules:  # already imported (by a plugin loaded before this file): set it as well
        sys.modules["torch"].set_num_threads(_threads)
