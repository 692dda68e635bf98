"""Triton kernels of the causal depthwise short convolution + SiLU (KDA's q/k/v convs), importable as
``k3lit.kernels.short_conv``; registered as the torch custom ops ``k3lit::short_conv_fwd`` / ``_bwd`` so
``torch.compile`` keeps them in its graph. Math: ``conv.py``."""

from __future__ import annotations

import torch

from k3lit.kernels.short_conv.conv import conv_bwd, conv_fwd

__all__ = ["short_conv_silu_triton"]


@torch.library.custom_op("k3lit::short_conv_fwd", mutates_args=())
def _fwd(x: torch.Tensor, w: torch.Tensor, parts: int) -> list[torch.Tensor]:
    return conv_fwd(x, w, parts)


@_fwd.register_fake
def _(x, w, parts):
    B, T, C = x.shape
    return [x.new_empty(B, T, C // parts) for _ in range(parts)]


@torch.library.custom_op("k3lit::short_conv_bwd", mutates_args=())
def _bwd(x: torch.Tensor, w: torch.Tensor, dys: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    return conv_bwd(x, w, dys)


@_bwd.register_fake
def _(x, w, dys):
    return torch.empty_like(x), torch.empty_like(w)


def _setup_context(ctx, inputs, output):
    ctx.save_for_backward(*inputs[:2])


def _backward(ctx, dys):
    x, w = ctx.saved_tensors
    return (*_bwd(x, w, [dy.contiguous() for dy in dys]), None)


_fwd.register_autograd(_backward, setup_context=_setup_context)


def short_conv_silu_triton(x: torch.Tensor, weight: torch.Tensor, parts: int = 1) -> tuple[torch.Tensor, ...]:
    """``silu(causal depthwise conv(x))`` from a zero history, differentiable in ``x`` and ``weight``.

    Args:
        x: ``[B, T, C]`` float32, bfloat16 or float16.
        weight: ``[C, W]`` per-channel taps; ``weight[:, W-1]`` multiplies the current step. Cast to x's dtype
            first (as the layer does under autocast); sums run in float32.
        parts: 1, or 3 for the result split into three channel groups (KDA's q, k and v), each written to a
            contiguous tensor of its own, whose gradients the backward reads where they are.

    Returns:
        In x's dtype: ``(y,)`` with y ``[B, T, C]``, or three contiguous ``[B, T, C / 3]``.

    Raises:
        ValueError: x not 3-D, weight not ``[C, W]``, mismatched dtypes, ``parts`` not 1 or 3, or C not divisible
            by 3 with ``parts = 3``.
    """
    if x.dim() != 3 or weight.dim() != 2 or weight.shape[0] != x.shape[2]:
        raise ValueError(f"short conv: x must be [B, T, C] and weight [C, W], got {tuple(x.shape)} and "
                         f"{tuple(weight.shape)}")
    if weight.dtype != x.dtype:
        raise ValueError(f"short conv: weight dtype {weight.dtype} must match x dtype {x.dtype}")
    if parts not in (1, 3) or x.shape[2] % parts:
        raise ValueError(f"short conv: parts must be 1, or 3 with C divisible by 3; got parts={parts}, "
                         f"C={x.shape[2]}")
    return tuple(_fwd(x.contiguous(), weight.contiguous(), parts))
