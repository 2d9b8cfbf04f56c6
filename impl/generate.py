"""Batch-1 decoding with a static KV cache: prefill, one-token decode steps, sampling.

The token loop keeps tokens and positions on the device and never reads them back, so a GPU
step can be captured as a CUDA graph; the host syncs once, after the loop.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplingConfig:
    temperature: float = 0.0  # 0 means greedy
    top_k: int | None = None
    top_p: float | None = None

    def __post_init__(self) -> None:
        if not self.temperature >= 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k is not None and self.top_k < 1:
            raise ValueError(f"top_k must be >= 1, got {self.top_k}")
        if self.top_p is not None and not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def filtered_probs(logits: torch.Tensor, sampling: SamplingConfig) -> torch.Tensor:
    """The distribution sampled from: temperature, then top-k, then top-p (nucleus), in fp32."""
    logits = logits.float() / max(sampling.temperature, 1e-5)
    if sampling.top_k is not None and sampling.top_k < logits.shape[-1]:
        kth = torch.topk(logits, sampling.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if sampling.top_p is not None and sampling.top_p < 1:
        sorted_p, order = probs.sort(dim=-1, descending=True)
        # Drop a token when the mass before it already reaches top_p (the first always stays).
        drop = (sorted_p.cumsum(-1) - sorted_p) >= sampling.top_p
        probs = probs.scatter(-1, order, sorted_p.masked_fill(drop, 0.0))
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def sample(logits: torch.Tensor, sampling: SamplingConfig, generator: torch.Generator | None = None) -> torch.Tensor:
    """Next token per row of `logits` [B, V] -> [B]."""
    if sampling.greedy:
        return logits.argmax(dim=-1)
    return torch.multinomial(filtered_probs(logits, sampling), 1, generator=generator).squeeze(-1)


@dataclass
class GenerationResult:
    tokens: torch.Tensor  # [B, prompt + new]
    prompt_len: int
    prefill_s: float
    decode_s: float

    @property
    def new_tokens(self) -> torch.Tensor:
        return self.tokens[:, self.prompt_len:]

    @property
    def decode_tokens_per_s(self) -> float:
        steps = self.new_tokens.shape[1] - 1  # the first new token comes from the prefill
        return steps / self.decode_s if self.decode_s > 0 else float("nan")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.inference_mode()
def generate(model, prompt: torch.Tensor, max_new_tokens: int, sampling: SamplingConfig = SamplingConfig(),
             generator: torch.Generator | None = None) -> GenerationResult:
    """Prefill `prompt` ([T] or [B, T] token ids), then decode `max_new_tokens` tokens."""
    if prompt.dim() == 1:
        prompt = prompt.unsqueeze(0)
    if prompt.dim() != 2 or prompt.shape[1] == 0:
        raise ValueError(f"prompt must be a non-empty [T] or [B, T] tensor of token ids, got {tuple(prompt.shape)}")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    vocab = model.config.vocab_size
    if int(prompt.min()) < 0 or int(prompt.max()) >= vocab:
        raise ValueError(f"prompt token ids must be in [0, {vocab}), got [{int(prompt.min())}, {int(prompt.max())}]")
    batch, t = prompt.shape
    total = t + max_new_tokens
    if total > model.config.max_seq_len:
        raise ValueError(f"prompt ({t}) + max_new_tokens ({max_new_tokens}) = {total} exceeds the cache "
                         f"length {model.config.max_seq_len}")
    device = model.embed_tokens.weight.device
    model.setup_caches(batch, model.config.max_seq_len)
    tokens = torch.empty(batch, total, dtype=torch.long, device=device)
    tokens[:, :t] = prompt.to(device)

    _sync(device)
    start = time.perf_counter()
    logits = model(tokens[:, :t], torch.arange(t, device=device))
    tokens[:, t] = sample(logits[:, -1], sampling, generator)
    _sync(device)
    prefill_s = time.perf_counter() - start

    input_pos = torch.tensor([t], device=device)
    for i in range(t, total - 1):
        logits = model(tokens[:, i:i + 1], input_pos)
        tokens[:, i + 1] = sample(logits[:, -1], sampling, generator)
        input_pos += 1
    _sync(device)
    return GenerationResult(tokens, t, prefill_s, time.perf_counter() - start - prefill_s)
