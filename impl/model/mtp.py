"""The NEXTN (multi-token prediction) layer in the DeepSeek-V3 layout, used as a speculative draft.

At position i it combines the target's last hidden state h_i (before the final norm, or after it
with `config.mtp_normed_hidden`) with the embedding of token i+1 and predicts token i+2:

    x = eh_proj(cat(enorm(embed(t_{i+1})), hnorm(h_i)))      # 2H -> H
    h' = block(x)                                            # one decoder layer, own KV cache
    logits = head(final_norm(h'))                            # final_norm: `shared_head.norm`

Chained drafting feeds h' back in place of h. The embedding and the head are the target's own
modules: the layer keeps plain references to them, not registered submodules, so they are
neither duplicated in the state dict nor copied by anything that walks the layer's children.
`head` must be the very module object the target calls (`mtp.head is target.lm_head`); the
target re-points it whenever it replaces its head (e.g. on FP8 quantization).
"""

from __future__ import annotations

import torch
from torch import nn

from impl import backends
from impl.model.attention import make_attention
from impl.model.config import ModelConfig
from impl.model.layers import DecoderLayer, RMSNorm


class MTPLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_index: int, moe_backend: backends.Backend,
                 embed_tokens: nn.Embedding, head: nn.Module, expert_format: str = "dense") -> None:
        super().__init__()
        h = config.hidden_size
        self.enorm = RMSNorm(h, config.rms_norm_eps)
        self.hnorm = RMSNorm(h, config.rms_norm_eps)
        self.eh_proj = nn.Linear(2 * h, h, bias=False)
        # The checkpoint's layer index decides dense vs MoE (past num_layers: MoE) and the
        # attention kind (past num_layers: config.mtp_attention).
        self.block = DecoderLayer(config, layer_index, moe_backend, make_attention(config, layer_index),
                                  expert_format)
        self.final_norm = RMSNorm(h, config.rms_norm_eps)
        self.share(embed_tokens, head)

    def share(self, embed_tokens: nn.Embedding, head: nn.Module) -> None:
        """Point at the target's embedding and head modules (bypassing nn.Module registration)."""
        object.__setattr__(self, "embed_tokens", embed_tokens)
        object.__setattr__(self, "head", head)

    def hidden(self, prev_hidden: torch.Tensor, next_ids: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
               input_pos: torch.Tensor | None, mask: torch.Tensor | None) -> torch.Tensor:
        """Pre-norm output hidden states [B, T, H] (what a chained next step takes as `prev_hidden`)."""
        e = self.enorm(self.embed_tokens(next_ids))
        x = self.eh_proj(torch.cat((e, self.hnorm(prev_hidden)), dim=-1))
        return self.block(x, cos, sin, input_pos, mask)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.head(self.final_norm(hidden))
