"""Expert-parallel token dispatch: all-to-all to the ranks that own the experts, and back.

Experts are split into ``ep`` contiguous blocks of ``n / ep``; rank r of the expert-parallel group owns
experts ``[r n/ep, (r+1) n/ep)``. One MoE forward on every rank of the group:

1. sort this rank's ``m k`` (token, expert) slots by expert id -- which also groups them by owner rank;
2. exchange the per-expert counts (one ``all_to_all_single`` of ``n`` int64 per rank) and read the split
   sizes on the host (the only host sync; every rank derives its splits from the same exchanged counts,
   so ranks cannot disagree on split sizes);
3. ``all_to_all_single`` the token rows (autograd-aware: the backward is the reverse exchange);
4. regroup the received rows (ordered by source rank, then local expert) by local expert, run the local
   experts with one grouped matmul, undo the regrouping;
5. reverse ``all_to_all_single``, put rows back in slot order; the caller combines them with the gate
   weights in float32.

Works on any backend with ``all_to_all_single`` and uneven splits (gloo on CPU, NCCL on GPU).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from k3lit.ops.routing import expert_counts

__all__ = ["all_to_all", "expert_parallel_apply", "ExpertParallelDispatch"]


class _AllToAll(torch.autograd.Function):
    """``all_to_all_single`` with uneven splits; backward runs the exchange in reverse."""

    @staticmethod
    def forward(ctx, x, out_splits, in_splits, group):  # noqa: ANN001, ANN205, D102
        ctx.out_splits, ctx.in_splits, ctx.group = out_splits, in_splits, group
        out = x.new_empty(sum(out_splits), *x.shape[1:])
        dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):  # noqa: ANN001, ANN205, D102
        back = grad.new_empty(sum(ctx.in_splits), *grad.shape[1:])
        dist.all_to_all_single(back, grad.contiguous(), ctx.in_splits, ctx.out_splits, group=ctx.group)
        return back, None, None, None


def all_to_all(
    x: torch.Tensor, out_splits: list[int], in_splits: list[int], group: dist.ProcessGroup | None
) -> torch.Tensor:
    """Differentiable ``all_to_all_single``: ``x [sum(in_splits), ...]`` -> ``[sum(out_splits), ...]``.

    ``in_splits[r]`` rows go to rank r, ``out_splits[r]`` rows come from rank r (rank order in the output).
    """
    return _AllToAll.apply(x, out_splits, in_splits, group)


def expert_parallel_apply(
    h: torch.Tensor, expert_idx: torch.Tensor, experts: nn.Module, n_experts: int, group: dist.ProcessGroup
) -> torch.Tensor:
    """Run every selected (token, expert) slot on the rank that owns the expert.

    Args:
        h: ``[m, D]`` this rank's tokens (any float dtype; sent as is).
        expert_idx: ``[m, k]`` int64 global expert ids, -1 for a dropped slot (capacity mode).
        experts: ``forward(xs [M, D] sorted by local expert, offsets [n/ep] int32) -> [M, D]`` over this
            rank's ``n / ep`` experts (a :class:`k3lit.nn.moe.GroupedExperts` sharded on dim 0). Called
            exactly once on every rank, also with zero rows, so FSDP collectives inside it stay matched.
        n_experts: n, divisible by the group size.
        group: the expert-parallel process group (every rank of it calls this function).

    Returns:
        ``[m, k, D]`` expert outputs in slot order (zeros for dropped slots), differentiable with respect to
        ``h`` and the expert weights.

    Raises:
        ValueError: ``n_experts`` not divisible by the group size.
    """
    ep = dist.get_world_size(group)
    if n_experts % ep:
        raise ValueError(f"expert parallelism: n_experts={n_experts} is not divisible by ep={ep}")
    n_local = n_experts // ep
    m, k = expert_idx.shape
    flat = expert_idx.reshape(-1)
    flat = torch.where(flat < 0, n_experts, flat)  # dropped slots sort last and are sent nowhere
    order = flat.argsort(stable=True)  # sorted slot -> original slot
    counts = expert_counts(flat, n_experts + 1)[:n_experts]  # [n] slots per global expert
    recv = torch.empty_like(counts)
    dist.all_to_all_single(recv, counts, group=group)  # recv[s * n_local + e]: from rank s for local e
    recv = recv.view(ep, n_local)
    splits = torch.cat([counts.view(ep, n_local).sum(1), recv.sum(1)]).tolist()  # the one host sync
    send_splits, recv_splits = splits[:ep], splits[ep:]
    kept = order[: sum(send_splits)]

    xs = all_to_all(h[kept // k], recv_splits, send_splits, group)  # [R, D] by (source rank, local expert)
    local = torch.arange(n_local, device=h.device).repeat(ep).repeat_interleave(recv.reshape(-1))  # [R]
    regroup = local.argsort(stable=True)
    ys = experts(xs[regroup], recv.sum(0).cumsum(0).to(torch.int32))  # [R, D] by local expert
    ys = torch.empty_like(ys).index_copy(0, regroup, ys)  # back to (source rank, local expert) order
    ys = all_to_all(ys, send_splits, recv_splits, group)  # [kept, D] in sorted-slot order
    return ys.new_zeros(m * k, ys.shape[-1]).index_copy(0, kept, ys).view(m, k, -1)


class ExpertParallelDispatch:
    """The :attr:`k3lit.nn.MoE.dispatcher` of expert parallelism: :func:`expert_parallel_apply` over ``group``
    (set by :func:`k3lit.parallel.parallelize` together with sharding the experts on dim 0)."""

    def __init__(self, group: dist.ProcessGroup) -> None:
        self.group = group

    def __call__(self, h: torch.Tensor, expert_idx: torch.Tensor, experts: nn.Module, n_experts: int) -> torch.Tensor:
        return expert_parallel_apply(h, expert_idx, experts, n_experts, self.group)
