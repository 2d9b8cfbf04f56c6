"""impl.model.norm_gemv: a decode token's residual add, RMS norm and input projection in one GEMV,
against the two steps in torch (add_rms_norm_reference, then the fp32 product), on the CPU through
Triton's interpreter and on a GPU compiled (with PDL as launched in a decode step). The `norms`
layer backend that runs it in KDA and MLA layers: tests/test_layer_backends.py.

Tolerances: fp32 1e-6 relative (the same products and statistics summed in another order over at
most 4096 terms); the stored sum is the same rounding of the same add (bitwise equal). bf16 on a
GPU 2^-6 relative against the two steps in bf16: the product rounds once in both (2^-7), and a
normed value whose fp32 statistics differ in their last bits may round to the other bf16
neighbour before it is multiplied. Inputs are fresh normal draws, norm weights around 1 but not 1.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from impl.model.add_rms_norm import add_rms_norm_reference
from impl.model.gemv import GemvLaunch, gemv_reference
from impl.model.norm_gemv import norm_gemv, norm_gemv_applies, norm_gemv_reference
from tests.test_gemv import TILE_CASES, rel

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def inputs(n: int, k: int, dtype: torch.dtype, seed: int):
    g = torch.Generator().manual_seed(seed)
    delta = torch.randn(1, 1, k, generator=g)
    residual = torch.randn(1, 1, k, generator=g) * 3
    norm_w = torch.rand(k, generator=g) + 0.5
    w = torch.randn(n, k, generator=g) * 0.02
    return tuple(t.to(DEVICE, dtype) for t in (delta, residual, norm_w, w))


@pytest.mark.parametrize("n,k,launch", TILE_CASES + [
    (24, 2560, GemvLaunch(block_n=4, block_k=1024, num_warps=8)),  # Ling-3.0-flash's hidden size
])
def test_the_kernel_matches_the_add_norm_and_product_in_fp32(n, k, launch):
    delta, residual, norm_w, w = inputs(n, k, torch.float32, seed=n + k)
    out, total = norm_gemv(delta, residual, norm_w, 1e-6, w, launch)
    want, want_total = norm_gemv_reference(delta, residual, norm_w, 1e-6, w)
    assert out.shape == (1, 1, n) and total.shape == residual.shape
    assert torch.equal(total, want_total)
    assert rel(out, want) <= 1e-6
    # Negative controls: the product of the un-normed sum, and of the stream without this branch's
    # output, are far off.
    assert rel(out, gemv_reference((residual + delta).reshape(1, k), w)) > 0.1
    assert rel(out, norm_gemv_reference(delta * 0, residual, norm_w, 1e-6, w)[0]) > 0.1


@pytest.mark.skipif(DEVICE != "cuda", reason="bf16 rounding as compiled needs a CUDA device")
@pytest.mark.parametrize("n,k", [(6144, 2560), (4672, 2560), (24, 96)])
def test_bf16_rounds_as_the_two_launches_on_the_gpu(n, k):
    delta, residual, norm_w, w = inputs(n, k, torch.bfloat16, seed=k + 1)
    out, total = norm_gemv(delta, residual, norm_w, 1e-6, w)
    h, want_total = add_rms_norm_reference(delta, residual, norm_w, 1e-6)
    assert torch.equal(total, want_total)
    assert rel(out, gemv_reference(h.reshape(1, k), w)) <= 2.0 ** -6


def test_bad_inputs_name_the_problem():
    delta, residual, norm_w, w = inputs(16, 64, torch.float32, seed=0)
    with pytest.raises(ValueError, match=r"delta \(1, 1, 32\) and residual \(1, 1, 64\) differ"):
        norm_gemv(delta[..., :32], residual, norm_w, 1e-6, w)
    with pytest.raises(ValueError, match="must hold one row of w's 64 inputs"):
        norm_gemv(torch.cat([delta, delta], 1), torch.cat([residual, residual], 1), norm_w, 1e-6, w)
    with pytest.raises(ValueError, match=r"norm weight \(32,\) does not match the hidden size 64"):
        norm_gemv(delta, residual, norm_w[:32], 1e-6, w)
    with pytest.raises(TypeError, match="must be one float dtype"):
        norm_gemv(delta.double(), residual, norm_w, 1e-6, w)
    with pytest.raises(ValueError, match="contiguous rows"):
        norm_gemv(delta, residual, norm_w, 1e-6, w.t().contiguous().t())


def fake_cuda(x: torch.Tensor):
    """x as `norm_gemv_applies` sees it on a GPU: only is_cuda differs."""
    return SimpleNamespace(is_cuda=True, dtype=x.dtype, numel=x.numel)


def test_the_kernel_takes_one_16_bit_row_on_a_gpu_and_nothing_else():
    w = torch.zeros(8, 64, dtype=torch.bfloat16)
    one = torch.zeros(1, 1, 64, dtype=torch.bfloat16)
    assert norm_gemv_applies(fake_cuda(one), w)
    assert not norm_gemv_applies(one, w)                                               # on the CPU
    assert not norm_gemv_applies(fake_cuda(torch.zeros(1, 4, 64, dtype=torch.bfloat16)), w)  # a verify pass
    assert not norm_gemv_applies(fake_cuda(one.float()), w.float())                     # fp32
    assert not norm_gemv_applies(fake_cuda(one), w.t().contiguous().t())                # strided rows
