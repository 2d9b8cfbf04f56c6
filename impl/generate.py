"""Decoding with a static KV cache: prefill, one-token decode steps, sampling, and `generate`, the
eager reference loop the parity tests compare against.

The token loop keeps tokens and positions on the device and never reads them back, so a GPU
step can be captured as a CUDA graph (impl.decode_runner does, for every decode measurement); the
host syncs once, after the loop. `next_token` is the registered `decoder:plain` backend.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

import torch

from impl import backends


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


@dataclass
class DecodeState:
    """Device state of a batch of generations: a decode step reads and writes it in place, so the
    step can be replayed from a CUDA graph."""

    tokens: torch.Tensor  # [B, capacity]
    pos: torch.Tensor  # [1] int64: position of the last committed token, the next step's input


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def check_prompt(model, prompt: torch.Tensor, max_new_tokens: int, reserve: int = 0,
                 reserve_name: str = "k") -> torch.Tensor:
    """`prompt` as [B, T] after checking it fits the model (vocab) and its cache, with `reserve`
    positions (named `reserve_name` in the error) written past the last token."""
    if prompt.dim() == 1:
        prompt = prompt.unsqueeze(0)
    if prompt.dim() != 2 or prompt.shape[1] == 0:
        raise ValueError(f"prompt must be a non-empty [T] or [B, T] tensor of token ids, got {tuple(prompt.shape)}")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    vocab = model.config.vocab_size
    if int(prompt.min()) < 0 or int(prompt.max()) >= vocab:
        raise ValueError(f"prompt token ids must be in [0, {vocab}), got [{int(prompt.min())}, {int(prompt.max())}]")
    t = prompt.shape[1]
    if t + max_new_tokens + reserve > model.config.max_seq_len:
        extra = f" + {reserve_name} ({reserve})" if reserve else ""
        raise ValueError(f"prompt ({t}) + max_new_tokens ({max_new_tokens}){extra} = {t + max_new_tokens + reserve} "
                         f"exceeds the cache length {model.config.max_seq_len}")
    return prompt


@torch.inference_mode()
def prefill(model, prompt: torch.Tensor, max_new_tokens: int, sampling: SamplingConfig = SamplingConfig(),
            generator: torch.Generator | None = None, state: DecodeState | None = None) -> DecodeState:
    """Run the prompt through the model and pick the first new token; `state`, if given, is reused
    in place (a captured decode step keeps reading the same buffers) and must have the run's shape."""
    prompt = check_prompt(model, prompt, max_new_tokens)
    batch, t = prompt.shape
    device = model.embed_tokens.weight.device
    if state is not None and state.tokens.shape != (batch, t + max_new_tokens):
        # A captured step reads the given buffers: replacing them would go unnoticed there.
        raise ValueError(f"the given DecodeState holds tokens of shape {tuple(state.tokens.shape)}, this "
                         f"generation needs {(batch, t + max_new_tokens)}")
    # Caches as long as a given state (a runner's capacity), else the model's context.
    model.setup_caches(batch, model.config.max_seq_len if state is None else state.tokens.shape[1])
    if state is None:
        state = DecodeState(torch.empty(batch, t + max_new_tokens, dtype=torch.long, device=device),
                            torch.zeros(1, dtype=torch.long, device=device))
    state.tokens[:, :t] = prompt.to(device)
    logits = model(state.tokens[:, :t], torch.arange(t, device=device), last_logits=True)
    state.tokens[:, t] = sample(logits[:, -1], sampling, generator)
    state.pos.fill_(t)
    return state


def next_token(model, ids: torch.Tensor, pos: torch.Tensor, sampling: SamplingConfig = SamplingConfig(),
               generator: torch.Generator | None = None) -> torch.Tensor:
    """The token after `ids` [B, 1] at position `pos` [1] for every row -> [B]: the target's forward
    over one token, then sampling."""
    return sample(model(ids, pos)[:, -1], sampling, generator)


def decode_step(model, state: DecodeState, sampling: SamplingConfig = SamplingConfig(),
                generator: torch.Generator | None = None, decode: Callable = next_token) -> None:
    """One token for every row: no host sync, static shapes. `decode`: how the token is made
    (impl.decode_runner passes the registered `decoder:plain` backend)."""
    token = decode(model, state.tokens.index_select(1, state.pos), state.pos, sampling, generator)
    state.tokens.index_copy_(1, state.pos + 1, token[:, None])
    state.pos += 1


backends.register(backends.Backend(
    "decoder", "plain", next_token, "one plain decode step: the target's forward over the last token, then sampling"))


@torch.inference_mode()
def generate(model, prompt: torch.Tensor, max_new_tokens: int, sampling: SamplingConfig = SamplingConfig(),
             generator: torch.Generator | None = None) -> GenerationResult:
    """Prefill `prompt` ([T] or [B, T] token ids), then decode `max_new_tokens` tokens."""
    device = model.embed_tokens.weight.device
    _sync(device)
    start = time.perf_counter()
    state = prefill(model, prompt, max_new_tokens, sampling, generator)
    _sync(device)
    prefill_s = time.perf_counter() - start
    for _ in range(max_new_tokens - 1):
        decode_step(model, state, sampling, generator)
    _sync(device)
    t = state.tokens.shape[1] - max_new_tokens
    return GenerationResult(state.tokens, t, prefill_s, time.perf_counter() - start - prefill_s)
