"""Loading the plugins imports neither torch nor scipy.stats: every pytest process pays for what
its plugins import at start (each xdist worker, each inner run of the pytester tests, a user's
`pytest --help`), and importing them took 5.5-6.1 s on the 2-core CI machine, where a trivial
pytest run now starts in 1.5-1.7 s. The model code, torch and the statistics load when a run
first needs them."""

from __future__ import annotations

import json
import subprocess
import sys

HEAVY = ("torch", "scipy.stats", "transformers", "triton")


def _heavy_after(code: str) -> list[str]:
    """The HEAVY modules a fresh interpreter holds after running `code`."""
    probe = f"{code}\nimport json, sys\nprint(json.dumps([m for m in {list(HEAVY)!r} if m in sys.modules]))"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout
    return json.loads(out.splitlines()[-1])


def test_the_plugins_and_the_ladder_defaults_load_without_torch_or_scipy():
    assert _heavy_after("import pytest_moeperf.plugin, moe_harness.plugin, impl.serve.defaults, "
                        "impl.model.config") == []


def test_the_probe_sees_torch_under_the_model_builder_and_scipy_once_a_figure_is_compared():
    """Negative control: the same probe names what a run that builds a model or compares a
    figure loads."""
    assert "torch" in _heavy_after("import impl.model.build")
    assert "scipy.stats" in _heavy_after("from pytest_moeperf.stats import compare\n"
                                         "compare([1.0, 1.1, 0.9] * 4, [1.0] * 12, 'higher', 0.1)")
