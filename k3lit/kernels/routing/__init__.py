"""Triton kernel of MoE routing, importable as ``k3lit.kernels.routing``: causal capacity admission, registered as
the torch custom op ``k3lit::causal_capacity`` so ``torch.compile`` keeps it in its graph. Algorithm:
``capacity.py``."""

from __future__ import annotations

import torch

from k3lit.kernels.routing.capacity import causal_capacity

__all__ = ["causal_capacity_triton"]


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
