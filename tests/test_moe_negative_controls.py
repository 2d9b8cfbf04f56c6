"""Negative controls: the parity and fuzz suites catch planted defects in a MoE backend.

Through pytester, the real suite files (read from suites/) run against two defective backends
registered by a conftest, each a thin wrapper of the real Triton kernels that re-records their
provenance under its own name (so the suites' provenance checks pass and only the numbers can
fail them):
- `triton-wrong-scale`: the MXFP4 scales read one block off along K (each row's E8M0 codes
  rolled by one block); for plain bf16/fp32 weights the same wrong index on the values (each
  row rolled by 32 along K);
- `triton-dropped-expert`: the last routed expert of every token dropped (its weight zeroed);
- `triton-ignores-clip`: declares that it clips SwiGLU, and drops the routed and shared limits;
- `triton-renormalizes-in-place`: divides the routing weights by their sum in place, then runs on
  them (an oracle that ran after it would see the same weights and agree);
- `triton-refuses-top1`: refuses top-1 routing (impl.backends.Unsupported) and drops each token's
  last expert otherwise (a refusal once ended a fuzz property, hiding the rest);
- `triton-refuses-all`: refuses every case;
- `triton-drops-past-top8`: drops every token's experts past its 8th (only top-k > 8 shows it).
The very same selection passes with the real `triton` backend. Small: a subset of the parity
cases and a few hypothesis examples per property, without shrinking; each run in a subprocess.
"""

from __future__ import annotations

import importlib.util
import sys
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from pathlib import Path

import pytest

from impl import backends

SUITES = Path(__file__).resolve().parents[1] / "suites"
SUITE_FILES = ("test_moe_parity.py", "test_moe_fuzz.py")
EXAMPLES = 4  # hypothesis examples per property in these runs

CONFTEST = f'''
import dataclasses

import torch
from hypothesis import HealthCheck, Phase, settings

from impl import backends
from impl.moe.triton_backend import moe_triton
from impl.quant.mxfp4 import MXFP4Tensor

# Few examples, reproducible, and no shrinking (a failure is all these runs need to see).
settings.register_profile("negative-controls", max_examples={EXAMPLES}, derandomize=True, deadline=None,
                          phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck))
settings.load_profile("negative-controls")


def _recorded_as(name, fn):
    """fn's kernels, recorded under backend `name` (as any wrapper backend records them)."""
    def run(*args, **kwargs):
        with backends.record_provenance() as inner:
            out = fn(*args, **kwargs)
        for e in inner.events:
            backends.note(e.kind, name, e.kernel, **e.config)
        return out
    return run


def _wrong_block(w):
    if isinstance(w, MXFP4Tensor):
        return MXFP4Tensor(w.packed, torch.roll(w.scales, 1, dims=-1).contiguous())
    return torch.roll(w, 32, dims=-1).contiguous()


def _wrong_scale(x, weights, ids, w_gate_up, w_down, shared=None):
    return moe_triton(x, weights, ids, _wrong_block(w_gate_up), _wrong_block(w_down), shared)


def _dropped_expert(x, weights, ids, w_gate_up, w_down, shared=None):
    weights = weights.clone()
    weights[:, -1] = 0
    return moe_triton(x, weights, ids, w_gate_up, w_down, shared)


def _ignores_clip(x, weights, ids, w_gate_up, w_down, shared=None, swiglu_limit=None):
    unclipped = None if shared is None else dataclasses.replace(shared, limit=None)
    return moe_triton(x, weights, ids, w_gate_up, w_down, unclipped)


def _renormalizes_in_place(x, weights, ids, w_gate_up, w_down, shared=None):
    weights.div_(weights.sum(dim=-1, keepdim=True))
    return moe_triton(x, weights, ids, w_gate_up, w_down, shared)


def _refuses_top1(x, weights, ids, w_gate_up, w_down, shared=None):
    if ids.shape[1] == 1:
        raise backends.Unsupported("top-1 routing is not supported")
    return _dropped_expert(x, weights, ids, w_gate_up, w_down, shared)


def _drops_past_top8(x, weights, ids, w_gate_up, w_down, shared=None):
    weights = weights.clone()
    weights[:, 8:] = 0
    return moe_triton(x, weights, ids, w_gate_up, w_down, shared)


def _refuses_all(x, weights, ids, w_gate_up, w_down, shared=None):
    raise backends.Unsupported("this planted backend covers no case")


DEFECTS = {{"triton-wrong-scale": _wrong_scale, "triton-dropped-expert": _dropped_expert,
           "triton-renormalizes-in-place": _renormalizes_in_place, "triton-refuses-top1": _refuses_top1,
           "triton-refuses-all": _refuses_all, "triton-drops-past-top8": _drops_past_top8}}
for _name, _fn in DEFECTS.items():
    backends.register(backends.Backend("moe", _name, _recorded_as(_name, _fn), "planted defect"), replace=True)
backends.register(backends.Backend("moe", "triton-ignores-clip", _recorded_as("triton-ignores-clip", _ignores_clip),
                                   "planted defect", clips_swiglu=True), replace=True)

'''

# Parity: the M=4 cases of one tiny shape (bf16, MXFP4 and fp32, with and without the shared
# expert, and clipped); fuzz: every property of the fuzz file. A control that reads only some of
# these runs only those (each case runs under Triton's interpreter on a CPU).
PARITY = "tiny-h96 and M4"
SELECTION = f"({PARITY}) or test_moe_fuzz"
PARITY_CASES = 6
CLIPPED_CASES = 3
FUZZ_TESTS = ("test_fuzz_matches_reference", "test_fuzz_nan_reaches_exactly_its_rows",
              "test_mxfp4_decode_every_code_and_scale", "test_mxfp4_nan_scale_and_overflow_reach_exactly_their_tokens")


@pytest.fixture
def suites(pytester):
    pytester.makeconftest(CONFTEST)
    pytester.makepyfile(**{Path(name).stem: (SUITES / name).read_text() for name in SUITE_FILES})
    return pytester


@dataclass
class Outcome:
    nodeid: str
    outcome: str  # passed, failed, skipped, error
    text: str  # the failure's message and traceback


def run_suites(pytester, backend: str, selection: str = SELECTION) -> list[Outcome]:
    """The selection against `backend`, in a subprocess: in-process runs drop the modules first
    imported inside them, and importing triton's or torch's C extensions twice aborts. The timeout
    only stops a hang: about a minute on an idle CI machine, it took over 240 s on a loaded one."""
    result = pytester.runpytest_subprocess(
        "-p", "no:cacheprovider", "--moe-backend", backend, "-W", "ignore::RuntimeWarning",
        "--junitxml=results.xml", "-k", selection, *SUITE_FILES, timeout=900)
    assert result.ret in (0, 1), result.stdout.str()[-4000:] + result.stderr.str()[-4000:]
    outcomes = []
    for case in ET.parse(pytester.path / "results.xml").iter("testcase"):
        nodeid = f"{case.get('classname').rsplit('.', 1)[-1]}.py::{case.get('name')}"
        status = next((c for c in case if c.tag in ("failure", "error", "skipped")), None)
        outcome = {None: "passed", "failure": "failed", "error": "error", "skipped": "skipped"}[
            None if status is None else status.tag]
        text = "" if status is None else f"{status.get('message', '')}\n{status.text or ''}"
        outcomes.append(Outcome(nodeid, outcome, text))
    return outcomes


def test_the_selection_passes_with_the_real_triton_backend(suites):
    outcomes = run_suites(suites, "triton")
    assert all(o.outcome == "passed" for o in outcomes), [(o.nodeid, o.outcome, o.text[-2000:]) for o in outcomes
                                                          if o.outcome != "passed"]
    assert len([o for o in outcomes if "test_parity_with_reference" in o.nodeid]) == PARITY_CASES
    assert len([o for o in outcomes if "test_clipped_parity" in o.nodeid]) == CLIPPED_CASES
    for test in FUZZ_TESTS:
        assert any(test in o.nodeid for o in outcomes), f"{test} did not run"


@pytest.mark.parametrize("defect", ["triton-wrong-scale", "triton-dropped-expert"])
def test_planted_defect_fails_parity_and_fuzz(suites, defect):
    outcomes = run_suites(suites, defect)
    assert not [o for o in outcomes if o.outcome == "error"], [o.text[-2000:] for o in outcomes]
    for o in outcomes:  # failed on the numbers, not on provenance or a crash
        if o.outcome == "failed":
            assert "provenance names backends" not in o.text and "AssertionError" in o.text, (
                f"{o.nodeid} failed otherwise:\n{o.text[-3000:]}")
    # Every parity case of the selection fails, with the stated tolerance exceeded.
    parity = [o for o in outcomes if "test_parity_with_reference" in o.nodeid]
    assert len(parity) == PARITY_CASES, [o.nodeid for o in parity]
    assert all(o.outcome == "failed" and "exceeds the tolerance" in o.text for o in parity), (
        f"{defect} got through parity cases {[o.nodeid for o in parity if o.outcome != 'failed']}")
    # So do the fuzz properties: the general one finds a failing example (reported with its
    # drawn case), and the MXFP4 decode checks fail for each of the three weights.
    fuzz = [o for o in outcomes if "test_fuzz_matches_reference" in o.nodeid]
    assert len(fuzz) == 1 and fuzz[0].outcome == "failed", f"{defect} got through the fuzz suite"
    assert "Case(experts=" in fuzz[0].text
    decode = [o for o in outcomes if "test_mxfp4_decode_every_code_and_scale" in o.nodeid]
    assert len(decode) == 3 and all(o.outcome == "failed" for o in decode), [(o.nodeid, o.outcome) for o in decode]


def test_a_backend_that_changes_its_inputs_fails_parity_and_fuzz_naming_them(suites):
    """Its outputs agree with an oracle run on the inputs as it left them; the suites check the
    inputs themselves."""
    outcomes = run_suites(suites, "triton-renormalizes-in-place", f"({PARITY}) or test_fuzz_matches_reference")
    parity = [o for o in outcomes if "test_parity_with_reference" in o.nodeid]
    assert len(parity) == PARITY_CASES and all(
        o.outcome == "failed" and "changed its input(s) ['weights'] in place" in o.text for o in parity), (
        [(o.nodeid, o.outcome, o.text[-500:]) for o in parity])
    fuzz = [o for o in outcomes if "test_fuzz_matches_reference" in o.nodeid]
    assert len(fuzz) == 1 and fuzz[0].outcome == "failed" and "in place" in fuzz[0].text


def test_refusing_some_drawn_cases_does_not_hide_a_defect_in_the_others(suites):
    outcomes = run_suites(suites, "triton-refuses-top1", "test_fuzz_matches_reference")
    fuzz = [o for o in outcomes if "test_fuzz_matches_reference" in o.nodeid]
    assert len(fuzz) == 1 and fuzz[0].outcome == "failed" and "exceeds the tolerance" in fuzz[0].text, (
        [(o.nodeid, o.outcome, o.text[-800:]) for o in fuzz])


def test_a_backend_that_refuses_every_drawn_case_fails_the_fuzz_properties(suites):
    outcomes = run_suites(suites, "triton-refuses-all", "test_fuzz_matches_reference")
    assert len(outcomes) == 1 and outcomes[0].outcome == "failed", outcomes
    assert "refused every drawn case" in outcomes[0].text and "covers no case" in outcomes[0].text


def test_a_defect_only_large_top_k_shows_fails_the_fuzz_suites_fixed_corners(suites):
    """The corners run every time, whatever the profile draws: the two past top-8 fail on the
    numbers, the top-1 and top-8 ones pass."""
    outcomes = run_suites(suites, "triton-drops-past-top8", "ends_of_the_drawn_ranges")
    got = {o.nodeid.split("[triton-drops-past-top8-", 1)[1].rstrip("]"): o for o in outcomes}
    assert len(got) == 4, sorted(got)
    failed = {name for name, o in got.items() if o.outcome == "failed" and "exceeds the tolerance" in o.text}
    assert failed == {name for name in got if "top-16" in name or "every expert" in name}, (
        {name: (o.outcome, o.text[-300:]) for name, o in got.items()})
    assert all(o.outcome == "passed" for name, o in got.items() if name not in failed)


def test_a_backend_that_ignores_the_clip_it_declares_fails_the_clipped_parity(suites):
    """Its unclipped cases are right, so only the clipped ones can catch it: they all fail on the
    numbers; a backend that does not declare the clip is skipped there (the defects above)."""
    outcomes = run_suites(suites, "triton-ignores-clip", PARITY)
    assert all("test_moe_parity" in o.nodeid for o in outcomes), [o.nodeid for o in outcomes]
    clipped = [o for o in outcomes if "test_clipped_parity" in o.nodeid]
    assert len(clipped) == CLIPPED_CASES and all(o.outcome == "failed" and "exceeds the tolerance" in o.text
                                                 for o in clipped), [(o.nodeid, o.outcome) for o in clipped]
    assert all(o.outcome == "passed" for o in outcomes if o not in clipped)


def test_the_provenance_check_fails_when_the_backend_under_test_did_not_run():
    """The parity suite's provenance check (a backend that computed the right numbers through
    another backend, or recorded nothing, must not pass), on hand-made provenance."""
    spec = importlib.util.spec_from_file_location("_negative_control_parity", SUITES / "test_moe_parity.py")
    parity = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = parity  # dataclasses look their module up there
    try:
        spec.loader.exec_module(parity)
    finally:
        del sys.modules[spec.name]
    triton = backends.get("moe", "triton")
    with backends.record_provenance() as nothing:
        pass
    with pytest.raises(AssertionError, match="recorded no moe kernels"):
        parity.assert_ran(nothing, triton, "bf16")
    with backends.record_provenance() as other:
        backends.note("moe", "reference", "moe_reference")
    with pytest.raises(AssertionError, match=r"names backends \['reference'\], expected only 'triton'"):
        parity.assert_ran(other, triton, "bf16")
    with backends.record_provenance() as wrong_format:
        backends.note("moe", "triton", "moe_gate_up_kernel+moe_down_kernel", format="bf16")
    with pytest.raises(AssertionError, match="ran weight format"):
        parity.assert_ran(wrong_format, triton, "mxfp4")
    parity.assert_ran(wrong_format, triton, "bf16")  # and the matching case passes
