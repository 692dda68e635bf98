"""Dense SwiGLU feed-forward: ``w_down(silu(x W_gate) * (x W_up))`` with the gate and up projections fused."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["SwiGLU"]


class SwiGLU(nn.Module):
    """Bias-free SwiGLU MLP.

    ``w_gate_up`` is one ``Linear(dim, 2 * hidden_dim)`` whose first ``hidden_dim`` outputs are the gate
    and last ``hidden_dim`` the up projection (the same split as the stacked MoE experts).
    """

    def __init__(self, dim: int, hidden_dim: int) -> None:
        super().__init__()
        if dim <= 0 or hidden_dim <= 0:
            raise ValueError(f"SwiGLU needs dim > 0 and hidden_dim > 0, got dim={dim}, hidden_dim={hidden_dim}")
        self.dim, self.hidden_dim = dim, hidden_dim
        self.w_gate_up = nn.Linear(dim, 2 * hidden_dim, bias=False)
        self.w_down = nn.Linear(hidden_dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``[..., dim] -> [..., dim]``."""
        gate, up = self.w_gate_up(x).chunk(2, dim=-1)
        return self.w_down(F.silu(gate) * up)

    def extra_repr(self) -> str:
        return f"dim={self.dim}, hidden_dim={self.hidden_dim}"
