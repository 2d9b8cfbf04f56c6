"""Top-k expert routing: softmax (Mixtral/Qwen) and sigmoid grouped (DeepSeek-V3/GLM-4.5/Ling).

Both return (weights fp32 [T, k], ids int64 [T, k]); the weights already include
renormalization and the routed scaling factor, so a MoE kernel only multiplies and sums.
"""

from __future__ import annotations

import torch


def _check_logits(logits: torch.Tensor, top_k: int) -> None:
    if logits.dim() != 2:
        raise ValueError(f"router logits must be [tokens, experts], got shape {tuple(logits.shape)}")
    if not logits.is_floating_point():
        raise TypeError(f"router logits must be floating point, got {logits.dtype}")
    if not 1 <= top_k <= logits.shape[1]:
        raise ValueError(f"top_k must be in [1, {logits.shape[1]}] experts, got {top_k}")


def softmax_topk(logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    _check_logits(logits, top_k)
    probs = torch.softmax(logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def sigmoid_grouped_topk(
    logits: torch.Tensor,
    top_k: int,
    n_group: int = 1,
    topk_group: int = 1,
    bias: torch.Tensor | None = None,
    routed_scaling_factor: float = 1.0,
    renormalize: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Experts are chosen by sigmoid score + correction bias, restricted to the `topk_group`
    groups whose two best biased scores sum highest; weights are the unbiased scores."""
    _check_logits(logits, top_k)
    num_tokens, num_experts = logits.shape
    if n_group < 1 or num_experts % n_group or not 1 <= topk_group <= n_group:
        raise ValueError(f"{num_experts} experts cannot form {n_group} groups with topk_group={topk_group}")
    if top_k > topk_group * (num_experts // n_group):
        raise ValueError(f"top_k ({top_k}) exceeds the {topk_group * (num_experts // n_group)} experts in the "
                         f"{topk_group} kept group(s) of {num_experts // n_group}")
    if bias is not None and bias.shape != (num_experts,):
        raise ValueError(f"correction bias must have shape ({num_experts},), got {tuple(bias.shape)}")
    scores = torch.sigmoid(logits.float())
    choice = scores if bias is None else scores + bias.float()
    if n_group > 1:
        per_group = num_experts // n_group
        grouped = choice.view(num_tokens, n_group, per_group)
        group_scores = grouped.topk(min(2, per_group), dim=-1).values.sum(dim=-1)
        group_ids = group_scores.topk(topk_group, dim=-1).indices
        keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, group_ids, True)
        choice = choice.masked_fill(~keep.repeat_interleave(per_group, dim=1), float("-inf"))
    ids = choice.topk(top_k, dim=-1).indices
    weights = scores.gather(1, ids)
    if renormalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * routed_scaling_factor, ids
