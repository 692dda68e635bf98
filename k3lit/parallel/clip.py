"""Gradient-norm clipping for a model whose gradients are DTensors on different meshes.

Under :func:`k3lit.parallel.parallelize` the dense gradients are sharded over the flattened
``data_parallel x expert_parallel`` mesh and the expert gradients over the 2-D ``(data_parallel,
expert_parallel)`` mesh; with hybrid sharding both meshes get a leading ``data_parallel_replicate`` axis on
which the gradients are replicated. ``torch.nn.utils.clip_grad_norm_`` cannot stack norms that live on
different meshes, and a per-rank norm of the local shards would be wrong: the total norm must add the squares
of *every* shard exactly once. We group gradients by mesh, let DTensor reduce each group's norm over its own
mesh (``get_total_norm`` returns a partial DTensor; ``full_tensor`` reduces it over the sharded axes only, never
over replicated ones, so replicas are not counted twice), and combine the groups:
``||g|| = (Σ_groups ||g_group||^p)^(1/p)``.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch.distributed.tensor import DTensor

__all__ = ["total_grad_norm", "clip_grad_norm_"]


def _groups(params: Iterable[torch.nn.Parameter]) -> dict[object, list[torch.nn.Parameter]]:
    out: dict[object, list[torch.nn.Parameter]] = {}
    for p in params:
        if p.grad is None:
            continue
        key = (p.grad.device_mesh, p.grad.placements) if isinstance(p.grad, DTensor) else None
        out.setdefault(key, []).append(p)
    return out


def total_grad_norm(params: Iterable[torch.nn.Parameter], norm_type: float = 2.0) -> torch.Tensor:
    """The p-norm of all gradients of ``params`` as one vector, identical on every rank.

    Args:
        params: parameters (plain tensors or DTensors on any meshes); those without ``.grad`` are skipped.
        norm_type: p (``inf`` allowed).

    Returns:
        ``[]`` float32 plain tensor on the gradients' device (zero if no gradient).
    """
    norms = []
    for group in _groups(params).values():
        n = torch.nn.utils.get_total_norm([p.grad for p in group], norm_type, foreach=False)
        if isinstance(n, DTensor):
            n = n.full_tensor()
        norms.append(n.float())
    if not norms:
        return torch.zeros(())
    stacked = torch.stack([n.to(norms[0].device) for n in norms])
    if norm_type == float("inf"):
        return stacked.max()
    return stacked.pow(norm_type).sum().pow(1.0 / norm_type)


@torch.no_grad()
def clip_grad_norm_(params: Iterable[torch.nn.Parameter], max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
    """Scale all gradients by ``min(1, max_norm / (total_norm + 1e-6))``; return the total norm (pre-clip).

    Same contract as ``torch.nn.utils.clip_grad_norm_``, correct across expert and data shards.
    """
    params = [p for p in params if p.grad is not None]
    total = total_grad_norm(params, norm_type)
    coef = (max_norm / (total + 1e-6)).clamp(max=1.0)
    for p in params:
        g = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
        g.mul_(coef.to(g.device, g.dtype))
    return total
