"""A user's MoE backend installed as a package that declares it in the `moeperf.backends`
entry-point group: found by name (`--moe-backend`), run by the shipped parity suite with its
provenance checked, failing that suite when its numbers are wrong; an entry point that fails to
load is named when its backend is asked for and does not take the other backends down.

The package is a folder on the path holding the module and a `.dist-info` with its
entry_points.txt, which is what `pip install` of a package declaring
`[project.entry-points."moeperf.backends"]` leaves behind; importlib.metadata reads it the same way.
"""

from __future__ import annotations

import os
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from impl import backends

SUITES = Path(__file__).resolve().parents[1] / "suites"

# The user's package: a correct layer (the fp32 oracle under another name, recording its own
# kernel as provenance), one that drops each token's last expert, a factory entry point, and
# entry points that fail: a module that is not installed, and a factory that returns no Backend.
MODULE = '''
from impl import backends
from impl.moe.reference import moe_reference


def _layer(name, drop_last=False):
    def run(x, weights, ids, w_gate_up, w_down, shared=None):
        backends.note("moe", name, "user_moe_kernel", tokens=x.shape[0])
        if drop_last:
            weights = weights.clone()
            weights[:, -1] = 0
        return moe_reference(x, weights, ids, w_gate_up, w_down, shared)
    return run


backend = backends.Backend("moe", "user-moe", _layer("user-moe"), "a user's MoE layer")
dropped = backends.Backend("moe", "user-moe-dropped", _layer("user-moe-dropped", drop_last=True), "planted defect")


def make():
    return backends.Backend("moe", "user-moe-made", _layer("user-moe-made"), "made by a factory")


cuda_only = backends.Backend("moe", "user-moe-cuda", _layer("user-moe-cuda"), "a GPU kernel", devices=("cuda",))
shadow = backends.Backend("moe", "gather", _layer("gather"), "a user's layer under a built-in's name")


def not_a_backend():
    return "moe"


aliased = backends.Backend("moe", "user-moe-real-name", _layer("user-moe-real-name"), "named otherwise than its entry point")
'''
ENTRY_POINTS = """[moeperf.backends]
user-moe = user_moe_pkg:backend
user-moe-dropped = user_moe_pkg:dropped
user-moe-made = user_moe_pkg:make
user-moe-missing = user_moe_pkg_not_installed:backend
user-moe-wrong = user_moe_pkg:not_a_backend
user-moe-cuda = user_moe_pkg:cuda_only
gather = user_moe_pkg:shadow
user-moe-alias = user_moe_pkg:aliased
"""


@pytest.fixture
def installed(tmp_path, monkeypatch) -> Path:
    """The user's package on the path of this process (fresh registry) and of subprocesses."""
    site = tmp_path / "site"
    (site / "user_moe_pkg").mkdir(parents=True)
    (site / "user_moe_pkg" / "__init__.py").write_text(MODULE)
    info = site / "user_moe_pkg-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: user-moe-pkg\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(ENTRY_POINTS)
    monkeypatch.syspath_prepend(str(site))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH")])))
    monkeypatch.setattr(backends, "_registry", dict(backends._registry))
    monkeypatch.setattr(backends, "_entry_point_failures", {})
    monkeypatch.setattr(backends, "_entry_points_loaded", False)
    return site


def test_an_installed_packages_backends_are_found_by_name(installed):
    with pytest.warns(UserWarning):  # the entry points below that fail to load
        assert backends.get("moe", "user-moe").description == "a user's MoE layer"
    assert backends.get("moe", "user-moe-made").description == "made by a factory"  # a factory entry point
    assert {"user-moe", "user-moe-made", "triton", "gather"} <= set(backends.available("moe"))


def test_an_entry_point_that_fails_to_load_warns_at_once_naming_it(installed):
    """Said when the entry points load, not only when its backend is asked for: a user's backend
    under a built-in's name would otherwise pass every suite as the built-in."""
    with pytest.warns(UserWarning) as caught:
        assert backends.get("moe", "gather").description != "a user's layer under a built-in's name"
    messages = [str(w.message) for w in caught]
    assert ("entry point gather = user_moe_pkg:shadow in 'moeperf.backends' was not loaded (ValueError: a moe backend "
            "named 'gather' is already registered); its backend is unavailable") in messages
    assert any(m.startswith("entry point user-moe-missing = user_moe_pkg_not_installed:backend") for m in messages)
    # A backend registered under another name than its entry point's is found by its own, and said so.
    assert ("entry point user-moe-alias = user_moe_pkg:aliased in 'moeperf.backends' registers the moe backend "
            "'user-moe-real-name': name it so (--moe-backend user-moe-real-name), or give the entry point the "
            "backend's name") in messages


def test_a_ladder_row_naming_a_backend_that_failed_to_load_says_why(installed):
    from impl.serve.rows import parse_row
    with pytest.warns(UserWarning), pytest.raises(ValueError, match=r"moe: unknown MoE backend 'user-moe-missing'; "
                                                                  r"known: .*entry point user-moe-missing = "
                                                                  r"user_moe_pkg_not_installed:backend .*failed to "
                                                                  r"load: ModuleNotFoundError"):
        parse_row("x=moe=user-moe-missing", "cpu")


def test_a_backend_for_another_device_is_a_usage_error(installed):
    from moe_harness.options import parse_backend
    with pytest.warns(UserWarning):
        assert parse_backend("user-moe-cuda", "cuda") == "user-moe-cuda"
    with pytest.raises(ValueError, match=r"--moe-backend: the 'user-moe-cuda' MoE backend runs on \['cuda'\], not on "
                                         r"this run's device \(cpu: --moe-device cpu\)"):
        parse_backend("user-moe-cuda", "cpu")


def test_an_entry_point_that_fails_to_load_is_named_and_spares_the_others(installed):
    with pytest.warns(UserWarning), pytest.raises(ValueError) as info:
        backends.get("moe", "user-moe-missing")
    message = str(info.value)
    assert "unknown moe backend 'user-moe-missing'" in message
    assert ("entry point user-moe-missing = user_moe_pkg_not_installed:backend in 'moeperf.backends' failed to "
            "load: ModuleNotFoundError: No module named 'user_moe_pkg_not_installed'") in message
    assert ("entry point user-moe-wrong = user_moe_pkg:not_a_backend in 'moeperf.backends' failed to load: "
            "TypeError: it gave str, expected impl.backends.Backend") in message
    assert backends.get("moe", "gather").name == "gather" and backends.get("moe", "user-moe").name == "user-moe"


def test_asking_for_a_backend_that_failed_to_load_is_a_usage_error_saying_why(installed, pytester):
    pytester.makepyfile("def test_nothing():\n    pass\n")
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "--moe-backend", "user-moe-missing")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*--moe-backend: unknown moe backend 'user-moe-missing'*entry point user-moe-missing"
                                 " = user_moe_pkg_not_installed:backend in 'moeperf.backends' failed to load: "
                                 "ModuleNotFoundError*"])


def _parity(pytester, backend: str) -> dict[str, tuple[str, str]]:
    """The shipped parity suite's tiny bf16 M=4 cases against `backend`, in a subprocess (a fresh
    process scans the installed entry points as a user's run does): nodeid -> (outcome, text)."""
    pytester.makepyfile(test_moe_parity=(SUITES / "test_moe_parity.py").read_text())
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "--moe-backend", backend, "--junitxml=out.xml",
                                           "-k", "test_parity_with_reference and tiny-h96 and bf16 and M4",
                                           "test_moe_parity.py", timeout=600)
    assert result.ret in (0, 1), result.stdout.str()[-3000:] + result.stderr.str()[-3000:]
    outcomes = {}
    for case in ET.parse(pytester.path / "out.xml").iter("testcase"):
        status = next((c for c in case if c.tag in ("failure", "error", "skipped")), None)
        outcomes[case.get("name")] = ("passed", "") if status is None else (
            status.tag, f"{status.get('message', '')}\n{status.text or ''}")
    return outcomes


def test_the_parity_suite_runs_an_installed_backend_and_checks_what_ran(installed, pytester):
    outcomes = _parity(pytester, "user-moe")
    assert len(outcomes) == 2 and all(o == ("passed", "") for o in outcomes.values()), outcomes


def test_the_parity_suite_fails_an_installed_backend_whose_numbers_are_wrong(installed, pytester):
    """The negative control: the same package's layer with each token's last expert dropped."""
    outcomes = _parity(pytester, "user-moe-dropped")
    assert len(outcomes) == 2, outcomes
    for outcome, text in outcomes.values():
        assert outcome == "failure" and "exceeds the tolerance" in text, text[-2000:]
