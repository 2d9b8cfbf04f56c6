"""Plain and speculative greedy decoding as fixed runs of captured steps, for measuring tokens/s
the way a serving loop runs: one CUDA graph per step on a GPU (plain calls on CPU), no host
synchronization between steps. `reset()` restores the state a run starts from (prefill, and for
speculation its first step, whose draft spans the whole prompt); `run()` replays the steps;
`new_tokens()` reads what the run committed.
"""

from __future__ import annotations

import torch

from impl.generate import decode_step, prefill
from impl.graphs import StepGraph
from impl.speculative.decoder import SpeculativeDecoder


def _checked_steps(steps: int | None, capacity: int) -> int:
    if steps is None:
        return capacity
    if not 0 <= steps <= capacity:
        raise ValueError(f"steps must be in [0, {capacity}] (the run's length), got {steps}")
    return steps


class GraphedDecoding:
    """`steps` plain greedy decode steps after a prompt."""

    def __init__(self, model, prompt: torch.Tensor, steps: int) -> None:
        self.model, self.prompt, self.steps = model, prompt, steps
        self.state = prefill(model, prompt, steps + 1)
        self.graph = StepGraph(lambda: decode_step(model, self.state), model.embed_tokens.weight.device)

    def reset(self) -> None:
        prefill(self.model, self.prompt, self.steps + 1, state=self.state)

    def run(self, steps: int | None = None) -> None:
        """Replay `steps` (at most the run's length; default all of them) decode steps."""
        for _ in range(_checked_steps(steps, self.steps)):
            self.graph()

    def new_tokens(self) -> torch.Tensor:
        """[steps + 1]: the prefill's token and one per step of a whole run."""
        return self.state.tokens[0, self.state.tokens.shape[1] - self.steps - 1:].cpu()


class GraphedSpeculation:
    """`steps` speculative steps (draft k, verify k+1) after a prompt and one eager first step."""

    def __init__(self, decoder: SpeculativeDecoder, prompt: torch.Tensor, steps: int) -> None:
        if not decoder.sampling.greedy:
            raise ValueError("GraphedSpeculation runs greedy decoding (sampling would need a graph-safe generator)")
        self.decoder, self.prompt, self.steps = decoder, prompt, steps
        # Each step commits at most k+1 tokens; the first (eager) one too.
        self.max_new = (steps + 1) * (decoder.k + 1) + 1
        self.state = decoder.start(prompt, self.max_new)
        with torch.inference_mode():
            decoder.step(self.state)
        self.span = self.state.span  # [1, k+1, ...]: the buffers the captured step reads and rewrites
        self.graph = StepGraph(self._step, decoder.target.embed_tokens.weight.device)
        self.start_n = 0

    def _step(self) -> None:
        self.decoder.step(self.state)
        self.span.copy_(self.state.span)
        self.state.span = self.span

    @torch.inference_mode()
    def reset(self) -> None:
        self.decoder.start(self.prompt, self.max_new, state=self.state)
        self.decoder.step(self.state)
        self.span.copy_(self.state.span)
        self.state.span = self.span
        self.start_n = int(self.state.n)

    def run(self, steps: int | None = None) -> None:
        """Replay `steps` (at most the run's length; default all of them) speculative steps."""
        for _ in range(_checked_steps(steps, self.steps)):
            self.graph()

    def parts(self) -> dict[str, StepGraph]:
        """The step's two big parts as separately replayable steps, to explain its cost: the k
        draft passes, and the target's verify pass over k+1 positions. Each rewrites the same
        cache entries and leaves the committed state alone, so replaying them changes nothing."""
        device = self.decoder.target.embed_tokens.weight.device
        with torch.inference_mode():
            draft = self.decoder.draft_tokens(self.state)[0]
        return {"draft (k passes)": StepGraph(lambda: self.decoder.draft_tokens(self.state), device),
                "verify (k+1 positions)": StepGraph(lambda: self.decoder.verify_pass(self.state, draft), device)}

    def committed(self) -> int:
        """Tokens committed by the last `run()` (one host read)."""
        return int(self.state.n) - self.start_n

    def new_tokens(self) -> torch.Tensor:
        """Every token committed after the prompt, the first step's included."""
        return self.state.tokens[0, self.state.prompt_len:int(self.state.n)].cpu()
