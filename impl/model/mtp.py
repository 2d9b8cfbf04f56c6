"""The NEXTN (multi-token prediction) layer in the DeepSeek-V3 layout, used as a speculative draft.

At position i it combines the target's last hidden state h_i (after the final norm with
`config.mtp_normed_hidden`, as the published checkpoints' own modeling code, vLLM and SGLang feed
it; before it otherwise, as this project's tiny-gsm was trained) with the embedding of token i+1
and predicts token i+2:

    x = eh_proj(cat(enorm(embed(t_{i+1})), hnorm(h_i)))      # 2H -> H
    h' = block(x)                                            # one decoder layer, own KV cache
    logits = head(final_norm(h'))                            # final_norm: `shared_head.norm`

Chained drafting feeds h' back in place of h, normed as h was: final_norm(h') where the layer
takes normed states (feeding it the block's raw output there lowered acceptance on a DeepSeek-R1
MXFP4 checkpoint, 2.84 -> 2.94 tokens a step once fixed, ROCm/ATOM#1764). The embedding and the head are the target's own
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
        self.normed_hidden = config.mtp_normed_hidden
        self.share(embed_tokens, head)

    def share(self, embed_tokens: nn.Embedding, head: nn.Module) -> None:
        """Point at the target's embedding and head modules (bypassing nn.Module registration)."""
        object.__setattr__(self, "embed_tokens", embed_tokens)
        object.__setattr__(self, "head", head)

    def hidden(self, prev_hidden: torch.Tensor, next_ids: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
               input_pos: torch.Tensor | None, mask: torch.Tensor | None) -> torch.Tensor:
        """Output hidden states [B, T, H], what a chained next step takes as `prev_hidden`: after the
        final norm where the layer takes normed states (`normed_hidden`), before it otherwise."""
        e = self.enorm(self.embed_tokens(next_ids))
        x = self.eh_proj(torch.cat((e, self.hnorm(prev_hidden)), dim=-1))
        out = self.block(x, cos, sin, input_pos, mask)
        return self.final_norm(out) if self.normed_hidden else out

    def head_input(self, hidden: torch.Tensor) -> torch.Tensor:
        """What the head takes of `hidden` as `hidden` returns it: the final norm's output."""
        return hidden if self.normed_hidden else self.final_norm(hidden)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.head(self.head_input(hidden))
