"""scripts/gpu/profile_prefill.py on CPU: its --prompts option (the GPU work needs a CUDA device)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts" / "gpu"))

import profile_prefill as pp  # noqa: E402


def test_prompts_parse_to_token_counts_up_to_the_context_less_the_slack():
    assert pp.parse_prompts("1024,8192,32768") == [1024, 8192, 32768]
    assert pp.parse_prompts("36800") == [36800]  # 36864 - 64


@pytest.mark.parametrize("text, match", [("1k", "comma-separated token counts"), ("1024,", "comma-separated"),
                                         ("1", r"\[1\] outside 2\.\.36800"), ("1024,36801", r"\[36801\] outside")])
def test_bad_prompts_are_refused_naming_the_value(text, match):
    with pytest.raises(argparse.ArgumentTypeError, match=match):
        pp.parse_prompts(text)


def test_without_a_cuda_device_it_says_so_and_exits_2(capsys):
    if pp.torch.cuda.is_available():
        pytest.skip("a CUDA device is present")
    assert pp.main(["--prompts", "1024"]) == 2
    assert "needs a CUDA device" in capsys.readouterr().err
