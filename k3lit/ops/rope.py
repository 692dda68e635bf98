"""Rotary position embedding (RoPE, Su et al. 2021, arXiv 2104.09864) in the half-split layout of GPT-NeoX and
Llama: channel i of the first half and channel i of the second half of a head form one rotated pair."""

from __future__ import annotations

import torch


def rotary(x: torch.Tensor, start: int, theta: float) -> torch.Tensor:
    """Rotate the heads of ``x`` by their positions ``start, start + 1, ...``.

    For a head ``x`` of even width d and position p, with ``w_i = theta ** (-2 i / d)`` (i < d / 2),
    ``y_i = x_i cos(p w_i) - x_{i + d/2} sin(p w_i)`` and ``y_{i + d/2} = x_{i + d/2} cos(p w_i) + x_i sin(p w_i)``,
    so that the dot product of a rotated query at p and a rotated key at p' depends on p - p' only.

    Args:
        x: ``[B, H, T, d]`` (any float dtype; the angles are computed in float32, float64 for float64 inputs).
        start: position of ``x[:, :, 0]`` (the number of cached tokens when decoding).
        theta: the frequency base, > 0 (10,000 in Llama 2).

    Returns:
        ``[B, H, T, d]`` in ``x``'s dtype.

    Raises:
        ValueError: d is odd.
    """
    d = x.shape[-1]
    if d % 2:
        raise ValueError(f"rotary embeddings need an even head width, got {d}")
    dtype = torch.float64 if x.dtype == torch.float64 else torch.float32
    freq = theta ** (-torch.arange(0, d, 2, device=x.device, dtype=dtype) / d)  # [d/2]
    pos = torch.arange(start, start + x.shape[-2], device=x.device, dtype=dtype)
    angle = pos[:, None] * freq  # [T, d/2]
    cos, sin = angle.cos(), angle.sin()
    x1, x2 = x.to(dtype).chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)
