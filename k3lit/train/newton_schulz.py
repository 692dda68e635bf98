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
NS_DTYPES = ("auto", "bfloat16", "float32")  # choices of OptimConfig.ns_dtype


def ns_dtype(choice: str, device: torch.device) -> torch.dtype:
    """The dtype of the Newton-Schulz products for ``choice`` (one of :data:`NS_DTYPES`) on ``device``: ``auto``
    is bfloat16 on accelerators, as in ``torch.optim.Muon``, and float32 on the CPU, where many processors have
    no bfloat16 matrix arithmetic and torch's bfloat16 products run far slower than its float32 ones
    (benchmarks/RESULTS.md, "Muon on the CPU without bfloat16 arithmetic").

    Raises:
        ValueError: an unknown choice.
    """
    if choice not in NS_DTYPES:
        raise ValueError(f"ns_dtype={choice!r}: choose one of {NS_DTYPES}")
    if choice == "auto":
        return torch.float32 if device.type == "cpu" else torch.bfloat16
    return getattr(torch, choice)


def newton_schulz(x: torch.Tensor, steps: int, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Approximate orthogonalisation ``U S' V^T`` (``S'`` near one) of every matrix of a batch, computed in
    ``dtype`` (torch's Muon: bfloat16).

    Per matrix ``X`` (wide orientation: a tall one is transposed first and back at the end):
    ``X <- X / max(||X||_F, eps)``, then ``steps`` times ``G = X X^T``, ``X <- a X + (b G + c G G) X`` with
    ``(a, b, c)`` = :data:`NS_COEFFICIENTS`: the operations of ``torch.optim.Muon``'s iteration, one batched
    product for all matrices where it runs one product per matrix. In bfloat16 the results equal torch's to the bit
    but where a batched product rounds an element differently in the last bit (rare; seen on matrices of 2-3 rows).

    Args:
        x: ``[N, A, C]`` matrices of one shape, any float dtype.
        steps: Newton-Schulz iterations (torch's Muon: 5).
        dtype: the products' dtype: bfloat16 (torch's Muon) or float32 (:func:`ns_dtype`).

    Returns:
        ``[N, A, C]`` in ``dtype``.
    """
    if x.dim() != 3:
        raise ValueError(f"newton_schulz takes [N, A, C] matrices, got shape {tuple(x.shape)}")
    a, b, c = NS_COEFFICIENTS
    y = x.to(dtype)
    tall = y.shape[-2] > y.shape[-1]
    if tall:
        y = y.mT
    y = y / torch.linalg.vector_norm(y, dim=(-2, -1), keepdim=True).clamp(min=NS_EPS)
    for _ in range(steps):
        gram = torch.bmm(y, y.mT)
        y = torch.baddbmm(y, torch.baddbmm(gram, gram, gram, beta=b, alpha=c), y, beta=a)
    return y.mT if tall else y


class BatchedBlocks:
    """The batched Newton-Schulz inputs of a fixed set of Muon updates: every block of one shape from all of them in
    one ``[N, A, C]`` buffer of the iteration's dtype, allocated once, with a view of it for every piece of every
    update.

    A step then copies every piece into its place with one multi-tensor copy, runs one :func:`newton_schulz` per
    block shape, and splits each result into the pieces' blocks; nothing is joined or reshaped per piece. The host
    issues 281 operators for a Muon step of ``small``'s model this way, 804 when the pieces were joined each step.

    Args:
        layouts: per update ``(shape, split_dim, split_sizes, steps, dtype)``: its full shape ``[A, C]`` or
            ``[E, A, C]`` (experts), split along ``split_dim`` (-2 or -1) into pieces of ``split_sizes``, each
            block of each leading index orthogonalised by ``steps`` iterations, the result in ``dtype``.
        device: where the buffers live.
        ns_dtype: the dtype the iteration computes in (:func:`newton_schulz`).

    Raises:
        ValueError: an update that is not 2-D or 3-D.

    Attributes:
        order: ``(update, piece)`` index pairs in the order :meth:`run` returns the pieces.
        rms_scale: per piece in ``order``, ``0.2 sqrt(max(a, c))`` of its blocks ``[a, c]`` (torch's
            ``match_rms_adamw`` rule; the update is ``lr`` times it times the orthogonalised block).
    """

    def __init__(self, layouts: list[tuple[torch.Size, int, list[int], int, torch.dtype]],
                 device: torch.device, ns_dtype: torch.dtype = torch.bfloat16) -> None:
        self.ns_dtype = ns_dtype
        groups: dict[tuple[int, int, int, torch.dtype], list[tuple[int, int, torch.Size]]] = defaultdict(list)
        for i, (shape, split_dim, split_sizes, steps, dtype) in enumerate(layouts):
            if len(shape) not in (2, 3):
                raise ValueError(f"Muon updates are [A, C] or [E, A, C], got shape {tuple(shape)}")
            for j, size in enumerate(split_sizes):
                piece = list(shape)
                piece[split_dim] = size
                groups[(piece[-2], piece[-1], steps, dtype)].append((i, j, torch.Size(piece)))
        self.order: list[tuple[int, int]] = []
        self.rms_scale: list[float] = []
        self._inputs: list[torch.Tensor] = []
        self._batches: list[tuple[torch.Tensor, int, torch.dtype, list[int]]] = []
        for (a, c, steps, dtype), members in groups.items():
            counts = [math.prod(piece[:-2]) for *_, piece in members]
            x = torch.empty(sum(counts), a, c, dtype=ns_dtype, device=device)
            for (i, j, piece), x_piece in zip(members, x.split(counts), strict=True):
                self.order.append((i, j))
                self.rms_scale.append(0.2 * math.sqrt(max(a, c)))
                self._inputs.append(x_piece.view(piece))
            self._batches.append((x, steps, dtype, counts))

    def run(self, pieces: list[torch.Tensor]) -> list[torch.Tensor]:
        """Orthogonalise every block of every piece (``pieces[k]`` of the shape of piece ``order[k]``, any float
        dtype): per piece in ``order``, its blocks ``[blocks, a, c]`` in its update's dtype (contiguous), each
        ``NS(block)`` of :func:`newton_schulz`, unscaled."""
        torch._foreach_copy_(self._inputs, pieces)  # to ns_dtype, as newton_schulz would cast each block
        out: list[torch.Tensor] = []
        for x, steps, dtype, counts in self._batches:
            ortho = newton_schulz(x, steps, self.ns_dtype)
            out.extend(ortho.to(dtype, memory_format=torch.contiguous_format).split(counts))
        return out
