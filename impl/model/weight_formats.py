"""How a checkpoint stores a weight, and its values back as the model takes them.

A stored weight is a data tensor with, when quantized, a scale tensor beside it:
- plain floats (`X.weight`);
- FP8 e4m3 (`X.weight`) with `X.weight_scale_inv` per block of `weight_block_size` (DeepSeek-V3's
  block layout, the `fp8` quantization method: value = e4m3 * scale over each block) or
  `X.weight_scale` per output channel [N, 1] / [N] or per tensor (compressed-tensors'
  float-quantized): dequantized to fp32 on load;
- MXFP4 (OCP: E2M1 pairs, element 2i in the low nibble, one E8M0 scale per 32 along the input dim):
  `X.weight` [N, K/2] with `X.weight_scale_inv` / `X.weight_scale` [N, K/32] (Ling-3.0's fp4
  checkpoints: block-FP8 projections, `routed_experts_quant_method: mxfp4`; quark),
  `X.weight_packed` + `X.weight_scale` (compressed-tensors' mxfp4-pack-quantized), or gpt-oss's
  `X_blocks` [..., N, K/32, 16] + `X_scales` [..., N, K/32]. Routed experts keep these bytes as
  they are (`MXFP4Tensor`); anything else is dequantized.
The packed bytes may be stored as uint8 or int8 (Ling-3.0-flash-fp4's experts are int8 as its
loaders in vLLM and omlx read them), E8M0 scales as uint8 or float8_e8m0fnu.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from impl.quant.fp8 import DEFAULT_BLOCK as DEFAULT_FP8_BLOCK, block_scale_shape, dequantize_fp8
from impl.quant.mxfp4 import MXFP4Tensor, decode_e8m0

QUANT_METHODS = ("fp8", "mxfp4", "compressed-tensors")
COMPRESSED_FORMATS = ("float-quantized", "mxfp4-pack-quantized")
MXFP4_GROUP = 32  # values a scale covers: OCP MX's block, the only one the MXFP4 kernels take
_PACKED = (torch.uint8, torch.int8)  # dtypes MXFP4 bytes are stored as: two E2M1 codes a byte
_SCALE_SUFFIXES = (".weight_scale_inv", ".weight_scale")
_E8M0 = getattr(torch, "float8_e8m0fnu", None)


class CheckpointError(ValueError):
    pass


@dataclass(frozen=True)
class Quantization:
    """What a config.json's `quantization_config` says, as far as loading needs it."""

    method: str | None = None
    fp8_block: tuple[int, int] = DEFAULT_FP8_BLOCK
    gpt_oss_experts: bool = False  # fused gate_up rows interleaved: gate at even rows, up at odd ones


def parse_quantization(raw: dict, path) -> Quantization:
    """The checkpoint's quantization (`raw` is config.json); unknown methods are an error naming it."""
    q = raw.get("quantization_config")
    if not q:
        return Quantization()
    method = q.get("quant_method")
    if method not in QUANT_METHODS:
        raise CheckpointError(f"{path}: quantization method {method!r} is not supported; supported: "
                              f"{list(QUANT_METHODS)}")
    if method == "fp8":
        if q.get("fmt", "e4m3") != "e4m3":
            raise CheckpointError(f"{path}: FP8 format {q.get('fmt')!r} is not supported (only e4m3)")
        block = tuple(q.get("weight_block_size") or DEFAULT_FP8_BLOCK)
        if len(block) != 2 or min(block) < 1:
            raise CheckpointError(f"{path}: weight_block_size must be two positive ints, got {list(block)}")
        experts = q.get("routed_experts_quant_method")
        if experts not in (None, "mxfp4"):
            raise CheckpointError(f"{path}: routed_experts_quant_method {experts!r} is not supported (only mxfp4)")
        group = q.get("routed_experts_group_size", MXFP4_GROUP)
        if experts and group != MXFP4_GROUP:
            raise CheckpointError(f"{path}: routed_experts_group_size {group!r} is not supported (MXFP4 scales "
                                  f"cover {MXFP4_GROUP} values)")
        return Quantization(method, block)
    if method == "compressed-tensors":
        fmt = q.get("format")
        if fmt not in COMPRESSED_FORMATS:
            raise CheckpointError(f"{path}: compressed-tensors format {fmt!r} is not supported; supported: "
                                  f"{list(COMPRESSED_FORMATS)}")
        if fmt == "mxfp4-pack-quantized":
            for name, group in (q.get("config_groups") or {}).items():
                size = ((group or {}).get("weights") or {}).get("group_size", MXFP4_GROUP)
                if size != MXFP4_GROUP:
                    raise CheckpointError(f"{path}: config_groups.{name}.weights.group_size {size!r} is not supported "
                                          f"(MXFP4 scales cover {MXFP4_GROUP} values)")
        return Quantization(method)
    return Quantization(method, gpt_oss_experts=True)


@dataclass
class Stored:
    """One weight's tensors in the checkpoint: `data`, and `scale` when quantized (keys)."""

    data: str | None = None
    scale: str | None = None
    keys: list[str] = field(default_factory=list)  # every checkpoint key it was read from


def group_keys(keys) -> dict[str, Stored]:
    """Checkpoint keys grouped per weight, under the weight's plain name (`X.weight`, or `X` for
    gpt-oss's fused `X_blocks`)."""
    groups: dict[str, Stored] = {}

    def entry(name: str) -> Stored:
        return groups.setdefault(name, Stored())

    for key in keys:
        scale = next((s for s in _SCALE_SUFFIXES if key.endswith(s)), None)
        if scale:
            e = entry(key[:-len(scale)] + ".weight")
            e.scale = key
        elif key.endswith(".weight_packed"):
            e = entry(key[:-len("_packed")])
            e.data = key
        elif key.endswith("_blocks"):
            e = entry(key[:-len("_blocks")])
            e.data = key
        elif key.endswith("_scales"):
            e = entry(key[:-len("_scales")])
            e.scale = key
        else:
            e = entry(key)
            e.data = key
        e.keys.append(key)
    return groups


def _e8m0_codes(s: torch.Tensor) -> torch.Tensor:
    if s.dtype == torch.uint8:
        return s
    if _E8M0 is not None and s.dtype == _E8M0:
        return s.view(torch.uint8)
    raise CheckpointError(f"an MXFP4 scale must be E8M0 (uint8 or float8_e8m0fnu), got {s.dtype}")


def _float_scale(s: torch.Tensor) -> torch.Tensor:
    """Scales as fp32 values; E8M0-coded ones (`scale_fmt: ue8m0`) decoded to powers of two."""
    if s.dtype == torch.uint8 or (_E8M0 is not None and s.dtype == _E8M0):
        return decode_e8m0(_e8m0_codes(s))
    return s.float()


def as_mxfp4(data: torch.Tensor, scale: torch.Tensor, where: str) -> MXFP4Tensor:
    """MXFP4 bytes in the project's layout: packed [..., N, K/2], scales [..., N, K/32]."""
    if data.dtype not in _PACKED:
        raise CheckpointError(f"{where}: MXFP4 data must be uint8 or int8 bytes, got {data.dtype}")
    data, scale = data.view(torch.uint8), _e8m0_codes(scale)
    if data.dim() == scale.dim() + 1 and data.shape[-1] == 16:  # gpt-oss: [..., N, K/32, 16]
        data = data.reshape(*data.shape[:-2], data.shape[-2] * 16)
    try:
        return MXFP4Tensor(data.contiguous(), scale.contiguous())
    except ValueError as e:
        raise CheckpointError(f"{where}: {e}") from None


def dequantize(data: torch.Tensor, scale: torch.Tensor | None, quant: Quantization, where: str) -> torch.Tensor:
    """A stored weight's values in floating point (fp32 when it was quantized)."""
    if scale is None:
        if data.dtype in (*_PACKED, torch.float8_e4m3fn):
            raise CheckpointError(f"{where}: {data.dtype} weight without a scale tensor beside it")
        return data
    if data.dtype in _PACKED:
        return as_mxfp4(data, scale, where).dequantize(torch.float32)
    if data.dtype != torch.float8_e4m3fn:
        raise CheckpointError(f"{where}: a scale is stored for a {data.dtype} weight (expected float8_e4m3fn or "
                              "MXFP4 bytes, uint8 or int8)")
    w, s = data.float(), _float_scale(scale)
    if s.numel() == 1:
        return w * s.reshape(())
    n, k = w.shape
    if s.shape in ((n,), (n, 1)):
        return w * s.reshape(n, 1)
    bn, bk = quant.fp8_block
    blocks = block_scale_shape((n, k), (bn, bk))
    if tuple(s.shape) != blocks:
        raise CheckpointError(f"{where}: FP8 scale of shape {tuple(s.shape)} fits neither a channel ({n},), a tensor "
                              f"nor blocks of {bn}x{bk} of a [{n}, {k}] weight (expected {blocks})")
    return dequantize_fp8(data, s.to(torch.float32), torch.float32, block=(bn, bk))


def is_mxfp4(data: torch.Tensor, scale: torch.Tensor | None) -> bool:
    return scale is not None and data.dtype in _PACKED


def deinterleave_rows(t: torch.Tensor) -> torch.Tensor:
    """gpt-oss stores a fused gate_up with gate rows at even and up rows at odd indices (dim -2 of
    [..., 2I, K]); the project's layout has all gate rows first."""
    return torch.cat((t[..., 0::2, :], t[..., 1::2, :]), dim=-2)
