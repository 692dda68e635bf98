"""Causal depthwise short convolution with a decoding state (the q/k/v conv of KDA layers)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class ShortConvolution(nn.Module):
    """Causal depthwise 1-D convolution over time followed by SiLU.

    Args:
        channels: feature width C.
        width: kernel width W (Kimi Linear uses 4).

    ``forward(x [B, T, C], state [B, C, W - 1] | None) -> (y [B, T, C], new_state [B, C, W - 1])``: the
    state holds the last W - 1 inputs, so decoding one token at a time equals one pass over the sequence.
    """

    def __init__(self, channels: int, width: int = 4) -> None:
        super().__init__()
        self.width = width
        self.weight = nn.Parameter(torch.empty(channels, 1, width))
        nn.init.kaiming_uniform_(self.weight, a=5**0.5)

    def forward(self, x: torch.Tensor, state: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        B, T, C = x.shape
        x = x.transpose(1, 2)  # [B, C, T]
        past = x.new_zeros(B, C, self.width - 1) if state is None else state.to(x.dtype)
        x = torch.cat([past, x], dim=-1)  # [B, C, W - 1 + T]
        y = F.conv1d(x, self.weight.to(x.dtype), groups=C)  # [B, C, T]
        return F.silu(y).transpose(1, 2), x[..., -(self.width - 1) :]
