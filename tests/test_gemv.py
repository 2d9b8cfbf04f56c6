"""impl.model.gemv: one token's projection as a Triton GEMV, against the fp32 product, on the CPU
through Triton's interpreter and on a GPU compiled (there with PDL as launched in a decode step);
`linear`'s choice between it and F.linear; and on a GPU a Ling decode step through it against the
same step through cuBLAS.

Tolerances: fp32 inputs 1e-6 relative (the same products summed in another order over at most
6144 terms); bf16 on a GPU 2^-7 relative (the one final rounding to bf16: the sums are fp32 in
both). Inputs are fresh normal draws; shapes whose N and K are not multiples of the tile check the
masks.
"""

from __future__ import annotations

import pytest
import torch

from types import SimpleNamespace

import impl.model.gemv as gemv_module
from impl import backends
from impl.model.gemv import GemvLaunch, gemv, gemv_applies, gemv_reference, launch_for, linear
from tests.helpers import rel_err

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def inputs(n: int, k: int, dtype: torch.dtype, seed: int):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(1, k, generator=g).to(DEVICE, dtype),
            (torch.randn(n, k, generator=g) * 0.02).to(DEVICE, dtype))


@pytest.mark.parametrize("n,k,launch", [
    (64, 256, GemvLaunch(block_n=8, block_k=64)),
    (37, 200, GemvLaunch(block_n=8, block_k=64)),      # N and K past the last full tile
    (130, 96, GemvLaunch(block_n=16, block_k=128)),    # K shorter than one tile
    (24, 520, GemvLaunch(block_n=4, block_k=256, pdl=False)),
])
def test_the_kernel_matches_the_fp32_product(n, k, launch):
    x, w = inputs(n, k, torch.float32, seed=n + k)
    out = gemv(x, w, launch)
    ref = x @ w.t()
    assert out.shape == (1, n)
    assert rel_err(out, ref) <= 1e-6
    # Negative control: every row's last K tile dropped is far off (the tail mask matters).
    assert rel_err(out, x[:, : k - 32] @ w[:, : k - 32].t()) > 1e-3


@pytest.mark.skipif(DEVICE != "cuda", reason="bf16 rounding as compiled needs a CUDA device")
@pytest.mark.parametrize("n,k", [(2560, 4096), (4352, 2560), (6144, 2560)])
def test_bf16_rounds_once_on_the_gpu(n, k):
    x, w = inputs(n, k, torch.bfloat16, seed=k)
    out = gemv(x, w, GemvLaunch(block_n=8, block_k=512))
    assert rel_err(out, gemv_reference(x, w)) <= 2.0 ** -7


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
    with pytest.raises(ValueError, match="out must hold 16"):
        gemv(x, w, out=torch.empty(1, 8))
    with pytest.raises(ValueError, match="out must hold 16"):
        gemv(x, w, out=torch.empty(1, 16, dtype=torch.float64))
    with pytest.raises(ValueError, match="power of two"):
        GemvLaunch(block_n=12)
    with pytest.raises(ValueError, match="num_warps"):
        GemvLaunch(num_warps=3)


def fake_cuda(x: torch.Tensor):
    """x as `gemv_applies` sees it on a GPU: only is_cuda differs."""
    return SimpleNamespace(is_cuda=True, dtype=x.dtype, numel=x.numel)


def test_the_kernel_takes_one_16_bit_row_on_a_gpu_and_nothing_else():
    w = torch.zeros(8, 64, dtype=torch.bfloat16)
    one = torch.zeros(1, 1, 64, dtype=torch.bfloat16)
    assert gemv_applies(fake_cuda(one), w, None)
    assert gemv_applies(fake_cuda(one.half()), w.half(), None)
    assert not gemv_applies(one, w, None)                                   # on the CPU
    assert not gemv_applies(fake_cuda(torch.zeros(1, 4, 64, dtype=torch.bfloat16)), w, None)  # a verify pass
    assert not gemv_applies(fake_cuda(one.float()), w.float(), None)        # fp32
    assert not gemv_applies(fake_cuda(one), w, torch.zeros(8, dtype=torch.bfloat16))  # a bias
    assert not gemv_applies(fake_cuda(one), w.t().contiguous().t(), None)   # strided rows


def test_linear_off_the_kernel_is_f_linear_and_notes_its_fallback():
    x, w = inputs(24, 64, torch.float32, seed=3)
    with backends.record_provenance() as prov:
        out = linear(x, w)
        cublas = linear(x, w, backend=backends.get("projection", "cublas"))
    assert torch.equal(out, torch.nn.functional.linear(x, w)) and torch.equal(cublas, out)
    assert [(e.kind, e.backend, e.kernel) for e in prov.events] == [("projection", "gemv", "F.linear"),
                                                                    ("projection", "cublas", "F.linear")]


def test_launches_are_data_keyed_by_shape():
    assert launch_for(2560, 4096) == gemv_module.TUNED[(2560, 4096)]
    assert launch_for(123, 456) == gemv_module.DEFAULT_LAUNCH


@pytest.mark.skipif(DEVICE != "cuda", reason="the decode step's projections take the kernel on a GPU only")
def test_a_ling_decode_step_through_the_kernel_matches_cublas():
    """ling-3.0-tiny in bf16 on the GPU: one decode token's logits with every one-row projection
    through gemv_kernel (the gemv projection backend, noted as provenance) against the same token
    through the cublas backend. Tolerance
    2e-2 relative: each of the step's projections rounds its bf16 output once in either path, but
    the two sum in another order, and 6 layers of bf16 activations carry the difference on."""
    from impl.model.build import build_model
    model = build_model("ling-3.0-tiny", device=DEVICE, dtype=torch.bfloat16, moe_backend="triton")
    tokens = torch.randint(0, model.config.vocab_size, (1, 9), generator=torch.Generator().manual_seed(0))
    tokens = tokens.to(DEVICE)

    def last_logits():
        model.setup_caches(1, 16)
        with torch.inference_mode():
            model(tokens[:, :8], torch.arange(8, device=DEVICE))
            with backends.record_provenance() as prov:
                out = model(tokens[:, 8:], torch.tensor([8], device=DEVICE))
        return out.float(), {(e.backend, e.kernel) for e in prov.events if e.kind == "projection"}

    got, ran = last_logits()
    assert ran == {("gemv", "gemv_kernel")}
    model.set_layer_backend("projection", "cublas")
    want, ran = last_logits()
    assert ran == {("cublas", "F.linear")}
    assert rel_err(got, want) <= 2e-2
