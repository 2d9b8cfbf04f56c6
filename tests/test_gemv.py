"""impl.model.gemv (the split-K GEMV of one decode token) against an fp64 matmul on fresh random
inputs: on CPU through Triton's interpreter, on a GPU compiled. Shapes with N and K not multiples of
the tiles, and a split that leaves the last slice short. Tolerance: fp32 inputs 1e-5 relative
(fp32 sums in another order); bf16 inputs 1e-2 (the output's bf16 rounding, 2^-8)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from impl.model.gemv import INTERPRETER, GemvConfig, linear

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
CONFIGS = [INTERPRETER, GemvConfig(block_n=32, block_k=64, split_k=4, num_warps=4, num_stages=1)]


@pytest.mark.parametrize("config", CONFIGS, ids=["interp", "split4"])
@pytest.mark.parametrize("n,k", [(1, 32), (37, 100), (64, 256), (130, 200)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gemv_equals_the_matmul(n, k, config, dtype):
    from impl.model.gemv_kernel import gemv
    g = torch.Generator(DEVICE).manual_seed(n * k)
    x = torch.randn(1, 1, k, device=DEVICE, generator=g).to(dtype)
    w = torch.randn(n, k, device=DEVICE, generator=g).to(dtype)
    got = gemv(x, w, config)
    want = (x.double() @ w.double().t())
    assert got.shape == (1, 1, n) and got.dtype == dtype
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    assert float((got.double() - want).norm() / want.norm()) <= tol


def test_a_planted_fault_is_caught():
    """The check above catches a kernel that drops the last K slice."""
    from impl.model.gemv_kernel import gemv
    x, w = torch.randn(1, 96, device=DEVICE), torch.randn(40, 96, device=DEVICE)
    got = gemv(x[:, :64], w[:, :64].contiguous(), INTERPRETER)  # K truncated
    want = x.double() @ w.double().t()
    assert float((got.double() - want).norm() / want.norm()) > 0.1


def test_bad_inputs_name_the_problem():
    from impl.model.gemv_kernel import gemv
    with pytest.raises(ValueError, match="must hold one row of K=8"):
        gemv(torch.randn(2, 8), torch.randn(4, 8), INTERPRETER)
    with pytest.raises(ValueError, match="contiguous in K"):
        gemv(torch.randn(1, 4), torch.randn(4, 8)[:, ::2], INTERPRETER)
    with pytest.raises(ValueError, match="split_k must be a power of two"):
        GemvConfig(block_n=16, block_k=32, split_k=3)


def test_linear_is_torch_where_no_config_is_tuned():
    x, w = torch.randn(1, 1, 16), torch.randn(8, 16)
    assert torch.equal(linear(x, w), F.linear(x, w))
