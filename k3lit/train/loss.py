"""The training loss: next-token cross-entropy over the LM head's logits, eager or compiled on its own."""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import torch.nn.functional as F

__all__ = ["next_token_loss", "compiled_next_token_loss"]


def next_token_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy ``-(1/N) Σ_i log softmax(z_i)[y_i]`` over the ``N = B T`` positions, in nats,
    with the log-softmax evaluated in float32 (the logits cast to float32 whatever their dtype).

    Args:
        logits: ``[B, T, V]`` in any floating dtype (bf16 under autocast).
        targets: ``[B, T]`` int64 token ids in ``[0, V)``.

    Returns:
        0-d float32 tensor.
    """
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


@functools.cache
def compiled_next_token_loss() -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """:func:`next_token_loss` through ``torch.compile`` (one per process), as torchtitan compiles its loss.

    Eagerly the loss materialises float32 copies of the ``[B T, V]`` logits (the upcast, the log-softmax and, in
    backward, its gradient: 2 GB each for ``small``'s 32,768 x 16,384 logits) and casts the gradient back to the
    logits' dtype in another pass. Compiled, inductor fuses the upcast into its reductions over the bf16 logits and
    writes the gradient in the logits' dtype (its effect on the step is timed by ``benchmarks/throughput.py``, whose
    compiled rows use it). The sums run in another order, so the loss agrees with the eager one to float32 rounding
    and the gradient to half a unit in the last place of its dtype (``tests/train/test_loss.py``). Compiled with
    ``torch.compile``'s default mode whatever ``compile_mode`` the model takes."""
    return torch.compile(next_token_loss)
