"""The MoE layer for a long prompt: slots grouped by expert, each expert's weights dequantized once.

A prefill of T tokens routes T * top_k slots, which at a few hundred tokens already touch every
expert of a layer. The decode kernels take tokens M_PAD at a time and re-read each chosen expert
per chunk; the gather path materializes one weight copy per slot ([T, k, 2I, H]: 64 GB at 1k tokens
of Ling-3.0-flash); Humming's indexed GEMM takes at most MAX_SLOTS slots. Here the slots are
sorted by expert once, each chunk of EXPERTS_PER_CHUNK experts is dequantized to the activation
dtype (MXFP4 or plain: the same code; MXFP4 to bf16 on CUDA in one Triton launch), and the
chunk's slots, padded to its largest expert's count, go through two batched GEMMs; the weighted
combine accumulates in fp32. One host read (the per-expert counts) per layer: prefill only, never
inside a captured decode step.
"""

from __future__ import annotations

import torch

from impl import backends
from impl.moe.reference import swiglu_act
from impl.moe.shared import SharedExpert, shared_expert
from impl.quant.mxfp4 import MXFP4Tensor, dequantize_mxfp4

# Bytes of experts dequantized together, in the activations' dtype: a chunk is about 18 launches
# driven from Python, so a layer should be few chunks (at 8 experts a chunk, Ling-3.0-flash's 64
# chunks a layer cost 0.16 s more of a 1k-token prompt pass on the H200 than 12 chunks), while the
# chunk stays small beside a card that also holds a second copy of the experts (Humming's).
# 512 MiB: 45 of Ling-3.0-flash's 11.8 MB bf16 experts.
CHUNK_BYTES = 512 * 2**20
# Layers of more tokens than this take the grouped path in backends without their own prefill
# (the Triton kernels' MXFP4 path, Humming's indexed GEMM: MAX_SLOTS slots / top-k).
GROUPED_MIN_TOKENS = 32


def expert_slice(w, start: int, stop: int, dtype: torch.dtype) -> torch.Tensor:
    """Experts start..stop-1 of a routed weight [E, N, K] (a tensor or MXFP4Tensor) in `dtype`;
    MXFP4 to bf16 on CUDA in one Triton launch."""
    if isinstance(w, MXFP4Tensor):
        packed, scales = w.packed[start:stop], w.scales[start:stop]
        if packed.is_cuda and dtype == torch.bfloat16:
            from impl.moe.triton_mxfp4 import dequantize_mxfp4_bf16
            return dequantize_mxfp4_bf16(packed, scales)
        return dequantize_mxfp4(packed, scales, dtype)
    return w[start:stop].to(dtype)


def experts_per_chunk_for(w_gate_up, w_down, dtype: torch.dtype, chunk_bytes: int = CHUNK_BYTES) -> int:
    """Experts whose weights, dequantized to `dtype`, fit `chunk_bytes` (at least one)."""
    per_expert = (w_gate_up.shape[1] * w_gate_up.shape[2] + w_down.shape[1] * w_down.shape[2]) * dtype.itemsize
    return max(1, chunk_bytes // per_expert)


def moe_grouped(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, w_gate_up, w_down,
                shared: SharedExpert | None = None, experts_per_chunk: int | None = None,
                backend: str = "grouped", swiglu_limit: float | None = None) -> torch.Tensor:
    """x [T, H], routing weights / ids [T, k] -> [T, H] in x's dtype: the routed experts
    (w_gate_up [E, 2I, H], w_down [E, H, I], tensors or MXFP4Tensor, clipped at `swiglu_limit`)
    plus `shared`. Provenance records it under `backend`: the MoE backend whose prefill it serves.

    Per chunk of experts, their slots padded to the chunk's largest count go through two batched
    GEMMs (a few launches a chunk, not a few an expert: 512 experts x 40 layers of Python-driven
    launches would dominate a prompt's time)."""
    tokens, top_k = ids.shape
    experts = w_gate_up.shape[0]
    if experts_per_chunk is None:
        experts_per_chunk = experts_per_chunk_for(w_gate_up, w_down, x.dtype)
    if experts_per_chunk < 1:
        raise ValueError(f"experts_per_chunk must be >= 1, got {experts_per_chunk}")
    if x.is_cuda and torch.cuda.is_current_stream_capturing():
        raise RuntimeError("moe_grouped reads the per-expert slot counts on the host, which a CUDA graph capture "
                           "does not allow: capture decode and verify steps through a backend's own kernels")
    backends.note("moe", backend, "moe_grouped", tokens=tokens, prefill=True,
                  format=backends.weight_format(w_gate_up))
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts_d = torch.bincount(flat, minlength=experts)
    first_d = torch.cumsum(counts_d, 0) - counts_d  # each expert's first sorted slot
    counts = counts_d.tolist()  # the one host read of the layer
    n_slots, hidden = flat.shape[0], x.shape[1]
    # Sorted slots' tokens and weights, with one pad slot past them (index n_slots) that padded
    # places read: its input row is zeros, its weight 0, its token a spare output row (`tokens`).
    # Padded places are then added like the others, so no chunk picks its valid places out by a
    # mask, which would read their number back to the host (a sync per chunk of experts).
    slot_token = torch.cat((order // top_k, order.new_full((1,), tokens)))
    xs = torch.cat((x.index_select(0, slot_token[:-1]), x.new_zeros(1, hidden)))
    slot_weight = torch.cat((weights.reshape(-1)[order].float(), weights.new_zeros(1, dtype=torch.float32)))
    out = torch.zeros(tokens + 1, w_down.shape[1], dtype=torch.float32, device=x.device)
    for start in range(0, experts, experts_per_chunk):
        stop = min(experts, start + experts_per_chunk)
        cap = max(counts[start:stop])
        if not cap:
            continue
        lane = torch.arange(cap, device=x.device)
        valid = lane[None, :] < counts_d[start:stop, None]                     # [c, cap]
        idx = torch.where(valid, first_d[start:stop, None] + lane[None, :], n_slots)
        gate_up = expert_slice(w_gate_up, start, stop, x.dtype)                # [c, 2I, H]
        down = expert_slice(w_down, start, stop, x.dtype)                      # [c, H, I]
        gate, up = torch.bmm(xs[idx], gate_up.transpose(1, 2)).float().chunk(2, dim=-1)
        y = torch.bmm(swiglu_act(gate, up, swiglu_limit).to(x.dtype), down.transpose(1, 2))  # [c, cap, H]
        out.index_add_(0, slot_token[idx].reshape(-1), (y.float() * slot_weight[idx, None]).reshape(-1, y.shape[-1]))
    out = out[:tokens]
    if shared is not None:
        out += shared_expert(x, shared).float()
    return out.to(x.dtype)


def moe_grouped_layer(x: torch.Tensor, router, w_gate_up, w_down, shared: SharedExpert | None = None,
                      backend: str = "grouped", swiglu_limit: float | None = None) -> torch.Tensor:
    """The whole layer for a long prompt: the router's own routing, then `moe_grouped`."""
    weights, ids = router(x)
    return moe_grouped(x, weights, ids, w_gate_up, w_down, shared, backend=backend, swiglu_limit=swiglu_limit)


__all__ = ["CHUNK_BYTES", "GROUPED_MIN_TOKENS", "expert_slice", "experts_per_chunk_for", "moe_grouped", "moe_grouped_layer"]
