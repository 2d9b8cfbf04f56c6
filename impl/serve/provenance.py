"""What actually ran for a row, and the check that it is what the row's name and configuration say.

Two sources, both needed:

* Backend provenance events (impl.backends.note) recorded during each request: which MoE,
  attention, projection and head kernels the target ran (prefill, decode or verify steps) and
  which the draft ran. A step
  replayed from a CUDA graph runs no Python and so records nothing; its events are the ones
  recorded while that graph was captured (what the graph replays), added for every request that
  replayed it (`RowProvenance.graphs` says so).
* The objects: the head module's class and scales, and for speculative rows whether the draft's
  head *is* the target's head module, or a different module that shares (only) its tensors.

The trap this exists for: a `+mtp` row whose draft holds the FP8 head's weight tensor but not the
module (a copy around the same tensor, or a bf16 path reading the e4m3 bytes without their
scales). Every flag still says MTP and FP8 are on; the draft drafts from a different function and
the accept length collapses. `check_provenance` refuses such a row by name.

`unshared_head_row` builds exactly that defective built, for negative controls only.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from impl.serve.rows import ServeConfig, preset_mismatch

__all__ = ["ProvenanceError", "RowProvenance", "check_provenance", "provenance_problems", "unshared_head_row"]

Event = tuple[str, str, str]  # (kind, backend, kernel)


class ProvenanceError(AssertionError):
    """A row whose provenance contradicts its name or configuration."""


def _tensor_ptrs(obj) -> set[int]:
    if isinstance(obj, torch.Tensor):
        return {obj.data_ptr()}
    if isinstance(obj, nn.Module):
        return {t.data_ptr() for t in (*obj.parameters(), *obj.buffers())}
    return set()


def _sharing(draft_head, head) -> str:
    if draft_head is head:
        return "same module"
    ours, theirs = _tensor_ptrs(draft_head), _tensor_ptrs(head)
    if not ours & theirs:
        return "no tensors"
    return "all tensors" if theirs <= ours else "some tensors"


@dataclass
class RowProvenance:
    """What ran over the requests of one row. Sets hold every value observed, so a row whose
    state changed between requests shows both."""

    name: str
    device: str
    expert_format: str
    graphs: bool = False  # decode/verify steps replayed from CUDA graphs
    requests: int = 0
    moe: set[tuple[str, str]] = field(default_factory=set)  # (backend, kernel), target and draft
    # Attention decode kernels that ran (impl.model.kda / mla), target and draft
    attention: set[tuple[str, str]] = field(default_factory=set)
    # KDA/MLA projections that ran (impl.model.gemv's backends: the GEMV kernel or F.linear), target and draft
    projection: set[tuple[str, str]] = field(default_factory=set)
    head: set[tuple[str, str]] = field(default_factory=set)  # the target's head calls
    draft_head: set[tuple[str, str]] = field(default_factory=set)  # the draft's head calls
    head_class: set[str] = field(default_factory=set)
    head_scales: set[str] = field(default_factory=set)  # FP8 heads' granularity
    speculative: bool = False
    draft_head_class: set[str] = field(default_factory=set)
    draft_head_is_target_head: set[bool] = field(default_factory=set)
    # How the draft's head relates to the target's: "same module", or a different module sharing
    # "all tensors" (a copy around the same storage), "some tensors" (e.g. the weight without
    # the scales) or "no tensors".
    draft_head_sharing: set[str] = field(default_factory=set)
    drafts_per_step: set[int] = field(default_factory=set)
    verify_steps: int = 0

    def observe(self, built, target: set[Event], draft: set[Event], verify_steps: int) -> None:
        """Add one request: the events its target and draft recorded, and the row's objects now."""
        from impl.head import FP8Head
        self.requests += 1
        for kind, backend, kernel in (*target, *draft):
            if kind == "moe":
                self.moe.add((backend, kernel))
            elif kind in ("attention", "projection"):
                getattr(self, kind).add((backend, kernel))
        self.head |= {(b, k) for kind, b, k in target if kind == "head"}
        self.draft_head |= {(b, k) for kind, b, k in draft if kind == "head"}
        head = built.model.lm_head
        self.head_class.add(type(head).__name__)
        if isinstance(head, FP8Head):
            self.head_scales.add(head.granularity)
        if built.decoder is not None:
            self.speculative = True
            dhead = getattr(built.decoder.draft, "head", None)
            self.draft_head_class.add(type(dhead).__name__)
            self.draft_head_is_target_head.add(dhead is head)
            self.draft_head_sharing.add(_sharing(dhead, head))
            self.drafts_per_step.add(built.decoder.k)
            self.verify_steps += verify_steps

    def backends(self, part: str) -> set[str]:
        return {b for b, _ in getattr(self, part)}

    def as_dict(self) -> dict:
        """JSON-ready: sets as sorted lists, event pairs as "backend:kernel"."""
        out = {}
        for key, value in vars(self).items():
            if isinstance(value, set):
                value = sorted(f"{v[0]}:{v[1]}" if isinstance(v, tuple) else v for v in value)
            out[key] = value
        return out


def provenance_problems(name: str, config: ServeConfig, prov: RowProvenance) -> list[str]:
    """Each part of row `name` (configuration `config`) that provenance shows is not what ran."""
    problems = []
    mismatch = preset_mismatch(name, config, prov.device)
    if mismatch:
        problems.append(mismatch)
    if not prov.requests:
        return problems + [f"{name}: no request ran, so nothing shows what this row runs"]
    moe = prov.backends("moe")
    if moe != {config.moe}:
        problems.append(f"moe: the row names the {config.moe!r} MoE backend but "
                        + (f"{sorted(moe)} ran (kernels {sorted(k for _, k in prov.moe)})" if moe
                           else "no MoE call was recorded (a backend calls impl.backends.note('moe', NAME, "
                                "KERNEL) each time it runs)"))
    if config.experts not in ("auto", prov.expert_format):
        problems.append(f"experts: the row names {config.experts} experts, the model holds {prov.expert_format}")
    head = prov.backends("head")
    if head != {config.head_backend}:
        fallback = " (a fallback to the unquantized head)" if config.head == "fp8" and "bf16" in head else ""
        problems.append(f"head: the row names the {config.head_backend!r} head backend but the target's head ran "
                        f"{sorted(head) or 'nothing recorded'}{fallback}")
    want_class = "FP8Head" if config.head == "fp8" else None
    if want_class and prov.head_class != {want_class}:
        problems.append(f"head: the row names an FP8 head but the model's head was {sorted(prov.head_class)}")
    if config.head == "bf16" and "FP8Head" in prov.head_class:
        problems.append("head: the row names the bf16 head but the model's head was an FP8Head")
    problems += _layer_problems(config, prov)
    if config.head == "fp8" and prov.head_scales != {config.head_scales}:
        problems.append(f"head_scales: the row names {config.head_scales} scales, the head had "
                        f"{sorted(prov.head_scales)}")
    label = name if config.speculative else "spec"
    if not config.speculative:
        if prov.speculative or prov.draft_head:
            problems.append("spec: the row has speculation off but a draft ran")
        return problems
    if not prov.speculative:
        return problems + [f"{label}: the row names MTP speculation but no draft was attached"]
    if prov.draft_head_is_target_head != {True}:
        sharing = prov.draft_head_sharing - {"same module"}
        what = ("only its weight tensor is shared, without its scales" if "some tensors" in sharing
                else "only its weight tensor(s) are shared: another module object around the same storage"
                if "all tensors" in sharing else "it shares no tensor with it: a copy or another head")
        problems.append(
            f"{label}: the draft's head is a different module from the target's ({what}; draft head "
            f"{sorted(prov.draft_head_class)}, target head {sorted(prov.head_class)}). The draft must hold the "
            f"target's head module itself (draft.head is target.lm_head): an FP8 head's e4m3 data means "
            f"nothing without its scales and kernel, and the accept length collapses")
    if prov.draft_head and prov.draft_head != prov.head:
        problems.append(f"{label}: the draft's head ran {sorted(f'{b}:{k}' for b, k in prov.draft_head)}, the "
                        f"target's {sorted(f'{b}:{k}' for b, k in prov.head)}")
    if not prov.draft_head:
        problems.append(f"{label}: the draft's head recorded no head kernel (the target's ran "
                        f"{sorted(f'{b}:{k}' for b, k in prov.head)}): it is not a registered head backend")
    if prov.drafts_per_step != {config.k}:
        problems.append(f"{label}: the row names k={config.k} drafts per step, the decoder drafted "
                        f"{sorted(prov.drafts_per_step)}")
    if not prov.verify_steps:
        problems.append(f"{label}: no verify step ran (every request ended at its first token)")
    return problems


def _layer_problems(config: ServeConfig, prov: RowProvenance) -> list[str]:
    """Per part of the KDA/MLA layers (attention, projection): the row's backend ran, and on CUDA a
    kernel backend's kernels ran, not only its fallbacks (a model without such layers notes nothing)."""
    from impl.model.layer_backends import DEFAULTS, FALLBACKS
    problems = []
    for kind, named in config.layer_backends().items():
        events = getattr(prov, kind)
        ran = {b for b, _ in events}
        if not ran:
            continue
        kernels = sorted({k for _, k in events})
        if ran != {named}:
            problems.append(f"{kind}: the row names the {named!r} {kind} backend but {sorted(ran)} ran "
                            f"(kernels {kernels})")
        elif named == DEFAULTS[kind] and prov.device == "cuda" and set(kernels) <= set(FALLBACKS[kind]):
            problems.append(f"{kind}: the row names the {named} {kind} kernels but only their fallback ran "
                            f"({kernels}): no decode step took the kernels")
    return problems


def check_provenance(name: str, config: ServeConfig, prov: RowProvenance) -> None:
    """Raise ProvenanceError naming every part of the row that is not active."""
    problems = provenance_problems(name, config, prov)
    if problems:
        raise ProvenanceError(f"row {name!r} ({config.spec_text()}) is not what it says:\n  " + "\n  ".join(problems))


# ------------------------------------------------------------------ negative control (tests only)

class _DraftWithHead:
    """The model's MTP layer with a head of its own instead of the target's: what a draft that was
    handed a head's tensors rather than its module amounts to."""

    def __init__(self, mtp: nn.Module, head: nn.Module) -> None:
        self.mtp, self.head = mtp, head

    def hidden(self, *args):
        return self.mtp.hidden(*args)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.head(self.mtp.head_input(hidden))


class _BytesAsValues(nn.Module):
    """A head holding only the FP8 head's e4m3 weight tensor (the same tensor object) and reading
    it as plain values, without the scales: the silent misuse the sharing contract exists for."""

    def __init__(self, data: torch.Tensor) -> None:
        super().__init__()
        self.register_buffer("weight", data)  # the very tensor the FP8 head owns, not a copy

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight.to(x.dtype))


def unshared_head_row(built, mode: str = "weight"):
    """A copy of speculative built row `built` (sharing its model) whose draft holds a different head module
    around the target head's own tensors, for negative controls:

    * "weight": only the weight tensor (for an FP8 head, its e4m3 data read without scales; for a
      bf16 head, a new linear module around the same weight parameter);
    * "copy": a shallow copy of the head module (same tensors, same kernel, another object).

    The decoder is built with the contract check off, which only negative controls may do."""
    from impl.head import BF16Head, FP8Head
    from impl.speculative import SpeculativeDecoder
    from impl.serve.built_row import BuiltRow

    if built.decoder is None:
        raise ValueError(f"built {built.name!r} is not speculative: there is no draft to give a head")
    head = built.head
    if mode == "copy":
        bad = copy.copy(head)
    elif mode == "weight":
        if isinstance(head, FP8Head):
            bad = _BytesAsValues(head.fp8_weight.data)
        else:
            bad = BF16Head(head.in_features, head.out_features, device=head.weight.device, dtype=head.weight.dtype)
            bad.weight = head.weight
    else:
        raise ValueError(f"mode must be 'weight' or 'copy', got {mode!r}")
    model = built.model
    draft = _DraftWithHead(model.mtp[0], bad)
    decoder = SpeculativeDecoder(model, built.config.k, built.config.sampling, draft=draft, require_shared_head=False)
    return BuiltRow(built.name, built.config, model, built.tokenizer, head, decoder)
