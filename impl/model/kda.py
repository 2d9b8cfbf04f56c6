"""Kimi Delta Attention (KDA), the linear-attention layer of Ling 3.0 (`bailing_hybrid`), for decode.

Parameter names follow transformers' `BailingHybridDeltaAttention`, so its state_dict loads with
`load_state_dict`: q_proj/k_proj/v_proj, one depthwise `conv1d` over the concatenated q|k|v channels,
`forget_gate.{f_proj, A_log, dt_bias}`, `b_proj`, `g_proj`, `o_norm.weight`, `o_proj`.

Per head h, with q and k L2-normalised, q scaled by 1/sqrt(head_dim), a per-channel log-decay g_t <= 0
and a write strength beta_t in (0, 1), the state S [head_dim_k, head_dim_v] follows the gated delta rule

    S  <- diag(exp(g_t)) S
    S  <- S + k_t (beta_t (v_t - S^T k_t))^T
    o_t = S^T q_t

The state per layer is constant in size: S for every head, plus the last (kernel - 1) pre-convolution
q|k|v inputs for the short causal convolution. Both live in `KDAState`, allocated once by
`setup_caches` (static shapes, like the KV cache) and updated in place, in fp32 whatever the model
dtype: the recurrence accumulates over the whole sequence, so rounding it to bf16 each step would drift.

Decode (T == 1) is the recurrent step; prefill (T > 1) is the chunked form (`chunked_kda`), which gives
the same outputs and final state as T recurrent steps up to fp32 rounding. Neither reads a value back
to the host, and every shape depends only on T (a Python int), never on tensor contents.

A recurrent state cannot be truncated like a KV cache. Speculative decoding keeps, during a verify
pass (2 <= T <= `verify_tokens` tokens, run as T recurrent steps), the state after every token and the
whole convolution window; `keep_verified(count)` then sets the live state to the one after the first
`count` tokens, by a device-side index (no host read, so it can sit inside a captured step), as vLLM
and SGLang do with per-draft-token state slots. `state_snapshot()` / `state_restore(snap)` and
`advance_from(snap, x)` (restore, then run the accepted tokens again) are the general form.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from impl import backends
from impl.model.fused import fuse_linears, fused_linear
from impl.model.gemv import linear
from impl.model.layer_backends import init_layer_backends

# The L2 norm of q and k adds its epsilon under the square root (x / sqrt(sum x^2 + eps)), as the
# reference kernels do; F.normalize clamps the norm instead, which differs for tiny vectors.
L2_EPS = 1e-6


def _l2norm(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + L2_EPS)


class ForgetGate(nn.Module):
    """Per-channel log-decay g <= 0 from the hidden state, in fp32.

    safe_gate: g = lower_bound * sigmoid(exp(A_log) * (f_proj(x) + dt_bias)), so g in (lower_bound, 0);
    otherwise g = -exp(A_log) * softplus(f_proj(x) + dt_bias).
    """

    def __init__(self, hidden_size: int, num_heads: int, head_dim: int, safe_gate: bool, lower_bound: float) -> None:
        super().__init__()
        self.num_heads, self.head_dim = num_heads, head_dim
        self.safe_gate, self.lower_bound = safe_gate, lower_bound
        # A_log and dt_bias stay fp32 in the checkpoint (transformers keeps them in fp32 strictly).
        self.A_log = nn.Parameter(torch.zeros(num_heads, dtype=torch.float32))
        self.dt_bias = nn.Parameter(torch.zeros(num_heads * head_dim, dtype=torch.float32))
        self.f_proj = nn.Linear(hidden_size, num_heads * head_dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.from_projection(self.f_proj(x))

    def from_projection(self, f: torch.Tensor) -> torch.Tensor:
        """g from f_proj's output f [B, T, H*D]."""
        b, t, _ = f.shape
        z = (f.float() + self.dt_bias.float()).view(b, t, self.num_heads, self.head_dim)
        rate = self.A_log.float().exp().view(1, 1, self.num_heads, 1)
        if self.safe_gate:
            return self.lower_bound * torch.sigmoid(rate * z)
        return -rate * F.softplus(z)


class GatedRMSNorm(nn.Module):
    """RMS norm over head_dim, then times sigmoid(gate); all in fp32, one rounding to the input dtype."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        y = F.rms_norm(x.float(), (x.shape[-1],), self.weight.float(), self.eps)
        return (y * torch.sigmoid(gate.float())).to(x.dtype)


class KDAState(nn.Module):
    """One layer's recurrent state: `recurrent` [B, H, Dk, Dv] and `conv` [B, 3*H*D, kernel - 1], fp32."""

    def __init__(self, batch: int, num_heads: int, head_dim: int, conv_dim: int, conv_kernel: int,
                 device=None) -> None:
        super().__init__()
        f32 = torch.float32
        self.register_buffer("recurrent", torch.zeros(batch, num_heads, head_dim, head_dim, dtype=f32,
                                                      device=device), persistent=False)
        self.register_buffer("conv", torch.zeros(batch, conv_dim, conv_kernel - 1, dtype=f32, device=device),
                             persistent=False)

    def copy_(self, other: "KDAState") -> "KDAState":
        if other.recurrent.shape != self.recurrent.shape or other.conv.shape != self.conv.shape:
            raise ValueError(f"state shapes differ: recurrent {tuple(other.recurrent.shape)} vs "
                             f"{tuple(self.recurrent.shape)}, conv {tuple(other.conv.shape)} vs "
                             f"{tuple(self.conv.shape)}")
        self.recurrent.copy_(other.recurrent)
        self.conv.copy_(other.conv)
        return self

    def zero_(self) -> "KDAState":
        self.recurrent.zero_()
        self.conv.zero_()
        return self


class VerifyTrack(nn.Module):
    """What a verify pass of up to `tokens` tokens leaves to choose from: the recurrent state after
    each token [tokens, B, H, Dk, Dv] and the convolution window [B, C, kernel - 1 + tokens], fp32."""

    def __init__(self, tokens: int, batch: int, num_heads: int, head_dim: int, conv_dim: int, conv_kernel: int,
                 device=None) -> None:
        super().__init__()
        f32 = torch.float32
        self.tokens = tokens
        self.register_buffer("states", torch.zeros(tokens, batch, num_heads, head_dim, head_dim, dtype=f32,
                                                   device=device), persistent=False)
        self.register_buffer("window", torch.zeros(batch, conv_dim, conv_kernel - 1 + tokens, dtype=f32,
                                                   device=device), persistent=False)
        self.register_buffer("offsets", torch.arange(conv_kernel - 1, device=device), persistent=False)
        # The last tracked pass's tokens and batch (Python ints: fixed per captured step).
        self.length = self.batch_in_use = 0


def recurrent_kda_step(q, k, v, g, beta, state):
    """One token. q, k, v, g [B, H, D] fp32 (q, k normalised, q scaled), beta [B, H]; state [B, H, Dk, Dv]
    updated in place. Returns o [B, H, Dv]."""
    state.mul_(g.exp().unsqueeze(-1))
    recalled = torch.einsum("bhk,bhkv->bhv", k, state)
    delta = beta.unsqueeze(-1) * (v - recalled)
    state.add_(k.unsqueeze(-1) * delta.unsqueeze(-2))
    return torch.einsum("bhk,bhkv->bhv", q, state)


# Tokens whose chunks are batched together in one pass of `chunked_kda`: bounds the pass's
# temporaries (the largest, the exact decays of `_intra_chunk_products`, is SUB x D fp32 a token
# and head: 512 MiB for 2048 tokens of 32 heads of 128) while keeping the batched products large.
GROUP_TOKENS = 2048
# Sub-block of a chunk whose pairwise decays are formed exactly (see `_intra_chunk_products`).
SUB_BLOCK = 16


def _intra_chunk_products(qc, kc, gc, sub: int):
    """Per chunk, A_kk[t, i] = sum_c k_tc k_ic exp(G_tc - G_ic) for i < t and A_qk, the same with q_t
    for i <= t. qc, kc, gc [X, N, C, D] (gc cumulative within the chunk). Returns both [X, N, C, C].

    G never increases along a chunk (g <= 0), so exp(G_t - G_i) <= 1 for i <= t, but exp(G_t) and
    exp(-G_i) alone over- and underflow once G reaches a few hundred. Pairs in different sub-blocks
    of `sub` tokens factor through r, the last token of i's sub-block (i <= r < t):
    exp(G_t - G_i) = exp(G_t - G_r) exp(G_r - G_i), both factors <= 1, so the pairs are one batched
    matmul per reference block. Pairs inside one sub-block take the exact [sub, sub, D] decay."""
    x, n, c, d = kc.shape
    p = c // sub
    block = torch.arange(c, device=kc.device) // sub
    g_ref = gc[:, :, sub - 1::sub]                                        # [X, N, P, D]
    k_in = kc * (g_ref.repeat_interleave(sub, dim=2) - gc).exp()          # relative to its block's end
    later = block.unsqueeze(0) > torch.arange(p, device=kc.device).unsqueeze(1)   # [P, C]: t past block p
    rel = (gc.unsqueeze(2) - g_ref.unsqueeze(3)).masked_fill(~later[..., None], float("-inf")).exp_()
    k_in_t = k_in.view(x, n, p, sub, d).transpose(-1, -2)                 # [X, N, P, D, sub]
    a_kk = ((kc.unsqueeze(2) * rel) @ k_in_t).permute(0, 1, 3, 2, 4).reshape(x, n, c, c)
    a_qk = ((qc.unsqueeze(2) * rel) @ k_in_t).permute(0, 1, 3, 2, 4).reshape(x, n, c, c)
    del rel
    gb, kb, qb = (y.view(x, n, p, sub, d) for y in (gc, kc, qc))
    causal = torch.ones(sub, sub, dtype=torch.bool, device=kc.device).tril()
    m = (gb.unsqueeze(4) - gb.unsqueeze(3)).masked_fill(~causal[..., None], float("-inf")).exp_()
    m.mul_(kb.unsqueeze(3))                                               # [X, N, P, t, i, D]: k_i decayed to t
    for a, y in ((a_kk, kb), (a_qk, qb)):
        diag = (m @ y.unsqueeze(-1)).squeeze(-1)                          # [X, N, P, t, i]
        a.view(x, n, p, sub, p, sub).diagonal(dim1=2, dim2=4).add_(diag.permute(0, 1, 3, 4, 2))
    return a_kk.tril_(-1), a_qk


def chunked_kda(q, k, v, g, beta, state, chunk_size: int = 64):
    """T tokens in chunks. q, k, v, g [B, H, T, D] fp32 (q, k normalised, q scaled), beta [B, H, T];
    state [B, H, Dk, Dv] updated in place to the state after the last token. Returns o [B, H, T, Dv].

    Within a chunk starting from state S0, with G_t = g_1 + ... + g_t (per channel, cumulative in the
    chunk), the per-token corrections d_t = beta_t (v_t - k_t^T S'_t), S'_t the decayed state just before
    token t's write, satisfy a unit lower-triangular system L d = beta (v - (k * exp(G)) S0),

        L = I + beta_t A_ti (i < t),   A_ti = sum_c k_tc k_ic exp(G_tc - G_ic),

    so d = U - W S0 with U = L^-1 (beta v) and W = L^-1 (beta (k * exp(G))), which do not depend on
    S0: every chunk's A, U and W come from one batched pass (triangular solves included). Only
        S_end = diag(exp(G_C)) S0 + sum_i (k_i * exp(G_C - G_i)) d_i^T
    runs chunk after chunk (two batched matmuls a chunk); then, for all chunks at once,
        o_t = (q_t * exp(G_t))^T S0 + sum_{i<=t} (sum_c q_tc k_ic exp(G_tc - G_ic)) d_i.
    Chunks are batched GROUP_TOKENS at a time; the last chunk is zero-padded (g = 0, beta = 0: no
    decay, no write), so shapes follow from T alone and no value is read back to the host.
    """
    t = k.shape[2]
    out = torch.empty(v.shape, dtype=torch.float32, device=q.device)
    step = max(chunk_size, GROUP_TOKENS // chunk_size * chunk_size)
    for s in range(0, t, step):
        e = min(s + step, t)
        out[:, :, s:e] = _chunk_group(q[:, :, s:e], k[:, :, s:e], v[:, :, s:e], g[:, :, s:e], beta[:, :, s:e],
                                      state, chunk_size)
    return out


def _chunk_group(q, k, v, g, beta, state, chunk_size: int):
    b, h, t, dk = k.shape
    dv = v.shape[-1]
    c = chunk_size
    n = -(-t // c)
    pad = n * c - t

    def chunks(y):                                                        # [B, H, T, ...] -> [BH, N, C, ...]
        if pad:
            y = F.pad(y, (0, 0, 0, pad) if y.dim() == 4 else (0, pad))
        return y.reshape(b * h, n, c, *y.shape[3:])

    qc, kc, vc, bc = chunks(q), chunks(k), chunks(v), chunks(beta)
    gc = chunks(g).cumsum(dim=2)                                          # [BH, N, C, Dk]
    sub = SUB_BLOCK if c % SUB_BLOCK == 0 else c
    a_kk, a_qk = _intra_chunk_products(qc, kc, gc, sub)
    lower = bc.unsqueeze(-1) * a_kk + torch.eye(c, device=q.device)
    decay = gc.exp()                                                      # exp(G_t) <= 1 from the chunk's start
    rhs = bc.unsqueeze(-1) * torch.cat([vc, kc * decay], dim=-1)
    u, w = torch.linalg.solve_triangular(lower, rhs, upper=False, unitriangular=True).split([dv, dk], dim=-1)
    g_end = gc[:, :, -1:]                                                 # [BH, N, 1, Dk]
    k_end_t = (kc * (g_end - gc).exp()).transpose(-1, -2)                # [BH, N, Dk, C]
    decay_end = g_end.exp().transpose(-1, -2)                             # [BH, N, Dk, 1]
    states = torch.empty(n + 1, b * h, dk, dv, dtype=torch.float32, device=q.device)  # [j]: before chunk j
    states[0] = state.reshape(b * h, dk, dv)
    d = torch.empty(n, b * h, c, dv, dtype=torch.float32, device=q.device)
    for j in range(n):
        torch.baddbmm(u[:, j], w[:, j], states[j], alpha=-1, out=d[j])
        torch.baddbmm(states[j] * decay_end[:, j], k_end_t[:, j], d[j], out=states[j + 1])
    state.copy_(states[n].view_as(state))
    o = (qc * decay) @ states[:n].transpose(0, 1) + a_qk @ d.transpose(0, 1)
    return o.reshape(b, h, n * c, dv)[:, :, :t]


def _keep_flag(input_pos: torch.Tensor | None, device) -> torch.Tensor:
    """[1] fp32: 0 where the call starts a sequence (input_pos[0] == 0: the stored state is
    forgotten, by a multiply on the device, not a host branch), else 1."""
    if input_pos is None:
        return torch.ones(1, device=device)
    return (input_pos[:1] != 0).to(torch.float32)


class KDAAttention(nn.Module):
    """KDA layer. `forward(x, cos, sin, input_pos, mask)` like `layers.Attention` (cos, sin and mask
    are unused: KDA has no positional rotation and is causal by construction).

    With a state (`setup_caches`), calls continue the state: one token takes the recurrent step, more
    take the chunked prefill. A call whose input_pos starts at 0 begins a new sequence from a zero state
    (applied on the device, by a multiply, without reading input_pos back). Without a state the call
    runs the sequence from a zero state and keeps nothing.
    """

    def __init__(self, hidden_size: int, num_heads: int, head_dim: int, conv_kernel_size: int = 4,
                 rms_norm_eps: float = 1e-6, safe_gate: bool = True, lower_bound: float = -5.0,
                 chunk_size: int = 64) -> None:
        super().__init__()
        if conv_kernel_size < 1:
            raise ValueError(f"conv_kernel_size must be >= 1, got {conv_kernel_size}")
        self.hidden_size, self.num_heads, self.head_dim = hidden_size, num_heads, head_dim
        self.qkv_dim = num_heads * head_dim
        self.conv_dim = 3 * self.qkv_dim
        self.conv_kernel_size = conv_kernel_size
        self.chunk_size = chunk_size
        self.q_proj = nn.Linear(hidden_size, self.qkv_dim, bias=False)
        self.k_proj = nn.Linear(hidden_size, self.qkv_dim, bias=False)
        self.v_proj = nn.Linear(hidden_size, self.qkv_dim, bias=False)
        # Depthwise, no bias, weight [3*H*D, 1, kernel] kept in fp32 as in the checkpoint; SiLU after it.
        # Padding is never used here (the state supplies the history), it only matches the reference module.
        self.conv1d = nn.Conv1d(self.conv_dim, self.conv_dim, conv_kernel_size, groups=self.conv_dim, bias=False,
                                padding=conv_kernel_size - 1, dtype=torch.float32)
        self.forget_gate = ForgetGate(hidden_size, num_heads, head_dim, safe_gate, lower_bound)
        self.b_proj = nn.Linear(hidden_size, num_heads, bias=False)
        self.o_norm = GatedRMSNorm(head_dim, rms_norm_eps)
        self.o_proj = nn.Linear(self.qkv_dim, hidden_size, bias=False)
        self.g_proj = nn.Linear(hidden_size, self.qkv_dim, bias=False)
        self.state: KDAState | None = None
        self.track: VerifyTrack | None = None
        self.in_proj: torch.Tensor | None = None  # q|k|v|f|g|b weights in one tensor (fuse_projections)
        # How forward and the projections run (impl.model.layer_backends): kernels, or torch.
        init_layer_backends(self)

    _IN_PROJ = ("q_proj", "k_proj", "v_proj", "forget_gate.f_proj", "g_proj", "b_proj")

    def fuse_projections(self) -> None:
        """The six input projections as one GEMV for a decode token (impl.model.fused)."""
        self.in_proj = fuse_linears(self, self._IN_PROJ)

    def _projections(self, x: torch.Tensor) -> torch.Tensor:
        """q|k|v|f|g|b of x [..., hidden]."""
        return fused_linear(self, self._IN_PROJ, self.in_proj, x)

    def _decode_kernel(self, x: torch.Tensor, input_pos: torch.Tensor | None) -> torch.Tensor:
        from impl.model.kda_decode import kda_decode
        backends.note("attention", self.attention_backend.name, "kda_decode_kernel", heads=self.num_heads,
                      head_dim=self.head_dim)
        b, hd = x.shape[0], self.qkv_dim
        proj = self._projections(x[:, 0])
        keep = _keep_flag(input_pos, x.device)
        recurrent = self.state.recurrent[:b]
        o = kda_decode(proj[:, :3 * hd], proj[:, 3 * hd:4 * hd], proj[:, 5 * hd:], proj[:, 4 * hd:5 * hd],
                       self.state.conv[:b], self.conv1d.weight.view(self.conv_dim, self.conv_kernel_size),
                       self.forget_gate.dt_bias, self.forget_gate.A_log, self.o_norm.weight, recurrent, recurrent,
                       keep, self.num_heads, self.forget_gate.safe_gate, self.forget_gate.lower_bound,
                       self.o_norm.eps, release_early=True)
        return linear(o, self.o_proj.weight, self.o_proj.bias, self.projection_backend).unsqueeze(1)

    def _verify_kernel(self, x: torch.Tensor, input_pos: torch.Tensor | None) -> torch.Tensor:
        """A verify pass of T tokens (2..track.tokens) through the decode kernel token by token:
        the projections once for all T rows (their weights read once), then each token's kernels
        reading the state the previous token wrote into the track and writing its own there, as
        the torch pass keeps them for keep_verified; the live state ends as the last token left
        it. (The torch pass is ~50 small kernels a token: 35 layers of it made most of a
        Ling-3.0-flash verify step.)"""
        from impl.model.kda_decode import kda_decode
        b, t, _ = x.shape
        hd, kern, track = self.qkv_dim, self.conv_kernel_size, self.track
        backends.note("attention", self.attention_backend.name, "kda_decode_kernel", heads=self.num_heads,
                      head_dim=self.head_dim, tokens=t)
        proj = self._projections(x)                                       # [B, T, P]
        recurrent, conv_state = self.state.recurrent[:b], self.state.conv[:b]
        keep = _keep_flag(input_pos, x.device)
        if kern > 1:  # the window keep_verified picks from: the stored inputs, then the T new ones
            track.window[:b, :, :kern - 1].copy_(conv_state * keep)
            track.window[:b, :, kern - 1:kern - 1 + t].copy_(proj[..., :3 * hd].transpose(1, 2))
        conv_w = self.conv1d.weight.view(self.conv_dim, kern)
        outs = []
        for j in range(t):
            outs.append(kda_decode(
                proj[:, j, :3 * hd], proj[:, j, 3 * hd:4 * hd], proj[:, j, 5 * hd:], proj[:, j, 4 * hd:5 * hd],
                conv_state, conv_w, self.forget_gate.dt_bias, self.forget_gate.A_log, self.o_norm.weight,
                recurrent if j == 0 else track.states[j - 1, :b], track.states[j, :b],
                keep if j == 0 else torch.ones_like(keep), self.num_heads, self.forget_gate.safe_gate,
                self.forget_gate.lower_bound, self.o_norm.eps))
        recurrent.copy_(track.states[t - 1, :b])
        track.length, track.batch_in_use = t, b
        return linear(torch.stack(outs, dim=1), self.o_proj.weight, self.o_proj.bias, self.projection_backend)

    @classmethod
    def from_hf_config(cls, config, **kwargs) -> "KDAAttention":
        """From a transformers `BailingHybridConfig` (its linear_* fields; silu is the only activation)."""
        if getattr(config, "hidden_act", "silu") != "silu":
            raise ValueError(f"only the silu short-conv activation is implemented, got {config.hidden_act!r}")
        return cls(config.hidden_size, config.linear_num_heads, config.linear_head_dim,
                   config.linear_conv_kernel_dim, config.rms_norm_eps, config.kda_safe_gate,
                   config.kda_lower_bound, **kwargs)

    # -- state -----------------------------------------------------------------------------------
    def setup_caches(self, max_batch_size: int, device=None) -> None:
        """Allocate the state once (zeros); shapes depend on the batch only, not on sequence length."""
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
        device = self.q_proj.weight.device if device is None else device
        self.state = KDAState(max_batch_size, self.num_heads, self.head_dim, self.conv_dim,
                              self.conv_kernel_size, device)

    def setup_cache(self, batch: int, max_seq_len: int = 0, dtype=None, device=None,
                    verify_tokens: int = 0) -> KDAState:
        """The uniform cache set-up of impl.model.attention: the state (max_seq_len and dtype do not
        change it: the state is fp32 and constant in size), plus a `VerifyTrack` for verify passes
        of up to `verify_tokens` tokens when that is >= 2."""
        self.setup_caches(batch, device)
        self.track = None
        if verify_tokens >= 2:
            self.track = VerifyTrack(verify_tokens, batch, self.num_heads, self.head_dim, self.conv_dim,
                                     self.conv_kernel_size, self.state.recurrent.device)
        return self.state

    def keep_verified(self, count: torch.Tensor) -> None:
        """After a tracked pass of T tokens, make the live state the one after its first `count`
        tokens (count [1] int, 1..T, on the device)."""
        track, state = self.track, self._require_state()
        if track is None or not track.length:
            raise RuntimeError("keep_verified needs a tracked verify pass first (setup_cache with verify_tokens "
                               ">= 2, then a call of 2..verify_tokens tokens)")
        b = track.batch_in_use
        state.recurrent[:b].copy_(track.states[:, :b].index_select(0, count - 1)[0])
        if self.conv_kernel_size > 1:
            state.conv[:b].copy_(track.window[:b].index_select(-1, count + track.offsets))

    def reset_state(self) -> None:
        self._require_state().zero_()

    def new_snapshot(self) -> KDAState:
        """A spare buffer shaped like the state, for `state_snapshot(out=...)` without allocating later."""
        s = self._require_state()
        return KDAState(s.recurrent.shape[0], self.num_heads, self.head_dim, self.conv_dim, self.conv_kernel_size,
                        s.recurrent.device)

    def state_snapshot(self, out: KDAState | None = None) -> KDAState:
        """A copy of the current state (into `out` when given, in place)."""
        out = self.new_snapshot() if out is None else out
        return out.copy_(self._require_state())

    def state_restore(self, snap: KDAState) -> None:
        """Copy a snapshot back into the live state, in place (the live buffers keep their addresses)."""
        self._require_state().copy_(snap)

    def advance_from(self, snap: KDAState, x: torch.Tensor) -> torch.Tensor:
        """Restore `snap`, then run the accepted tokens x [B, n, hidden] through (chunked form when
        n > 1): after a rejection in speculative decoding, the state is the one n accepted tokens leave."""
        self.state_restore(snap)
        return self(x)

    def _require_state(self) -> KDAState:
        if self.state is None:
            raise RuntimeError("no KDA state: call setup_caches(max_batch_size) first")
        return self.state

    # -- forward ---------------------------------------------------------------------------------
    def _check(self, x: torch.Tensor, input_pos: torch.Tensor | None) -> None:
        if x.dim() != 3 or x.shape[-1] != self.hidden_size:
            raise ValueError(f"x must be [batch, seq, hidden={self.hidden_size}], got {tuple(x.shape)}")
        if x.shape[1] < 1:
            raise ValueError("x has no tokens (seq == 0)")
        if input_pos is not None and input_pos.shape != (x.shape[1],):
            raise ValueError(f"input_pos must be [seq={x.shape[1]}], got {tuple(input_pos.shape)}")
        if self.state is not None and x.shape[0] > self.state.recurrent.shape[0]:
            raise ValueError(f"batch {x.shape[0]} exceeds the KDA state's {self.state.recurrent.shape[0]}")

    def forward(self, x: torch.Tensor, cos: torch.Tensor | None = None, sin: torch.Tensor | None = None,
                input_pos: torch.Tensor | None = None, mask: torch.Tensor | None = None) -> torch.Tensor:
        """Through the module's attention backend (impl.model.layer_backends)."""
        self._check(x, input_pos)
        return self.attention_backend.fn(self, x, cos, sin, input_pos, mask)

    def forward_kernels(self, x: torch.Tensor, cos: torch.Tensor | None = None, sin: torch.Tensor | None = None,
                        input_pos: torch.Tensor | None = None, mask: torch.Tensor | None = None) -> torch.Tensor:
        """A decode token or a verify pass on CUDA through the kernels; anything else as forward_torch."""
        if self.state is not None and x.is_cuda:
            t = x.shape[1]
            if t == 1:
                return self._decode_kernel(x, input_pos)
            if self.track is not None and t <= self.track.tokens:
                return self._verify_kernel(x, input_pos)
        return self.forward_torch(x, cos, sin, input_pos, mask)

    def forward_torch(self, x: torch.Tensor, cos: torch.Tensor | None = None, sin: torch.Tensor | None = None,
                      input_pos: torch.Tensor | None = None, mask: torch.Tensor | None = None) -> torch.Tensor:
        """The recurrent step (one token), the verify pass token by token, or the chunked form (a
        prompt), in torch ops."""
        b, t, _ = x.shape
        h, d, kern = self.num_heads, self.head_dim, self.conv_kernel_size
        backends.note("attention", self.attention_backend.name, "kda_torch", tokens=t)
        if self.state is not None:
            recurrent, conv_state = self.state.recurrent[:b], self.state.conv[:b]
            if input_pos is not None:
                keep = _keep_flag(input_pos, x.device)
                recurrent.mul_(keep)
                conv_state.mul_(keep)
        else:
            recurrent = torch.zeros(b, h, d, d, dtype=torch.float32, device=x.device)
            conv_state = torch.zeros(b, self.conv_dim, kern - 1, dtype=torch.float32, device=x.device)

        # Short causal depthwise conv over q|k|v, continuing from the stored (kernel - 1) inputs.
        proj = self._projections(x)
        hd = self.qkv_dim
        mixed = proj[..., :3 * hd].transpose(1, 2).float()
        window = torch.cat([conv_state, mixed], dim=-1)                   # [B, C, kernel - 1 + T]
        w = self.conv1d.weight.float()                                    # [C, 1, kernel]
        if t == 1:
            conv = (window * w.squeeze(1)).sum(-1, keepdim=True)
        else:
            conv = F.conv1d(window, w, groups=self.conv_dim)
        if kern > 1:
            conv_state.copy_(window[..., -(kern - 1):])
        qkv = F.silu(conv).to(x.dtype).transpose(1, 2)                    # [B, T, C]
        q, k, v = (y.reshape(b, t, h, d).float() for y in qkv.split(self.qkv_dim, dim=-1))
        q = _l2norm(q) * d ** -0.5
        k = _l2norm(k)

        g = self.forget_gate.from_projection(proj[..., 3 * hd:4 * hd])    # [B, T, H, D] fp32
        beta = torch.sigmoid(proj[..., 5 * hd:]).float()                  # [B, T, H]
        track = self.track if self.state is not None and self.track is not None else None
        if track is not None and 2 <= t <= track.tokens:
            # A verify pass: token by token, keeping each state and the window for keep_verified.
            track.window[:b, :, :kern - 1 + t].copy_(window)
            outs = []
            for j in range(t):
                outs.append(recurrent_kda_step(q[:, j], k[:, j], v[:, j], g[:, j], beta[:, j], recurrent))
                track.states[j, :b].copy_(recurrent)
            o = torch.stack(outs, dim=1)
            track.length, track.batch_in_use = t, b
        elif t == 1:
            o = recurrent_kda_step(q[:, 0], k[:, 0], v[:, 0], g[:, 0], beta[:, 0], recurrent).unsqueeze(1)
        else:
            tr = lambda y: y.transpose(1, 2)                              # noqa: E731  [B, H, T, ...]
            o = tr(chunked_kda(tr(q), tr(k), tr(v), tr(g), tr(beta), recurrent, self.chunk_size))
        o = o.to(x.dtype)
        o = self.o_norm(o, proj[..., 4 * hd:5 * hd].reshape(b, t, h, d)).reshape(b, t, -1)
        return linear(o, self.o_proj.weight, self.o_proj.bias, self.projection_backend)
