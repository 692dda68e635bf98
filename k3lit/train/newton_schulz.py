"""Muon's orthogonalisation of many matrix blocks at once: the quintic Newton-Schulz iteration of
``torch.optim.Muon``, batched over every block of the same shape, so that one optimizer step runs a few batched
matrix products per distinct block shape instead of 15 small ones per block (an MoE layer of 16 experts holds 48
blocks)."""

from __future__ import annotations

import math
from collections import defaultdict

import torch

NS_COEFFICIENTS = (3.4445, -4.775, 2.0315)  # the quintic Newton-Schulz iteration of torch.optim.Muon
NS_EPS = 1e-7  # torch.optim.Muon's floor on the norm the iteration divides by


def newton_schulz(x: torch.Tensor, steps: int) -> torch.Tensor:
    """Approximate orthogonalisation ``U S' V^T`` (``S'`` near one) of every matrix of a batch, in bfloat16.

    Per matrix ``X`` (wide orientation: a tall one is transposed first and back at the end):
    ``X <- X / max(||X||_F, eps)``, then ``steps`` times ``G = X X^T``, ``X <- a X + (b G + c G G) X`` with
    ``(a, b, c)`` = :data:`NS_COEFFICIENTS`: the operations of ``torch.optim.Muon``'s iteration, one batched
    product for all matrices where it runs one product per matrix. The results equal torch's to the bit but where
    a batched product rounds an element differently in the last bfloat16 bit (rare; seen on matrices of 2-3 rows).

    Args:
        x: ``[N, A, C]`` matrices of one shape, any float dtype.
        steps: Newton-Schulz iterations (torch's Muon: 5).

    Returns:
        ``[N, A, C]`` bfloat16.
    """
    if x.dim() != 3:
        raise ValueError(f"newton_schulz takes [N, A, C] matrices, got shape {tuple(x.shape)}")
    a, b, c = NS_COEFFICIENTS
    y = x.bfloat16()
    tall = y.shape[-2] > y.shape[-1]
    if tall:
        y = y.mT
    y = y / torch.linalg.vector_norm(y, dim=(-2, -1), keepdim=True).clamp(min=NS_EPS)
    for _ in range(steps):
        gram = torch.bmm(y, y.mT)
        y = torch.baddbmm(y, torch.baddbmm(gram, gram, gram, beta=b, alpha=c), y, beta=a)
    return y.mT if tall else y


def orthogonalized_updates(updates: list[tuple[torch.Tensor, int, list[int], float, int]]) -> list[torch.Tensor]:
    """Muon's update for several parameters: every block of every ``u`` orthogonalised and RMS-matched.

    Each entry is ``(u, split_dim, split_sizes, lr, steps)``: ``u`` ``[..., A, C]`` the Nesterov momentum of one
    parameter (a plain tensor; leading dims index experts), split along ``split_dim`` (-2 or -1) into blocks of
    ``split_sizes`` (summing to its size), each block of every leading index on its own, orthogonalised by
    ``steps`` Newton-Schulz iterations. Blocks of one shape from all parameters go through one
    :func:`newton_schulz` call.

    Returns:
        Per entry a tensor of ``u``'s shape and dtype: per block ``b`` (``[a, c]``) ``lr 0.2 sqrt(max(a, c))
        NS(b)`` (torch's ``match_rms_adamw`` rule, which carries AdamW's learning rate and weight decay over).
    """
    # per group (a, c, scale, dtype, steps): the blocks [n, a, c] of every piece, and where each piece goes
    groups: dict[tuple, list[tuple[torch.Tensor, torch.Size, int, int]]] = defaultdict(list)
    pieces: list[list[torch.Tensor | None]] = []
    for i, (u, split_dim, split_sizes, lr, steps) in enumerate(updates):
        parts = u.split(split_sizes, split_dim) if len(split_sizes) > 1 else (u,)
        pieces.append([None] * len(parts))
        for j, src in enumerate(parts):
            a, c = src.shape[-2:]
            key = (a, c, lr * (0.2 * math.sqrt(max(a, c))), u.dtype, steps)  # torch's _adjust_lr, to the bit
            groups[key].append((src.reshape(-1, a, c), src.shape, i, j))
    for (_, _, scale, dtype, steps), blocks in groups.items():  # scaled in the parameter's dtype, as torch's Muon
        ortho = newton_schulz(torch.cat([b for b, *_ in blocks]), steps).to(dtype).mul_(scale)
        for (_, shape, i, j), y in zip(blocks, ortho.split([b.shape[0] for b, *_ in blocks]), strict=True):
            pieces[i][j] = y.view(shape)
    # one piece: the view of the batched result is the update; several: joined along the split dim
    return [parts[0] if len(parts) == 1 else torch.cat(parts, split_dim)
            for parts, (_, split_dim, *_) in zip(pieces, updates, strict=True)]
