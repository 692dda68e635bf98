"""Log-decay gates: the lower-bounded K3 gate and the unbounded one it replaces."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def bounded_log_decay(e: torch.Tensor, g_min: float = -5.0) -> torch.Tensor:
    """Lower-bounded log-decay ``g = g_min * sigmoid(e)`` in ``[g_min, 0]`` (K3 innovation 1).

    Args:
        e: gate pre-activation, any shape (``[B, T, H, K]`` in the layer), any float dtype.
        g_min: the fixed lower bound, negative (default -5).

    Returns:
        tensor of e's shape in float32 (float64 for float64 e): the per-channel log-decay the KDA op consumes.

    Raises:
        ValueError: g_min is not negative.
    """
    if not g_min < 0:
        raise ValueError(f"g_min must be negative, got {g_min}")
    return g_min * torch.sigmoid(e.to(torch.promote_types(e.dtype, torch.float32)))


def softplus_log_decay(e: torch.Tensor, A_log: torch.Tensor) -> torch.Tensor:
    """Unbounded log-decay ``g = -exp(A_log) * softplus(e)`` in ``(-inf, 0]``, for comparison only.

    A model trained with one gate must not be run with the other.
    """
    return -A_log.float().exp() * F.softplus(e.float())
