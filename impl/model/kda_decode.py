"""One KDA decode token as two Triton kernels: everything between the input projections and o_proj.

The first, per (batch row, head, block of BLOCK_V state columns) program: the short causal
convolution over the head's q|k|v channels from the stored (kernel - 1) inputs, SiLU, L2 norms
of q and k (q scaled by head_dim^-0.5), the forget gate g from f_proj's output, beta =
sigmoid(b), the gated delta rule on the [Dk, Dv] fp32 state

    S <- diag(exp(g)) S;   S <- S + k (beta (v - S^T k))^T;   o = S^T q

on its columns of the state (4 programs a head at D = 128: one per head took 13.4 us for the 4.5 MB
of state on the H200, four 11.6 us). The second, per (row, head): the gated RMS norm of o
over Dv and the shift of the stored convolution inputs, which only it writes, so no program of the
first can read a shifted window. The torch form of the same step (impl.model.kda:
`recurrent_kda_step` and the module around it) is its reference, and rounds where these kernels
round: the convolution's SiLU output and o to the activation dtype, as the module does.

Both launch with programmatic dependent launch where the GPU has it (impl/moe/triton_pdl.py's
rules): the first loads its columns of the state, written a token ago, while the input projection
before it still runs; the second its norm weight. For a decode token the second lets the launch
after it, o_proj's GEMV, start before it waits (`release_early`), so the GEMV loads its first
weight tiles during the first kernel: row 3's step of Ling-3.0-flash 0.989-0.991x at 1k, 8k and
32k, logits bit for bit the same (notes/runs/2026-12-04-ab-step-early-release-h200.log).

The state is read once and written once (`state_in` may be `state_out`: decode updates in place);
`keep` (1.0, or 0.0 at position 0) multiplies the stored state and convolution inputs, so a new
sequence starts from zeros without a host branch. In eager torch this step is about 55 small
kernels a layer, several passes over the 2 MB state: launch-bound next to the layer's 126 MB of
projections, even replayed from a CUDA graph.
"""

from __future__ import annotations

import torch

from impl.moe.triton_pdl import pdl_release, pdl_supported, pdl_wait
from impl.triton_env import tl, triton

L2_EPS = tl.constexpr(1e-6)  # impl.model.kda.L2_EPS: inside the square root


@triton.jit
def _conv_silu(mixed_row_ptr, conv_state_ptr, conv_w_ptr, ch, keep, out_dtype: tl.constexpr, KERN: tl.constexpr,
               KP: tl.constexpr):
    """Channels `ch` of one token: the causal convolution over the stored (KERN - 1) inputs and this
    token's, SiLU, rounded to the activation dtype. Reads the stored inputs only (KP: KERN - 1
    rounded up to a power of two); `kda_output_kernel` shifts them once every program has read."""
    acc = tl.load(mixed_row_ptr + ch).to(tl.float32) * tl.load(conv_w_ptr + ch * KERN + (KERN - 1))
    if KERN > 1:
        offs_j = tl.arange(0, KP)
        j_ok = (offs_j < KERN - 1)[None, :]
        prev = tl.load(conv_state_ptr + ch[:, None] * (KERN - 1) + offs_j[None, :], mask=j_ok, other=0.0) * keep
        w = tl.load(conv_w_ptr + ch[:, None] * KERN + offs_j[None, :], mask=j_ok, other=0.0)
        acc += tl.sum(prev * w, axis=1)
    act = acc / (1.0 + tl.exp(-acc))
    return act.to(out_dtype).to(tl.float32)


@triton.jit
def _shift_window(mixed_row_ptr, conv_state_ptr, ch, keep, KERN: tl.constexpr, KP: tl.constexpr):
    """The stored inputs of channels `ch` shifted by one, this token's appended. The window is read
    whole before a barrier and only then written in place: a vector of channels is held by
    several warps at once, and a warp storing its shift while another still read the window gave
    wrong states at D = 128 on the H200."""
    if KERN > 1:
        offs_j = tl.arange(0, KP)
        j_ok = (offs_j < KERN - 1)[None, :]
        window = conv_state_ptr + ch[:, None] * (KERN - 1) + offs_j[None, :]
        prev = tl.load(window, mask=j_ok, other=0.0) * keep
        new = tl.load(mixed_row_ptr + ch).to(tl.float32)
        tl.debug_barrier()
        tl.store(window - 1, prev, mask=j_ok & (offs_j > 0)[None, :])
        tl.store(conv_state_ptr + ch * (KERN - 1) + (KERN - 2), new)


@triton.jit
def kda_decode_kernel(mixed_ptr, f_ptr, b_ptr, conv_state_ptr, conv_w_ptr, dt_bias_ptr, a_log_ptr,
                      state_in_ptr, state_out_ptr, keep_ptr, out_ptr,
                      stride_mixed, stride_f, stride_b, stride_out,
                      H, lower_bound,
                      D: tl.constexpr, BLOCK_V: tl.constexpr, KERN: tl.constexpr, KP: tl.constexpr,
                      SAFE_GATE: tl.constexpr, PDL: tl.constexpr):
    """Program (row * H + head, value block): the delta rule on the state's columns [D, BLOCK_V]
    (columns are independent: the recall and the output sum over the key dim only); writes the
    head's output o unnormalized (rounded to the activation dtype, as the module rounds it)."""
    pid = tl.program_id(0)
    row, h = pid // H, pid % H
    offs_d = tl.arange(0, D)
    offs_v = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
    offs_s = (row * H + h) * D * D + offs_d[:, None] * D + offs_v[None, :]
    s = tl.load(state_in_ptr + offs_s)  # written by an earlier token's launch (or a verify pass's, two launches ago)
    pdl_wait(PDL)  # the projections, the convolution window (shifted by the launch before in a verify pass), keep
    pdl_release(PDL)
    keep = tl.load(keep_ptr)
    hd = H * D
    out_dtype: tl.constexpr = out_ptr.dtype.element_ty
    mixed_row = mixed_ptr + row * stride_mixed
    conv_state_row = conv_state_ptr + row * 3 * hd * (KERN - 1)
    q = _conv_silu(mixed_row, conv_state_row, conv_w_ptr, h * D + offs_d, keep, out_dtype, KERN, KP)
    k = _conv_silu(mixed_row, conv_state_row, conv_w_ptr, hd + h * D + offs_d, keep, out_dtype, KERN, KP)
    v = _conv_silu(mixed_row, conv_state_row, conv_w_ptr, 2 * hd + h * D + offs_v, keep, out_dtype, KERN, KP)
    q = q * tl.rsqrt(tl.sum(q * q, axis=0) + L2_EPS) * (D ** -0.5)
    k = k * tl.rsqrt(tl.sum(k * k, axis=0) + L2_EPS)

    # Forget gate (per channel of the key dim) and write strength.
    z = tl.load(f_ptr + row * stride_f + h * D + offs_d).to(tl.float32) + tl.load(dt_bias_ptr + h * D + offs_d)
    rate = tl.exp(tl.load(a_log_ptr + h))
    if SAFE_GATE:
        g = lower_bound / (1.0 + tl.exp(-rate * z))
    else:
        g = -rate * tl.where(z > 20.0, z, tl.log(1.0 + tl.exp(z)))
    beta = 1.0 / (1.0 + tl.exp(-tl.load(b_ptr + row * stride_b + h).to(tl.float32)))

    # Gated delta rule on S [Dk, Dv], columns offs_v.
    s = s * keep * tl.exp(g)[:, None]
    recalled = tl.sum(k[:, None] * s, axis=0)
    s = s + k[:, None] * (beta * (v - recalled))[None, :]
    tl.store(state_out_ptr + offs_s, s)
    o = tl.sum(q[:, None] * s, axis=0)
    tl.store(out_ptr + row * stride_out + h * D + offs_v, o.to(out_dtype))


@triton.jit
def kda_output_kernel(mixed_ptr, gate_ptr, conv_state_ptr, norm_w_ptr, keep_ptr, out_ptr,
                      stride_mixed, stride_gate, stride_out, H, norm_eps,
                      D: tl.constexpr, KERN: tl.constexpr, KP: tl.constexpr, PDL: tl.constexpr,
                      RELEASE_EARLY: tl.constexpr):
    """Program row * H + head, after kda_decode_kernel: the gated RMS norm of the head's o over Dv
    (then the sigmoid of the output gate), in place, and the shift of the head's q, k, v
    convolution inputs (every program of the first kernel has read them by now)."""
    pid = tl.program_id(0)
    row, h = pid // H, pid % H
    offs_d = tl.arange(0, D)
    norm_w = tl.load(norm_w_ptr + offs_d).to(tl.float32)
    if RELEASE_EARLY:  # the launch after reads nothing but weights before its wait
        pdl_release(PDL)
    pdl_wait(PDL)  # o comes from the launch before
    if not RELEASE_EARLY:
        pdl_release(PDL)
    hd = H * D
    o_ptrs = out_ptr + row * stride_out + h * D + offs_d
    o = tl.load(o_ptrs).to(tl.float32)
    o = o * tl.rsqrt(tl.sum(o * o, axis=0) / D + norm_eps) * norm_w
    gate = tl.load(gate_ptr + row * stride_gate + h * D + offs_d).to(tl.float32)
    tl.store(o_ptrs, (o / (1.0 + tl.exp(-gate))).to(out_ptr.dtype.element_ty))
    keep = tl.load(keep_ptr)
    mixed_row = mixed_ptr + row * stride_mixed
    conv_state_row = conv_state_ptr + row * 3 * hd * (KERN - 1)
    for part in tl.static_range(3):
        _shift_window(mixed_row, conv_state_row, part * hd + h * D + offs_d, keep, KERN, KP)


BLOCK_V = 32  # state columns a program of kda_decode_kernel updates: 4 programs a head at D = 128


def kda_decode(mixed: torch.Tensor, f: torch.Tensor, b: torch.Tensor, gate: torch.Tensor, conv_state: torch.Tensor,
               conv_w: torch.Tensor, dt_bias: torch.Tensor, a_log: torch.Tensor, norm_w: torch.Tensor,
               state_in: torch.Tensor, state_out: torch.Tensor, keep: torch.Tensor, num_heads: int,
               safe_gate: bool, lower_bound: float, norm_eps: float, release_early: bool = False) -> torch.Tensor:
    """One token of B rows: mixed [B, 3*H*D] (q|k|v projections before the convolution), f and gate
    [B, H*D], b [B, H] (rows may be strided views, the last dim contiguous); conv_state
    [B, 3*H*D, kernel-1] and the states [B, H, D, D] fp32, updated; conv_w [3*H*D, kernel] fp32.
    Returns o [B, H*D] in mixed's dtype, ready for o_proj. `release_early`: the launch after this
    one may start before the first kernel has finished, so it must read nothing but weights before
    its wait (o_proj's GEMV; not the next token's first kernel in a verify pass, which reads the
    state this token writes)."""
    bsz, hd = f.shape
    d = hd // num_heads
    kern = conv_w.shape[-1]
    for name, t in (("mixed", mixed), ("f", f), ("b", b), ("gate", gate)):
        if t.stride(-1) != 1:
            raise ValueError(f"kda_decode: {name} must be contiguous in its last dim, got strides {t.stride()}")
    if mixed.shape != (bsz, 3 * hd) or b.shape != (bsz, num_heads) or gate.shape != (bsz, hd):
        raise ValueError(f"kda_decode: shapes mixed {tuple(mixed.shape)}, f {tuple(f.shape)}, b {tuple(b.shape)}, "
                         f"gate {tuple(gate.shape)} do not fit {num_heads} heads of {d}")
    if d & (d - 1):
        raise ValueError(f"kda_decode: head_dim {d} must be a power of two (the kernel's tiles)")
    for name, t in (("conv_state", conv_state), ("state_in", state_in), ("state_out", state_out)):
        if t.dtype != torch.float32 or not t.is_contiguous():
            raise ValueError(f"kda_decode: {name} must be contiguous fp32, got {t.dtype}")
    out = torch.empty(bsz, hd, dtype=mixed.dtype, device=mixed.device)
    kp = triton.next_power_of_2(max(kern - 1, 1))
    block_v = min(BLOCK_V, d)
    pdl = pdl_supported(mixed.device)
    kda_decode_kernel[(bsz * num_heads, d // block_v)](
        mixed, f, b, conv_state, conv_w, dt_bias, a_log, state_in, state_out, keep, out,
        mixed.stride(0), f.stride(0), b.stride(0), out.stride(0), num_heads, float(lower_bound),
        D=d, BLOCK_V=block_v, KERN=kern, KP=kp, SAFE_GATE=safe_gate, PDL=pdl, launch_pdl=pdl, num_warps=4)
    kda_output_kernel[(bsz * num_heads,)](
        mixed, gate, conv_state, norm_w, keep, out, mixed.stride(0), gate.stride(0), out.stride(0), num_heads,
        float(norm_eps), D=d, KERN=kern, KP=kp, PDL=pdl, RELEASE_EARLY=release_early,
        launch_pdl=pdl, num_warps=4)
    return out
