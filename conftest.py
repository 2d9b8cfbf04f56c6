"""Repo-root conftest: hypothesis profiles only (the plugin itself loads via its entry point)."""

import os

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
