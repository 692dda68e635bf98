"""Causal depthwise short convolution with a decoding state (the q/k/v conv of KDA layers)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from k3lit.ops.kda import triton_available


class ShortConvolution(nn.Module):
    """Causal depthwise 1-D convolution over time followed by SiLU.

    Args:
        channels: feature width C.
        width: kernel width W (Kimi Linear uses 4).
        backend: ``auto`` (the Triton kernel ``k3lit.kernels.short_conv`` on CUDA, ``F.conv1d`` elsewhere),
            ``triton`` (the kernel wherever Triton runs, e.g. on CPU under ``TRITON_INTERPRET=1``) or ``torch``.
            With a decoding state the ``F.conv1d`` form always runs (one token at a time), and with document
            positions the masked PyTorch form.
        parts: the output as this many channel groups (1, or 3 for KDA's q, k and v); the Triton kernel writes
            each group to a contiguous tensor of its own, the PyTorch forms return views.

    ``forward(x [B, T, C], state [B, C, W - 1] | None, pos [B, T] | None) -> (ys, new_state [B, C, W - 1])``,
    ``ys`` the ``parts`` groups ``[B, T, C / parts]`` of ``y``: the state holds the last W - 1 inputs, so decoding
    one token at a time equals one pass over the sequence. With ``pos`` (int64, each token's position in its
    document, :class:`k3lit.nn.documents.Documents`) the tap that reads ``d`` tokens back counts only where
    ``pos >= d``: ``y_t = silu(Σ_d w_d x_{t-d} [pos_t >= d])``, no input of an earlier document (training and
    scoring only: no state with it).

    Raises:
        ValueError: an unknown backend, ``parts`` not 1 or 3 or not dividing ``channels``; in forward, ``pos``
            together with a state.
    """

    def __init__(self, channels: int, width: int = 4, backend: str = "auto", parts: int = 1) -> None:
        super().__init__()
        if backend not in ("auto", "triton", "torch"):
            raise ValueError(f"ShortConvolution: backend must be auto, triton or torch, got {backend!r}")
        if parts not in (1, 3) or channels % parts:
            raise ValueError(f"ShortConvolution: parts must be 1, or 3 dividing channels; got parts={parts}, "
                             f"channels={channels}")
        self.width, self.backend, self.parts = width, backend, parts
        self.weight = nn.Parameter(torch.empty(channels, 1, width))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """``weight [C, 1, W]`` ~ U(-1/sqrt(W), 1/sqrt(W)) (``kaiming_uniform_(a=sqrt(5))``, nn.Conv1d's default);
        works on DTensor shards."""
        nn.init.kaiming_uniform_(self.weight, a=5**0.5)

    def _use_triton(self, x: torch.Tensor, state: torch.Tensor | None) -> bool:
        if state is not None or self.backend == "torch":
            return False
        return self.backend == "triton" or (x.is_cuda and triton_available())

    def forward(
        self, x: torch.Tensor, state: torch.Tensor | None = None, pos: torch.Tensor | None = None
    ) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
        B, T, C = x.shape
        if pos is not None:
            if state is not None:
                raise ValueError("ShortConvolution: document positions (pos) are for whole sequences; pass no state")
            y, tail = self._masked(x, pos)
            return y.chunk(self.parts, -1), tail
        if self._use_triton(x, state):
            from k3lit.kernels.short_conv import short_conv_silu_triton  # lazy: Triton only where it runs

            ys = short_conv_silu_triton(x, self.weight[:, 0].to(x.dtype), self.parts)
            tail = x[:, -(self.width - 1) :]  # [B, W - 1, C]: a view, no copy on the training path
            if T < self.width - 1:  # zero history before the first token
                tail = F.pad(tail, (0, 0, self.width - 1 - T, 0))
            return ys, tail.transpose(1, 2)
        x = x.transpose(1, 2)  # [B, C, T]
        past = x.new_zeros(B, C, self.width - 1) if state is None else state.to(x.dtype)
        x = torch.cat([past, x], dim=-1)  # [B, C, W - 1 + T]
        y = F.conv1d(x, self.weight.to(x.dtype), groups=C)  # [B, C, T]
        return F.silu(y).transpose(1, 2).chunk(self.parts, -1), x[..., -(self.width - 1) :]

    def _masked(self, x: torch.Tensor, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The convolution with taps across a document start zeroed (``forward``'s ``pos``), one shifted product per
        tap, in x's dtype."""
        T, W = x.shape[1], self.width
        w = self.weight[:, 0].to(x.dtype)  # [C, W]; tap j reads d = W - 1 - j tokens back
        y = x * w[:, W - 1]
        for d in range(1, min(W, T + 1)):
            shifted = F.pad(x[:, : T - d], (0, 0, d, 0))  # x_{t-d}, zero before the sequence
            y = y + shifted * w[:, W - 1 - d] * (pos >= d).unsqueeze(-1).to(x.dtype)
        tail = F.pad(x[:, -(W - 1) :], (0, 0, max(W - 1 - T, 0), 0))
        return F.silu(y), tail.transpose(1, 2)
