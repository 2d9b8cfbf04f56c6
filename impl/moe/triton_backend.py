"""The `triton` MoE backend's host side: input checks, then for each chunk of at most M_PAD
tokens the launches in order, with no host synchronization:

- `moe_triton` (routing given as weights/ids): `moe_slots_kernel` groups it by expert
  (impl/moe/triton_slots.py), then the expert kernels;
- `moe_triton_layer` (the whole layer, routing included): the router's logits and top-k
  kernels (impl/moe/triton_routing.py; with MXFP4 on the register path the logits kernel also
  splits x for the dp4a products), then the expert kernels. A prefill of plain experts (more
  than M_PAD tokens) takes one batched gather pass instead (`_prefill`), and one of MXFP4 experts
  longer than GROUPED_MIN_TOKENS the grouped path (impl/moe/grouped.py).

The expert kernels (impl/moe/triton_experts.py) run as the launch plan says
(impl/moe/triton_launch.py, from the committed config of the shape's M bucket). Provenance
records each call's kernels, config and product path.
"""

from __future__ import annotations

import torch

from impl import backends
from impl.moe.moe_launch_config import M_PAD, MoELaunchConfig
from impl.moe.grouped import GROUPED_MIN_TOKENS, moe_grouped_layer
from impl.moe.shared import SharedExpert, check_shared_expert, clip_note
from impl.moe.triton_dp4a import check_split, empty_split, split_int8_kernel
from impl.moe.triton_experts import moe_down_kernel, moe_gate_up_kernel
from impl.moe.triton_launch import Plan, expert_launch, plan
from impl.moe.triton_pdl import use_pdl
from impl.moe.triton_slots import Slots, slots_from_routing
from impl.quant.mxfp4 import MXFP4Tensor
from impl.triton_env import FP32_MATH, INTERPRET, triton

SPLIT_BLOCK_K = 512  # columns of x a program of `split_int8_kernel` splits (the dp4a products)


def _capturing(x: torch.Tensor) -> bool:
    return x.is_cuda and torch.cuda.is_current_stream_capturing()


def check_triton_inputs(x, weights, ids, w_gate_up, w_down, shared) -> tuple[int, int, int]:
    """Shapes, dtypes, devices and layout the kernels rely on; returns (E, H, I). Routing None
    (weights and ids): a layer that routes itself, checked without."""
    from impl.moe.reference import check_moe_inputs, logical_weight
    gu, dn = logical_weight(w_gate_up), logical_weight(w_down)
    # The kernels take CUDA tensors (CPU ones under the interpreter); meta or other devices
    # would otherwise fail deep inside (reading the ids back, or at launch) with unrelated errors.
    devices = ("cuda", "cpu") if INTERPRET else ("cuda",)
    if x.device.type not in devices:
        raise ValueError(f"the Triton MoE needs {' or '.join(devices)} tensors, got x on {x.device}")
    check_moe_inputs(x, weights, ids, gu, dn, check_ids=not _capturing(x))
    if ids is not None and ids.shape[1] == 0:  # no (token, expert) pair: the kernels would leave the output unwritten
        raise ValueError(f"the Triton MoE needs top_k >= 1, got routing ids of shape {tuple(ids.shape)}")
    experts, two_i, hidden = gu.shape
    for name, w in (("gate_up", w_gate_up), ("down", w_down)):
        t = w.packed if isinstance(w, MXFP4Tensor) else w
        if not t.is_contiguous() or (isinstance(w, MXFP4Tensor) and not w.scales.is_contiguous()):
            raise ValueError(f"{name} weight must be contiguous")
        if not isinstance(w, MXFP4Tensor) and w.dtype not in (torch.bfloat16, torch.float16, torch.float32):
            raise TypeError(f"{name} weight must be bf16, fp16, fp32 or MXFP4, got {w.dtype}")
    if x.stride(-1) != 1:
        raise ValueError("x must be contiguous along the hidden dimension")
    if hidden % 32 or (two_i // 2) % 32:
        raise ValueError(f"the Triton MoE needs H and I to be multiples of 32, got H={hidden}, I={two_i // 2}")
    if shared is not None:
        check_shared_expert(shared, hidden, x.device)
    return experts, hidden, two_i // 2


def _weight_args(w, words: bool):
    """(weight pointer, scale pointer, strides) for a routed weight [E, N, K] of either format;
    with `words`, MXFP4 codes as int32 words ([E, N, K/8], strides in words) for the dp4a products."""
    if isinstance(w, MXFP4Tensor):
        q, s = w.packed, w.scales
        if words:  # K is a multiple of 32, so a row is 16 * (K / 32) bytes: whole, aligned words
            q = q.view(torch.int32)
        return q, s, q.stride(0), q.stride(1), s.stride(0), s.stride(1)
    return w, w, w.stride(0), w.stride(1), 0, 0


_COUNTERS: dict = {}


def _counters(device: torch.device, n: int) -> torch.Tensor:
    """Arrival counters of the down kernel, zero between calls (the last arrival resets its own);
    one persistent buffer per device, so CUDA graphs capture a fixed address."""
    buf = _COUNTERS.get(device)
    if buf is None or buf.numel() < n:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            # Allocated inside a capture, the buffer would come from the graph's private pool and
            # its zeros would be written only when the graph replays.
            raise RuntimeError("call the Triton MoE once outside CUDA-graph capture first (its arrival counters "
                               "are allocated and zeroed on the first call)")
        buf = _COUNTERS[device] = torch.zeros(max(n, 1024), dtype=torch.int32, device=device)
    return buf


def split_buffers(x: torch.Tensor, p: Plan) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Empty (planes, scales) for x split as the dp4a products read it, when plan `p` takes them
    (else None): whoever reads x before the experts (the router's logits kernel) can fill them,
    saving the split launch."""
    return empty_split(*x.shape, x.device) if p.dp4a else None


def moe_experts(x: torch.Tensor, slots: Slots, w_gate_up, w_down, shared: SharedExpert | None = None,
                config: MoELaunchConfig | None = None,
                x_split: tuple[torch.Tensor, torch.Tensor] | None = None,
                swiglu_limit: float | None = None) -> torch.Tensor:
    """The expert kernels for at most M_PAD tokens whose routing is grouped in `slots`. `x_split`:
    x already split for the dp4a products, in buffers from `split_buffers` (else x is split here
    when the plan needs it). The routed experts' SwiGLU clips at `swiglu_limit`, the shared
    expert's at its own limit (None: no clipping; the kernel is built without it when neither clips)."""
    m, top_k, num_slots = slots.num_tokens, slots.top_k, slots.num_slots
    p = plan(m, top_k, w_gate_up, w_down, x.device, config)
    cfg, mxfp4 = p.config, p.format == "mxfp4"
    hidden = w_gate_up.shape[-1]
    inter = w_down.shape[-1]
    i_shared = shared.gate.shape[0] if shared is not None else 0
    split_here = p.dp4a and x_split is None
    shared_limit = shared.limit if shared is not None else None
    clip = clip_note(swiglu_limit, shared)
    backends.note("moe", "triton", ("split_int8_kernel+" if split_here else "") + "moe_gate_up_kernel+moe_down_kernel",
                  format=backends.weight_format(w_gate_up), tokens=m, shared=shared is not None, config=cfg,
                  product=p.product, **clip)
    act_dtype = torch.float32 if FP32_MATH else x.dtype
    dev = x.device
    pdl = use_pdl(cfg.pdl, dev)
    launch = expert_launch(cfg, tokens=m, num_slots=num_slots, hidden=hidden, inter=inter, i_shared=i_shared,
                           mxfp4=mxfp4, pdl=pdl, clip=bool(clip))
    if p.dp4a:  # x and the routed activations as int8 splits (impl.moe.triton_dp4a)
        if x_split is not None:
            check_split(x_split, m, hidden, dev)
        xq, xs = x_split or empty_split(m, hidden, dev)
        if split_here:
            split_int8_kernel[(m, triton.cdiv(hidden, SPLIT_BLOCK_K))](x, x.stride(0), xq, xs, hidden,
                                                                       BLOCK_K=SPLIT_BLOCK_K, num_warps=4)
        act = torch.empty(num_slots, M_PAD, 4, inter // 8, dtype=torch.int32, device=dev)
        act_s = torch.empty(num_slots, M_PAD, inter // 32, dtype=torch.float32, device=dev)
    else:
        xq, xs = x, x
        act = torch.empty(num_slots, M_PAD, inter, dtype=act_dtype, device=dev)
        act_s = act
    shared_act = torch.empty(M_PAD, max(i_shared, 1), dtype=act_dtype, device=dev)
    out = torch.empty(m, hidden, dtype=x.dtype, device=dev)

    gw, gs, s_we, s_wn, s_se, s_sn = _weight_args(w_gate_up, p.dp4a)
    sg = shared.gate if shared is not None else x
    su = shared.up if shared is not None else x
    k = launch.gate_up
    moe_gate_up_kernel[k.grid](
        x, x.stride(0), xq, xq.stride(0), xs, m, hidden, inter, i_shared, slots.expert, slots.tokens, num_slots,
        gw, gs, s_we, s_wn, s_se, s_sn, sg, su, sg.stride(0),
        act, act.stride(0), act.stride(1), act_s, act_s.stride(0), shared_act, shared_act.stride(0),
        _limit(swiglu_limit), _limit(shared_limit),
        **k.consts, launch_pdl=pdl, num_warps=k.num_warps, num_stages=k.num_stages)
    dw, ds, d_we, d_wn, d_se, d_sn = _weight_args(w_down, p.dp4a)
    sd = shared.down if shared is not None else x
    k = launch.down
    partial = torch.empty(k.grid[1], M_PAD, hidden, dtype=torch.float32, device=dev)
    moe_down_kernel[k.grid](
        act, act.stride(0), act.stride(1), act_s, act_s.stride(0), shared_act, shared_act.stride(0),
        slots.expert, slots.weight, slots.tokens, num_slots, dw, ds, d_we, d_wn, d_se, d_sn,
        sd, sd.stride(0), partial, partial.stride(0), _counters(dev, k.grid[0]),
        out, out.stride(0), m, hidden, inter, i_shared, launch.shared_chunk,
        **k.consts, launch_pdl=pdl, num_warps=k.num_warps, num_stages=k.num_stages)
    return out


def _limit(limit: float | None) -> float:
    """A clipping limit as the gate-up kernel takes it: infinite for none (min and max keep every value)."""
    return float("inf") if limit is None else float(limit)


def moe_triton(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, w_gate_up, w_down,
               shared: SharedExpert | None = None, config: MoELaunchConfig | None = None,
               swiglu_limit: float | None = None) -> torch.Tensor:
    """Fused MoE for x [T, H]: routed experts (bf16/fp16/fp32 tensors or MXFP4Tensor, SwiGLU
    clipped at `swiglu_limit`) chosen by ids/weights [T, k], plus `shared`; returns [T, H] in x's dtype."""
    experts, _, _ = check_triton_inputs(x, weights, ids, w_gate_up, w_down, shared)
    outs = []
    for i in range(0, max(x.shape[0], 1), M_PAD):  # no tokens: one empty chunk, an empty output
        chunk = slice(i, i + M_PAD)
        backends.note("moe", "triton", "moe_slots_kernel", tokens=x[chunk].shape[0])
        slots = slots_from_routing(weights[chunk], ids[chunk], experts)
        outs.append(moe_experts(x[chunk], slots, w_gate_up, w_down, shared, config, swiglu_limit=swiglu_limit))
    return outs[0] if len(outs) == 1 else torch.cat(outs)


def moe_triton_layer(x: torch.Tensor, router, w_gate_up, w_down, shared: SharedExpert | None = None,
                     config: MoELaunchConfig | None = None, swiglu_limit: float | None = None) -> torch.Tensor:
    """The whole layer for x [T, H], routing included, in chunks of M_PAD tokens, each as its
    launch config says (`config`, else the committed one for the chunk's size). `router` has
    `weight` (fp32 [E, H]), `e_score_correction_bias` and `config` (impl.model.layers.Router)."""
    check_triton_inputs(x, None, None, w_gate_up, w_down, shared)
    if x.shape[0] > M_PAD and not isinstance(w_gate_up, MXFP4Tensor):
        return _prefill(x, router, w_gate_up, w_down, shared, swiglu_limit)
    if x.shape[0] > GROUPED_MIN_TOKENS and not (x.is_cuda and torch.cuda.is_current_stream_capturing()):
        # An MXFP4 prefill: each expert dequantized once, not re-read per chunk (a captured pass
        # over a prompt, the MTP draft's, stays on the kernels: the grouped path reads the host)
        return moe_grouped_layer(x, router, w_gate_up, w_down, shared, backend="triton", swiglu_limit=swiglu_limit)
    outs = []
    for i in range(0, max(x.shape[0], 1), M_PAD):
        chunk = x[i:i + M_PAD]
        p = plan(chunk.shape[0], router.config.top_k, w_gate_up, w_down, x.device, config)
        x_split, slots = route_chunk(chunk, router, p)
        outs.append(moe_experts(chunk, slots, w_gate_up, w_down, shared, p.config, x_split=x_split,
                                swiglu_limit=swiglu_limit))
    return outs[0] if len(outs) == 1 else torch.cat(outs)


def _prefill(x: torch.Tensor, router, w_gate_up, w_down, shared: SharedExpert | None,
             swiglu_limit: float | None = None) -> torch.Tensor:
    """More than M_PAD tokens of plain experts (a prefill): the router's own routing, then the
    chosen experts' weights gathered and applied by two batched matmuls (impl.moe.gather), one
    pass over all tokens. The decode kernels would take the tokens 16 at a time, re-reading each
    chosen expert per chunk and paying four launches a chunk: on the H200 the tiny model's
    time to first token (about 80-token prompts) was 16.7 ms through them against 7.2 ms here."""
    from impl.moe.gather import moe_gather
    from impl.moe.shared import shared_expert
    weights, ids = router(x)
    backends.note("moe", "triton", "moe_gather", tokens=x.shape[0], prefill=True)
    out = moe_gather(x, weights, ids, w_gate_up, w_down, swiglu_limit)
    return out if shared is None else out + shared_expert(x, shared)


def route_chunk(x: torch.Tensor, router, p: Plan, split_x: bool = True
                ) -> tuple[tuple[torch.Tensor, torch.Tensor] | None, Slots]:
    """The routing of at most M_PAD tokens as plan `p` runs it: (x split for the dp4a products by
    the router's logits kernel, when the plan takes them and `split_x`; else None), the slots.
    The router overlaps its launches (`pdl`) and prefetches its rows (`l2_prefetch`) as the plan's
    config says."""
    from impl.moe.triton_routing import route_triton
    x_split = split_buffers(x, p) if split_x else None
    cfg = p.config
    backends.note("moe", "triton", "router_logits_kernel+router_topk_kernel", tokens=x.shape[0],
                  split_x=x_split is not None, pdl=cfg.pdl, l2_prefetch=cfg.l2_prefetch)
    slots = route_triton(x, router.weight, router.e_score_correction_bias, router.config, x_split=x_split,
                         pdl=cfg.pdl, prefetch=cfg.l2_prefetch)[0]
    return x_split, slots
