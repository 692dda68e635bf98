"""Attention Residuals: the per-sublayer depth mixer and the residual stream that uses it."""

from __future__ import annotations

import torch
from torch import nn

from k3lit.ops.attn_res import attn_res_mix


class AttnResMixer(nn.Module):
    """One sublayer's read of the residual sources (arXiv 2603.15031): pseudo-query ``w`` (zero at init,
    so the first step is the uniform mean) and RMSNorm weight ``γ``. ``forward(sources) -> [B, T, D]``.
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

    @property
    def effective_query(self) -> torch.Tensor:
        """``w ⊙ γ``: the pseudo-query folded with the RMSNorm weight, ``[D]``."""
        return self.query * self.norm_weight

    def forward(self, sources: list[torch.Tensor]) -> torch.Tensor:
        return attn_res_mix(sources, self.effective_query, self.eps)


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
