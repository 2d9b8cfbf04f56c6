"""Triton's interpreter on a CPU machine whatever imported Triton first: transformers importing it
before impl broke every Triton backend ("Cannot call @triton.jit'd outside of the scope of a
kernel"). Each order runs in a fresh interpreter, since Triton's state is per process."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# The triton MoE backend (routing, experts, combine: reductions and tl.zeros throughout) on a tiny
# layer, against the fp32 oracle.
PROGRAM = """
import sys
if sys.argv[1] == "transformers-first":
    import transformers.models.bailing_hybrid.modeling_bailing_hybrid  # imports triton
    assert "triton" in sys.modules
import torch
from impl.model.config import get_config
from impl.moe.random_layer import random_moe_block
cfg = get_config("tiny")
block = random_moe_block(cfg, "bf16", torch.device("cpu"), "triton", dtype=torch.float32)
x = torch.randn(1, 3, cfg.hidden_size, generator=torch.Generator().manual_seed(0))
out = block(x)
from impl import backends
block.backend = backends.get("moe", "reference")
ref = block(x)
err = ((out - ref).norm() / ref.norm()).item()
print(f"rel_err {err:.2e}")
assert err < 1e-5, err
"""


def _run(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in (env or os.environ).items() if k != "TRITON_INTERPRET"}
    return subprocess.run([sys.executable, "-c", PROGRAM, *args], cwd=ROOT, capture_output=True, text=True,
                          env={**env, "CUDA_VISIBLE_DEVICES": ""}, timeout=600)


@pytest.mark.parametrize("order", ["transformers-first", "impl-first"])
def test_the_triton_backend_works_on_cpu_in_either_import_order(order):
    pytest.importorskip("transformers")
    done = _run(order)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "rel_err" in done.stdout


def test_a_triton_that_cannot_be_adopted_is_a_clear_error_before_any_kernel_runs():
    # A Triton whose interpreter takes other arguments than the ones impl rebuilds its helpers with.
    program = ("import triton, triton.runtime.interpreter as i\n"
               "def refuse(self, fn, **kw): raise TypeError('unexpected keyword')\n"
               "i.InterpretedFunction.__init__ = refuse\n"
               "import impl.triton_env\n")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", program], cwd=ROOT, capture_output=True, text=True,
                          env={**env, "CUDA_VISIBLE_DEVICES": ""}, timeout=300)
    assert done.returncode != 0
    assert "TritonImportOrderError" in done.stderr
    assert "Set TRITON_INTERPRET=1 in the environment before Python starts" in done.stderr
