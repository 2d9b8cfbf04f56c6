"""A few tokens' routed and shared experts in one launch (`MoELaunchConfig.fused_down`, register
path only): each program computes one block of an expert's intermediate activations, as
`moe_gate_up_kernel` does, and then at once that block's share of the down projection over the
whole hidden size (Wd[:, block] act[block], K = the block's width): an fp32 partial [M, H]. The
programs that arrive last sum the partials, a block of hidden columns each, in program order.

Why: with two kernels the down projection starts only when every gate_up program has finished
(a grid-wide dependency, PDL's wait), then streams its weights. Here a program asks for its down
slice in L2 as soon as it knows its expert, so those bytes stream while its gate_up tile does;
the layer keeps one dependency, the final sum.

The sum, deterministic and without a second launch: every program writes its partial, then
counts itself in (an atomic counter; its count is its order of arrival). The last C arrivals
each wait until every program has arrived and add a block of hidden columns of all partials in
program order. Waiting cannot deadlock: a waiting program has done its own work, at most C - 1
programs are still unfinished, and every other finished program has exited, so the unfinished
ones find SM slots (C is at most half the SMs). Under the interpreter programs run one after
another, so the last arrival sums every block itself.

Task order: the shared expert's blocks first (they need only x: with PDL they run while the
router's top-k does), then slot by slot the routed experts' blocks.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from impl.moe.configs import MoELaunchConfig
from impl.moe.triton_dp4a import store_split_int8
from impl.moe.triton_moe import (DP4A, M_PAD, KernelLaunch, _gemv_step, _live, _matmul, _partial_cols, _rows_tile,
                                 _step_weights, _swiglu_tile)
from impl.moe.triton_pdl import pdl_release, pdl_wait
from impl.triton_env import ASM, FP32_MATH, INTERPRET, tl, triton

# Hidden columns one combining program sums (a block of every partial); the tile of partials it
# loads at once holds COMBINE_TILE values, LOADS such tiles in flight.
COMBINE_N = 64
COMBINE_TILE = tl.constexpr(2048)
COMBINE_LOADS = tl.constexpr(4)
MAX_H_STEPS = 16  # the down product's steps over H are unrolled: its loads can all be in flight


@triton.jit
def prefetch_l2_rows(row_ptrs, ASM: tl.constexpr):
    """Ask for the 128-byte lines holding each of `row_ptrs` in L2 (a hint; no-op when not ASM)."""
    if ASM:
        tl.inline_asm_elementwise("prefetch.global.L2 [$1]; mov.u32 $0, 0;", "=r,l", [row_ptrs], dtype=tl.int32,
                                  is_pure=False, pack=1)


@triton.jit
def _store_partial(partial_ptr, acc, offs_m, M, H, offs_h, h_mask):
    tl.store(partial_ptr + offs_m[:, None] * H + offs_h[None, :], acc, mask=(offs_m[:, None] < M) & h_mask[None, :])


@triton.jit
def _slice_product(a_ptr, stride_am, as_ptr, M, K, w_ptr, ws_ptr, offs_h, h_mask, stride_wn, stride_sn, tokens,
                   M_PAD: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr, MXFP4: tl.constexpr,
                   GEMV_ROWS: tl.constexpr, WORD32: tl.constexpr, FP32_MATH: tl.constexpr):
    """a[:M, :K] @ W[offs_h, :K]^T, [M_PAD, BLOCK_H] fp32, for K = BLOCK_K (one block): the dp4a
    and plain register products as straight-line code, no loop, so that the unrolled steps over
    H can have their loads in flight together (through `_matmul`, each step's one-pass K loop
    kept its loads inside, one memory round trip a step); the fp32 word decodes via `_matmul`."""
    if WORD32 == DP4A or not MXFP4:
        dp4a: tl.constexpr = WORD32 == DP4A
        COLS: tl.constexpr = _partial_cols(BLOCK_K, GEMV_ROWS, dp4a, w_ptr.dtype.element_ty.primitive_bitwidth)
        w, ws, w2, ws2 = _step_weights(w_ptr, ws_ptr, w_ptr, ws_ptr, offs_h, h_mask, stride_wn, stride_sn, 0, K,
                                       _live(0, K), BLOCK_H, BLOCK_K, dp4a, False, True)
        zero = tl.zeros((BLOCK_H, COLS), dtype=tl.float32)
        a0, a1, a2, a3, _, _, _, _ = _gemv_step(zero, zero, zero, zero, zero, zero, zero, zero, w, ws, w2, ws2, a_ptr,
                                                stride_am, as_ptr, offs_h, 0, K, M, BLOCK_H, BLOCK_K, GEMV_ROWS, COLS,
                                                dp4a, False, True)
        return _rows_tile(tl.sum(a0, axis=1), tl.sum(a1, axis=1), tl.sum(a2, axis=1), tl.sum(a3, axis=1), 0,
                          GEMV_ROWS, M_PAD)
    return _matmul(a_ptr, stride_am, as_ptr, M, K, w_ptr, ws_ptr, w_ptr, ws_ptr, offs_h, h_mask, stride_wn, stride_sn,
                   tokens, M_PAD, BLOCK_H, BLOCK_K, MXFP4, GEMV_ROWS, WORD32, False, FP32_MATH, False, 0, True)[0]


@triton.jit
def _combine(partial_ptr, out_ptr, stride_om, M, H, tasks, first, step, COMBINE_N: tl.constexpr):
    """out[:, blocks first, first + step, ...] = the sum over every task's partial [M, H], in task
    order within tiles of PARTS tasks (a fixed reduction tree: the same sums every call)."""
    PARTS: tl.constexpr = max(1, COMBINE_TILE // COMBINE_N)
    offs_c = tl.arange(0, COMBINE_N)
    offs_p = tl.arange(0, PARTS)
    for b in range(first, tl.cdiv(H, COMBINE_N), step):
        cols = b * COMBINE_N + offs_c
        c_mask = cols < H
        for m in range(0, M):
            total = tl.zeros((COMBINE_N,), dtype=tl.float32)
            for p0 in range(0, tasks, PARTS * COMBINE_LOADS):
                for j in tl.static_range(COMBINE_LOADS):
                    p = p0 + j * PARTS + offs_p
                    tile = tl.load(partial_ptr + p[:, None] * (M * H) + m * H + cols[None, :],
                                   mask=(p < tasks)[:, None] & c_mask[None, :], other=0.0, cache_modifier=".cg")
                    total += tl.sum(tile, axis=0)
            tl.store(out_ptr + m * stride_om + cols, total.to(out_ptr.dtype.element_ty), mask=c_mask)


@triton.jit
def moe_fused_kernel(x_ptr, stride_xm, xq_ptr, stride_xqm, xs_ptr, M, H, I, I_SHARED,
                     slot_expert_ptr, slot_weight_ptr, slot_tokens_ptr,
                     gw_ptr, gws_ptr, stride_ge, stride_gn, stride_gse, stride_gsn,
                     dw_ptr, dws_ptr, stride_de, stride_dn, stride_dse, stride_dsn,
                     sg_ptr, su_ptr, stride_shn, sd_ptr, stride_sdn,
                     act_ptr, act_s_ptr, shared_act_ptr, partial_ptr, counter_ptr, out_ptr, stride_om,
                     shared_tasks, combiners,
                     M_PAD: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_H: tl.constexpr,
                     H_STEPS: tl.constexpr, COMBINE_N: tl.constexpr, MXFP4: tl.constexpr, GEMV_ROWS: tl.constexpr,
                     WORD32: tl.constexpr, FP32_MATH: tl.constexpr, SHARED_SPLIT: tl.constexpr,
                     SHARED_BLOCK_K: tl.constexpr, EVEN: tl.constexpr, GEMV_PIPELINE: tl.constexpr,
                     SHARED_PIPELINE: tl.constexpr, PDL: tl.constexpr, PREFETCH: tl.constexpr, SPIN: tl.constexpr):
    """Program t: block t of the shared expert's intermediate rows (BLOCK_N / SHARED_SPLIT of them)
    for t < shared_tasks, else block (t - shared_tasks) % (I / BLOCK_N) of slot
    (t - shared_tasks) // (I / BLOCK_N); then that block's down product over H in H_STEPS tiles
    of BLOCK_H rows, into partial t; then the sum (module docstring). The block's activations go
    through a scratch of the program's own (act_ptr / act_s_ptr: split for the dp4a decode;
    shared_act_ptr), where the down product's register path reads them as its K = the block.
    EVEN: the gate_up tiles lie whole inside the weights (the launcher checks the blocks do).
    PREFETCH: a routed program asks for its down slice in L2 once it knows its expert."""
    task = tl.program_id(0)
    tasks = tl.num_programs(0)
    offs_m = tl.arange(0, M_PAD)
    part_ptr = partial_ptr + task * (M * H)
    if task < shared_tasks:
        pdl_release(PDL)  # reads x and the shared weights only, two or more launches old
        BLOCK_S: tl.constexpr = BLOCK_N // SHARED_SPLIT
        s0 = task * BLOCK_S
        if PREFETCH:  # the block's down slice (a line a row)
            for i in tl.static_range(H_STEPS):
                prefetch_l2_rows(sd_ptr + s0 + tl.minimum(i * BLOCK_H + tl.arange(0, BLOCK_H), H - 1) * stride_sdn, ASM)
        offs_s = s0 + tl.arange(0, BLOCK_S)
        act = _swiglu_tile(x_ptr, stride_xm, x_ptr, M, H, sg_ptr, su_ptr, sg_ptr, su_ptr, offs_s, offs_s < I_SHARED,
                           stride_shn, 0, -1, M_PAD, BLOCK_S, SHARED_BLOCK_K, False, GEMV_ROWS, False, False, FP32_MATH,
                           SHARED_PIPELINE, EVEN)
        pdl_wait(PDL)  # writes wait (see impl/moe/triton_pdl.py)
        a_ptr = shared_act_ptr + task * (M_PAD * BLOCK_S)
        tl.store(a_ptr + offs_m[:, None] * BLOCK_S + tl.arange(0, BLOCK_S)[None, :],
                 act.to(shared_act_ptr.dtype.element_ty), mask=(offs_m < M)[:, None])
        tl.debug_barrier()  # the block's activations are written before any thread reads them back
        for i in tl.static_range(H_STEPS):
            offs_h = i * BLOCK_H + tl.arange(0, BLOCK_H)
            h_mask = offs_h < H
            acc = _slice_product(a_ptr, BLOCK_S, a_ptr, M, BLOCK_S, sd_ptr + s0, sd_ptr, offs_h, h_mask, stride_sdn,
                                 0, -1, M_PAD, BLOCK_H, BLOCK_S, False, GEMV_ROWS, 0, FP32_MATH)
            _store_partial(part_ptr, acc, offs_m, M, H, offs_h, h_mask)
    else:
        pdl_wait(PDL)  # the slots come from the launch before this one
        pdl_release(PDL)
        blocks = I // BLOCK_N
        slot = (task - shared_tasks) // blocks
        n0 = ((task - shared_tasks) % blocks) * BLOCK_N
        expert = tl.load(slot_expert_ptr + slot)
        tokens = tl.load(slot_tokens_ptr + slot)
        if expert >= 0:
            dp4a: tl.constexpr = WORD32 == DP4A
            # The down slice: columns n0 .. n0 + BLOCK_N of every row (int32 words of 8 codes and
            # a scale a row for MXFP4, plain values otherwise).
            if MXFP4:
                d_ptr = dw_ptr + expert.to(tl.int64) * stride_de + n0 // 8
                ds_ptr = dws_ptr + expert.to(tl.int64) * stride_dse + n0 // 32
            else:
                d_ptr = dw_ptr + expert.to(tl.int64) * stride_de + n0
                ds_ptr = d_ptr
            if PREFETCH:
                for i in tl.static_range(H_STEPS):
                    offs_h = tl.minimum(i * BLOCK_H + tl.arange(0, BLOCK_H), H - 1)
                    prefetch_l2_rows(d_ptr + offs_h * stride_dn, ASM)
                    if MXFP4:
                        prefetch_l2_rows(ds_ptr + offs_h * stride_dsn, ASM)
            offs_n = n0 + tl.arange(0, BLOCK_N)
            g_ptr = gw_ptr + expert.to(tl.int64) * stride_ge
            gs_ptr = gws_ptr + expert.to(tl.int64) * stride_gse
            if dp4a:  # x as its int8 split
                a_in, stride_a, as_in = xq_ptr, stride_xqm, xs_ptr
            else:
                a_in, stride_a, as_in = x_ptr, stride_xm, x_ptr
            act = _swiglu_tile(a_in, stride_a, as_in, M, H, g_ptr, g_ptr + I * stride_gn, gs_ptr, gs_ptr + I * stride_gsn,
                               offs_n, offs_n < I, stride_gn, stride_gsn, tokens, M_PAD, BLOCK_N, BLOCK_K, MXFP4,
                               GEMV_ROWS, WORD32, False, FP32_MATH, GEMV_PIPELINE, EVEN)
            r = task - shared_tasks
            if dp4a:  # split as the down product's dp4a decode reads it: rows of BLOCK_N / 2 words
                a_ptr = act_ptr + r * (M_PAD * BLOCK_N // 2)
                as_ptr = act_s_ptr + r * (M_PAD * BLOCK_N // 32)
                store_split_int8(a_ptr, BLOCK_N // 2, as_ptr, BLOCK_N // 32, act, offs_m, offs_m < M_PAD, 0, BLOCK_N,
                                 M_PAD, BLOCK_N)
                stride_am = BLOCK_N // 2
            else:
                a_ptr = act_ptr + r * (M_PAD * BLOCK_N)
                as_ptr = a_ptr
                tl.store(a_ptr + offs_m[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :],
                         act.to(act_ptr.dtype.element_ty))
                stride_am = BLOCK_N
            tl.debug_barrier()  # the block's activations are written before any thread reads them back
            chose = ((tokens >> offs_m) & 1) != 0
            weight = tl.load(slot_weight_ptr + slot * M_PAD + offs_m)
            k_block = tl.full((), BLOCK_N, tl.int32)  # the products' K, as a value (they hint its alignment)
            for i in tl.static_range(H_STEPS):
                offs_h = i * BLOCK_H + tl.arange(0, BLOCK_H)
                h_mask = offs_h < H
                acc = _slice_product(a_ptr, stride_am, as_ptr, M, k_block, d_ptr, ds_ptr, offs_h, h_mask, stride_dn,
                                     stride_dsn, tokens, M_PAD, BLOCK_H, BLOCK_N, MXFP4, GEMV_ROWS, WORD32, FP32_MATH)
                # A token that did not choose this expert adds exactly nothing (not 0 * inf = NaN).
                _store_partial(part_ptr, tl.where(chose[:, None], acc * weight[:, None], 0.0), offs_m, M, H, offs_h,
                               h_mask)
        else:  # an unused slot (fewer distinct experts than slots): a zero partial
            for i in tl.static_range(H_STEPS):
                offs_h = i * BLOCK_H + tl.arange(0, BLOCK_H)
                _store_partial(part_ptr, tl.zeros((M_PAD, BLOCK_H), dtype=tl.float32), offs_m, M, H, offs_h,
                               offs_h < H)
    tl.debug_barrier()  # every thread's partial is written before the release below
    arrived = tl.atomic_add(counter_ptr, 1, sem="acq_rel", scope="gpu")
    if SPIN:
        if arrived >= tasks - combiners:
            seen = arrived + 1
            while seen < tasks:
                seen = tl.atomic_add(counter_ptr, 0, sem="acquire", scope="gpu")
            _combine(partial_ptr, out_ptr, stride_om, M, H, tasks, arrived - (tasks - combiners), combiners,
                     COMBINE_N)
            if tl.atomic_add(counter_ptr + 1, 1, sem="acq_rel", scope="gpu") == combiners - 1:
                tl.store(counter_ptr, 0)  # every combiner is past its wait: ready for the next call
                tl.store(counter_ptr + 1, 0)
    elif arrived == tasks - 1:
        _combine(partial_ptr, out_ptr, stride_om, M, H, tasks, 0, 1, COMBINE_N)
        tl.store(counter_ptr, 0)


@dataclass(frozen=True)
class FusedLaunch:
    """The one launch of `moe_fused`: the kernel's grid and constexprs, and its task counts."""

    kernel: KernelLaunch
    shared_tasks: int
    routed_tasks: int
    combiners: int


def fused_launch(cfg: MoELaunchConfig, *, tokens: int, num_slots: int, hidden: int, inter: int, i_shared: int,
                 gemv_rows: int, word32: int, mxfp4: bool, pdl: bool, sms: int) -> FusedLaunch | None:
    """The fused launch for these tokens and shapes, or None where `cfg.fused_down` does not apply:
    not asked for, the tensor-core path (more tokens than `gemv_max_tokens`), or blocks that do
    not tile the intermediate sizes (the two kernels then run, as provenance records)."""
    if not cfg.fused_down or not gemv_rows or (mxfp4 and not word32):  # MXFP4 as int32 words only
        return None
    split = cfg.shared_split if i_shared else 1
    block_s = cfg.gate_up_block_n // split
    if inter % cfg.gate_up_block_n or (i_shared and i_shared % block_s):
        return None
    shared_tasks = i_shared // block_s if i_shared else 0
    routed_tasks = num_slots * (inter // cfg.gate_up_block_n)
    tasks = shared_tasks + routed_tasks
    shared_k = cfg.shared_block_k or cfg.gate_up_block_k
    even = hidden % cfg.gate_up_block_k == 0 and (not i_shared or hidden % shared_k == 0)
    # The down product's tiles: down_block_n rows of Wd a step, at most MAX_H_STEPS steps (unrolled).
    block_h = min(max(cfg.down_block_n, triton.next_power_of_2(triton.cdiv(hidden, MAX_H_STEPS))),
                  triton.next_power_of_2(hidden))
    # Combiners: one a block of COMBINE_N hidden columns, at most half the SMs (the wait's safety).
    combiners = max(1, min(triton.cdiv(hidden, COMBINE_N), tasks, max(1, sms // 2)))
    consts = dict(M_PAD=M_PAD, BLOCK_N=cfg.gate_up_block_n, BLOCK_K=cfg.gate_up_block_k, BLOCK_H=block_h,
                  H_STEPS=triton.cdiv(hidden, block_h), COMBINE_N=COMBINE_N, MXFP4=mxfp4, GEMV_ROWS=gemv_rows,
                  WORD32=word32, FP32_MATH=FP32_MATH, SHARED_SPLIT=split, SHARED_BLOCK_K=shared_k, EVEN=even,
                  GEMV_PIPELINE=cfg.gate_up_prefetch or -cfg.gemv_stages,
                  SHARED_PIPELINE=cfg.shared_prefetch or -cfg.gemv_stages, PDL=pdl,
                  PREFETCH=cfg.pdl_prefetch and not INTERPRET, SPIN=not INTERPRET)
    return FusedLaunch(KernelLaunch((tasks, 1), consts, cfg.gate_up_warps, cfg.gate_up_stages), shared_tasks,
                       routed_tasks, combiners)


_COUNTERS: dict = {}


def _counters(device: torch.device) -> torch.Tensor:
    """(arrivals, combiners done): zero between calls (the last combiner resets them); one
    persistent pair per device, so CUDA graphs capture a fixed address."""
    buf = _COUNTERS.get(device)
    if buf is None:
        buf = _COUNTERS[device] = torch.zeros(2, dtype=torch.int32, device=device)
    return buf


def moe_fused(x, xq, xs, slots, w_gate_up, w_down, shared, launch: FusedLaunch, weight_args, act_dtype) -> torch.Tensor:
    """Run the fused launch for x [M, H] (xq, xs: its dp4a split, else x) on `slots`; weight_args
    (w_gate_up, words) -> its pointer, scales and strides (`triton_moe._weight_args`)."""
    k = launch.kernel
    m, hidden = x.shape
    dev = x.device
    block_n = k.consts["BLOCK_N"]
    if k.consts["WORD32"] == DP4A.value:
        act = torch.empty(max(launch.routed_tasks, 1), M_PAD, block_n // 2, dtype=torch.int32, device=dev)
        act_s = torch.empty(max(launch.routed_tasks, 1), M_PAD, block_n // 32, dtype=torch.float32, device=dev)
    else:
        act = torch.empty(max(launch.routed_tasks, 1), M_PAD, block_n, dtype=act_dtype, device=dev)
        act_s = act
    block_s = block_n // k.consts["SHARED_SPLIT"]
    shared_act = torch.empty(max(launch.shared_tasks, 1), M_PAD, block_s, dtype=act_dtype, device=dev)
    partial = torch.empty(k.grid[0], m, hidden, dtype=torch.float32, device=dev)
    out = torch.empty(m, hidden, dtype=x.dtype, device=dev)
    words = k.consts["WORD32"] > 0
    gw, gs, g_we, g_wn, g_se, g_sn = weight_args(w_gate_up, words)
    dw, ds, d_we, d_wn, d_se, d_sn = weight_args(w_down, words)
    sg = shared.gate if shared is not None else x
    su = shared.up if shared is not None else x
    sd = shared.down if shared is not None else x
    moe_fused_kernel[k.grid](
        x, x.stride(0), xq, xq.stride(0), xs, m, hidden, w_down.shape[-1], shared.gate.shape[0] if shared else 0,
        slots.expert, slots.weight, slots.tokens, gw, gs, g_we, g_wn, g_se, g_sn, dw, ds, d_we, d_wn, d_se, d_sn,
        sg, su, sg.stride(0), sd, sd.stride(0), act, act_s, shared_act, partial, _counters(dev), out, out.stride(0),
        launch.shared_tasks, launch.combiners, **k.consts, launch_pdl=k.consts["PDL"], num_warps=k.num_warps,
        num_stages=k.num_stages)
    return out
