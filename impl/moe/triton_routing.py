"""Routing for decode and verify steps in two launches, so that a whole MoE layer is four
kernels:

1. `router_logits_kernel` (expert blocks): logits = x Wr^T in fp32 (exact fp32 products, not
   tf32: a top-k choice flips on tiny differences); with MXFP4 experts on the register path it
   also splits x for their dp4a products, saving that launch;
2. `router_topk_kernel` (one program): softmax or sigmoid + correction bias + group-limited
   top-k (impl/moe/triton_topk.py), renormalization and routed scaling, then the expert slots the
   expert kernels consume (impl/moe/triton_slots.py).

Same semantics as `impl.routing` (the oracle); grouped routing needs a power-of-two number of
groups and of experts per group (every model in the presets), other shapes use the oracle.
"""

from __future__ import annotations

import torch

from impl.moe.moe_launch_config import M_PAD
from impl.moe.triton_dp4a import check_split, store_split_int8
from impl.moe.triton_slots import Slots, write_slots
from impl.moe.triton_pdl import pdl_release, pdl_wait, prefetch_l2, use_pdl
from impl.moe.triton_topk import batch_ids, choice_weights, decode_ids, store_decode_routing
from impl.triton_env import ASM, tl, triton

ROUTER_SOFTMAX, ROUTER_SIGMOID_GROUPED = 0, 1


@triton.jit
def split_x_block(x_ptr, stride_xm, xq_ptr, xs_ptr, M, H, c, ROWS: tl.constexpr):
    """Columns c..c+31 of x [M, H] split for the dp4a decode (impl.moe.triton_dp4a) into planes
    xq_ptr [M, 4, H/8] and scales xs_ptr [M, H/32]."""
    offs_r = tl.arange(0, ROWS)
    offs_c = c + tl.arange(0, 32)
    a = tl.load(x_ptr + offs_r[:, None] * stride_xm + offs_c[None, :], mask=(offs_r < M)[:, None],
                other=0.0).to(tl.float32)
    store_split_int8(xq_ptr, H // 2, xs_ptr, H // 32, a, offs_r, offs_r < M, c, H, ROWS, 32)


@triton.jit
def logits_block(x_ptr, stride_xm, w_ptr, stride_we, logits_ptr, M, E, H, offs_e, e_end,
                 ROWS: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr):
    """logits[:, offs_e] = x Wr[offs_e]^T for the experts before e_end, as fp32 multiply-adds (a
    GEMV per token: no tensor-core padding to 16 rows, and no tf32 rounding). Each weight tile is
    loaded once and met by the tokens one at a time, so the tile (and the number of K steps, each
    a memory round trip) does not shrink as tokens are added."""
    offs_m = tl.arange(0, ROWS)
    e_mask = offs_e < e_end
    acc = tl.zeros((ROWS, BLOCK_E), dtype=tl.float32)
    for k0 in range(0, H, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < H
        w = tl.load(w_ptr + offs_e[:, None] * stride_we + offs_k[None, :], mask=e_mask[:, None] & k_mask[None, :],
                    other=0.0).to(tl.float32)
        for r in tl.static_range(ROWS):
            x = tl.load(x_ptr + r * stride_xm + offs_k, mask=k_mask & (offs_k * 0 + r < M), other=0.0).to(tl.float32)
            acc += tl.where(offs_m[:, None] == r, tl.sum(w * x[None, :], axis=1)[None, :], 0.0)
    tl.store(logits_ptr + offs_m[:, None] * E + offs_e[None, :], acc, mask=(offs_m[:, None] < M) & e_mask[None, :])


@triton.jit
def router_logits_kernel(x_ptr, stride_xm, w_ptr, stride_we, logits_ptr, M, E, H, xq_ptr, xs_ptr,
                         ROWS: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_X: tl.constexpr,
                         PDL: tl.constexpr, PREFETCH: tl.constexpr):
    """logits[:, block] = x Wr[block]^T (`logits_block`), a block of BLOCK_E experts a program.
    SPLIT_X: the programs also split x for the MoE's dp4a decode (impl.moe.triton_dp4a), a block
    of 32 columns each in turn, into planes xq_ptr [M, 4, H/8] and scales xs_ptr [M, H/32]: the
    MoE's own split launch is saved.
    PREFETCH (with PDL): the program's router rows are asked for in L2 while x's writer finishes."""
    if PREFETCH:
        e0 = tl.program_id(0) * BLOCK_E
        prefetch_l2(w_ptr + e0 * stride_we, w_ptr + tl.minimum(e0 + BLOCK_E, E) * stride_we, ASM)
    pdl_wait(PDL)  # x's writer
    pdl_release(PDL)
    if SPLIT_X:
        for c in range(tl.program_id(0) * 32, H, tl.num_programs(0) * 32):
            split_x_block(x_ptr, stride_xm, xq_ptr, xs_ptr, M, H, c, ROWS)
    logits_block(x_ptr, stride_xm, w_ptr, stride_we, logits_ptr, M, E, H,
                 tl.program_id(0) * BLOCK_E + tl.arange(0, BLOCK_E), E, ROWS, BLOCK_E, BLOCK_K)


@triton.jit
def router_topk_kernel(logits_ptr, bias_ptr, ids_ptr, weights_ptr,
                       slot_expert_ptr, slot_weight_ptr, slot_tokens_ptr,
                       M, E, TOP_K, num_slots, routed_scaling,
                       ROUTER: tl.constexpr, RENORMALIZE: tl.constexpr, HAS_BIAS: tl.constexpr,
                       N_GROUP: tl.constexpr, TOPK_GROUP: tl.constexpr, ROWS: tl.constexpr,
                       M_PAD: tl.constexpr, E_PAD: tl.constexpr, K_PAD: tl.constexpr, S_PAD: tl.constexpr,
                       PDL: tl.constexpr):
    """One program: scores, group-limited top-k, weights and slots from the logits [M, E], in
    tiles of ROWS = next_power_of_2(M) tokens (1 at decode), so a decode step does 1/16 of the
    work of a padded verify step."""
    pdl_wait(PDL)
    pdl_release(PDL)
    offs_m = tl.arange(0, ROWS)
    offs_k = tl.arange(0, K_PAD)
    if ROWS == 1:
        scores, ids = decode_ids(logits_ptr, bias_ptr, E, ROUTER, HAS_BIAS, N_GROUP, TOPK_GROUP, E_PAD, K_PAD)
    else:
        scores, ids = batch_ids(logits_ptr, bias_ptr, M, E, TOP_K, ROUTER, HAS_BIAS, N_GROUP, TOPK_GROUP, ROWS,
                                E_PAD, K_PAD)
    weights = choice_weights(scores, ids, TOP_K, RENORMALIZE, routed_scaling, K_PAD)
    if ROWS == 1:
        store_decode_routing(ids, weights, ids_ptr, weights_ptr, slot_expert_ptr, slot_weight_ptr, slot_tokens_ptr,
                             TOP_K, K_PAD, M_PAD)
    else:
        valid = (offs_m[:, None] < M) & (offs_k[None, :] < TOP_K)
        tl.store(ids_ptr + offs_m[:, None] * TOP_K + offs_k[None, :], ids, mask=valid)
        tl.store(weights_ptr + offs_m[:, None] * TOP_K + offs_k[None, :], weights, mask=valid)
        P: tl.constexpr = ROWS * K_PAD
        write_slots(tl.reshape(ids, (P,)), tl.reshape(weights, (P,)), tl.reshape(valid, (P,)),
                    tl.arange(0, P) // K_PAD, slot_expert_ptr, slot_weight_ptr, slot_tokens_ptr, num_slots,
                    P, S_PAD, M_PAD)


def routing_supported(router_config) -> bool:
    c = router_config
    if c.router == "softmax" or c.n_group == 1:
        return True
    per_group = c.num_experts // c.n_group
    return c.n_group & (c.n_group - 1) == 0 and per_group & (per_group - 1) == 0


def topk_consts(config, experts: int, has_bias: bool) -> tuple[dict, float]:
    """(the top-k kernel's constexprs, routed scaling) for a router config over `experts` experts."""
    sigmoid = config.router == "sigmoid_grouped"
    if sigmoid and config.n_group > 1 and triton.next_power_of_2(experts) != experts:
        raise ValueError(f"grouped routing needs a power-of-two expert count, got {experts}")
    consts = dict(ROUTER=ROUTER_SIGMOID_GROUPED if sigmoid else ROUTER_SOFTMAX,
                  RENORMALIZE=bool(config.norm_topk_prob), HAS_BIAS=has_bias,
                  N_GROUP=config.n_group if sigmoid else 1, TOPK_GROUP=config.topk_group if sigmoid else 1,
                  E_PAD=triton.next_power_of_2(experts), K_PAD=triton.next_power_of_2(config.top_k))
    return consts, float(config.routed_scaling_factor if sigmoid else 1.0)


def check_router_weight(router_weight: torch.Tensor, config, experts: int, hidden: int) -> None:
    """What the routing kernels read: an fp32 [experts, hidden] router whose rows are contiguous
    (they step through a row by one), and a router config they can route."""
    if router_weight.shape != (experts, hidden) or router_weight.dtype != torch.float32:
        raise ValueError(f"router weight must be fp32 [{experts}, {hidden}], got {router_weight.dtype} "
                         f"{tuple(router_weight.shape)}")
    if router_weight.stride(1) != 1:
        raise ValueError(f"router weight must be contiguous along the hidden dimension, got strides "
                         f"{router_weight.stride()}")
    if not routing_supported(config):
        raise ValueError(f"the Triton routing needs power-of-two groups and experts per group, got "
                         f"{config.num_experts} experts in {config.n_group} groups")


def _check_route_args(x, router_weight, config, block_e, block_k, logits_warps, x_split, pdl, prefetch,
                      topk_warps=4):
    m, hidden = x.shape
    experts = router_weight.shape[0]
    if m > M_PAD:
        raise ValueError(f"route_triton takes at most {M_PAD} tokens, got {m}")
    check_router_weight(router_weight, config, experts, hidden)
    if prefetch and not pdl:
        raise ValueError("prefetch needs pdl (it prefetches while waiting for the launch before)")
    if topk_warps not in (1, 2, 4, 8) or logits_warps not in (1, 2, 4, 8):
        raise ValueError(f"topk_warps and logits_warps must be 1, 2, 4 or 8, got {topk_warps}, {logits_warps}")
    if block_e < 1 or block_e & (block_e - 1) or (block_k is not None and (block_k < 32 or block_k & (block_k - 1))):
        raise ValueError(f"block_e must be a power of two and block_k a power of two >= 32, got {block_e}, {block_k}")
    if x_split is not None:
        check_split(x_split, m, hidden, x.device)


def _logits_launch(x, router_weight, block_e, block_k, x_split):
    """(grid, kernel arguments after x's and the router's, constexprs) of the logits kernel."""
    m, hidden = x.shape
    experts = router_weight.shape[0]
    xq, xs = x_split if x_split is not None else (x, x)  # read only when SPLIT_X
    # Few experts per program, so that E / block_e programs (256 at E = 512) stream the router
    # weight from many SMs at once (on the H200 8 programs of 64 experts took 55 us; 2 experts a
    # program beat 4 and 8: notes/moe-h200.md); a K tile as long as the row
    # where that fits (<= 4096 columns, <= 8K weights a program), so a program issues its loads
    # in one memory round trip at H <= 4096.
    block_k = block_k or min(triton.next_power_of_2(hidden), max(32, 8192 // block_e))
    return ((triton.cdiv(experts, block_e),), (xq, xs),
            dict(ROWS=triton.next_power_of_2(m), BLOCK_E=block_e, BLOCK_K=block_k, SPLIT_X=x_split is not None))


def _run_logits(x, router_weight, logits, block_e, block_k, x_split, pdl, prefetch, warps) -> None:
    """logits [M, E] = x Wr^T (and x split into `x_split` if given) in one launch."""
    m, hidden = x.shape
    grid, split_args, meta = _logits_launch(x, router_weight, block_e, block_k, x_split)
    router_logits_kernel[grid](x, x.stride(0), router_weight, router_weight.stride(0), logits, m,
                               router_weight.shape[0], hidden, *split_args, **meta, PDL=pdl, PREFETCH=prefetch,
                               num_warps=warps, launch_pdl=pdl)


def route_triton(x: torch.Tensor, router_weight: torch.Tensor, bias: torch.Tensor | None, config,
                 block_e: int = 2, block_k: int | None = None, topk_warps: int = 4,
                 logits_warps: int = 4, x_split: tuple[torch.Tensor, torch.Tensor] | None = None,
                 pdl: bool = False, prefetch: bool = False) -> tuple[Slots, torch.Tensor, torch.Tensor]:
    """Route at most M_PAD tokens x [M, H] with an fp32 router [E, H]; returns the slots and the
    (weights fp32 [M, k], ids int32 [M, k]) they were built from. `topk_warps`: warps of the
    one-program top-k kernel (fewer warps, fewer block-wide barriers in its k rounds of
    reductions); `logits_warps`: of the logits kernel. `x_split` (from
    `triton_backend.split_buffers`): buffers the logits kernel fills with x split for the dp4a
    products. `pdl`: programmatic dependent launches (impl/moe/triton_pdl.py), as the MoE's
    `pdl`; `prefetch` (with `pdl`): the logits programs ask for their router rows in L2 while
    waiting, as the MoE's `l2_prefetch`."""
    _check_route_args(x, router_weight, config, block_e, block_k, logits_warps, x_split, pdl, prefetch, topk_warps)
    m, hidden = x.shape
    experts = router_weight.shape[0]
    dev = x.device
    top_k = config.top_k
    logits = torch.empty(m, experts, dtype=torch.float32, device=dev)
    slots = Slots.empty(m, top_k, experts, dev)
    ids = torch.empty(m, top_k, dtype=torch.int32, device=dev)
    weights = torch.empty(m, top_k, dtype=torch.float32, device=dev)
    consts, scaling = topk_consts(config, experts, bias is not None)
    pdl = use_pdl(pdl, dev)
    _run_logits(x, router_weight, logits, block_e, block_k, x_split, pdl, prefetch and pdl, logits_warps)
    router_topk_kernel[(1,)](logits, bias if bias is not None else logits, ids, weights, slots.expert, slots.weight,
                             slots.tokens, m, experts, top_k, slots.num_slots, scaling, **consts,
                             ROWS=triton.next_power_of_2(m), M_PAD=M_PAD, S_PAD=triton.next_power_of_2(slots.num_slots),
                             PDL=pdl, num_warps=topk_warps, launch_pdl=pdl)
    return slots, weights, ids
