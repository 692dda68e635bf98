"""Attention Residuals: the per-sublayer depth mixer and the residual stream that uses it."""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import nn

from k3lit.ops.attn_res import attn_res_inter_block, attn_res_merge, attn_res_mix


class AttnResMixer(nn.Module):
    """One sublayer's read of the residual sources (arXiv 2603.15031): pseudo-query ``w`` (zero at init, so the
    first step is the uniform mean) and RMSNorm weight ``γ``. ``forward() -> [D]`` is ``w ⊙ γ``, the two folded
    (``w^T RMSNorm(v) = ((w ⊙ γ)^T v) / rms(v)``); the reads call it as a module so that FSDP2, which shards each
    mixer as its own unit, gathers the parameters for them (phase 1 reads a whole block's queries before any of
    its sublayers runs). Called once per forward pass.
    """

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.query = nn.Parameter(torch.empty(dim))
        self.norm_weight = nn.Parameter(torch.empty(dim))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """``query = 0`` (the first read is the uniform mean of the sources), ``norm_weight = 1``."""
        nn.init.zeros_(self.query)
        nn.init.ones_(self.norm_weight)

    def forward(self) -> torch.Tensor:
        return self.query * self.norm_weight

    def mix(self, sources: list[torch.Tensor]) -> torch.Tensor:
        """The one-pass read ``Σ_i softmax_i(w^T RMSNorm(s_i)) s_i`` of N sources ``[B, T, D]``."""
        return attn_res_mix(sources, self(), self.eps)


def mix_dtype(embedding: torch.Tensor) -> torch.dtype | None:
    """The dtype of the two-phase reads' mixes: under autocast of a float32 model, the autocast dtype, which the
    sublayers' outputs and so the block summaries and partial sums already are; None otherwise (the embedding's
    dtype; autocast leaves float64 alone, and devices without autocast, such as ``meta``, have none). A mix is a
    sublayer's input, formed in float32 and rounded once; keeping it in float32 beside the float32 embedding
    moves twice the bytes through every phase-1 write, merge and pre-norm (benchmarks/RESULTS.md, "Attention
    residuals × checkpointing"). ``torch.compile`` cannot trace ``is_autocast_available`` (a graph break, which
    inside the training loop over segments sends the whole model back to eager), so CPU and CUDA, which always
    have autocast, are answered without it."""
    kind = embedding.device.type
    available = kind in ("cpu", "cuda") or torch.amp.is_autocast_available(kind)
    if embedding.dtype != torch.float32 or not available:
        return None
    return torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else None


def block_read(
    eps: float, mix: torch.Tensor, lse: torch.Tensor | None = None, partial: torch.Tensor | None = None,
    query: torch.Tensor | None = None,
) -> torch.Tensor:
    """A sublayer's input from one tuple of :meth:`BlockResidualStream.reads`: the phase-1 ``mix`` alone (first
    sublayer of a block), or merged with the block's ``partial`` sum (phase 2; ``lse`` the mix's log-sum-exp,
    ``query`` the sublayer's ``w ⊙ γ``). ``[B, T, D]`` in mix's dtype."""
    return mix if partial is None else attn_res_merge(mix, lse, partial, query, eps)


class BlockResidualStream:
    """Block AttnRes bookkeeping over one forward pass, block size S counted in **sublayers**.

    ``b_0`` is the embedding; inside block n the outputs are summed into the partial sum ``b_n^i``; the i-th
    sublayer reads ``[b_0 … b_{n-1}]`` (i = 1) or ``[b_0 … b_{n-1}, b_n^{i-1}]`` (i >= 2). S = 1 is Full AttnRes
    (every earlier sublayer output is its own source).
    """

    def __init__(
        self,
        blocks: list[torch.Tensor],
        block_size: int,
        eps: float,
        partial: torch.Tensor | None = None,
        n_in_block: int = 0,
    ) -> None:
        self.block_size, self.eps = block_size, eps
        self.blocks = list(blocks)  # [b_0 = embedding, b_1, ...], each [B, T, D]
        self.partial = partial
        self.n_in_block = n_in_block

    def reads(self, mixers: list[AttnResMixer]) -> Iterator[tuple[torch.Tensor, ...]]:
        """Two-phase reads for consecutive sublayers from the stream's position, one tuple per mixer in turn:
        ``(mix,)`` at a block's first sublayer, ``(mix, lse, partial, query)`` after it; :func:`block_read` turns
        it into the sublayer's input. The caller must :meth:`add` each sublayer's output before asking for the
        next tuple. At each block start (or at the first mixer) one phase-1 read of the completed summaries serves
        every mixer up to the block's end (:func:`k3lit.ops.attn_res.attn_res_inter_block`)."""
        k, dtype = 0, mix_dtype(self.blocks[0])
        while k < len(mixers):
            queries = [m() for m in mixers[k : k + self.block_size - self.n_in_block]]
            mixes, lse = attn_res_inter_block(self.blocks, torch.stack(queries), self.eps, out_dtype=dtype)
            for j, mix in enumerate(mixes):
                yield (mix,) if self.partial is None else (mix, lse[j], self.partial, queries[j])
            k += len(queries)

    def sources(self) -> list[torch.Tensor]:
        """Current sources: the block summaries, then the partial sum if any."""
        return self.blocks if self.partial is None else self.blocks + [self.partial]

    def add(self, out: torch.Tensor) -> None:
        """Add one sublayer's output; close the block after S outputs."""
        self.partial = out if self.partial is None else self.partial + out
        self.n_in_block += 1
        if self.n_in_block == self.block_size:
            self.blocks.append(self.partial)
            self.partial, self.n_in_block = None, 0
