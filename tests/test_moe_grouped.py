"""The grouped prefill MoE (impl.moe.grouped) against the fp32 oracle, and its dispatch."""

import pytest
import torch

from impl.moe.grouped import GROUPED_MIN_TOKENS, experts_per_chunk_for, moe_grouped
from impl.moe.reference import moe_reference
from impl.moe.shared import SharedExpert
from impl.quant.mxfp4 import quantize_mxfp4


def _layer(seed, tokens, experts=12, hidden=64, inter=32, top_k=3, skew=False):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=g)
    w_gate_up = torch.randn(experts, 2 * inter, hidden, generator=g) / hidden ** 0.5
    w_down = torch.randn(experts, hidden, inter, generator=g) / inter ** 0.5
    scores = torch.rand(tokens, experts, generator=g)
    if skew:  # most slots on two experts, some experts unused: empty and crowded groups
        scores[:, :2] += 1.0
        scores[:, -3:] -= 2.0
    weights, ids = torch.softmax(scores, -1).topk(top_k, dim=-1)
    shared = SharedExpert(*(torch.randn(s, generator=g) / s[1] ** 0.5
                            for s in ((inter, hidden), (inter, hidden), (hidden, inter))))
    return x, weights, ids, w_gate_up, w_down, shared


@pytest.mark.parametrize("seed,tokens,skew,chunk", [(0, 40, False, 5), (1, 7, True, 4), (2, 65, True, 32), (3, 1, False, 1)])
def test_grouped_matches_the_oracle_on_plain_experts(seed, tokens, skew, chunk):
    """fp32 in, fp32 oracle: only summation order differs (tolerance 1e-5 relative)."""
    x, weights, ids, gu, dn, shared = _layer(seed, tokens, skew=skew)
    got = moe_grouped(x, weights, ids, gu, dn, shared, experts_per_chunk=chunk)
    want = moe_reference(x, weights, ids, gu, dn, shared)
    assert (got - want).abs().max() / want.abs().max() < 1e-5


def test_grouped_matches_the_oracle_on_mxfp4_experts_in_bf16():
    """MXFP4 experts with bf16 activations: the oracle runs the same dequantized weights in fp32;
    bf16 rounding of x, the GEMM inputs and outputs bounds the error (2e-2 relative to the largest
    output, three bf16 roundings of ~4e-3 each, with margin)."""
    x, weights, ids, gu, dn, shared = _layer(4, 48, experts=16)
    gu_q, dn_q = quantize_mxfp4(gu), quantize_mxfp4(dn)
    got = moe_grouped(x.bfloat16(), weights, ids, gu_q, dn_q,
                      SharedExpert(*(t.bfloat16() for t in (shared.gate, shared.up, shared.down))))
    want = moe_reference(x.bfloat16().float(), weights, ids, gu_q, dn_q,
                         SharedExpert(*(t.bfloat16().float() for t in (shared.gate, shared.up, shared.down))))
    assert got.dtype == torch.bfloat16
    assert (got.float() - want).abs().max() / want.abs().max() < 2e-2


def test_chunk_of_experts_follows_the_dequantized_bytes():
    """Ling-3.0-flash's experts ([1536, 2560] + [2560, 768]) are 11.8 MB each in bf16: 45 fit the
    512 MiB chunk (45.5), 91 in one-byte elements, and a chunk never drops below one expert;
    MXFP4 weights count by their logical (unpacked) shape."""
    gu, dn = torch.empty(512, 1536, 2560, device="meta"), torch.empty(512, 2560, 768, device="meta")
    assert experts_per_chunk_for(gu, dn, torch.bfloat16) == 45
    assert experts_per_chunk_for(gu, dn, torch.float8_e4m3fn) == 91
    assert experts_per_chunk_for(gu, dn, torch.float32, chunk_bytes=1) == 1
    q = quantize_mxfp4(torch.randn(2, 64, 64))
    assert experts_per_chunk_for(q, q, torch.bfloat16, chunk_bytes=4 * 64 * 64 * 2) == 2


def test_grouped_detects_a_wrong_expert_weight():
    """Negative control: one expert's weights changed after the oracle ran is seen."""
    x, weights, ids, gu, dn, shared = _layer(5, 30)
    want = moe_reference(x, weights, ids, gu, dn, shared)
    gu = gu.clone()
    gu[int(ids[0, 0])] *= 1.5
    got = moe_grouped(x, weights, ids, gu, dn, shared)
    assert (got - want).abs().max() / want.abs().max() > 1e-3


def test_triton_layer_takes_the_grouped_path_for_a_long_mxfp4_prompt():
    """The Triton backend's layer hands an MXFP4 prefill longer than GROUPED_MIN_TOKENS to the
    grouped path (provenance says so). On CUDA where there is one: the Triton backend takes CPU
    tensors only under the interpreter (this test failed on the H200 with the model on the CPU)."""
    from impl import backends
    from impl.model import build_model
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = build_model("tiny", device=device, experts="mxfp4", moe_backend="triton")
    block = model.layers[1].mlp
    with backends.record_provenance() as prov:
        block(torch.randn(1, GROUPED_MIN_TOKENS + 1, model.config.hidden_size, device=device))
    assert prov.kernels("moe") == {"moe_grouped"} and prov.backends("moe") == {"triton"}
