"""impl.model.gemv: one token's projection as a Triton GEMV, against the fp32 product, on the CPU
through Triton's interpreter and on a GPU compiled (there with PDL and the L2 prefetch as launched
in a decode step).

Tolerances: fp32 inputs 1e-6 relative (the same products summed in another order over at most
6144 terms); bf16 on a GPU 2^-7 relative (the one final rounding to bf16: the sums are fp32 in
both). Inputs are fresh normal draws; shapes whose N and K are not multiples of the tile check the
masks.
"""

from __future__ import annotations

import pytest
import torch

from impl.model.gemv import GemvLaunch, gemv, gemv_reference

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def inputs(n: int, k: int, dtype: torch.dtype, seed: int):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(1, k, generator=g).to(DEVICE, dtype),
            (torch.randn(n, k, generator=g) * 0.02).to(DEVICE, dtype))


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


@pytest.mark.parametrize("n,k,launch", [
    (64, 256, GemvLaunch(block_n=8, block_k=64)),
    (37, 200, GemvLaunch(block_n=8, block_k=64)),      # N and K past the last full tile
    (130, 96, GemvLaunch(block_n=16, block_k=128)),    # K shorter than one tile
    (24, 520, GemvLaunch(block_n=4, block_k=256, pdl=False, prefetch=False)),
])
def test_the_kernel_matches_the_fp32_product(n, k, launch):
    x, w = inputs(n, k, torch.float32, seed=n + k)
    out = gemv(x, w, launch)
    ref = x @ w.t()
    assert out.shape == (1, n)
    assert rel(out, ref) <= 1e-6
    # Negative control: every row's last K tile dropped is far off (the tail mask matters).
    assert rel(out, x[:, : k - 32] @ w[:, : k - 32].t()) > 1e-3


@pytest.mark.skipif(DEVICE != "cuda", reason="bf16 rounding as compiled needs a CUDA device")
@pytest.mark.parametrize("n,k", [(2560, 4096), (4352, 2560), (6144, 2560)])
def test_bf16_rounds_once_on_the_gpu(n, k):
    x, w = inputs(n, k, torch.bfloat16, seed=k)
    out = gemv(x, w, GemvLaunch(block_n=8, block_k=512))
    assert rel(out, gemv_reference(x, w)) <= 2.0 ** -7


def test_bad_inputs_name_the_problem():
    x, w = inputs(16, 64, torch.float32, seed=0)
    with pytest.raises(ValueError, match="one row"):
        gemv(torch.cat([x, x]), w)
    with pytest.raises(ValueError, match="one row"):
        gemv(x[:, :32], w)
    with pytest.raises(TypeError, match="bfloat16"):
        gemv(x.to(torch.bfloat16), w)
    with pytest.raises(ValueError, match="contiguous"):
        gemv(x[:, :16], w.t().contiguous().t()[:16, :16])
    with pytest.raises(ValueError, match="power of two"):
        GemvLaunch(block_n=12)
    with pytest.raises(ValueError, match="prefetch needs pdl"):
        GemvLaunch(pdl=False, prefetch=True)
