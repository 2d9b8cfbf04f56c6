"""Multi-head latent attention (MLA) as Ling 3.0 (`bailing_hybrid`) has it, with a compressed
static KV cache for batch-1 decode.

Parameter names follow transformers' `BailingHybridAttention`, so its state_dict loads with
`load_state_dict` as it is: `q_proj` (or `q_a_proj` / `q_a_layernorm` / `q_b_proj` when the
query has a low-rank path; Ling-3.0-flash has none), `kv_a_proj_with_mqa`, `kv_a_layernorm`,
`kv_b_proj`, `o_proj` and the head-wise output gate `g_proj` (DeepSeek-V3's MLA, otherwise the
same, has no gate: `output_gate`).

Per token the cache keeps only the normalized latent c (kv_lora_rank values) and the rotated
shared key k_rope (qk_rope_head_dim values): 512 + 64 = 576 values at Ling-3.0-flash, against
2 x 32 heads x 192 / 128 values for the expanded per-head K/V.

Two forms of the same attention, which agree to rounding:
- expanded ("naive"): kv_b_proj turns every cached latent into per-head k_nope [dn] and v [dv],
  then ordinary attention with q = [q_nope, q_rope], k = [k_nope, k_rope];
- absorbed: kv_b_proj's weight, viewed as [H, dn + dv, r], splits into W_uk [H, dn, r] and
  W_uv [H, dv, r]. Since q_nope . (W_uk c) = (W_uk^T q_nope) . c, the query is moved into the
  latent space (q_lat = W_uk^T q_nope, [r] a head) and attends over the cache rows [c, k_rope]
  directly; the values are the latents c themselves, and W_uv is applied once to each head's
  attention-weighted latent afterwards.

Which form a call uses: `absorb=None` (the default) picks the absorbed form for calls of at
most `absorb_max_tokens` tokens (decode, and a speculative verification of a few tokens) and the
expanded form for longer ones (prefill). Reason: a query-key pair costs (r + dr) + r multiply-adds
a head in the absorbed form against (dn + dr) + dv in the expanded one (1088 against 320 at
Ling-3.0-flash), which dominates when many queries share the keys; with one query the expansion
of every cached latent (S x r x H x (dn + dv)) dominates instead, and the absorbed form reads
nothing but the 576-value cache rows. Either form can be forced with `absorb=True/False`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from impl import backends
from impl.model.fused import fuse_linears, fused_linear
from impl.model.gemv import linear
from impl.model.layer_backends import init_layer_backends
from impl.model.layers import RMSNorm, apply_rope, rope_tables

# transformers builds kv_a_layernorm and q_a_layernorm with the RMSNorm's default eps (1e-6),
# not with config.rms_norm_eps; matching the reference means using the same constant.
LATENT_NORM_EPS = 1e-6


@dataclass(frozen=True)
class MLAConfig:
    hidden_size: int
    num_heads: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    q_lora_rank: int | None = None
    rope_theta: float = 6_000_000.0
    attention_bias: bool = False
    # Ling 3.0's head-wise output gate (g_proj); DeepSeek-V3 has none.
    output_gate: bool = True
    # The softmax scale when not qk_head_dim ** -0.5: YaRN's mscale folded in (DeepSeek-V3).
    softmax_scale: float | None = None

    def __post_init__(self) -> None:
        for name in ("hidden_size", "num_heads", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
                     "v_head_dim"):
            if getattr(self, name) < 1:
                raise ValueError(f"MLAConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.qk_rope_head_dim % 2:
            raise ValueError(f"qk_rope_head_dim must be even (rotary pairs), got {self.qk_rope_head_dim}")
        if self.q_lora_rank is not None and self.q_lora_rank < 1:
            raise ValueError(f"q_lora_rank must be None or >= 1, got {self.q_lora_rank}")

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def rotary_dim(self) -> int:
        # What `rope_tables` reads: the rotary tables cover the rope part of a head only.
        return self.qk_rope_head_dim

    @property
    def cache_dim(self) -> int:
        """Values cached per token: the latent and the shared rope key."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def scaling(self) -> float:
        # Softmax scale over the full query-key head dim (nope + rope), as with plain attention
        # on the expanded heads; the absorbed form must use the same one, not (r + dr)^-0.5.
        return self.qk_head_dim ** -0.5 if self.softmax_scale is None else self.softmax_scale

    @classmethod
    def from_hf(cls, config) -> "MLAConfig":
        """From a transformers `BailingHybridConfig`. Only the default rope is supported: the
        other rope types change the frequencies and the softmax scale (YaRN's mscale)."""
        rope = dict(getattr(config, "rope_parameters", None) or {})
        rope_type = rope.get("rope_type", "default")
        if rope_type != "default":
            raise NotImplementedError(f"MLA supports the default rope only, config has rope_type={rope_type!r}")
        if config.num_key_value_heads != config.num_attention_heads:
            # kv_b_proj emits num_attention_heads K/V heads; the reference's GQA repeat only works
            # when the two counts agree, so any other setting is not a model it can run either.
            raise ValueError(f"MLA needs num_key_value_heads == num_attention_heads, got "
                             f"{config.num_key_value_heads} and {config.num_attention_heads}")
        return cls(hidden_size=config.hidden_size, num_heads=config.num_attention_heads,
                   kv_lora_rank=config.kv_lora_rank, qk_nope_head_dim=config.qk_nope_head_dim,
                   qk_rope_head_dim=config.qk_rope_head_dim, v_head_dim=config.v_head_dim,
                   q_lora_rank=config.q_lora_rank, rope_theta=float(rope.get("rope_theta", config.rope_theta)),
                   attention_bias=config.attention_bias)


def mla_rope_tables(config: MLAConfig, max_seq_len: int, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [max_seq_len, qk_rope_head_dim] fp32 for `MLAAttention.forward`."""
    return rope_tables(config, max_seq_len, device=device)


def apply_interleaved_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Ling / DeepSeek rope: channels (2i, 2i+1) form the pair rotated by frequency i. The result
    is laid out as [rotated even channels, rotated odd channels], the layout transformers leaves
    q_rope and k_rope in; a query and a key in the same layout give the same dot product, and the
    cache stores k_rope in it. Gathering evens then odds turns the pairs into the rotate-half pairs
    (i, i + d/2), so the project's `apply_rope` does the rotation. x [B, heads, T, d]."""
    x = torch.cat((x[..., 0::2], x[..., 1::2]), dim=-1)
    return apply_rope(x, cos, sin)


class MLACache(nn.Module):
    """Static compressed cache: one row [latent (kv_lora_rank), k_rope (qk_rope_head_dim)] per
    position. A row is written by position (index_copy_), so a speculative rejection needs no
    undo: the rejected positions are masked out by the causal mask of later calls and are
    overwritten when those positions are written again."""

    def __init__(self, batch: int, max_seq_len: int, kv_lora_rank: int, qk_rope_head_dim: int,
                 dtype, device) -> None:
        super().__init__()
        if batch < 1 or max_seq_len < 1:
            raise ValueError(f"cache batch and max_seq_len must be >= 1, got {batch} and {max_seq_len}")
        self.kv_lora_rank = kv_lora_rank
        self.register_buffer("kv", torch.zeros(batch, max_seq_len, kv_lora_rank + qk_rope_head_dim,
                                               dtype=dtype, device=device), persistent=False)

    @property
    def bytes_per_token(self) -> int:
        return self.kv.shape[-1] * self.kv.element_size()

    def update(self, input_pos: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """rows [b, T, cache_dim] written at positions input_pos [T]; returns the cache's first b
        rows [b, S, cache_dim]. Positions stay on the device (no host sync)."""
        b = rows.shape[0]
        self.kv[:b].index_copy_(1, input_pos, rows.to(self.kv.dtype))
        return self.kv[:b]


class MLAAttention(nn.Module):
    def __init__(self, config: MLAConfig, absorb_max_tokens: int = 16) -> None:
        super().__init__()
        c = config
        self.config = c
        self.absorb_max_tokens = absorb_max_tokens
        h, nh = c.hidden_size, c.num_heads
        if c.q_lora_rank is None:
            self.q_proj = nn.Linear(h, nh * c.qk_head_dim, bias=False)
        else:
            self.q_a_proj = nn.Linear(h, c.q_lora_rank, bias=c.attention_bias)
            self.q_a_layernorm = RMSNorm(c.q_lora_rank, LATENT_NORM_EPS)
            self.q_b_proj = nn.Linear(c.q_lora_rank, nh * c.qk_head_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(h, c.cache_dim, bias=c.attention_bias)
        self.kv_a_layernorm = RMSNorm(c.kv_lora_rank, LATENT_NORM_EPS)
        self.kv_b_proj = nn.Linear(c.kv_lora_rank, nh * (c.qk_nope_head_dim + c.v_head_dim), bias=False)
        self.o_proj = nn.Linear(nh * c.v_head_dim, h, bias=c.attention_bias)
        if c.output_gate:
            self.g_proj = nn.Linear(h, nh, bias=False)
        self.kv_cache: MLACache | None = None
        self.in_proj: torch.Tensor | None = None  # q|kv_a|g weights in one tensor (fuse_projections)
        # How forward and the projections run (impl.model.layer_backends): kernels, or torch.
        init_layer_backends(self)

    def _in_names(self) -> tuple[str, ...]:
        first = "q_proj" if self.config.q_lora_rank is None else "q_a_proj"
        return (first, "kv_a_proj_with_mqa") + (("g_proj",) if self.config.output_gate else ())

    def fuse_projections(self) -> None:
        """The input projections (q or q_a, kv_a, g where there is a gate) as one GEMV for a decode token (impl.model.fused)."""
        self.in_proj = fuse_linears(self, self._in_names())

    def _projections(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """q (after q_b_proj with a q LoRA), kv_a and the gate's pre-activation g of x [..., hidden]
        (None without a gate)."""
        names = self._in_names()
        sizes = [self.get_submodule(n).out_features for n in names]
        q, kv_a, *g = fused_linear(self, names, self.in_proj, x).split(sizes, dim=-1)
        g = g[0] if g else None
        if self.config.q_lora_rank is not None:
            q = self.q_b_proj(self.q_a_layernorm(q))
        return q, kv_a, g

    @classmethod
    def from_hf_config(cls, hf_config, **kwargs) -> "MLAAttention":
        return cls(MLAConfig.from_hf(hf_config), **kwargs)

    def setup_cache(self, max_batch_size: int, max_seq_len: int, dtype=None, device=None) -> MLACache:
        """A zeroed static cache in the weights' dtype and device unless told otherwise."""
        w = self.kv_b_proj.weight
        self.kv_cache = MLACache(max_batch_size, max_seq_len, self.config.kv_lora_rank,
                                 self.config.qk_rope_head_dim, dtype or w.dtype, device or w.device)
        return self.kv_cache

    # The up-projection's two halves as views of kv_b_proj's weight (no copies, so they follow a
    # load_state_dict): W_uk [H, dn, r] and W_uv [H, dv, r].
    def _up_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        c = self.config
        w = self.kv_b_proj.weight.view(c.num_heads, c.qk_nope_head_dim + c.v_head_dim, c.kv_lora_rank)
        return w[:, :c.qk_nope_head_dim], w[:, c.qk_nope_head_dim:]

    def _check(self, x, cos, sin, input_pos, mask) -> None:
        c = self.config
        if x.dim() != 3 or x.shape[-1] != c.hidden_size:
            raise ValueError(f"x must be [batch, seq, hidden={c.hidden_size}], got {tuple(x.shape)}")
        b, t, _ = x.shape
        for name, tab in (("cos", cos), ("sin", sin)):
            if tab.shape != (t, c.qk_rope_head_dim):
                raise ValueError(f"{name} must be [seq={t}, qk_rope_head_dim={c.qk_rope_head_dim}], "
                                 f"got {tuple(tab.shape)}")
        if self.kv_cache is None:
            if input_pos is not None or mask is not None:
                raise ValueError("input_pos and mask are for a cached call; call setup_cache first, "
                                 "or pass None for both (causal attention within x)")
            return
        cb, s, _ = self.kv_cache.kv.shape
        if b > cb:
            raise ValueError(f"batch {b} exceeds the cache's batch {cb}")
        if input_pos is None or input_pos.shape != (t,) or input_pos.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"with a cache, input_pos must be an integer tensor [seq={t}], got "
                             f"{None if input_pos is None else (tuple(input_pos.shape), input_pos.dtype)}")
        if mask is None or mask.shape[-2:] != (t, s):
            raise ValueError(f"with a cache, mask must end in [seq={t}, cache_len={s}] (True = attend), got "
                             f"{None if mask is None else tuple(mask.shape)}")

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                input_pos: torch.Tensor | None, mask: torch.Tensor | None,
                absorb: bool | None = None) -> torch.Tensor:
        """x [B, T, hidden]; cos/sin [T, qk_rope_head_dim] (rows of `mla_rope_tables` at the
        positions); with a cache, input_pos [T] absolute positions and mask [T, S] bool (True =
        attend: cache rows <= input_pos); without one, both None and attention is causal in x."""
        self._check(x, cos, sin, input_pos, mask)
        if absorb is None:
            absorb = x.shape[1] <= self.absorb_max_tokens
        return self.attention_backend.fn(self, x, cos, sin, input_pos, mask, absorb=absorb)

    def forward_kernels(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, input_pos: torch.Tensor | None,
                        mask: torch.Tensor | None, absorb: bool = True) -> torch.Tensor:
        """The absorbed form of one token, or of one sequence's verify tokens, with a cache on CUDA
        through the kernels (`_decode_kernels`); anything else as forward_torch."""
        b, t, _ = x.shape
        if (absorb and (t == 1 or b == 1) and self.kv_cache is not None and x.is_cuda
                and self._kernel_shapes_ok()):
            return self._decode_kernels(*self._projections(x), cos, sin, input_pos)
        return self.forward_torch(x, cos, sin, input_pos, mask, absorb)

    def forward_torch(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, input_pos: torch.Tensor | None,
                      mask: torch.Tensor | None, absorb: bool = True) -> torch.Tensor:
        """The absorbed (`_absorbed`) or expanded (`_expanded`) form through SDPA, in torch ops."""
        c = self.config
        b, t, _ = x.shape
        nh, dn, dr = c.num_heads, c.qk_nope_head_dim, c.qk_rope_head_dim
        path = "mla_absorbed_sdpa" if absorb else "mla_expanded_sdpa"
        backends.note("attention", self.attention_backend.name, path, tokens=t)
        q, kv_a, g = self._projections(x)
        q = q.view(b, t, nh, c.qk_head_dim).transpose(1, 2)
        q_nope, q_rope = q[..., :dn], apply_interleaved_rope(q[..., dn:], cos, sin)

        latent = self.kv_a_layernorm(kv_a[..., :c.kv_lora_rank])
        k_rope = apply_interleaved_rope(kv_a[..., c.kv_lora_rank:].unsqueeze(1), cos, sin).squeeze(1)
        rows = torch.cat((latent, k_rope), dim=-1)  # [B, T, r + dr], one cache row a token

        if self.kv_cache is not None:
            rows = self.kv_cache.update(input_pos, rows)
            attn = dict(attn_mask=mask)
            if t > self.absorb_max_tokens and not (x.is_cuda and torch.cuda.is_current_stream_capturing()):
                rows, attn = self._valid_prefix(rows, mask, input_pos)
        else:
            attn = dict(is_causal=t > 1)
        y = (self._absorbed(q_nope, q_rope, rows, attn) if absorb
             else self._expanded(q_nope, q_rope, rows, attn))  # [B, H, T, dv]

        y = y.transpose(1, 2)
        if g is not None:
            # The head-wise output gate: sigmoid in fp32 of g_proj(x), cast back to the activation
            # dtype, scaling each head's attention output before o_proj.
            y = y * torch.sigmoid(g.float()).to(x.dtype).unsqueeze(-1)
        return linear(y.reshape(b, t, nh * c.v_head_dim), self.o_proj.weight, self.o_proj.bias,
                      self.projection_backend)

    @staticmethod
    def _valid_prefix(rows: torch.Tensor, mask: torch.Tensor, input_pos: torch.Tensor):
        """An eager prompt pass (more tokens than a verify step) attends to the cache rows up to its last position only, not the
        whole static cache (36,864 rows for Ling-3.0-flash: the expanded keys and the mask of a
        long prompt over all of them are gigabytes); a pass from position 0 is plainly causal
        (no mask: SDPA's fused kernels). Reads the positions' ends on the host: not for a
        captured step."""
        first, last = input_pos[[0, -1]].tolist()
        rows = rows[:, :last + 1]
        if first == 0 and last + 1 == input_pos.shape[0]:
            return rows, dict(is_causal=True)
        return rows, dict(attn_mask=mask[..., :last + 1])

    def _absorbed(self, q_nope, q_rope, rows, attn) -> torch.Tensor:
        """The heads share one key/value head (the cache rows), so they are folded into the query
        length: [B, 1, H*T, r + dr] queries against [B, 1, S, r + dr] keys read the cache once. SDPA
        with enable_gqa instead repeats the key head H times when no fused kernel takes a 576-wide
        head (its math path: 32 copies of the cache, about 1.2 GB at 32k tokens)."""
        c = self.config
        b, nh, t, _ = q_nope.shape
        w_uk, w_uv = self._up_weights()
        q_lat = torch.einsum("bhtd,hdr->bhtr", q_nope, w_uk.to(q_nope.dtype))
        query = torch.cat((q_lat, q_rope), dim=-1).reshape(b, 1, nh * t, -1)
        key = rows.unsqueeze(1).to(query.dtype)              # [B, 1, S, r + dr]
        value = key[..., :c.kv_lora_rank]                    # the latents themselves
        mask = attn.get("attn_mask")
        if mask is None:  # causal within x, per head
            mask = torch.ones(t, t, dtype=torch.bool, device=query.device).tril() if attn.get("is_causal") else None
        if mask is not None:
            lead, s = mask.shape[:-2], mask.shape[-1]
            mask = mask.reshape(*lead, 1, t, s).expand(*lead, nh, t, s).reshape(*lead, nh * t, s)
        o_lat = F.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=c.scaling)
        return torch.einsum("bhtr,hvr->bhtv", o_lat.view(b, nh, t, -1), w_uv.to(o_lat.dtype))

    def _kernel_shapes_ok(self) -> bool:
        """The decode kernels' tiles: latent and rope widths powers of two."""
        r, dr = self.config.kv_lora_rank, self.config.qk_rope_head_dim
        return not (r & (r - 1) or dr & (dr - 1))

    def _decode_kernels(self, q, kv_a, g, cos, sin, input_pos) -> torch.Tensor:
        """The absorbed form in four kernels and o_proj: impl.model.mla_absorb's query kernel (the
        latent queries, the cache rows written), impl.model.mla_decode's split-K attention over
        the rows up to each token's position, read once for all heads, and its combine, then
        mla_absorb's output kernel (W_uv, the gate where there is one). For one token of a batch, or the T tokens of
        one sequence's verify step, each a row of the kernels over the one cache (the SDPA form
        reads the whole static cache, masked: at 36,864 rows that made a Ling-3.0-flash verify
        step 40 ms)."""
        from impl.model.mla_absorb import mla_output, mla_query
        from impl.model.mla_decode import mla_decode_attention
        backends.note("attention", self.attention_backend.name,
                      "mla_query_kernel+mla_decode_kernel+mla_output_kernel",
                      heads=self.config.num_heads, kv_lora_rank=self.config.kv_lora_rank)
        c = self.config
        b, t, _ = q.shape
        w_uk, w_uv = self._up_weights()
        cache = self.kv_cache.kv
        query = mla_query(q.reshape(b * t, -1), kv_a.reshape(b * t, -1), w_uk, cos, sin,
                          self.kv_a_layernorm.weight, self.kv_a_layernorm.eps, input_pos, cache)
        # b == 1 with T tokens: the T rows share the cache (batch stride 0), each up to its position.
        kv = cache[:b] if t == 1 else cache[:1].expand(t, *cache.shape[1:])
        # The positions are the step's input, written launches ago: the attention and its combine
        # read them before the query kernel ends.
        o_lat = mla_decode_attention(query, kv, None, c.kv_lora_rank, c.scaling, positions=input_pos)
        y = mla_output(o_lat, None if g is None else g.reshape(b * t, -1), w_uv)
        return linear(y.view(b, t, -1), self.o_proj.weight, self.o_proj.bias, self.projection_backend)

    def _expanded(self, q_nope, q_rope, rows, attn) -> torch.Tensor:
        c = self.config
        b, s, _ = rows.shape
        rows = rows.to(q_nope.dtype)
        kv = self.kv_b_proj(rows[..., :c.kv_lora_rank]).view(b, s, c.num_heads, -1).transpose(1, 2)
        k_nope, v = kv[..., :c.qk_nope_head_dim], kv[..., c.qk_nope_head_dim:]
        k_rope = rows[..., c.kv_lora_rank:].unsqueeze(1).expand(-1, c.num_heads, -1, -1)
        query = torch.cat((q_nope, q_rope), dim=-1)
        key = torch.cat((k_nope, k_rope), dim=-1)
        return F.scaled_dot_product_attention(query, key, v, scale=c.scaling, **attn)


__all__ = ["LATENT_NORM_EPS", "MLAAttention", "MLACache", "MLAConfig", "apply_interleaved_rope",
           "mla_rope_tables"]
