"""Token permutation of an MoE layer: (token, expert) slots sorted by expert, and back, as gathers only.

With ``m`` tokens and ``k`` experts per token, slot ``s = i k + r`` is token ``i``'s ``r``-th choice. ``order``
sorts the slots by expert (``order[p]`` = the slot at sorted position ``p``) and ``inverse`` undoes it
(``inverse[order[p]] = p``). Then

    dispatch:  xs[p] = h[order[p] // k]            ``[m, D] -> [m k, D]``
    undo:      y[s]  = ys[inverse[s]]               ``[m k, D] -> [m k, D]``

Both are gathers, and so are their gradients: ``dh[i] = Σ_r dxs[inverse[i k + r]]`` (every token owns exactly
``k`` slots) and ``dys[p] = dy[order[p]]``. Plain indexing would differentiate them into ``index_put`` with
accumulation, which sorts the indices again (or adds with atomics) in every backward.
"""

from __future__ import annotations

import torch

from k3lit.kernels import use_triton
from k3lit.ops.routing import expert_counts

__all__ = ["sort_slots", "dispatch_tokens", "undo_sort"]


def sort_slots(expert_idx: torch.Tensor, n: int, *, backend: str = "auto"
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The ``m k`` slots of ``expert_idx [m, k]`` sorted stably by expert, dropped slots (-1) after every expert.

    Args:
        expert_idx: ``[m, k]`` int64 experts in ``[0, n)``, or -1 for a dropped slot.
        n: experts.
        backend: ``"auto"`` (the Triton counting sort of ``k3lit.kernels.routing`` on CUDA tensors, a stable
            ``argsort`` elsewhere), ``"triton"`` (also CPU tensors under ``TRITON_INTERPRET=1``) or ``"torch"``.

    Returns:
        ``(order [m k] int64, inverse [m k] int64, ends [n] int32)``: ``order`` sorted position -> slot,
        ``inverse`` slot -> sorted position, ``ends[e]`` the end of expert e's sorted rows (the grouped product's
        offsets). Both backends return the same tensors.

    Raises:
        ValueError: ``expert_idx`` not a 2-D int64 tensor, an unknown backend, or ``"triton"`` for tensors no Triton
            kernel runs on. Values outside ``[-1, n)`` are not checked (that would synchronise the host).
    """
    if expert_idx.dim() != 2 or expert_idx.dtype != torch.int64:
        raise ValueError(f"expert_idx must be a [m, k] int64 tensor, got {expert_idx.dtype} of shape "
                         f"{tuple(expert_idx.shape)}")
    if use_triton(expert_idx, backend):
        from k3lit.kernels.routing import sort_slots_triton

        return sort_slots_triton(expert_idx, n)
    flat = expert_idx.reshape(-1)
    flat = torch.where(flat < 0, n, flat)  # dropped slots sort last, into no expert's rows
    order = flat.argsort(stable=True)
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(order.numel(), device=order.device)
    return order, inverse, expert_counts(flat, n + 1)[:n].cumsum(0).to(torch.int32)


class _Dispatch(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h, order, inverse, k):  # noqa: ANN001, ANN205, D102
        ctx.save_for_backward(inverse)
        ctx.k = k
        return h.index_select(0, order // k)

    @staticmethod
    def backward(ctx, dxs):  # noqa: ANN001, ANN205, D102
        (inverse,) = ctx.saved_tensors
        m = inverse.numel() // ctx.k
        return dxs.index_select(0, inverse).view(m, ctx.k, -1).sum(1), None, None, None


class _Undo(torch.autograd.Function):
    @staticmethod
    def forward(ctx, ys, order, inverse):  # noqa: ANN001, ANN205, D102
        ctx.save_for_backward(order)
        return ys.index_select(0, inverse)

    @staticmethod
    def backward(ctx, dy):  # noqa: ANN001, ANN205, D102
        (order,) = ctx.saved_tensors
        return dy.index_select(0, order), None, None


def dispatch_tokens(h: torch.Tensor, order: torch.Tensor, inverse: torch.Tensor, k: int) -> torch.Tensor:
    """``xs[p] = h[order[p] // k]``: ``h [m, D]`` -> ``[m k, D]`` rows in expert order, differentiable in ``h``
    (the gradient sums each token's ``k`` rows, gathered through ``inverse``)."""
    return _Dispatch.apply(h, order, inverse, k)


def undo_sort(ys: torch.Tensor, order: torch.Tensor, inverse: torch.Tensor) -> torch.Tensor:
    """``y[s] = ys[inverse[s]]``: ``ys [m k, D]`` in expert order -> slot order, differentiable in ``ys``."""
    return _Undo.apply(ys, order, inverse)
