"""The LM head as a module: bf16 (the baseline) or FP8 e4m3 quantized online, at load time.

`FP8Head` owns its e4m3 weight *and* its fp32 scales (per output row, or one per tensor) as
buffers of one module: they move, save and load together, and there is no `.weight` to lift
out of it. Whatever uses the head (the model, a speculative draft) must hold the module
(`draft.head is target.head`); the FP8 data is reachable only as an `FP8Tensor` through the
explicit `fp8_weight` property, and every bf16 code path takes its weight through
`as_bf16_weight`, which refuses FP8 data loudly instead of reading FP8 bytes as bf16.

Head backends (kind "head" in impl.backends), all `fn(x [T, H], weight, out_dtype) -> [T, V]`:
  * "bf16":          F.linear on a floating-point weight tensor (the baseline; cuBLAS on GPU);
  * "fp8-triton":    impl.head.fp8_gemv (W8A16 numerics: bf16 activations are split exactly into two
                     e4m3 terms for the FP8 tensor cores, fp32 accumulation across K tiles);
  * "fp8-scaled-mm": torch._scaled_mm (W8A8: activations are quantized to e4m3 on the fly, per
                     tensor for a per-tensor weight, per row for a per-row weight; on CUDA the
                     rows are padded to a multiple of 16, K and N to multiples of 16);
  * "fp8-dequant":   the reference: dequantize to fp32, fp32 matmul.
Each call records provenance (`backends.note("head", backend, kernel, ...)`), so suites assert
which head actually ran (`require_head_backend`), not which flag was set.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from impl import backends
from impl.quant.fp8 import E4M3_MAX, FP8Tensor, quantize_fp8

# A head's scales: per vocabulary row or per tensor (the FP8 head quantizes a checkpoint's bf16 head
# itself; block scales are how checkpoints ship their projections, impl.quant.fp8).
HEAD_GRANULARITIES = ("row", "tensor")

__all__ = ["ACTIVATION_DTYPES", "BF16Head", "FP8Head", "FP8_DTYPES", "HEAD_BACKEND_ALIASES", "HEAD_GRANULARITIES", "LogitParity",
           "as_bf16_weight", "compare_logits", "default_fp8_backend", "require_head_backend", "resolve_fp8_backend"]

FP8_DTYPES = tuple(getattr(torch, name) for name in (
    "float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2", "float8_e5m2fnuz", "float8_e8m0fnu")
    if hasattr(torch, name))
ACTIVATION_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_WEIGHT_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)
# Short names accepted by FP8Head(backend=...), e.g. "triton" for the "fp8-triton" head backend.
HEAD_BACKEND_ALIASES = {"triton": "fp8-triton", "scaled_mm": "fp8-scaled-mm", "scaled-mm": "fp8-scaled-mm",
                        "dequant": "fp8-dequant"}
_SHARING_HINT = ("share the head *module* (e.g. `draft.head = target.lm_head`), never its weight tensor: "
                 "an FP8 head's weight is e4m3 data plus fp32 scales and is only meaningful through the module")


def as_bf16_weight(weight: object) -> torch.Tensor:
    """The weight of a bf16/fp16/fp32 head path, refusing anything FP8 instead of misreading it."""
    if isinstance(weight, FP8Tensor):
        raise TypeError(f"an FP8 head weight (FP8Tensor {tuple(weight.shape)}, {weight.granularity} scales) "
                        f"was handed to a bf16 head path; {_SHARING_HINT}")
    if not isinstance(weight, torch.Tensor):
        raise TypeError(f"a head weight must be a floating-point torch.Tensor, got {type(weight).__name__}")
    if weight.dtype in FP8_DTYPES:
        raise TypeError(f"a bare {weight.dtype} tensor {tuple(weight.shape)} was handed to a bf16 head path: "
                        f"these are FP8 bytes without their scales; {_SHARING_HINT}")
    if weight.dtype not in _WEIGHT_DTYPES:
        raise TypeError(f"a bf16 head path needs a bfloat16/float16/float32 weight, got {weight.dtype} "
                        f"{tuple(weight.shape)} (FP8 bytes viewed as integers?); {_SHARING_HINT}")
    if weight.ndim != 2:
        raise ValueError(f"a head weight must be 2-D [vocab, hidden], got shape {tuple(weight.shape)}")
    return weight


def _require_fp8(weight: object, backend: str) -> FP8Tensor:
    if isinstance(weight, FP8Tensor):
        return weight
    if isinstance(weight, torch.Tensor) and weight.dtype in FP8_DTYPES:
        raise TypeError(f"head backend {backend!r} got a bare {weight.dtype} tensor without its scales; "
                        f"it takes an FP8Tensor (data + scales); {_SHARING_HINT}")
    raise TypeError(f"head backend {backend!r} takes an FP8Tensor weight, got "
                    f"{type(weight).__name__}{'' if not isinstance(weight, torch.Tensor) else ' ' + str(weight.dtype)}")


def _rows(x: torch.Tensor) -> int:
    return x.numel() // x.shape[-1] if x.shape[-1] else 0


# ----------------------------------------------------------------------------------- backends

def _bf16_backend(x: torch.Tensor, weight: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    w = as_bf16_weight(weight)
    out = F.linear(x, w)
    backends.note("head", "bf16", "F.linear", M=_rows(x), N=w.shape[0], K=w.shape[1], dtype=str(w.dtype))
    return out if out.dtype == out_dtype else out.to(out_dtype)


def _fp8_triton_backend(x: torch.Tensor, weight: FP8Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    fp8 = _require_fp8(weight, "fp8-triton")
    from impl.head.fp8_gemv import fp8_gemv, kernel_path, launch_config

    n, k = fp8.shape
    m = x.shape[0]
    cfg, rule = launch_config(n, k, m, x.device)
    out = fp8_gemv(x, fp8.data, fp8.scale, out_dtype, config=cfg)
    backends.note("head", "fp8-triton", "fp8_gemv_kernel", M=m, N=n, K=k, granularity=fp8.granularity,
                  path=kernel_path(cfg, x.dtype, x.device), config=cfg.as_dict(), config_rule=rule,
                  out_dtype=str(out_dtype))
    return out


def _round_up(v: int, to: int) -> int:
    return -(-v // to) * to


def _quantize_activations(xf: torch.Tensor, per_row: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 [M, K] -> e4m3 [M, K] and fp32 scales ([M, 1] per row, [] per tensor), amax over the
    finite values: a NaN stays in its own element (and so in its own output row), +-Inf saturates."""
    finite = torch.where(torch.isfinite(xf), xf.abs(), 0.0)
    amax = finite.amax(dim=1, keepdim=True) if per_row else finite.amax()
    scale = torch.where(amax == 0, 1.0, (amax / E4M3_MAX).clamp(min=torch.finfo(torch.float32).smallest_normal))
    return (xf / scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn), scale


def _fp8_scaled_mm_backend(x: torch.Tensor, weight: FP8Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    fp8 = _require_fp8(weight, "fp8-scaled-mm")
    per_row = fp8.granularity == "row"
    (n, k), m = fp8.shape, x.shape[0]
    data, w_scale, xf = fp8.data, fp8.scale, x.to(torch.float32)
    padded = False
    if x.is_cuda:  # cuBLASLt FP8: M padded to 16 (as measured), K and N multiples of 16
        mp, kp, np_ = _round_up(max(m, 1), 16), _round_up(k, 16), _round_up(n, 16)
        if (mp, kp) != (m, k):
            xf = F.pad(xf, (0, kp - k, 0, mp - m))
        if (np_, kp) != (n, k):
            padded = True
            wp = torch.zeros(np_, kp, dtype=torch.uint8, device=data.device)
            wp[:n, :k] = data.view(torch.uint8)
            data = wp.view(torch.float8_e4m3fn)
            if per_row:
                w_scale = F.pad(w_scale, (0, np_ - n), value=1.0)
    xq, x_scale = _quantize_activations(xf, per_row)
    if per_row:
        # Row-wise scaling on CUDA produces bf16 only.
        mm_dtype = torch.bfloat16 if x.is_cuda else out_dtype
        out = torch._scaled_mm(xq, data.t(), scale_a=x_scale, scale_b=w_scale.view(1, -1), out_dtype=mm_dtype)
    else:
        out = torch._scaled_mm(xq, data.t(), scale_a=x_scale, scale_b=w_scale, out_dtype=out_dtype)
    out = out[:m, :n]
    backends.note("head", "fp8-scaled-mm", "torch._scaled_mm", M=m, N=n, K=k, granularity=fp8.granularity,
                  rows_padded_to=xq.shape[0], weight_padded=padded, out_dtype=str(out_dtype))
    return out if out.dtype == out_dtype else out.to(out_dtype)


def _fp8_dequant_backend(x: torch.Tensor, weight: FP8Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    fp8 = _require_fp8(weight, "fp8-dequant")
    out = x.to(torch.float32) @ fp8.dequantize(torch.float32).t()
    backends.note("head", "fp8-dequant", "dequantize_fp8+matmul", M=x.shape[0], N=fp8.shape[0],
                  K=fp8.shape[1], granularity=fp8.granularity, out_dtype=str(out_dtype))
    return out.to(out_dtype)


for _backend in (
    backends.Backend("head", "bf16", _bf16_backend, "F.linear on the bf16 (or fp32) weight: the baseline"),
    backends.Backend("head", "fp8-triton", _fp8_triton_backend,
                     "Triton FP8 e4m3 GEMV for small M, bf16 activations, fp32 accumulation (impl.head.fp8_gemv)"),
    backends.Backend("head", "fp8-scaled-mm", _fp8_scaled_mm_backend,
                     "torch._scaled_mm with activations quantized to e4m3 on the fly (W8A8)"),
    backends.Backend("head", "fp8-dequant", _fp8_dequant_backend,
                     "reference: dequantize the FP8 weight to fp32, fp32 matmul"),
):
    backends.register(_backend)


def default_fp8_backend(device_type: str) -> str:
    """The FP8 head backend a device runs unless told otherwise: the Triton GEMV on CUDA, torch's
    scaled matmul on the CPU (the Triton kernel there runs in Triton's interpreter: 8.9 ms a token
    on tiny-gsm's head against 0.17 ms, notes/cpu.md)."""
    return "fp8-triton" if device_type == "cuda" else "fp8-scaled-mm"


def resolve_fp8_backend(name: str) -> backends.Backend:
    """The registered FP8 head backend for `name` (a short name or a full one); ValueError lists them."""
    if not isinstance(name, str):
        raise TypeError(f"an FP8 head backend is named by a string, got {type(name).__name__}")
    full = HEAD_BACKEND_ALIASES.get(name, name)
    if full == "bf16":
        fp8_names = [b for b in backends.available("head") if b != "bf16"]
        raise ValueError(f"'bf16' is not an FP8 head backend (it reads an unquantized weight); "
                         f"FP8 head backends: {fp8_names}; short names: {sorted(HEAD_BACKEND_ALIASES)}")
    try:
        return backends.get("head", full)
    except ValueError as e:
        raise ValueError(f"{e}; short names: {sorted(HEAD_BACKEND_ALIASES)}") from None


# ------------------------------------------------------------------------------------ modules

class BF16Head(nn.Linear):
    """The unquantized LM head: an nn.Linear without bias (same parameter, same state_dict key
    `weight`) whose forward runs the registered "bf16" head backend, so provenance shows it ran."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False, device=None, dtype=None) -> None:
        if bias:
            raise ValueError("an LM head has no bias")
        super().__init__(in_features, out_features, bias=False, device=device, dtype=dtype)
        self.backend = backends.get("head", "bf16")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.backend.fn(x, self.weight, x.dtype)


class FP8Head(nn.Module):
    """LM head with e4m3 weights and fp32 scales owned together; call it as a module.

    Input: [..., H] bfloat16 / float16 / float32 hidden states on the head's device. Output:
    [..., V] logits in `out_dtype` (None: the input's dtype). `backend` names an FP8 head backend
    ("triton", "scaled_mm", "dequant", or any registered head backend's full name).
    Changing the module's dtype (`.to(torch.bfloat16)`, `.float()`) keeps the e4m3 data and the
    fp32 scales as they are; only the device follows.
    """

    def __init__(self, fp8: FP8Tensor, backend: str = "triton", out_dtype: torch.dtype | None = None) -> None:
        super().__init__()
        if not isinstance(fp8, FP8Tensor):
            raise TypeError(f"FP8Head takes an FP8Tensor (e4m3 data + fp32 scales), got {type(fp8).__name__}; "
                            "use FP8Head.from_linear to quantize a bf16 head")
        if out_dtype is not None and out_dtype not in ACTIVATION_DTYPES:
            raise TypeError(f"out_dtype must be None, bfloat16, float16 or float32, got {out_dtype}")
        self.register_buffer("_fp8_data", fp8.data)
        self.register_buffer("_fp8_scale", fp8.scale)
        self.granularity = fp8.granularity
        self.out_dtype = out_dtype
        self.backend = backend

    @classmethod
    def from_linear(cls, linear: nn.Module | torch.Tensor, granularity: str = "row", backend: str = "triton",
                    out_dtype: torch.dtype | None = None) -> "FP8Head":
        """Quantize a bf16/fp32 head (an nn.Linear without bias, or its [V, H] weight) to e4m3 with
        one fp32 scale per output row (`granularity="row"`) or per tensor (`"tensor"`)."""
        if isinstance(linear, FP8Head):
            raise ValueError("this head is already an FP8Head; quantize the original bf16 head instead")
        if isinstance(linear, nn.Module):
            if getattr(linear, "bias", None) is not None:
                raise ValueError("an LM head with a bias is not supported by FP8Head")
            weight = linear.weight
        else:
            weight = linear
        weight = as_bf16_weight(weight)
        if granularity not in HEAD_GRANULARITIES:
            raise ValueError(f"unknown FP8 granularity {granularity!r}; allowed: {HEAD_GRANULARITIES}")
        resolve_fp8_backend(backend)  # fail before quantizing
        with torch.no_grad():
            fp8 = quantize_fp8(weight.detach(), granularity)
        return cls(fp8, backend=backend, out_dtype=out_dtype)

    # -- the one way to the FP8 data
    @property
    def fp8_weight(self) -> FP8Tensor:
        """The e4m3 data and its fp32 scales, together (never one without the other)."""
        return FP8Tensor(self._fp8_data, self._fp8_scale, self.granularity)

    def __getattr__(self, name: str):
        if name == "weight":
            raise AttributeError(
                "FP8Head has no `.weight`: it owns e4m3 data and fp32 scales that are only meaningful "
                "together; call the head as a module (`head(hidden)`), or read both through "
                f"`head.fp8_weight` (an FP8Tensor); {_SHARING_HINT}")
        return super().__getattr__(name)

    @property
    def backend(self) -> str:
        return self._backend.name

    @backend.setter
    def backend(self, name: str) -> None:
        self._backend = resolve_fp8_backend(name)

    @property
    def in_features(self) -> int:
        return self._fp8_data.shape[1]

    @property
    def out_features(self) -> int:
        return self._fp8_data.shape[0]

    def _apply(self, fn, recurse: bool = True):
        # nn.Module converts every floating-point tensor on .to(dtype) / .half() / .float(), and
        # e4m3 counts as floating point: that would turn the data into unscaled bf16 values and
        # round the scales. Keep both formats; let only the device change.
        data, scale = self._fp8_data, self._fp8_scale
        super()._apply(fn, recurse)
        if self._fp8_data.dtype != data.dtype:
            self._fp8_data = data.to(self._fp8_data.device)
        if self._fp8_scale.dtype != scale.dtype:
            self._fp8_scale = scale.to(self._fp8_scale.device)
        return self

    def _check_input(self, x: object) -> None:
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"FP8Head takes a torch.Tensor of hidden states, got {type(x).__name__}")
        if x.dtype in FP8_DTYPES:
            raise TypeError(f"FP8Head takes bfloat16, float16 or float32 hidden states, got {x.dtype}: "
                            "FP8 activations are not an input format (the fp8-scaled-mm backend quantizes "
                            "activations itself)")
        if x.dtype not in ACTIVATION_DTYPES:
            raise TypeError(f"FP8Head takes bfloat16, float16 or float32 hidden states, got {x.dtype}")
        if x.ndim == 0 or x.shape[-1] != self.in_features:
            raise ValueError(f"FP8Head expects hidden states [..., {self.in_features}], got shape {tuple(x.shape)}")
        if x.device != self._fp8_data.device:
            raise ValueError(f"hidden states are on {x.device} but the FP8 head's weight and scales are on "
                             f"{self._fp8_data.device}; move the whole head module with .to(device)")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self._check_input(x)
        out_dtype = self.out_dtype or x.dtype
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features)
        if x2.shape[0] == 0:
            return x.new_empty(*lead, self.out_features, dtype=out_dtype)
        out = self._backend.fn(x2, self.fp8_weight, out_dtype)
        return out.reshape(*lead, self.out_features)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"granularity={self.granularity!r}, backend={self.backend!r}, out_dtype={self.out_dtype}")


# ----------------------------------------------------------------------- parity and provenance

@dataclass(frozen=True)
class LogitParity:
    """How close a head's logits are to a reference head's, over `rows` rows of logits."""

    rows: int
    rel_err: float          # ||ours - ref|| / ||ref|| over all rows (Frobenius), fp64
    max_row_rel_err: float  # the worst row's ||ours - ref|| / ||ref||
    top1_agreement: float   # fraction of rows whose argmax is the same
    top5_overlap: float     # mean |top5(ours) & top5(ref)| / 5
    nonfinite_rows: int     # rows where ours is non-finite but the reference is finite

    def violations(self, *, max_rel_err: float, min_top1: float, min_top5: float) -> list[str]:
        out = []
        if self.nonfinite_rows:
            out.append(f"{self.nonfinite_rows} row(s) non-finite where the reference is finite")
        if not self.rel_err <= max_rel_err:  # NaN fails
            out.append(f"relative error {self.rel_err:.4g} > {max_rel_err:.4g}")
        if not self.top1_agreement >= min_top1:
            out.append(f"top-1 agreement {self.top1_agreement:.4f} < {min_top1:.4f}")
        if not self.top5_overlap >= min_top5:
            out.append(f"top-5 overlap {self.top5_overlap:.4f} < {min_top5:.4f}")
        return out

    def check(self, *, max_rel_err: float, min_top1: float, min_top5: float, what: str = "head") -> "LogitParity":
        bad = self.violations(max_rel_err=max_rel_err, min_top1=min_top1, min_top5=min_top5)
        if bad:
            raise AssertionError(f"{what} parity failed: {'; '.join(bad)} ({self})")
        return self

    def __str__(self) -> str:
        return (f"rows={self.rows} rel_err={self.rel_err:.4g} max_row_rel_err={self.max_row_rel_err:.4g} "
                f"top1={self.top1_agreement:.4f} top5={self.top5_overlap:.4f} nonfinite_rows={self.nonfinite_rows}")


@torch.no_grad()
def compare_logits(ours: torch.Tensor, ref: torch.Tensor, k: int = 5) -> LogitParity:
    """Parity of logits `ours` against `ref` (same shape [..., V]); computed in float64 on the CPU."""
    if ours.shape != ref.shape:
        raise ValueError(f"logits shapes differ: {tuple(ours.shape)} vs {tuple(ref.shape)}")
    if ours.ndim == 0 or ours.numel() == 0:
        raise ValueError("no logits to compare")
    a = ours.detach().reshape(-1, ours.shape[-1]).to("cpu", torch.float64)
    b = ref.detach().reshape(-1, ref.shape[-1]).to("cpu", torch.float64)
    ref_ok = torch.isfinite(b).all(dim=1)
    ours_ok = torch.isfinite(a).all(dim=1)
    both = ref_ok & ours_ok
    a_, b_ = a[both], b[both]
    if a_.shape[0]:
        diff = (a_ - b_).norm(dim=1)
        norms = b_.norm(dim=1)
        rel = (diff.norm() / norms.norm()).item()
        max_row = (diff / norms.clamp(min=torch.finfo(torch.float64).tiny)).max().item()
        top1 = (a_.argmax(dim=1) == b_.argmax(dim=1)).double().mean().item()
        kk = min(k, a_.shape[1])
        ta, tb = a_.topk(kk, dim=1).indices, b_.topk(kk, dim=1).indices
        overlap = (ta.unsqueeze(2) == tb.unsqueeze(1)).any(dim=2).sum(dim=1).double() / kk
        top5 = overlap.mean().item()
    else:
        rel = max_row = top1 = top5 = math.nan
    return LogitParity(rows=a.shape[0], rel_err=rel, max_row_rel_err=max_row, top1_agreement=top1,
                       top5_overlap=top5, nonfinite_rows=int((ref_ok & ~ours_ok).sum()))


def require_head_backend(prov: backends.Provenance, expected: str) -> None:
    """Assert from provenance that the head ran, and only through `expected` (e.g. "fp8-triton")."""
    expected = HEAD_BACKEND_ALIASES.get(expected, expected)
    ran = prov.backends("head")
    if ran == {expected}:
        return
    if not ran:
        raise AssertionError(f"head backend {expected!r} was requested but no head call was recorded")
    why = " (a silent fallback to the unquantized bf16 head)" if "bf16" in ran and expected != "bf16" else ""
    raise AssertionError(f"head backend {expected!r} was requested but provenance shows {sorted(ran)}{why}; "
                         f"kernels: {sorted(prov.kernels('head'))}")
