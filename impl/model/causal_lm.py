"""A compact MoE causal LM with static decode state (gpt-fast style: fixed shapes, positions as
device tensors, no host syncs inside forward).

Each layer's attention is of the kind its config names (impl.model.attention): KV caches for
softmax attention, compressed latent caches for MLA, recurrent states for KDA. Position-indexed
caches roll back after a speculative rejection by moving the position pointer alone; recurrent
states cannot, so `keep_verified(count)` picks, for every KDA layer, the state after the first
`count` tokens of the last verify pass (a no-op in a model without recurrent layers)."""

from __future__ import annotations

import torch
from torch import nn

from impl import backends
from impl.head import BF16Head, FP8Head
from impl.model.add_rms_norm import add_rms_norm
from impl.model.attention import make_attention
from impl.model.layer_backends import layer_backend, set_layer_backend
from impl.model.config import ModelConfig
from impl.model.kda import KDAAttention
from impl.model.layers import DecoderLayer, Experts, RMSNorm, rope_tables
from impl.model.mtp import MTPLayer
from impl.speculative.sampling import MAX_K


class MoECausalLM(nn.Module):
    def __init__(self, config: ModelConfig, moe_backend: str = "gather", expert_format: str = "dense") -> None:
        super().__init__()
        self.config = config
        backend = backends.get("moe", moe_backend)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i, backend, make_attention(config, i), expert_format)
                                    for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        # An nn.Linear that runs the "bf16" head backend (provenance); `quantize_head` swaps in FP8.
        self.lm_head = BF16Head(config.hidden_size, config.vocab_size)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        # NEXTN layers (the speculative draft), stored after the decoder layers in checkpoints.
        self.mtp = nn.ModuleList(MTPLayer(config, config.num_layers + j, backend, self.embed_tokens, self.lm_head,
                                          expert_format) for j in range(config.num_mtp_layers))
        cos, sin = rope_tables(config, config.max_seq_len)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        # Cache row indices 0..max_seq_len-1: the causal mask of queries at input_pos is
        # cache_rows <= input_pos, formed per call ([T, S]) rather than stored ([S, S] bool: 1.3 GB
        # at Ling-3.0-flash's 36,864 rows).
        self.register_buffer("cache_rows", None, persistent=False)
        self.cache_batch_size = 0
        self.cache_seq_len = 0
        self.cache_generation = 0  # counts allocations: what a captured step read may be gone
        self._recurrent = [m for m in self.modules() if isinstance(m, KDAAttention)]

    @property
    def moe_backend(self) -> str:
        blocks = [layer.mlp for layer in self.layers if hasattr(layer.mlp, "backend")]
        return blocks[0].backend.name if blocks else "none"

    def set_moe_backend(self, name: str) -> None:
        backend = backends.get("moe", name)
        for layer in [*self.layers, *(m.block for m in self.mtp)]:
            if hasattr(layer.mlp, "backend"):
                layer.mlp.backend = backend

    def layer_backend(self, kind: str) -> str:
        """The backend part `kind` ("attention", "projection") of the KDA and MLA layers runs
        through (impl.model.layer_backends); "none" for a model without them."""
        return layer_backend(self, kind)

    def set_layer_backend(self, kind: str, name: str) -> None:
        set_layer_backend(self, kind, name)

    @property
    def head_kind(self) -> str:
        """'fp8' when the LM head is an FP8Head, else 'bf16' (the unquantized head, whatever its dtype)."""
        return "fp8" if isinstance(self.lm_head, FP8Head) else "bf16"

    def quantize_head(self, granularity: str = "row", backend: str = "triton",
                      out_dtype: torch.dtype | None = None) -> FP8Head:
        """Replace the LM head by an FP8Head quantized from it (e4m3 data + fp32 scales per row or
        per tensor, owned by the module); logits keep the hidden states' dtype unless `out_dtype`.
        Returns the new head: share that module (never its tensors) with anything that needs it."""
        if isinstance(self.lm_head, FP8Head):
            raise ValueError(f"the LM head is already FP8 ({self.lm_head.extra_repr()}); "
                             "build the model again to quantize it differently")
        return self.set_head(FP8Head.from_linear(self.lm_head, granularity=granularity, backend=backend,
                                                 out_dtype=out_dtype))

    def set_head(self, head: nn.Module) -> nn.Module:
        """Make `head` the LM head and point every MTP layer at that module: the draft must hold
        the target's head itself, also when a head is swapped back (e.g. after a quantized trial)."""
        self.lm_head = head
        for mtp in self.mtp:
            mtp.share(self.embed_tokens, head)
        return head

    @torch.no_grad()
    def init_weights(self, generator: torch.Generator | None = None, std: float = 0.02,
                     expert_generator: torch.Generator | None = None) -> "MoECausalLM":
        """Random weights for shape-faithful benchmarking; norms at 1, biases at 0. MXFP4 experts
        are drawn from `expert_generator` (on the device, a chunk at a time: a full model's experts
        would not fit unquantized), the rest from `generator` (on the host)."""
        for name, p in self.named_parameters():
            if name.endswith("norm.weight") or name.endswith("layernorm.weight"):
                p.fill_(1.0)
            elif name.endswith(".bias"):
                p.zero_()
            else:
                p.copy_(torch.randn(p.shape, generator=generator) * std)
        for module in self.modules():
            if isinstance(module, Experts) and module.format == "mxfp4":
                module.init_random(expert_generator, std, self.embed_tokens.weight.dtype)
        return self

    def setup_caches(self, max_batch_size: int, max_seq_len: int) -> None:
        if not 1 <= max_seq_len <= self.config.max_seq_len:
            raise ValueError(f"cache length must be in [1, {self.config.max_seq_len}] "
                             f"(the model's max_seq_len), got {max_seq_len}")
        if self.cache_batch_size == max_batch_size and self.cache_seq_len == max_seq_len:
            return
        p = self.embed_tokens.weight
        for layer in [*self.layers, *(m.block for m in self.mtp)]:
            attn = layer.self_attn
            if isinstance(attn, KDAAttention):
                # The speculative decoder's largest verify pass is MAX_K + 1 tokens.
                attn.setup_cache(max_batch_size, max_seq_len, p.dtype, p.device, verify_tokens=MAX_K + 1)
            else:
                attn.setup_cache(max_batch_size, max_seq_len, p.dtype, p.device)
        self.cache_rows = torch.arange(max_seq_len, device=p.device)
        self.cache_batch_size, self.cache_seq_len = max_batch_size, max_seq_len
        self.cache_generation += 1

    def keep_verified(self, count: torch.Tensor) -> None:
        """After a verify pass over T tokens, keep the recurrent states after its first `count`
        (a device tensor [1], 1..T); KV and latent caches need nothing (module docstring)."""
        for attn in self._recurrent:
            attn.keep_verified(count)

    def _check_inputs(self, input_ids: torch.Tensor, input_pos: torch.Tensor | None) -> None:
        if input_ids.dim() != 2 or input_ids.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"input_ids must be an int tensor [batch, seq], got {input_ids.dtype} "
                             f"{tuple(input_ids.shape)}")
        if input_ids.device != self.embed_tokens.weight.device:
            raise ValueError(f"input_ids are on {input_ids.device}, the model on {self.embed_tokens.weight.device}")
        if self.cache_seq_len:
            if input_pos is None or input_pos.shape != (input_ids.shape[1],):
                raise ValueError(f"with a KV cache, input_pos must be [seq={input_ids.shape[1]}], got "
                                 f"{None if input_pos is None else tuple(input_pos.shape)}")
            if input_ids.shape[0] > self.cache_batch_size:
                raise ValueError(f"batch {input_ids.shape[0]} exceeds the cache's {self.cache_batch_size}")
        elif input_ids.shape[1] > self.config.max_seq_len:
            raise ValueError(f"sequence of {input_ids.shape[1]} exceeds max_seq_len {self.config.max_seq_len}")

    def positions(self, t: int, input_pos: torch.Tensor | None):
        """(cos, sin, mask) for `t` tokens at `input_pos` (with caches) or at 0..t-1 (without)."""
        if self.cache_seq_len:
            return (self.rope_cos[input_pos], self.rope_sin[input_pos],
                    self.cache_rows[None, :] <= input_pos[:, None])
        return self.rope_cos[:t], self.rope_sin[:t], None

    def _stream(self, input_ids: torch.Tensor, input_pos: torch.Tensor | None, rope: tuple | None
                ) -> tuple[torch.Tensor | None, torch.Tensor]:
        """(the last layer's MLP output, the residual stream before it): their sum is the last
        decoder layer's output (DecoderLayer.streamed)."""
        self._check_inputs(input_ids, input_pos)
        cos, sin, mask = rope or self.positions(input_ids.shape[1], input_pos)
        delta, residual = None, self.embed_tokens(input_ids)
        for layer in self.layers:
            delta, residual = layer.streamed(delta, residual, cos, sin, input_pos, mask)
        return delta, residual

    def last_hidden_states(self, input_ids: torch.Tensor, input_pos: torch.Tensor | None = None,
                           rope: tuple | None = None) -> torch.Tensor:
        """The last decoder layer's output [B, T, H], before the final norm (what MTP layers take).
        `rope`: `positions(T, input_pos)` when the caller already has it (a speculative step shares
        one lookup between its draft and verify passes)."""
        delta, residual = self._stream(input_ids, input_pos, rope)
        return residual if delta is None else residual + delta

    def hidden_states(self, input_ids: torch.Tensor, input_pos: torch.Tensor | None = None) -> torch.Tensor:
        """Final-norm hidden states [B, T, H]; with caches, `input_pos` are the absolute positions."""
        return add_rms_norm(*self._stream(input_ids, input_pos, None), self.norm)[0]

    def forward_with_hidden(self, input_ids: torch.Tensor, input_pos: torch.Tensor | None = None,
                            rope: tuple | None = None, last_logits: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """(logits, the hidden states the MTP layers take): one pass feeding both the sampler and
        the draft. Those are the last layer's output before the final norm, or after it where the
        config says so (`mtp_normed_hidden`: Ling's NEXTN layer is fed the normed states).
        `last_logits`: logits of the last position only ([B, 1, V]; a prefill's)."""
        normed, last = add_rms_norm(*self._stream(input_ids, input_pos, rope), self.norm)
        return (self.lm_head(normed[:, -1:] if last_logits else normed),
                normed if self.config.mtp_normed_hidden else last)

    def forward(self, input_ids: torch.Tensor, input_pos: torch.Tensor | None = None,
                last_logits: bool = False) -> torch.Tensor:
        """Logits [B, T, V], or [B, 1, V] of the last position with `last_logits` (a prefill needs
        no more: at 32k tokens of a 157k vocabulary all of them would be 10 GB)."""
        hidden = self.hidden_states(input_ids, input_pos)
        return self.lm_head(hidden[:, -1:] if last_logits else hidden)
