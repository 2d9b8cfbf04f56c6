"""Routing grouped by expert ("slots"), what the Triton expert kernels consume: each chosen
expert gets one slot however many tokens chose it, so its weights are read once per call.

`write_slots` is the grouping as a Triton function (the router's top-k kernel calls it on its
own choices); `moe_slots_kernel` applies it to routing given as ids/weights, for the backend
that takes the model's routing.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from impl.moe.moe_launch_config import M_PAD
from impl.triton_env import tl, triton


@triton.jit
def write_slots(expert, weight, valid, token, slot_expert_ptr, slot_weight_ptr, slot_tokens_ptr, num_slots,
                P_PAD: tl.constexpr, S_PAD: tl.constexpr, M_PAD: tl.constexpr):
    """Pairs (token, expert) [P_PAD] -> slots: slot_expert[s] (-1 if unused), slot_weight[s, m]
    (sum of token m's weights for that expert) and slot_tokens[s] (bit m set if token m chose it).
    Called by a single program. Returns the number of slots used (they come first)."""
    offs_p = tl.arange(0, P_PAD)
    same = (expert[:, None] == expert[None, :]) & valid[:, None] & valid[None, :]
    seen_before = tl.sum((same & (offs_p[None, :] < offs_p[:, None])).to(tl.int32), axis=1)
    first = valid & (seen_before == 0)
    first_slot = tl.cumsum(first.to(tl.int32), axis=0) - 1
    slot = tl.max(tl.where(same & first[None, :], first_slot[None, :], -1), axis=1)
    offs_s = tl.arange(0, S_PAD)
    tl.store(slot_expert_ptr + offs_s, tl.full((S_PAD,), -1, tl.int32), mask=offs_s < num_slots)
    tl.store(slot_tokens_ptr + offs_s, tl.zeros((S_PAD,), tl.int32), mask=offs_s < num_slots)
    offs_sm = tl.arange(0, S_PAD * M_PAD)
    tl.store(slot_weight_ptr + offs_sm, tl.zeros((S_PAD * M_PAD,), tl.float32), mask=offs_sm < num_slots * M_PAD)
    tl.debug_barrier()
    tl.store(slot_expert_ptr + first_slot, expert, mask=first)
    tl.atomic_add(slot_weight_ptr + slot * M_PAD + token, weight, mask=valid)
    tl.atomic_or(slot_tokens_ptr + slot, 1 << token, mask=valid)
    tl.static_assert(M_PAD <= 31)  # slot_tokens is a 32-bit mask of tokens
    return tl.sum(first.to(tl.int32), axis=0)


@triton.jit
def moe_slots_kernel(ids_ptr, weights_ptr, slot_expert_ptr, slot_weight_ptr, slot_tokens_ptr,
                     num_pairs, top_k, num_slots,
                     P_PAD: tl.constexpr, S_PAD: tl.constexpr, M_PAD: tl.constexpr):
    """Slots from routing given as ids/weights [M, k] (one program)."""
    offs_p = tl.arange(0, P_PAD)
    valid = offs_p < num_pairs
    expert = tl.load(ids_ptr + offs_p, mask=valid, other=-1).to(tl.int32)
    weight = tl.load(weights_ptr + offs_p, mask=valid, other=0.0)
    write_slots(expert, weight, valid, offs_p // top_k, slot_expert_ptr, slot_weight_ptr, slot_tokens_ptr,
                num_slots, P_PAD, S_PAD, M_PAD)


@dataclass(frozen=True)
class Slots:
    """Routing grouped by expert, on the device."""

    expert: torch.Tensor  # int32 [S]: expert of each slot, -1 if unused
    weight: torch.Tensor  # fp32 [S, M_PAD]: routing weight of token m for the slot's expert
    tokens: torch.Tensor  # int32 [S]: bit m set if token m chose the slot's expert
    num_tokens: int
    top_k: int

    @classmethod
    def empty(cls, num_tokens: int, top_k: int, experts: int, device) -> "Slots":
        n = min(num_tokens * top_k, experts)
        return cls(torch.empty(n, dtype=torch.int32, device=device),
                   torch.empty(n, M_PAD, dtype=torch.float32, device=device),
                   torch.empty(n, dtype=torch.int32, device=device), num_tokens, top_k)

    @property
    def num_slots(self) -> int:
        return self.expert.shape[0]


def slots_from_routing(weights: torch.Tensor, ids: torch.Tensor, experts: int) -> Slots:
    """The slots of routing given as weights/ids [M, k], M <= M_PAD (one launch)."""
    m, top_k = ids.shape
    slots = Slots.empty(m, top_k, experts, ids.device)
    moe_slots_kernel[(1,)](ids.contiguous(), weights.float().contiguous(), slots.expert, slots.weight, slots.tokens,
                           m * top_k, top_k, slots.num_slots, P_PAD=max(1, triton.next_power_of_2(m * top_k)),
                           S_PAD=max(1, triton.next_power_of_2(slots.num_slots)), M_PAD=M_PAD, num_warps=4)
    return slots
