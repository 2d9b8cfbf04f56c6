"""The repo's hypothesis profiles (conftest.py at the root): the `fuzz` profile's size comes from
MOEPERF_FUZZ_EXAMPLES, and a bad value is an error naming it before any test runs."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PROBE = ("import sys; sys.path.insert(0, 'suites'); import conftest, test_moe_fuzz as f; "
         "from hypothesis import settings; print(settings.default.max_examples, f._share(0.35))")


def _probe(value: str | None) -> subprocess.CompletedProcess:
    env = {**os.environ, "HYPOTHESIS_PROFILE": "fuzz", "PYTHONPATH": str(ROOT)}
    env.pop("MOEPERF_FUZZ_EXAMPLES", None)
    if value is not None:
        env["MOEPERF_FUZZ_EXAMPLES"] = value
    return subprocess.run([sys.executable, "-c", PROBE], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)


def test_the_fuzz_profile_takes_its_size_from_the_environment_and_each_property_its_share():
    default, short = _probe(None), _probe("40")
    assert default.returncode == 0 and default.stdout.split() == ["2000", "700"], default.stderr[-2000:]
    assert short.returncode == 0 and short.stdout.split() == ["40", "14"], short.stderr[-2000:]


@pytest.mark.parametrize("value", ["many", "0", "-5"])
def test_a_bad_example_count_is_an_error_naming_the_variable(value):
    result = _probe(value)
    assert result.returncode != 0
    assert f"MOEPERF_FUZZ_EXAMPLES must be a whole number >= 1, got {value!r}" in result.stderr
