"""Built rows: one shared model, run the way a ServeConfig says.

Every row of a model holds the same model object; no weight is copied. What differs between
rows is mutable state of that model (its MoE backend, its LM head module, the FP8 head's
backend), so `BuiltRow.activate()` sets all of it, and the serving loop calls it at the start of every
request: rows interleaved request by request never run with another row's state.

Heads are kept per model in a bank: the model's own unquantized head, and at most one FP8Head per
scale granularity, quantized once from it and shared by every row that runs FP8 (`activate`
sets the FP8 backend the row names). `MoECausalLM.set_head` re-points the MTP layer at the head
it installs, so a speculative row's draft always holds the very head module the target calls.

Expert weights cannot switch per row: quantizing them to MXFP4 replaces the dense tensors. A
row checks that the model's experts are in the format its configuration names (`experts=auto`
takes the model's) and that its MoE backend takes that format.
"""

from __future__ import annotations

import dataclasses
import weakref
from dataclasses import dataclass

import torch
from torch import nn

from impl import backends
from impl.serve.rows import Row, ServeConfig

__all__ = ["BuiltRow", "RowError", "build_row", "build_rows", "expert_format", "why_cannot_run"]


class RowError(ValueError):
    """The model cannot run a ladder row as asked (its experts' format, its device, its head, no MTP
    layer, a layer backend for layers it does not have): the row's or the model's choice, a usage
    error, not a failure of the code under test."""


def expert_format(model) -> str:
    """The routed experts' weight format of `model`: "mxfp4", or the dense dtype as "bf16"/"fp32"
    (another dense dtype by its torch name); "none" without MoE layers."""
    from impl.model.layers import MoEBlock
    blocks = [m for m in model.modules() if isinstance(m, MoEBlock)]
    if not blocks:
        return "none"
    formats = set()
    for block in blocks:
        formats.add(backends.weight_format(block.experts.weights()[0]))
    if len(formats) != 1:
        raise RowError(f"the model's MoE layers hold experts in several formats {sorted(formats)}; a row "
                       "runs one format")
    return formats.pop()


def why_cannot_run(model, moe: backends.Backend) -> str | None:
    """Why MoE backend `moe` cannot run `model`'s experts, or None when it can: the experts' format
    is not among `Backend.formats`, or the model clips SwiGLU and the backend does not. The ladder
    refuses such a row (RowError) and the model suites skip (pytest_moeperf.fixtures), with this
    one reason."""
    fmt = expert_format(model)
    if fmt != "none" and fmt not in moe.formats:
        return (f"the {moe.name!r} MoE backend takes {', '.join(moe.formats)} experts, and model "
                f"{model.config.name!r} holds {fmt} (Backend.formats)")
    if model.config.clips_swiglu and not moe.clips_swiglu:
        return (f"the {moe.name!r} MoE backend does not clip SwiGLU (Backend.clips_swiglu), and model "
                f"{model.config.name!r} does in some layers")
    return None


class _HeadBank:
    """The head modules rows of one model choose from: the unquantized head and FP8 heads."""

    def __init__(self, model) -> None:
        from impl.head import FP8Head
        head = model.lm_head
        self.bf16: nn.Module | None = None if isinstance(head, FP8Head) else head
        self.fp8: dict[str, nn.Module] = {head.granularity: head} if isinstance(head, FP8Head) else {}

    def get(self, config: ServeConfig) -> nn.Module:
        from impl.head import FP8Head
        if config.head == "bf16":
            if self.bf16 is None:
                raise RowError("head: this row runs the bf16 head, but the model's head was quantized to FP8 "
                               "when it was built (build_model(..., head='fp8')); build the model with its bf16 "
                               "head so that bf16 and FP8 rows share it")
            return self.bf16
        if config.head_scales not in self.fp8:
            if self.bf16 is None:
                raise RowError(f"head: this row runs an FP8 head with {config.head_scales} scales, but the model's "
                               f"head is already FP8 with {sorted(self.fp8)} scales and its bf16 head is gone")
            self.fp8[config.head_scales] = FP8Head.from_linear(self.bf16, granularity=config.head_scales,
                                                               backend=config.head_backend)
        return self.fp8[config.head_scales]


_banks: "weakref.WeakKeyDictionary[nn.Module, _HeadBank]" = weakref.WeakKeyDictionary()


def _bank(model) -> _HeadBank:
    bank = _banks.get(model)
    if bank is None:
        bank = _banks[model] = _HeadBank(model)
    return bank


@dataclass(frozen=True, eq=False)
class BuiltRow:
    """A row of the A/B ladder built on a model: `activate()` makes the model run it. What serving
    it builds (buffers, graphs, provenance) belongs to its impl.serve.engine.EngineRow."""

    name: str
    config: ServeConfig  # `experts` resolved to the model's format
    model: nn.Module
    tokenizer: object  # encode(text) -> ids, decode(ids) -> text, eos_id
    head: nn.Module  # the LM head module this row runs (shared with rows of the same head)
    decoder: object | None = None  # impl.speculative.SpeculativeDecoder for speculative rows

    @property
    def device(self) -> torch.device:
        return self.model.embed_tokens.weight.device

    def runs_as(self) -> str:
        """The spec of the code this row runs on its device (ServeConfig.runs_as)."""
        return self.config.runs_as(self.device.type)

    def activate(self) -> None:
        """Switch the shared model to this row: MoE and layer backends, head module, FP8 head backend."""
        model, config = self.model, self.config
        if model.moe_backend != config.moe:
            model.set_moe_backend(config.moe)
        for kind, name in config.layer_backends().items():
            if model.layer_backend(kind) not in ("none", name):
                model.set_layer_backend(kind, name)
        if model.lm_head is not self.head:
            model.set_head(self.head)
        from impl.head import FP8Head
        if isinstance(self.head, FP8Head) and self.head.backend != config.head_backend:
            self.head.backend = config.head_backend


def build_row(model, config: ServeConfig, *, tokenizer, name: str | None = None) -> BuiltRow:
    """The row running `config` on `model` (shared, switched in place; see the module docstring).
    RowError when the model cannot run it (its experts' format, its device, its head, no MTP layer,
    a layer backend named for layers it does not have)."""
    if not isinstance(config, ServeConfig):
        raise TypeError(f"config must be a ServeConfig, got {type(config).__name__}")
    for attr in ("encode", "decode", "eos_id"):
        if not hasattr(tokenizer, attr):
            raise TypeError(f"tokenizer {tokenizer!r} has no {attr!r} (needs encode, decode and eos_id)")
    name = name or config.spec_text()
    device = model.embed_tokens.weight.device
    moe = backends.get("moe", config.moe)
    if device.type not in moe.devices:
        raise RowError(f"{name}: moe: the {config.moe!r} MoE backend runs on {list(moe.devices)}, the model is on "
                       f"{device}")
    fmt = expert_format(model)
    if config.experts != "auto" and config.experts != fmt:
        raise RowError(f"{name}: experts: the row expects {config.experts} experts but the model holds {fmt}; "
                       "rows share one model, so convert the model's experts before building its rows")
    reason = why_cannot_run(model, moe)
    if reason:
        raise RowError(f"{name}: moe: {reason}")
    from impl.model.layer_backends import DEFAULTS
    for kind, backend in config.layer_backends().items():
        if backend != DEFAULTS[kind] and model.layer_backend(kind) == "none":
            raise RowError(f"{name}: {kind}: model {model.config.name!r} has no KDA or MLA layers, whose {kind} "
                           f"{kind}={backend} would choose: the row would run the same as without it")
    config = dataclasses.replace(config, experts=fmt if config.experts == "auto" else config.experts)
    head = _bank(model).get(config)
    built = BuiltRow(name, config, model, tokenizer, head)
    if config.speculative:
        from impl.speculative import SpeculativeDecoder
        if not len(getattr(model, "mtp", ())):
            raise RowError(f"{name}: spec: model {model.config.name!r} has no MTP (NEXTN) layer to draft with")
        built.activate()  # the decoder checks that the draft holds the head this row runs
        built = dataclasses.replace(built, decoder=SpeculativeDecoder(model, config.k, config.sampling,
                                                                  assume=config.acceptance_profile()))
    return built


def build_rows(model, rows: list[Row], *, tokenizer) -> list[BuiltRow]:
    """One built row per ladder row (impl.serve.rows.parse_ladder), all on `model`."""
    names = [r.name for r in rows]
    if len(set(names)) != len(names):
        raise RowError(f"row names must differ, got {names}")
    return [build_row(model, r.config, tokenizer=tokenizer, name=r.name) for r in rows]
