"""The `humming` MoE backend: the peer library behind the same API as the others.

Humming (`humming-kernels`, CUDA only, JIT-compiled) has shape-specialized MXFP4 x bf16 MoE GEMMs
but leaves the rest of the layer to its caller. This module supplies that rest the way a serving
engine does, so that the peer is timed as a whole layer (routing, experts, shared expert, combine)
and checked against the oracle like every backend:

- the routing preparation: the indexed layout of blocks of HUMMING_BLOCK slots, one expert per
  block (`humming_align_kernel`, one launch, no host sync, fixed sizes: CUDA-graph capturable);
- SwiGLU between the two GEMMs and the weighted combine after them (`humming_swiglu_kernel`,
  `humming_combine_kernel`: one launch each, fp32 math);
- the shared expert as cuBLAS bf16 GEMMs on a side stream, overlapping the routed part (what
  engines do for a dense shared expert at small batch).

The three Triton kernels run under the interpreter too (CI checks them on CPU); Humming itself
needs a GPU. Each weight is converted to Humming's layout once (`HummingLayer.transform`) and
kept while the weight lives.
"""

from __future__ import annotations

import weakref

import torch

from impl import backends
from impl.moe.reference import check_moe_inputs, logical_weight
from impl.moe.shared import check_shared_expert, clip_note
from impl.quant.mxfp4 import MXFP4Tensor
from impl.triton_env import tl, triton

# Slots a block of the indexed layout holds: 8 beat 16 at every shape measured (DESIGN.md).
HUMMING_BLOCK = 8
# Slots (tokens x top-k) one call may route: the decode and verify steps these kernels are for.
MAX_SLOTS = 256


@triton.jit
def humming_align_kernel(ids_ptr, sorted_ptr, expert_ids_ptr, padded_ptr, S, E,
                         BLOCK: tl.constexpr, S_PAD: tl.constexpr, OUT_PAD: tl.constexpr):
    """The indexed layout of S slots' expert ids (one program): experts in ascending order, each
    in ceil(count / BLOCK) blocks of BLOCK slots, its slots in slot order, pads = S; expert_ids
    one per block; padded_ptr the number of slots the blocks hold. Entries past the last block
    are pads (block expert 0), which Humming never reads (it stops at padded_ptr)."""
    offs_out = tl.arange(0, OUT_PAD)
    tl.store(sorted_ptr + offs_out, S + offs_out * 0, mask=offs_out < S * BLOCK)
    tl.store(expert_ids_ptr + offs_out, offs_out * 0, mask=offs_out < S)
    tl.debug_barrier()  # the pads are down before the slots overwrite some of them
    offs = tl.arange(0, S_PAD)
    valid = offs < S
    e = tl.load(ids_ptr + offs, mask=valid, other=E)
    # [slot i, slot j]: every slot's rank among its expert's slots and its expert's slot count.
    same = (e[None, :] == e[:, None]) & valid[None, :]
    pos = tl.sum((same & (offs[None, :] < offs[:, None])).to(tl.int32), axis=1)
    count = tl.sum(same.to(tl.int32), axis=1)
    blocks = (count + BLOCK - 1) // BLOCK
    opens = (pos == 0) & valid  # each expert counted once, at its first slot
    # Blocks before slot i's expert: those of every smaller expert.
    before = tl.sum(tl.where((e[None, :] < e[:, None]) & opens[None, :], blocks[None, :], 0), axis=1)
    block = before + pos // BLOCK
    tl.store(sorted_ptr + block * BLOCK + pos % BLOCK, offs, mask=valid)
    tl.store(expert_ids_ptr + block, e, mask=valid & (pos % BLOCK == 0))
    tl.store(padded_ptr, tl.sum(tl.where(opens, blocks, 0), axis=0) * BLOCK)


@triton.jit
def humming_swiglu_kernel(y_ptr, stride_y, out_ptr, stride_o, I, limit, BLOCK_I: tl.constexpr, CLIP: tl.constexpr):
    """out[r, :I] = silu(y[r, :I]) * y[r, I:2I], in fp32, stored in out's dtype; when CLIP the
    silu capped at `limit` and the up half clamped to +-limit. Grid (rows, I blocks)."""
    r = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK_I + tl.arange(0, BLOCK_I)
    mask = offs < I
    g = tl.load(y_ptr + r * stride_y + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(y_ptr + r * stride_y + I + offs, mask=mask, other=0.0).to(tl.float32)
    act = g / (1.0 + tl.exp(-g))
    if CLIP:
        act = tl.minimum(act, limit)
        u = tl.minimum(tl.maximum(u, -limit), limit)
    tl.store(out_ptr + r * stride_o + offs, (act * u).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def humming_combine_kernel(z_ptr, stride_z, w_ptr, shared_ptr, stride_s, out_ptr, stride_o, H, TOP_K,
                           HAS_SHARED: tl.constexpr, BLOCK_H: tl.constexpr):
    """out[t] = sum_j w[t, j] * z[t * TOP_K + j] (+ shared[t]), summed in fp32 in slot order.
    Grid (tokens, H blocks): a token's sum reads its own slots only (a NaN row stays in its token)."""
    t = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    mask = offs < H
    acc = tl.zeros((BLOCK_H,), dtype=tl.float32)
    for j in range(TOP_K):
        w = tl.load(w_ptr + t * TOP_K + j)
        acc += w * tl.load(z_ptr + (t * TOP_K + j) * stride_z + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_SHARED:
        acc += tl.load(shared_ptr + t * stride_s + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + t * stride_o + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)


def humming_align(ids: torch.Tensor, experts: int, block: int = HUMMING_BLOCK
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(sorted_ids int32 [S * block], expert_ids int32 [S], num_tokens_padded int32 [1]) of the
    slots ids [M, k] (S = M * k), in Humming's indexed layout (`humming_align_kernel`)."""
    slots = ids.numel()
    if not 0 < slots <= MAX_SLOTS:
        raise ValueError(f"the humming backend routes 1 to {MAX_SLOTS} slots (tokens x top-k) a call, got {slots}")
    dev = ids.device
    sorted_ids = torch.empty(slots * block, dtype=torch.int32, device=dev)
    expert_ids = torch.empty(slots, dtype=torch.int32, device=dev)
    padded = torch.empty(1, dtype=torch.int32, device=dev)
    humming_align_kernel[(1,)](ids.reshape(-1).to(torch.int32), sorted_ids, expert_ids, padded, slots, experts,
                               BLOCK=block, S_PAD=triton.next_power_of_2(slots),
                               OUT_PAD=triton.next_power_of_2(slots * block))
    return sorted_ids, expert_ids, padded


def humming_swiglu(y: torch.Tensor, out: torch.Tensor | None = None, limit: float | None = None) -> torch.Tensor:
    """silu(gate) * up of y [R, 2I] (gate first) as [R, I] in y's dtype, clipped at `limit`
    (`humming_swiglu_kernel`)."""
    rows, two_i = y.shape
    inter = two_i // 2
    out = torch.empty(rows, inter, dtype=y.dtype, device=y.device) if out is None else out
    block = min(1024, triton.next_power_of_2(inter))
    humming_swiglu_kernel[(rows, triton.cdiv(inter, block))](y, y.stride(0), out, out.stride(0), inter,
                                                             0.0 if limit is None else float(limit),
                                                             BLOCK_I=block, CLIP=limit is not None)
    return out


def humming_combine(z: torch.Tensor, weights: torch.Tensor, shared: torch.Tensor | None, dtype: torch.dtype
                    ) -> torch.Tensor:
    """sum_j weights[t, j] * z[t * k + j] (+ shared[t]) as [T, H] in `dtype` (`humming_combine_kernel`)."""
    tokens, top_k = weights.shape
    hidden = z.shape[1]
    out = torch.empty(tokens, hidden, dtype=dtype, device=z.device)
    block = min(1024, triton.next_power_of_2(hidden))
    w = weights.float().contiguous()
    humming_combine_kernel[(tokens, triton.cdiv(hidden, block))](
        z, z.stride(0), w, z if shared is None else shared, 0 if shared is None else shared.stride(0),
        out, out.stride(0), hidden, top_k, HAS_SHARED=shared is not None, BLOCK_H=block)
    return out


class _Prepared:
    """Per-weight state kept while the weight lives: Humming's converted layers, the shared
    expert's stacked gate/up."""

    def __init__(self) -> None:
        self._entries: dict[int, tuple] = {}

    def get(self, key: torch.Tensor, build, *inputs: torch.Tensor):
        """build() once per tensor `key`, rebuilt when `key` or one of the other `inputs` it is
        built from changes in place (their version counters)."""
        versions = tuple(t._version for t in (key, *inputs))
        entry = self._entries.get(id(key))
        if entry is not None and entry[0]() is key and entry[1] == versions:
            return entry[2]
        value = build()
        if entry is None or entry[0]() is not key:
            weakref.finalize(key, self._entries.pop, id(key), None)
        self._entries[id(key)] = (weakref.ref(key), versions, value)
        return value

    def clear(self) -> None:
        self._entries.clear()


_prepared = _Prepared()


def release() -> None:
    """Drop every converted weight (Humming's copies of the experts: as large as the experts
    themselves, 60 GiB for Ling-3.0-flash); the next call converts again."""
    import gc
    _prepared.clear()
    gc.collect()  # graphs of finished runs that captured those weights, kept alive by reference cycles
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
_side_streams: dict[torch.device, torch.cuda.Stream] = {}


def humming_layer(w: MXFP4Tensor):
    """Humming's MXFP4 layer for the routed weight w [E, N, K] (converted once per weight)."""
    def build():
        from humming.layer import HummingLayer
        experts, n, k = w.shape
        layer = HummingLayer(shape_n=n, shape_k=k, weight_config={"quant_method": "mxfp4"},
                             num_experts=experts, torch_dtype=torch.bfloat16)
        layer.load_from_tensors({"weight": w.packed, "weight_scale": w.scales})
        layer = layer.to(w.packed.device)
        layer.transform()
        return layer
    return _prepared.get(w.packed, build, w.scales)


# Humming 0.1.19's own limits on a weight [E, N, K] (transform.py; tune/sm90_policies.py keeps a
# whole four-warp WGMMA group of bf16 activations across N: 128 columns). Named here so that a
# shape outside them is refused in words, not by an assertion deep inside its tuning.
HUMMING_N_MULTIPLE = {(9, 0): 128}
HUMMING_N_MULTIPLE_DEFAULT = 64
HUMMING_K_MULTIPLE = 32


def check_humming_shape(name: str, w: MXFP4Tensor, device: torch.device) -> None:
    _, n, k = w.shape
    cap = torch.cuda.get_device_capability(device) if device.type == "cuda" else None
    n_multiple = HUMMING_N_MULTIPLE.get(cap, HUMMING_N_MULTIPLE_DEFAULT)
    if n % n_multiple or k % HUMMING_K_MULTIPLE:
        raise backends.Unsupported(
            f"the humming backend needs each weight's N a multiple of {n_multiple} and K of {HUMMING_K_MULTIPLE} "
            f"on this GPU (Humming's tiles); the {name} weight is [E, N, K] = {list(w.shape)}")


def check_humming_inputs(x, weights, ids, w_gate_up, w_down, shared=None) -> None:
    """Named errors for what the humming backend does not take, beyond `check_moe_inputs`:
    device-independent ones first, then the device, dtype and Humming's shape limits."""
    for name, w in (("gate_up", w_gate_up), ("down", w_down)):
        if not isinstance(w, MXFP4Tensor):
            raise TypeError(f"the humming backend takes MXFP4 experts (MXFP4Tensor); the {name} weight is a "
                            f"{type(w).__name__} of {getattr(w, 'dtype', '?')}: use 'triton' for bf16 experts")
    # The ids' range is read back to the host, which a CUDA graph capture does not allow.
    check_moe_inputs(x, weights, ids, logical_weight(w_gate_up), logical_weight(w_down),
                     check_ids=not (x.is_cuda and torch.cuda.is_current_stream_capturing()))
    if not x.is_contiguous():
        raise ValueError(f"the humming backend needs x contiguous, got strides {x.stride()}")
    if shared is not None:  # cuBLAS GEMMs into buffers of x's dtype
        check_shared_expert(shared, x.shape[1], x.device)
        dtypes = {t.dtype for t in (shared.gate, shared.up, shared.down)}
        if dtypes != {x.dtype}:
            raise TypeError(f"the humming backend needs the shared expert in x's dtype {x.dtype}, "
                            f"got {sorted(map(str, dtypes))}")
    if x.device.type != "cuda":
        raise ValueError(f"the humming backend needs CUDA tensors (Humming's kernels run on NVIDIA GPUs), "
                         f"got x on {x.device}")
    if x.dtype != torch.bfloat16:
        raise TypeError(f"the humming backend takes bf16 activations, got x in {x.dtype}")
    for name, w in (("gate_up", w_gate_up), ("down", w_down)):
        check_humming_shape(name, w, x.device)


def moe_humming(x, weights, ids, w_gate_up: MXFP4Tensor, w_down: MXFP4Tensor, shared=None,
                swiglu_limit: float | None = None) -> torch.Tensor:
    """The MoE layer on Humming's GEMMs: x [T, H] bf16, routing weights / ids [T, k]; the
    SwiGLU between them (this repository's kernel) clipped at `swiglu_limit`."""
    check_humming_inputs(x, weights, ids, w_gate_up, w_down, shared)
    if ids.numel() > MAX_SLOTS:  # a prefill: past Humming's indexed layout here, grouped by expert
        from impl.moe.grouped import moe_grouped
        return moe_grouped(x, weights, ids, w_gate_up, w_down, shared, backend="humming", swiglu_limit=swiglu_limit)
    gate_up, down = humming_layer(w_gate_up), humming_layer(w_down)
    tokens, top_k = ids.shape
    main = torch.cuda.current_stream(x.device)
    shared_out = None
    if shared is not None:  # allocated on the main stream, which waits for the side stream before use
        side = _side_streams.setdefault(x.device, torch.cuda.Stream(x.device))
        stacked = _prepared.get(shared.gate, lambda: torch.cat((shared.gate, shared.up)), shared.up)
        shared_h = torch.empty(tokens, stacked.shape[0], dtype=x.dtype, device=x.device)
        shared_act = torch.empty(tokens, shared.down.shape[1], dtype=x.dtype, device=x.device)
        shared_out = torch.empty(tokens, x.shape[1], dtype=x.dtype, device=x.device)
        side.wait_stream(main)
        with torch.cuda.stream(side):
            torch.mm(x, stacked.t(), out=shared_h)
            humming_swiglu(shared_h, shared_act, shared.limit)
            torch.mm(shared_act, shared.down.t(), out=shared_out)
    sorted_ids, expert_ids, padded = humming_align(ids, w_gate_up.shape[0])
    indexed = dict(sorted_ids=sorted_ids, expert_ids=expert_ids, num_tokens_padded=padded,
                   compute_config={"gemm_type": "indexed"})
    y = gate_up(x, top_k=top_k, **indexed)  # [T * k, 2I], slot order
    z = down(humming_swiglu(y, limit=swiglu_limit), top_k=1, **indexed)  # [T * k, H]
    if shared is not None:
        main.wait_stream(side)
    clip = clip_note(swiglu_limit, shared)
    backends.note("moe", "humming", "humming_indexed_gemm", tokens=tokens, format="mxfp4", block=HUMMING_BLOCK,
                  shared_stream=shared is not None, **clip)
    return humming_combine(z, weights, shared_out, x.dtype)


def moe_humming_layer(x, router, w_gate_up, w_down, shared=None, swiglu_limit: float | None = None) -> torch.Tensor:
    """The whole layer: this repository's Triton routing (the fastest here), then `moe_humming`;
    a prompt past Humming's MAX_SLOTS slots takes the grouped path (impl.moe.grouped)."""
    from impl.moe.triton_routing import routing_supported, route_triton
    if x.shape[0] * router.config.top_k > MAX_SLOTS:
        from impl.moe.grouped import moe_grouped_layer
        return moe_grouped_layer(x, router, w_gate_up, w_down, shared, backend="humming", swiglu_limit=swiglu_limit)
    if routing_supported(router.config):
        _, weights, ids = route_triton(x, router.weight, router.e_score_correction_bias, router.config)
    else:
        weights, ids = router(x)
    return moe_humming(x, weights, ids, w_gate_up, w_down, shared, swiglu_limit)
