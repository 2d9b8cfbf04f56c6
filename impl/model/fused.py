"""Several Linears of one module read as one GEMV: their weights moved into one tensor, each
Linear's weight a view of its rows, so names, state_dict and loading stay as they were while a
decode token reads every input projection of an attention layer with one launch instead of one
per projection (on the H200 a bf16 GEMV of a few MB is launch- and tail-bound)."""

from __future__ import annotations

import torch
from torch import nn

from impl.model.gemv import linear


@torch.no_grad()
def fuse_linears(module: nn.Module, names: tuple[str, ...]) -> torch.Tensor | None:
    """Make the weights of `module`'s bias-free Linears `names` row blocks of one new tensor (in
    that order) and return it; None (nothing changed) when one of them has a bias."""
    linears = [module.get_submodule(n) for n in names]
    if any(lin.bias is not None for lin in linears):
        return None
    fused = torch.cat([lin.weight.data for lin in linears])
    start = 0
    for lin in linears:
        rows = lin.weight.shape[0]
        lin.weight = nn.Parameter(fused[start:start + rows], requires_grad=lin.weight.requires_grad)
        start += rows
    return fused


def fused_linear(module: nn.Module, names: tuple[str, ...], fused: torch.Tensor | None,
                 x: torch.Tensor) -> torch.Tensor:
    """The outputs of `module`'s Linears `names` on x, concatenated on the last dim: one GEMV over
    `fused` while every weight is still its view (a later .to() or load replaces the parameters,
    the fused tensor goes stale, and the Linears run one by one)."""
    backend = getattr(module, "projection_backend", None)
    if fused is not None:
        offset, base, step = 0, fused.data_ptr(), fused.stride(0) * fused.element_size()
        for n in names:
            w = module.get_submodule(n).weight
            if w.data_ptr() != base + offset * step or w.dtype != fused.dtype:
                break
            offset += w.shape[0]
        else:
            return linear(x, fused, backend=backend)
    return torch.cat([linear(x, lin.weight, lin.bias, backend) for lin in map(module.get_submodule, names)], dim=-1)
