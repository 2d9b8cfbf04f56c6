"""Negative controls for the accept-length suite (suites/test_accept_length.py), run through
pytester against the trained checkpoint (checkpoints/tiny-gsm) in a subprocess each:
- `unchecked-fp8-bytes`: the draft's head is a bf16 head holding the FP8 head's e4m3 bytes read
  as bf16, without their scales, and the decoder's head-sharing check is switched off (an
  implementation that forgot the contract): the output is still the target's, but the accept
  length collapses (about 1.6 against 2.9 at k = 3 on a partly trained checkpoint) and the floor
  test fails with a message pointing at head sharing. (The e4m3 *values* without the per-row
  scales hurt far less on this checkpoint, about 2.5: its predictions are confident enough that
  rescaling rows rarely moves the argmax. The frozen-figure gate with --moe-bench catches that.)
- `checked-fp8-bytes`: the same draft with the check on: refused up front, naming head sharing;
- `fp8-fallback`: the model's head is FP8 but its kernel silently runs the bf16 path: the
  provenance test fails.
The unmodified checkpoint passes the same selection.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SUITE = ROOT / "suites" / "test_accept_length.py"
CHECKPOINT = ROOT / "checkpoints" / "tiny-gsm"

pytestmark = pytest.mark.skipif(not (CHECKPOINT / "model.safetensors").is_file(),
                                reason=f"no trained checkpoint at {CHECKPOINT}")

COMMON = '''
import pytest
import torch

from impl import backends
from impl.head import BF16Head, FP8Head


def fp8_bytes_head(model):
    """A bf16 head whose weights are the FP8 head's e4m3 bytes read as bf16 (each byte taken as
    a bf16's high byte, as a byte-wise copy into a bf16 buffer does), scales dropped."""
    fp8 = FP8Head.from_linear(model.lm_head, backend="dequant").fp8_weight
    as_bf16 = (fp8.data.view(torch.uint8).to(torch.int16) << 8).view(torch.bfloat16)
    head = BF16Head(model.config.hidden_size, model.config.vocab_size)
    with torch.no_grad():
        head.weight.copy_(as_bf16.to(torch.float32))
    return head
'''

VARIANTS = {
    "unchecked-fp8-bytes": COMMON + '''
import impl.speculative.decoder as decoder


@pytest.fixture(scope="session", autouse=True)
def _plant(moe_model):
    decoder.check_head_sharing = lambda target, draft: None
    moe_model.mtp[0].share(moe_model.embed_tokens, fp8_bytes_head(moe_model))
''',
    "checked-fp8-bytes": COMMON + '''
@pytest.fixture(scope="session", autouse=True)
def _plant(moe_model):
    moe_model.mtp[0].share(moe_model.embed_tokens, fp8_bytes_head(moe_model))
''',
    "fp8-fallback": COMMON + '''
bf16 = backends.get("head", "bf16")


def _fallback(x, weight, out_dtype):
    return bf16.fn(x, weight.dequantize(x.dtype), out_dtype)


@pytest.fixture(scope="session", autouse=True)
def _plant(moe_model):
    head = moe_model.quantize_head(backend="dequant")
    head._backend = backends.Backend("head", "fp8-dequant", _fallback, "planted: silently runs the bf16 head")
''',
}


def run_suite(pytester, conftest: str | None) -> tuple[dict[str, str], str]:
    """(test name -> outcome, full output) of the suite against the checkpoint."""
    if conftest:
        pytester.makeconftest(conftest)
    pytester.makepyfile(test_accept_length=SUITE.read_text())
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "--moe-model", str(CHECKPOINT),
                                           "-rA", "test_accept_length.py", timeout=300)
    assert result.ret in (0, 1), result.stdout.str()[-4000:] + result.stderr.str()[-4000:]
    text = result.stdout.str()
    # -rA summary lines: "OUTCOME <nodeid>::<test>[ - message]" (the node id's path varies with the rootdir).
    summary = re.findall(r"^(PASSED|FAILED|ERROR) \S*::(test_\w+)", text, flags=re.MULTILINE)
    return {name: outcome for outcome, name in summary}, text


def test_unmodified_checkpoint_passes(pytester):
    outcomes, text = run_suite(pytester, None)
    assert set(outcomes.values()) == {"PASSED"} and len(outcomes) == 3, text[-3000:]


def test_unchecked_fp8_bytes_collapse_accept_length(pytester):
    outcomes, text = run_suite(pytester, VARIANTS["unchecked-fp8-bytes"])
    assert outcomes["test_accept_length_floor"] == "FAILED", text[-3000:]
    assert "check head sharing" in text and "mean accept length" in text


def test_checked_fp8_bytes_are_refused(pytester):
    outcomes, text = run_suite(pytester, VARIANTS["checked-fp8-bytes"])
    assert set(outcomes.values()) == {"ERROR"}, text[-3000:]
    assert "head sharing violated" in text


def test_fp8_fallback_fails_provenance(pytester):
    outcomes, text = run_suite(pytester, VARIANTS["fp8-fallback"])
    assert outcomes["test_head_provenance"] == "FAILED", text[-3000:]
    assert "silently fell back to bf16" in text
