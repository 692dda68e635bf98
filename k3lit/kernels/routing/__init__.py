"""Triton kernels of MoE routing, importable as ``k3lit.kernels.routing``: causal capacity admission
(``capacity.py``) and the slots' sort by expert (``sort.py``), registered as the torch custom ops
``k3lit::causal_capacity`` and ``k3lit::sort_slots`` so ``torch.compile`` keeps them in its graph."""

from __future__ import annotations

import torch

from k3lit.kernels.routing import sort
from k3lit.kernels.routing.capacity import causal_capacity

__all__ = ["causal_capacity_triton", "sort_slots_triton"]


@torch.library.custom_op("k3lit::causal_capacity", mutates_args=())
def _causal_capacity(scores: torch.Tensor, bias: torch.Tensor, k: int, cap: int,
                     seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    return causal_capacity(scores, bias, k, cap, seq_len)


@_causal_capacity.register_fake
def _(scores, bias, k, cap, seq_len):
    return scores.new_empty(scores.shape[0], k, dtype=torch.int64), scores.new_empty(2, dtype=torch.int64)


def causal_capacity_triton(scores: torch.Tensor, bias: torch.Tensor, k: int, cap: int,
                           seq_len: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(expert_idx [m, k] int64, rerouted [] int64, dropped [] int64)`` of causal capacity routing (see
    :func:`k3lit.ops.routing.causal_capacity_route`, which checks the arguments), in two launches."""
    idx, stats = _causal_capacity(scores.detach(), bias.detach(), k, cap, seq_len)
    return idx, stats[0], stats[1]


@torch.library.custom_op("k3lit::sort_slots", mutates_args=())
def sort_slots_triton(expert_idx: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(order, inverse, ends)`` of :func:`k3lit.ops.permute.sort_slots`, a counting sort in two launches."""
    return sort.sort_slots(expert_idx, n)


@sort_slots_triton.register_fake
def _(expert_idx, n):
    slots = expert_idx.numel()
    return (expert_idx.new_empty(slots, dtype=torch.int64), expert_idx.new_empty(slots, dtype=torch.int64),
            expert_idx.new_empty(n, dtype=torch.int32))
