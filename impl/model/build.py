"""Build the model under test from a preset name or a checkpoint folder, on a device."""

from __future__ import annotations

import os
from pathlib import Path

import torch

from impl.model.causal_lm import MoECausalLM
from impl.model.config import EMBEDDED, HEADS, PRESETS, ModelConfig, get_config
from impl.model.kda import KDAAttention
from impl.model.layers import EXPERT_FORMATS, Router
from impl.model.mla import MLAAttention
from pytest_moeperf.device import resolve_device  # noqa: F401  (one rule for a device name, the gate's)



def _free_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


def weight_bytes(config: ModelConfig, dtype: torch.dtype, experts: str = "dense") -> int:
    """Bytes of the model's weights: routed experts in MXFP4 (4 bits an element, one 8-bit scale
    per 32) or in `dtype`, everything else in `dtype`."""
    per = torch.finfo(dtype).bits / 8
    expert = config.expert_parameters()
    return int((config.num_parameters() - expert) * per + expert * (17 / 32 if experts == "mxfp4" else per))


def _restore_fp32(model: MoECausalLM) -> None:
    """Parameters the reference keeps in fp32 whatever the model dtype: the router (top-k choices
    are sensitive to rounding) and KDA's convolution and forget-gate constants."""
    for module in model.modules():
        if isinstance(module, Router):
            module.float()
        elif isinstance(module, KDAAttention):
            module.conv1d.float()
            module.forget_gate.A_log.data = module.forget_gate.A_log.data.float()
            module.forget_gate.dt_bias.data = module.forget_gate.dt_bias.data.float()


def model_config(spec: str | ModelConfig) -> ModelConfig:
    """The config of the model `build_model(spec)` builds, without building it: a preset's, or a
    checkpoint's after its headers are checked (its NEXTN layers only as many as its weights hold)."""
    if isinstance(spec, ModelConfig):
        return spec
    if spec in PRESETS:
        return get_config(spec)
    if spec in EMBEDDED or Path(spec).is_dir():
        from impl.model.loading import check_checkpoint
        return check_checkpoint(EMBEDDED.get(spec, Path(spec)))
    raise ValueError(f"model spec {spec!r} is neither a preset ({sorted(PRESETS)}), an embedded checkpoint "
                     f"({sorted(EMBEDDED)}) nor a checkpoint folder")


def build_model(spec: str | ModelConfig, device: str | torch.device = "cpu",
                dtype: torch.dtype = torch.float32, moe_backend: str = "gather",
                seed: int = 0, head: str = "bf16", head_backend: str | None = None,
                head_granularity: str = "row", experts: str = "auto") -> MoECausalLM:
    """`spec` is a preset name (random weights from `seed`), a ModelConfig, the name of an embedded
    checkpoint (`EMBEDDED`), or a folder holding a transformers-format checkpoint (config.json +
    safetensors).

    `experts="auto"` takes the config's `expert_format` (MXFP4 for ling-3.0-flash, else dense).
    `experts="mxfp4"` holds the routed experts in MXFP4 from the start: random ones are drawn and
    quantized a few experts at a time on the device, a checkpoint's are quantized as they are read
    (or copied, when it stores MXFP4), so no more than one layer's unquantized experts ever exist.

    `head="fp8"` quantizes the LM head to e4m3 once the weights are in (`MoECausalLM.quantize_head`:
    scales per row, or per tensor with `head_granularity="tensor"`), run by the FP8 head backend
    `head_backend` (default: the device's, impl.head.default_fp8_backend); `head="bf16"` keeps the
    unquantized head."""
    if experts not in ("auto", *EXPERT_FORMATS):
        raise ValueError(f"unknown expert format {experts!r}; expected auto or one of {EXPERT_FORMATS}")
    if head not in HEADS:
        raise ValueError(f"unknown head {head!r}; expected one of {HEADS}")
    if head == "bf16" and head_backend not in (None, "bf16"):
        raise ValueError(f"head_backend={head_backend!r} needs head='fp8' (the bf16 head has one backend)")
    if head == "fp8":
        from impl.head import resolve_fp8_backend
        from impl.head.fp8_head import HEAD_GRANULARITIES
        resolve_fp8_backend(head_backend or "fp8-triton")  # a name that does not exist fails before the build
        if head_granularity not in HEAD_GRANULARITIES:
            raise ValueError(f"unknown head_granularity {head_granularity!r}; allowed: {HEAD_GRANULARITIES}")
    device = resolve_device(device)
    if isinstance(spec, ModelConfig):
        config, folder = spec, None
    elif spec in PRESETS:
        config, folder = get_config(spec), None
    elif spec in EMBEDDED or Path(spec).is_dir():
        from impl.model.loading import read_config
        folder = EMBEDDED.get(spec, Path(spec))
        if not folder.is_dir():
            raise ValueError(f"embedded checkpoint {spec!r} is missing: expected {folder} (install the package "
                             "from its repository checkout, e.g. pip install -e .)")
        config = read_config(folder)
    else:
        raise ValueError(f"model spec {spec!r} is neither a preset ({sorted(PRESETS)}), an embedded checkpoint "
                         f"({sorted(EMBEDDED)}) nor a checkpoint folder")
    if experts == "auto":
        experts = config.expert_format
    need = weight_bytes(config, dtype, experts)
    free = _free_bytes(device)
    if need > free:
        what = f"{dtype}" + (" with MXFP4 experts" if experts == "mxfp4" else "")
        hint = "" if experts == "mxfp4" else " or experts='mxfp4'"
        raise MemoryError(f"model {config.name!r} needs {need / 2**30:.1f} GiB of weights in {what}, "
                          f"{device} has {free / 2**30:.1f} GiB free; use a smaller preset{hint}")
    with torch.device(device):
        model = MoECausalLM(config, moe_backend=moe_backend, expert_format=experts)
    model.to(dtype)
    _restore_fp32(model)
    if folder is None:
        model.init_weights(torch.Generator().manual_seed(seed),
                           expert_generator=torch.Generator(device).manual_seed(seed))
    else:
        from impl.model.loading import load_weights
        load_weights(model, folder)
    for module in model.modules():
        if isinstance(module, (KDAAttention, MLAAttention)):
            module.fuse_projections()
    if head == "fp8":
        from impl.head import default_fp8_backend
        model.quantize_head(granularity=head_granularity, backend=head_backend or default_fp8_backend(device.type))
    return model.eval()
