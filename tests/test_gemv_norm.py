"""impl.model.gemv_norm: a decode token's o_proj, the residual add after it and the RMS norm after
that in one GEMV, its programs counting themselves done so that the last one norms, against the
two steps in torch (the fp32 product rounded, then add_rms_norm_reference), on the CPU through
Triton's interpreter and on a GPU compiled (with PDL, and launched many times over one counter:
a lost count or a missed reset shows as a wrong or stale output). The `norms` layer backend that
runs it in KDA and MLA layers: tests/test_layer_backends.py.

Tolerances: fp32 1e-6 relative for both outputs (the same products summed in another order over at
most 4096 terms, then the same add and norm). bf16 on a GPU against the two steps in bf16: the sum
within one bf16 ulp of the stream's magnitude (2^-8 relative: the projection's own rounding may
land on either neighbour, and the add rounds again), the normed output 2^-6 (that, and fp32
statistics summed in another order). Inputs are fresh normal draws, norm weights around 1 but
not 1.
"""

from __future__ import annotations

import pytest
import torch

from impl.model.gemv import GemvLaunch, gemv_reference
from impl.model.gemv_norm import gemv_norm, gemv_norm_applies, gemv_norm_reference, new_counter
from tests.test_gemv import TILE_CASES, rel

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def inputs(n: int, k: int, dtype: torch.dtype, seed: int):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(1, 1, k, generator=g)
    w = torch.randn(n, k, generator=g) * 0.02
    residual = torch.randn(1, 1, n, generator=g) * 3
    norm_w = torch.rand(n, generator=g) + 0.5
    return tuple(t.to(DEVICE, dtype) for t in (x, w, residual, norm_w))


@pytest.mark.parametrize("n,k,launch", TILE_CASES + [
    (2560, 4096, GemvLaunch(block_n=4, block_k=1024, num_warps=8)),  # Ling-3.0-flash's KDA o_proj
])
def test_the_kernel_matches_the_product_add_and_norm_in_fp32(n, k, launch):
    x, w, residual, norm_w = inputs(n, k, torch.float32, seed=n + k)
    counter = new_counter(DEVICE)
    for _ in range(2):  # the second launch counts from the zero the first left
        out, total = gemv_norm(x, w, residual, norm_w, 1e-6, counter, launch)
        want, want_total = gemv_norm_reference(x, w, residual, norm_w, 1e-6)
        assert out.shape == total.shape == residual.shape
        assert rel(total, want_total) <= 1e-6 and rel(out, want) <= 1e-6
        assert counter.item() == 0
    # Negative controls: the norm of the projection alone, and of the stream alone, are far off.
    proj = gemv_reference(x.reshape(1, k), w).reshape(residual.shape)
    assert rel(out, gemv_norm_reference(x, w, residual * 0, norm_w, 1e-6)[0]) > 0.1
    assert rel(total, proj) > 0.1 and rel(total, residual) > 1e-3


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")  # the unnormed buffers' garbage
def test_a_counter_left_off_zero_is_caught_by_the_outputs():
    """The planted fault the counting guards against: a counter not at zero when a launch starts
    means no program counts last, nothing is normed, and the outputs are whatever the buffers held."""
    x, w, residual, norm_w = inputs(64, 256, torch.float32, seed=5)
    counter = new_counter(DEVICE)
    counter.fill_(1)
    out, total = gemv_norm(x, w, residual, norm_w, 1e-6, counter, GemvLaunch(block_n=8, block_k=64))
    want, want_total = gemv_norm_reference(x, w, residual, norm_w, 1e-6)
    assert not (torch.allclose(out, want) and torch.allclose(total, want_total))


@pytest.mark.skipif(DEVICE != "cuda", reason="the programs race for the count on a GPU only")
@pytest.mark.parametrize("n,k", [(2560, 4096), (2560, 4352), (96, 64)])
def test_bf16_on_the_gpu_over_many_launches_of_one_counter(n, k):
    counter = new_counter(DEVICE)
    for seed in range(50):
        x, w, residual, norm_w = inputs(n, k, torch.bfloat16, seed=seed)
        out, total = gemv_norm(x, w, residual, norm_w, 1e-6, counter)
        want, want_total = gemv_norm_reference(x, w, residual, norm_w, 1e-6)
        assert rel(total, want_total) <= 2.0 ** -8, seed
        assert rel(out, want) <= 2.0 ** -6, seed
    torch.cuda.synchronize()
    assert counter.item() == 0


def test_bad_inputs_name_the_problem():
    x, w, residual, norm_w = inputs(16, 64, torch.float32, seed=0)
    counter = new_counter(DEVICE)
    with pytest.raises(ValueError, match="must hold one row of w's 64 inputs"):
        gemv_norm(x[..., :32], w, residual, norm_w, 1e-6, counter)
    with pytest.raises(ValueError, match="must hold one row of w's 16 outputs"):
        gemv_norm(x, w, residual[..., :8], norm_w, 1e-6, counter)
    with pytest.raises(ValueError, match=r"norm weight \(8,\) does not match the 16 outputs"):
        gemv_norm(x, w, residual, norm_w[:8], 1e-6, counter)
    with pytest.raises(TypeError, match="must be one float dtype"):
        gemv_norm(x.double(), w, residual, norm_w, 1e-6, counter)
    with pytest.raises(TypeError, match="the done counter must be one int32"):
        gemv_norm(x, w, residual, norm_w, 1e-6, torch.zeros(2, dtype=torch.int32, device=DEVICE))
    with pytest.raises(ValueError, match="contiguous rows"):
        gemv_norm(x, w.t().contiguous().t(), residual, norm_w, 1e-6, counter)


def test_the_kernel_takes_what_the_gemv_takes():
    from types import SimpleNamespace
    w = torch.zeros(8, 64, dtype=torch.bfloat16)
    one = torch.zeros(1, 1, 64, dtype=torch.bfloat16)
    on_gpu = SimpleNamespace(is_cuda=True, dtype=one.dtype, numel=one.numel)
    assert gemv_norm_applies(on_gpu, w, None)
    assert not gemv_norm_applies(one, w, None)                                   # on the CPU
    assert not gemv_norm_applies(on_gpu, w, torch.zeros(8, dtype=torch.bfloat16))  # a bias
    assert not gemv_norm_applies(on_gpu, w.t().contiguous().t(), None)           # strided rows
