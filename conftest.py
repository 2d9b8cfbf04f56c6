"""Repo-root conftest: hypothesis profiles only (the plugin itself loads via its entry point)."""

import os

from hypothesis import HealthCheck, settings

# "ci": derandomized and bounded, so the default run is reproducible and fast on 2 cores;
# "fuzz": many more examples (tox -e fuzz).
settings.register_profile("ci", derandomize=True, max_examples=30, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("fuzz", max_examples=2000, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))
