"""Small pieces that several test modules share; import them as `tests.helpers`. Fixtures that
several modules use are in tests/conftest.py. No test module imports another test module.

The other support modules beside it, each for one area:

- pytester_runs.py: how an inner pytest session runs, and the synthetic gate suites it runs;
- moe_cases.py: MoE kernel inputs (weights, routing, shared expert) and the run against the oracle;
- decode_parity.py: decode and NEXTN parity of a checkpoint against transformers;
- gsm8k_checkpoint.py, ling_checkpoint.py, broken_checkpoints.py: checkpoints built for a test;
- planted_kernels.py: planted GPU kernel defects (it also runs as a script)."""

from __future__ import annotations

import weakref

from dataclasses import dataclass

import torch

from impl.data.text import ByteTokenizer
from impl.serve.engine import EngineRow

__all__ = ["ByteTokenizer", "MAX_TOKENS", "Request", "assert_rows_close", "byte_tokenizer", "echo_draft_",
           "engine_row", "rel_err", "rel_rows", "request", "serve"]


# --- relative errors ----------------------------------------------------------------------------
# In float64 on the CPU whatever the inputs' dtype and device: the error of a bf16 or fp8 result is
# measured, not the rounding of the measurement itself.

def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    """||got - want|| / ||want|| over the whole tensor."""
    got, want = got.detach().double().cpu(), want.detach().double().cpu()
    return ((got - want).norm() / want.norm()).item()


def rel_rows(got: torch.Tensor, want: torch.Tensor) -> torch.Tensor:
    """||got - want|| / ||want|| along the last dimension (per token row, or per position)."""
    got, want = got.detach().double().cpu(), want.detach().double().cpu()
    return (got - want).norm(dim=-1) / want.norm(dim=-1)


def assert_rows_close(got: torch.Tensor, want: torch.Tensor, tol: float, what: str = "output") -> None:
    """Every row's relative error within `tol` (a NaN row fails)."""
    assert got.shape == want.shape, f"{what}: shape {tuple(got.shape)}, expected {tuple(want.shape)}"
    rel = rel_rows(got, want)
    bad = ~(rel <= tol)
    assert not bad.any(), (f"{what}: relative error per row {[f'{e:.3g}' for e in rel.flatten().tolist()]} "
                           f"exceeds {tol:g} in rows {bad.nonzero().tolist()}")


# --- serving requests on the byte-level tiny models -----------------------------------------------

MAX_TOKENS = 40


@dataclass(frozen=True)
class Request:
    """The fields of impl.data.workloads.Request that the serving engine reads, and no stop logic
    of its own: the engine's stop handling is what the tests check."""
    request_id: str
    prompt: str
    prompt_ids: list
    answer: str | None
    max_tokens: int
    stop: tuple = ()
    ignore_eos: bool = False


def request(prompt: str, max_tokens: int = MAX_TOKENS, rid: str | None = None, **kw) -> Request:
    """A request for an ASCII `prompt` (the tiny models are byte-level: an id is a byte)."""
    return Request(rid or prompt[-24:], prompt, list(prompt.encode("ascii")), None, max_tokens, **kw)


def byte_tokenizer(eos_id: int | None = None) -> ByteTokenizer:
    """impl's byte tokenizer of the tiny models (128 ids), with an EOS token if `eos_id` is given
    (the tiny models have none: a test plants one to see the engine stop on it)."""
    tok = ByteTokenizer()
    tok.eos_id = eos_id
    return tok


_rows: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def engine_row(built) -> EngineRow:
    """One EngineRow per row, kept while the row lives, so its captured steps and provenance carry
    over from request to request as in a ladder."""
    row = _rows.get(built)
    if row is None:
        row = _rows[built] = EngineRow(built)
    return row


def serve(built, request):
    """What `row` serves for `request` (impl.serve.result.ServedRequest)."""
    return engine_row(built).serve(request)


# --- speculative decoding ------------------------------------------------------------------------

def echo_draft_(model):
    """`model` with an "echo" MTP draft, in place: eh_proj passes the target's hidden state
    through and the block is zeroed to an identity, so the draft re-predicts the target's current
    next token and is accepted exactly where the target repeats itself (random MTP weights almost
    never guess the target)."""
    mtp = model.mtp[0]
    h = model.config.hidden_size
    with torch.no_grad():
        mtp.eh_proj.weight.copy_(torch.cat((torch.zeros(h, h), torch.eye(h)), dim=1))
        mtp.block.self_attn.o_proj.weight.zero_()
        mtp.block.mlp.experts.down_proj.zero_()
        mtp.block.mlp.shared_experts.down_proj.weight.zero_()
    return model
