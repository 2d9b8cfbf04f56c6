"""Serving configurations: which MoE backend, head, speculation and sampling one A/B row runs.

A `ServeConfig` is concrete: every part named, nothing left to the device. It is written as a
*spec*, comma-separated `key=value` items, optionally led by a preset name that the items then
override:

    moe=NAME                the MoE backend (impl.backends kind "moe": gather, reference, triton,
                            humming when installed, or a user backend)
    experts=FORMAT          routed experts' weight format the row expects: auto (whatever the model
                            holds), bf16, fp32 or mxfp4. Arms share one model, so this is checked
                            against the model, never converted (quantize the model's experts first)
    head=bf16 | fp8[:B]     the LM head; B an FP8 head backend: triton, scaled_mm, dequant (short
                            names) or a full head backend name (fp8-triton, ...). Without B, the
                            device's default: fp8-triton on CUDA, fp8-scaled-mm on CPU
    head_scales=row|tensor  FP8 head scale granularity (fp8 only; default row)
    attention=NAME          the attention backend of KDA and MLA layers (impl.model.layer_backends:
                            triton, the default, takes their decode and verify steps through Triton
                            kernels on CUDA; torch runs them in torch ops and SDPA)
    projection=NAME         their projections' backend: gemv (the default: one token through the
                            Triton GEMV on CUDA) or cublas (F.linear always). Models without KDA or
                            MLA layers refuse a row that names anything but the defaults
    spec=off | mtp[:K]      speculation: none, or MTP with K drafts per verify step (default K: the
                            `k` given to the parser, 3 for the embedded model)
    accept=MEAN             MTP rows only, greedy: acceptance assumed, not judged (impl.speculative.assumed):
                            the drafts are forced to the target's choices with the constant
                            per-position profile whose mean accept length is MEAN (e.g. 3.90),
                            for random-weight models; every output labels such a row
    temperature=T           0 (default) is greedy
    top_k=N  top_p=P        need temperature > 0
    seed=S                  base seed of sampled rows (each request draws from its own stream,
                            the same in every row: see `request_seed`)

Keys left out take the device's `baseline` values (or those of the leading preset). Examples:
`moe=triton,head=fp8,spec=mtp:3,temperature=0.7,top_p=0.9,seed=1`; `+mtp,temperature=0.7`.

Presets, the ladder of this project's optimizations, resolved per device (`resolve_preset`):

    baseline   what runs without them: the plain gather MoE (torch gather + einsum) and the bf16
               head, no speculation
    +kernels   this project's MoE kernels: `triton` on CUDA. On a CPU they exist only under Triton's
               interpreter, a correctness path hundreds of times slower, so there +kernels is the
               gather backend again (a row can still name moe=triton explicitly)
    +fp8-head  +kernels with the FP8 head (fp8-triton on CUDA, fp8-scaled-mm on CPU, where the
               Triton GEMV would run interpreted too)
    +mtp       +fp8-head with MTP speculation, K drafts

Every preset keeps the KDA/MLA layers' default backends (attention=triton, projection=gemv): the
ladder measures the MoE, head and speculation rungs; a row turns the layer kernels off by naming
attention=torch or projection=cublas (their text, and so the frozen figures' keys, stay as they were).

Rows (`parse_row`) are `PRESET`, `NAME=SPEC` (a name of the user's choosing) or a bare `SPEC`
(named by its text); a ladder (`parse_ladder`, the `--moe-ladder` option) is rows separated by
";" (the spec itself uses ","), e.g. `baseline;+mtp;mine=moe=gather,head=fp8`. A ladder of
presets only may separate them by "," as well: `baseline,+kernels,+fp8-head,+mtp`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch

from impl import backends
from impl.generate import SamplingConfig
from impl.model.layer_backends import DEFAULTS as LAYER_DEFAULTS

__all__ = ["DEFAULT_K", "EXPERT_FORMATS", "PRESETS", "Row", "ServeConfig", "parse_ladder", "parse_row",
           "parse_serve_config", "resolve_preset"]

PRESETS = ("baseline", "+kernels", "+fp8-head", "+mtp")
DEFAULT_K = 3  # drafts per verify step of the embedded checkpoint's MTP layer (its eval.json: k=3)
EXPERT_FORMATS = ("auto", *backends.WEIGHT_FORMATS)
HEADS = ("bf16", "fp8")
HEAD_SCALES = ("row", "tensor")
SPECULATION = ("off", "mtp")
# Per layer part, the built-in backends that run the same code on a CPU (the kernel backends take
# their torch form there): rows differing only among them are an A/A comparison (`runs_as`).
CPU_ALIKE = {"attention": ("triton", "torch"), "projection": ("gemv", "cublas")}
KEYS = ("moe", "experts", "head", "head_scales", *LAYER_DEFAULTS, "spec", "accept", "temperature", "top_k",
        "top_p", "seed")


def _device_type(device) -> str:
    if device is None:
        return "cuda" if torch.cuda.is_available() else "cpu"
    kind = torch.device(device).type
    if kind not in ("cpu", "cuda"):
        raise ValueError(f"serving configurations resolve for cpu or cuda devices, got {device!r}")
    return kind


def _fp8_backend_name(name: str) -> str:
    from impl.head import resolve_fp8_backend  # lists the FP8 head backends when the name is unknown
    try:
        return resolve_fp8_backend(name).name
    except ValueError as e:
        raise ValueError(f"head: {e}") from None


def default_fp8_backend(device) -> str:
    from impl.head import default_fp8_backend as for_device
    return for_device(_device_type(device))


@dataclass(frozen=True)
class ServeConfig:
    moe: str
    head: str = "bf16"
    head_backend: str = "bf16"  # the head backend's full name ("bf16", "fp8-triton", ...)
    head_scales: str | None = None  # FP8 only: "row" or "tensor"
    experts: str = "auto"
    spec: str = "off"
    k: int = 0  # drafts per verify step; 0 when spec is off
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    seed: int = 0
    assumed_accept: float | None = None  # mean accept length assumed (impl.speculative.assumed); None: judged
    attention: str = LAYER_DEFAULTS["attention"]  # the KDA/MLA layers' backends (impl.model.layer_backends)
    projection: str = LAYER_DEFAULTS["projection"]

    def __post_init__(self) -> None:
        for kind, name in self.layer_backends().items():
            if name not in backends.available(kind):
                raise ValueError(f"{kind}: unknown {kind} backend {name!r}; known: {backends.available(kind)}"
                                 f"{backends.load_failures()}")
        moe_names = backends.available("moe")
        if self.moe not in moe_names:
            raise ValueError(f"moe: unknown MoE backend {self.moe!r}; known: {moe_names}{backends.load_failures()}")
        if self.experts not in EXPERT_FORMATS:
            raise ValueError(f"experts: unknown expert weight format {self.experts!r}; "
                             f"expected one of {EXPERT_FORMATS}")
        moe = backends.get("moe", self.moe)
        if self.experts != "auto" and self.experts not in moe.formats:
            raise ValueError(f"moe/experts: the {self.moe!r} MoE backend takes {list(moe.formats)} experts, "
                             f"not {self.experts!r}")
        if self.head not in HEADS:
            raise ValueError(f"head: unknown head {self.head!r}; expected one of {HEADS}")
        if self.head == "bf16":
            if self.head_backend != "bf16":
                raise ValueError(f"head: the bf16 head runs the 'bf16' head backend only, got {self.head_backend!r} "
                                 "(FP8 head backends need head=fp8)")
            if self.head_scales is not None:
                raise ValueError(f"head_scales: {self.head_scales!r} applies to head=fp8 only")
        else:
            if _fp8_backend_name(self.head_backend) != self.head_backend:
                raise ValueError(f"head: give the FP8 head backend's full name, got {self.head_backend!r} "
                                 f"(it is {_fp8_backend_name(self.head_backend)!r})")
            if self.head_scales not in HEAD_SCALES:
                raise ValueError(f"head_scales: expected one of {HEAD_SCALES} for head=fp8, got {self.head_scales!r}")
        if self.spec not in SPECULATION:
            raise ValueError(f"spec: unknown speculation {self.spec!r}; expected off or mtp[:K]")
        from impl.speculative.sampling import MAX_K
        if self.spec == "off" and self.k != 0:
            raise ValueError(f"spec: k={self.k} drafts given with speculation off")
        if self.spec == "mtp" and not (isinstance(self.k, int) and 1 <= self.k <= MAX_K):
            raise ValueError(f"spec: mtp needs k (drafts per verify step) in [1, {MAX_K}], got {self.k!r}")
        if not isinstance(self.sampling, SamplingConfig):
            raise TypeError(f"sampling must be an impl.generate.SamplingConfig, got {type(self.sampling).__name__}")
        if self.sampling.greedy and (self.sampling.top_k is not None or self.sampling.top_p is not None):
            raise ValueError("top_k/top_p: they filter a sampled distribution and need temperature > 0 "
                             "(temperature 0 is greedy)")
        if not isinstance(self.seed, int) or self.seed < 0:
            raise ValueError(f"seed: must be an int >= 0, got {self.seed!r}")
        if self.assumed_accept is not None:
            if self.spec != "mtp" or not self.sampling.greedy:
                raise ValueError("accept: an assumed acceptance applies to greedy MTP rows only (spec=mtp:K, "
                                 "temperature 0)")
            if not 1.0 <= self.assumed_accept <= self.k + 1:
                raise ValueError(f"accept: a mean accept length with k={self.k} drafts lies in [1, {self.k + 1}], "
                                 f"got {self.assumed_accept:g}")

    def acceptance_profile(self):
        """The impl.speculative.assumed.AcceptanceProfile of an assumed-acceptance row, else None."""
        if self.assumed_accept is None:
            return None
        from impl.speculative.assumed import AcceptanceProfile
        return AcceptanceProfile.from_mean(self.assumed_accept, self.k)

    def layer_backends(self) -> dict[str, str]:
        """kind -> backend of the KDA/MLA layers' parts this row runs."""
        return {kind: getattr(self, kind) for kind in LAYER_DEFAULTS}

    def runs_as(self, device_type: str) -> str:
        """The spec of the code this row runs on a `device_type` device: on a CPU the KDA/MLA
        layers' kernel backends take their torch form for every call, as attention=torch and
        projection=cublas do, so those keys make no difference there. Two rows that run as the
        same spec are an A/A comparison, whatever their names."""
        if device_type == "cuda":
            return self.spec_text()
        same = {kind: LAYER_DEFAULTS[kind] for kind, name in self.layer_backends().items()
                if name in CPU_ALIKE[kind]}  # a user's own layer backend may run otherwise
        return dataclasses.replace(self, **same).spec_text()

    @property
    def speculative(self) -> bool:
        return self.spec == "mtp"

    def spec_text(self) -> str:
        """The canonical spec: `parse_serve_config(c.spec_text()) == c` on any device."""
        head = "bf16" if self.head == "bf16" else f"fp8:{self.head_backend}"
        parts = [f"moe={self.moe}", f"experts={self.experts}", f"head={head}"]
        if self.head == "fp8":
            parts.append(f"head_scales={self.head_scales}")
        # Left out at their defaults: rows' texts, and the gate's keys built from them, stay as they were.
        parts += [f"{kind}={name}" for kind, name in self.layer_backends().items() if name != LAYER_DEFAULTS[kind]]
        parts.append("spec=off" if self.spec == "off" else f"spec=mtp:{self.k}")
        if self.assumed_accept is not None:
            parts.append(f"accept={self.assumed_accept:g}")
        s = self.sampling
        if not s.greedy:
            parts.append(f"temperature={s.temperature:g}")
            if s.top_k is not None:
                parts.append(f"top_k={s.top_k}")
            if s.top_p is not None:
                parts.append(f"top_p={s.top_p:g}")
        if self.seed:
            parts.append(f"seed={self.seed}")
        return ",".join(parts)

    def __str__(self) -> str:
        return self.spec_text()


def preset_mismatch(name: str, config: ServeConfig, device=None) -> str | None:
    """Why a row named after the preset `name` does not run that preset on `device` (anything of
    its configuration differs: backends, head and its scales, speculation, sampling, seed, layer
    backends), or None when it does or `name` is no preset. The experts' format is the model's in a
    preset (`auto`, resolved when the row is built; parse_row refuses a preset's name on a row that
    sets it). An assumed acceptance is allowed: it is labelled in every output that shows the row."""
    if name not in PRESETS:
        return None
    preset = resolve_preset(name, device, config.k or DEFAULT_K)
    if dataclasses.replace(config, assumed_accept=None, experts=preset.experts) == preset:
        return None
    return (f"{name}: the row is named after the preset but runs {config.spec_text()}, not the preset's "
            f"{preset.spec_text()} on {_device_type(device)}")


def resolve_preset(name: str, device=None, k: int = DEFAULT_K) -> ServeConfig:
    """The preset `name` (PRESETS) on `device` (cpu, cuda; None: cuda when available)."""
    kind = _device_type(device)
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; presets: {list(PRESETS)}")
    rung = PRESETS.index(name)
    kernels = "triton" if kind == "cuda" else "gather"
    config = ServeConfig(moe="gather")
    if rung >= 1:
        config = dataclasses.replace(config, moe=kernels)
    if rung >= 2:
        config = dataclasses.replace(config, head="fp8", head_backend=default_fp8_backend(kind), head_scales="row")
    if rung >= 3:
        config = dataclasses.replace(config, spec="mtp", k=k)
    return config


def _int(key: str, value: str) -> int:
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"{key}: expected an integer, got {value!r}") from None


def _float(key: str, value: str) -> float:
    try:
        v = float(value)
    except ValueError:
        raise ValueError(f"{key}: expected a number, got {value!r}") from None
    if v != v:
        raise ValueError(f"{key}: expected a number, got NaN")
    return v


def parse_serve_config(text: str, device=None, k: int = DEFAULT_K) -> ServeConfig:
    """The ServeConfig of spec `text` (module docstring) on `device` (None: cuda when available);
    `k`: the drafts per step of `spec=mtp` without :K and of the +mtp preset. ValueError names the
    spec and the part of it that is wrong."""
    if not isinstance(text, str):
        raise TypeError(f"a serving spec is a string, got {type(text).__name__}")
    kind = _device_type(device)
    try:
        return _parse(text, kind, k)
    except ValueError as e:
        raise ValueError(f"serving spec {text!r}: {e}") from None


def _parse(text: str, kind: str, k: int) -> ServeConfig:
    items = [p.strip() for p in text.split(",")]
    if not text.strip() or any(not p for p in items):
        raise ValueError("empty item (items are comma-separated key=value)")
    base = "baseline"
    if "=" not in items[0]:
        if items[0] not in PRESETS:
            raise ValueError(f"{items[0]!r} is neither a preset ({list(PRESETS)}) nor a key=value item")
        base, items = items[0], items[1:]
    config = resolve_preset(base, kind, k)
    values: dict[str, str] = {}
    for item in items:
        if "=" not in item:
            what = "a second preset (a spec starts with at most one)" if item in PRESETS else "not key=value"
            raise ValueError(f"item {item!r} is {what}")
        key, value = (s.strip() for s in item.split("=", 1))
        if key not in KEYS:
            raise ValueError(f"unknown key {key!r}; keys: {list(KEYS)}")
        if key in values:
            raise ValueError(f"key {key!r} given twice")
        if not value:
            raise ValueError(f"{key}= has no value")
        values[key] = value
    changes: dict = {}
    if "moe" in values:
        changes["moe"] = values["moe"]
        known = backends.available("moe")
        if values["moe"] not in known:
            raise ValueError(f"moe: unknown MoE backend {values['moe']!r}; known: {known}{backends.load_failures()}")
        backend = backends.get("moe", values["moe"])
        if kind not in backend.devices:
            raise ValueError(f"moe: the {values['moe']!r} MoE backend runs on {list(backend.devices)}, not {kind}")
    if "experts" in values:
        changes["experts"] = values["experts"]
    if "head" in values:
        head, _, hb = values["head"].partition(":")
        if head == "bf16":
            if hb:
                raise ValueError(f"head: the bf16 head has one backend; {values['head']!r} names {hb!r}")
            changes.update(head="bf16", head_backend="bf16", head_scales=None)
        elif head == "fp8":
            changes.update(head="fp8", head_backend=_fp8_backend_name(hb) if hb else default_fp8_backend(kind),
                           head_scales=config.head_scales or "row")
        else:
            raise ValueError(f"head: unknown head {head!r}; expected bf16 or fp8[:BACKEND]")
    if "head_scales" in values:
        if changes.get("head", config.head) != "fp8":
            raise ValueError(f"head_scales: {values['head_scales']!r} applies to head=fp8 only")
        changes["head_scales"] = values["head_scales"]
    changes.update({kind: values[kind] for kind in LAYER_DEFAULTS.keys() & values.keys()})  # ServeConfig checks them
    if "spec" in values:
        mode, colon, kk = values["spec"].partition(":")
        if mode in ("off", "none") and not colon:
            changes.update(spec="off", k=0)
        elif mode == "mtp":
            changes.update(spec="mtp", k=_int("spec", kk) if colon else k)
        else:
            raise ValueError(f"spec: expected off or mtp[:K], got {values['spec']!r}")
    s = config.sampling
    temperature = _float("temperature", values["temperature"]) if "temperature" in values else s.temperature
    top_k = _int("top_k", values["top_k"]) if "top_k" in values else s.top_k
    top_p = _float("top_p", values["top_p"]) if "top_p" in values else s.top_p
    if not temperature >= 0:
        raise ValueError(f"temperature: must be >= 0 (0 is greedy), got {temperature:g}")
    if top_k is not None and top_k < 1:
        raise ValueError(f"top_k: must be >= 1, got {top_k}")
    if top_p is not None and not 0 < top_p <= 1:
        raise ValueError(f"top_p: must be in (0, 1], got {top_p:g}")
    if {"temperature", "top_k", "top_p"} & values.keys():
        changes["sampling"] = SamplingConfig(temperature, top_k, top_p)
    if "seed" in values:
        changes["seed"] = _int("seed", values["seed"])
    if "accept" in values:
        changes["assumed_accept"] = _float("accept", values["accept"])
    return dataclasses.replace(config, **changes)


@dataclass(frozen=True)
class Row:
    """One A/B row: the name it is reported under and its configuration."""

    name: str
    config: ServeConfig


def parse_row(text: str, device=None, k: int = DEFAULT_K) -> Row:
    """`PRESET`, `NAME=SPEC` or `SPEC` (module docstring). A row is NAME=SPEC when the text before
    its first "=" is not a spec key; a name may not contain "," or ";"."""
    text = text.strip()
    if not text:
        raise ValueError("empty ladder row")
    head, eq, rest = text.partition("=")
    if eq and head.strip() not in KEYS and "," not in head:
        name = head.strip()
        if not name or ";" in name:
            raise ValueError(f"ladder row {text!r}: bad row name {name!r}")
        config = parse_serve_config(rest, device, k)
        mismatch = preset_mismatch(name, config, device)
        if name in PRESETS and config.experts != "auto":
            mismatch = f"{name}: the row is named after the preset but sets experts={config.experts}"
        if mismatch:  # provenance would refuse the row after the whole ladder has run
            raise ValueError(f"{mismatch}; give the row a name of its own")
        return Row(name, config)
    if text in PRESETS:
        return Row(text, resolve_preset(text, device, k))
    return Row(text, parse_serve_config(text, device, k))


def parse_ladder(text: str, device=None, k: int = DEFAULT_K) -> list[Row]:
    """Rows separated by ";" (or, when every row is a bare preset, by ","); names must differ."""
    if not isinstance(text, str) or not text.strip():
        raise ValueError("empty ladder: give rows separated by ';', e.g. 'baseline;+kernels;+fp8-head;+mtp'")
    parts = [p.strip() for p in text.split(";")]
    if len(parts) == 1 and "=" not in text and "," in text:
        parts = [p.strip() for p in text.split(",")]
        bad = [p for p in parts if p not in PRESETS]
        if bad:
            raise ValueError(f"ladder {text!r}: {bad} are not presets ({list(PRESETS)}); rows with specs are "
                             "separated by ';'")
    if any(not p for p in parts):
        raise ValueError(f"ladder {text!r}: an empty row (rows are separated by ';')")
    rows = []
    for part in parts:
        try:
            rows.append(parse_row(part, device, k))
        except ValueError as e:
            raise ValueError(f"ladder row {part!r}: {e}") from None
    names = [r.name for r in rows]
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        raise ValueError(f"ladder {text!r}: row names {dupes} appear more than once (name rows as NAME=SPEC)")
    return rows
