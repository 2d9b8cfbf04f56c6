"""impl.model.add_rms_norm: the residual add and the RMS norm after it in one kernel, against the
torch form (the add, then F.rms_norm), on the CPU through Triton's interpreter and on a GPU
compiled; and the model built on it against the layer written out as two adds and two norms.

Tolerances: fp32 1e-6 relative (the same terms summed in another order over at most 4096
values); bf16 on a GPU: the stored sum is the same rounding of the same fp32 add (bitwise equal),
the normed output within 2 bf16 ulps (2^-7 relative: the fp32 statistics differ in their last
bits and the one final rounding may land on either neighbour). Triton's interpreter rounds fp32
to bf16 toward zero (checked: its sums are the truncated fp32 sums bit for bit), so there the
sum is held to that and the output to 2 ulps more. Inputs are fresh normal draws, weights around
1 but not 1.
"""

from __future__ import annotations

import pytest
import torch

from impl.model.add_rms_norm import add_rms_norm, add_rms_norm_reference, add_rms_norm_triton
from impl.model.layers import RMSNorm
from impl.triton_env import INTERPRET
from tests.helpers import rel_err

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
BF16_REL = 2.0 ** -7


def inputs(rows: int, hidden: int, dtype: torch.dtype, seed: int, device: str = DEVICE):
    g = torch.Generator().manual_seed(seed)
    delta = torch.randn(rows, hidden, generator=g)
    residual = torch.randn(rows, hidden, generator=g) * 3
    weight = torch.rand(hidden, generator=g) + 0.5
    return delta.to(device, dtype), residual.to(device, dtype), weight.to(device, dtype)


@pytest.mark.parametrize("rows,hidden", [(1, 2560), (3, 96), (5, 4096)])
def test_the_kernel_matches_the_torch_form_in_fp32(rows, hidden):
    delta, residual, weight = inputs(rows, hidden, torch.float32, seed=rows + hidden)
    out, total = add_rms_norm_triton(delta, residual, weight, 1e-6)
    ref_out, ref_total = add_rms_norm_reference(delta, residual, weight, 1e-6)
    assert torch.equal(total, ref_total)
    assert rel_err(out, ref_out) <= 1e-6
    # Negative control: the norm of the stream without this branch's output is far off.
    assert rel_err(out, add_rms_norm_reference(delta * 0, residual, weight, 1e-6)[0]) > 0.1


def test_the_kernel_rounds_as_the_torch_form_in_bf16():
    delta, residual, weight = inputs(4, 2560, torch.bfloat16, seed=7)
    out, total = add_rms_norm_triton(delta, residual, weight, 1e-6)
    ref_out, ref_total = add_rms_norm_reference(delta, residual, weight, 1e-6)
    if INTERPRET:  # rounds toward zero (module docstring)
        exact = residual.float() + delta.float()
        ref_total = (exact.view(torch.int32) & ~0xFFFF).view(torch.float32).to(torch.bfloat16)
    assert torch.equal(total, ref_total)
    ulps = (out.float() - ref_out.float()).abs() / ref_out.float().abs().clamp_min(1e-30)
    assert float(ulps.max()) <= (4 if INTERPRET else 2) * BF16_REL


def test_without_a_branch_output_it_is_the_norm_alone():
    _, residual, weight = inputs(2, 64, torch.float32, seed=1, device="cpu")
    norm = RMSNorm(64, 1e-6)
    norm.weight.data.copy_(weight)
    out, total = add_rms_norm(None, residual, norm)
    assert total is residual and torch.equal(out, norm(residual))


@pytest.mark.parametrize("change,error,match", [
    (lambda d, r, w: (d[:, :-1], r, w), ValueError, r"delta \(2, 63\) and residual \(2, 64\) differ"),
    (lambda d, r, w: (d, r, w[:-1]), ValueError, "weight .63,. does not match the hidden size 64"),
    (lambda d, r, w: (d.double(), r, w), TypeError, "delta is torch.float64, the residual stream torch.float32"),
])
def test_mismatched_inputs_are_refused_by_name(change, error, match):
    delta, residual, weight = change(*inputs(2, 64, torch.float32, seed=2, device="cpu"))
    norm = RMSNorm(64, 1e-6)
    norm.weight.data = weight
    with pytest.raises(error, match=match):
        add_rms_norm(delta, residual, norm)
    with pytest.raises(error, match=match):
        add_rms_norm_triton(delta, residual, weight, 1e-6)


def test_the_model_on_the_kept_apart_stream_is_the_layer_written_out():
    """Every decoder layer of the tiny Ling model, chained through DecoderLayer.streamed by the
    model, against x + attn(norm(x)) then x + mlp(norm(x)) spelled out, in fp32 on the device."""
    from impl.model.build import build_model
    model = build_model("ling-3.0-tiny", device=DEVICE, dtype=torch.float32, seed=0).eval()
    ids = torch.randint(0, model.config.vocab_size, (1, 12), generator=torch.Generator().manual_seed(0)).to(DEVICE)
    with torch.inference_mode():
        got = model.last_hidden_states(ids)
        cos, sin, mask = model.positions(ids.shape[1], None)
        x = model.embed_tokens(ids)
        for layer in model.layers:
            x = x + layer.self_attn(layer.input_layernorm(x), cos, sin, None, mask)
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        assert rel_err(got, x) <= 1e-6
        assert rel_err(model.hidden_states(ids), model.norm(x)) <= 1e-6
