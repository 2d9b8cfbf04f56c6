"""The oracle MoE: SwiGLU experts, weighted combine, optional shared expert, in fp32.

Deliberately simple (a loop over the experts that were chosen) so that every faster
implementation can be checked against it. Weights may be given dequantized in any float dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from impl.quant.mxfp4 import MXFP4Tensor


def logical_weight(w) -> torch.Tensor:
    """A tensor standing for `w`'s logical shape, dtype class and device: `w` itself, or for an
    MXFP4Tensor a zero-stride fp32 view (no memory) of its dequantized shape."""
    if isinstance(w, MXFP4Tensor):
        return torch.empty(1, device=w.packed.device).expand(w.shape)
    return w


def expert_weight(w, expert: int) -> torch.Tensor:
    """Expert `expert` of a routed weight [E, N, K] in fp32, dequantizing only that expert."""
    if isinstance(w, MXFP4Tensor):
        return MXFP4Tensor(w.packed[expert], w.scales[expert]).dequantize(torch.float32)
    return w[expert].float()


def check_moe_inputs(x: torch.Tensor, weights: torch.Tensor | None, ids: torch.Tensor | None,
                     w_gate_up: torch.Tensor, w_down: torch.Tensor, check_ids: bool = True) -> None:
    """Raise a named error for any shape, dtype or device mismatch between the MoE operands.
    `check_ids` reads the ids' range back to the host: leave it off inside a CUDA graph capture.
    Routing None (weights and ids): a layer that routes itself; x and the weights are checked."""
    if x.dim() != 2:
        raise ValueError(f"x must be [tokens, hidden], got shape {tuple(x.shape)}")
    tokens, hidden = x.shape
    if w_gate_up.dim() != 3 or w_down.dim() != 3:
        raise ValueError(f"expert weights must be [E, 2I, H] and [E, H, I], got "
                         f"{tuple(w_gate_up.shape)} and {tuple(w_down.shape)}")
    experts, two_i, h = w_gate_up.shape
    if h != hidden or two_i % 2:
        raise ValueError(f"gate_up weight {tuple(w_gate_up.shape)} does not fit hidden size {hidden}")
    if w_down.shape != (experts, hidden, two_i // 2):
        raise ValueError(f"down weight must be {(experts, hidden, two_i // 2)}, got {tuple(w_down.shape)}")
    routed = weights is not None or ids is not None
    if routed and (ids is None or weights is None or ids.shape != weights.shape or ids.dim() != 2
                   or ids.shape[0] != tokens):
        raise ValueError(f"routing ids {None if ids is None else tuple(ids.shape)} and weights "
                         f"{None if weights is None else tuple(weights.shape)} must both be [{tokens}, top_k]")
    if routed and ids.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"routing ids must be int32 or int64, got {ids.dtype}")
    for name, t in (("x", x), ("routing weights", weights), ("gate_up weight", w_gate_up),
                    ("down weight", w_down)):
        if t is not None and not t.is_floating_point():
            raise TypeError(f"{name} must be floating point, got {t.dtype}")
    devices = {t.device for t in (x, weights, ids, w_gate_up, w_down) if t is not None}
    if len(devices) > 1:
        raise ValueError(f"MoE operands are on different devices: {sorted(map(str, devices))}")
    if routed and check_ids and ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= experts):
        raise ValueError(f"expert ids must be in [0, {experts}), got range "
                         f"[{int(ids.min())}, {int(ids.max())}]")


def swiglu_act(gate: torch.Tensor, up: torch.Tensor, limit: float | None = None) -> torch.Tensor:
    """silu(gate) * up; with a clipping `limit` (Ling 3.0's late layers, as transformers'
    bailing_hybrid computes it) silu(gate) is capped at the limit and up clamped to +-limit."""
    act = F.silu(gate)
    if limit is not None:
        act, up = act.clamp(max=limit), up.clamp(-limit, limit)
    return act * up


def swiglu(x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor, limit: float | None = None) -> torch.Tensor:
    """down(silu(gate(x)) * up(x)) with gate and up stacked as [2I, H] (gate first), clipped at `limit`."""
    gate, up = F.linear(x, w_gate_up).chunk(2, dim=-1)
    return F.linear(swiglu_act(gate, up, limit), w_down)


def moe_reference(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                  w_gate_up, w_down, shared=None, swiglu_limit: float | None = None) -> torch.Tensor:
    """sum_j weights[t, j] * expert_{ids[t, j]}(x[t]) (+ shared expert), computed in fp32,
    returned in x's dtype. Weights may be plain tensors or MXFP4Tensor (dequantized here). The
    routed experts clip at `swiglu_limit`, the shared one at its own `limit`."""
    check_moe_inputs(x, weights, ids, logical_weight(w_gate_up), logical_weight(w_down))
    xf = x.float()
    out = torch.zeros_like(xf)
    for expert in torch.unique(ids).tolist():
        token_idx, slot = torch.where(ids == expert)
        y = swiglu(xf[token_idx], expert_weight(w_gate_up, expert), expert_weight(w_down, expert), swiglu_limit)
        out.index_add_(0, token_idx, y * weights[token_idx, slot, None].float())
    if shared is not None:
        out += swiglu(xf, torch.cat((shared.gate, shared.up)).float(), shared.down.float(), shared.limit)
    return out.to(x.dtype)


class InputSnapshot:
    """What a MoE backend's inputs held before its call, to check after it that it changed none of
    them: a backend that renormalizes the routing weights or uses x as scratch in place computes
    from inputs no other caller expects, and an oracle run after it would share the damage.
    Small tensors are copied whole; the routed experts (GBs at the Ling shapes) by the sum of
    their bytes and a strided sample of 4096 elements."""

    WHOLE = 1 << 20  # elements up to which a tensor is copied whole

    def __init__(self, **inputs) -> None:
        self._held = {name: self._take(value) for name, value in inputs.items()}

    @classmethod
    def _tensors(cls, value) -> dict[str, torch.Tensor]:
        if value is None:
            return {}
        if isinstance(value, torch.Tensor):
            return {"": value}
        if isinstance(value, MXFP4Tensor):
            return {".packed": value.packed, ".scales": value.scales}
        return {f".{k}": v for k, v in vars(value).items() if isinstance(v, torch.Tensor)}  # a SharedExpert

    @classmethod
    def _take(cls, value):
        return {part: cls._digest(t) for part, t in cls._tensors(value).items()}

    @classmethod
    def _digest(cls, t: torch.Tensor):
        if t.numel() <= cls.WHOLE:
            return t.detach().clone()
        flat = t.detach().reshape(-1)
        step = max(1, flat.numel() // 4096)
        return int(flat.view(torch.uint8).sum(dtype=torch.int64)), flat[::step][:4096].clone()

    def changed(self, **inputs) -> list[str]:
        """The names (with their part: `.scales`, `.gate`) of the inputs whose values differ now."""
        out = []
        for name, value in inputs.items():
            for part, now in self._take(value).items():
                before = self._held[name][part]
                same = (_same_bits(before, now) if isinstance(before, torch.Tensor)
                        else before[0] == now[0] and _same_bits(before[1], now[1]))
                if not same:
                    out.append(name + part)
        return out


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal bit for bit (a NaN equals the same NaN, which == would not say)."""
    return (a.shape == b.shape and a.dtype == b.dtype
            and torch.equal(a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8)))
