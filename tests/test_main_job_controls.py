"""Planted defects that the CPU main job must fail on any machine, whatever its host's level:
the MoE backend 25% slower (through moe_over_plain_torch, the CPU's gate of the MoE layer, on a
freeze of this machine) and an MTP draft ranking with scrambled weights (accept length near 1:
the accept-length floor and the gated figures, which are deterministic on a CPU, so the
committed ones are used, keyed to this machine)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pytest_moeperf.device import DeviceInfo

ROOT = Path(__file__).resolve().parents[1]
CHECKPOINT = ROOT / "checkpoints" / "tiny-gsm"

pytestmark = pytest.mark.skipif(not (CHECKPOINT / "model.safetensors").is_file(),
                                reason=f"no trained checkpoint at {CHECKPOINT}")

# The NEXTN layer's input projection permuted along its outputs: the draft still runs, shares the
# target's head and embedding, and proposes tokens the target rarely accepts.
SCRAMBLED_DRAFT = '''
import pytest
import torch


@pytest.fixture(scope="session", autouse=True)
def _scrambled_draft(moe_model):
    w = moe_model.mtp[0].eh_proj.weight
    with torch.no_grad():
        w.copy_(w[torch.randperm(w.shape[0], generator=torch.Generator().manual_seed(0))])
'''


def _run(pytester, suite: str, *args):
    pytester.makepyfile(**{Path(suite).stem: (ROOT / suite).read_text()})
    # A subprocess: each run builds its own model. The host's contention is not what is tested
    # (--moe-host-stall off): on CI the other xdist worker keeps it contended.
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-rA", "--moe-bench", "--moe-host-stall", "off",
                                           "--moe-baselines", str(pytester.path / "baselines"),
                                           f"{Path(suite).stem}.py", *args, timeout=300)
    assert result.ret in (0, 1), result.stdout.str()[-4000:] + result.stderr.str()[-3000:]
    return result


def test_a_moe_backend_25_percent_slower_fails_the_moe_layer_over_plain_torch(pytester):
    suite, only = "suites/test_decode_bench.py", ("-k", "plain_torch")
    _run(pytester, suite, "--moe-freeze", *only).assert_outcomes(passed=1)
    _run(pytester, suite, *only).assert_outcomes(passed=1)
    slow = _run(pytester, suite, "--moe-plant", "moe=0.25", *only)
    slow.assert_outcomes(failed=1)
    slow.stdout.fnmatch_lines(["*moe_over_plain_torch*-> regression*"])


def test_a_scrambled_mtp_draft_fails_the_accept_length_floor_and_its_gated_figures(pytester):
    committed = json.loads((ROOT / "baselines" / "cpu-amd-epyc-2c.json").read_text())
    here = DeviceInfo("cpu")
    metrics = {mid: m for e in committed["entries"] for mid, m in e["metrics"].items()
               if mid.startswith("suites/test_accept_length.py::")}
    assert len(metrics) == 4
    folder = pytester.mkdir("baselines")
    (folder / f"{here.slug}.json").write_text(json.dumps({"schema": committed["schema"], "entries": [
        {"fingerprint": here.fingerprint, "metrics": {mid.replace("suites/", ""): m for mid, m in metrics.items()}}]}))
    _run(pytester, "suites/test_accept_length.py").assert_outcomes(passed=7)
    pytester.makeconftest(SCRAMBLED_DRAFT)
    broken = _run(pytester, "suites/test_accept_length.py")
    broken.assert_outcomes(failed=5, passed=2)  # the floor, the mean and every position; sanity, provenance pass
    broken.stdout.fnmatch_lines(["*mtp_accept_length_k3*-> regression*", "*check head sharing*"])
