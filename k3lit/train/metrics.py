"""Training and validation metrics."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torchmetrics import Metric

__all__ = ["ExpertLoad"]


class ExpertLoad(Metric):
    """Per-layer MoE load: MaxVio and the token fraction per expert (REFERENCE.md §2).

    ``MaxVio_l = (max_j load_lj - mean_load) / mean_load`` with ``mean_load = tokens · k / n``, where
    ``tokens`` counts the tokens routed through each layer. Use one instance per training batch
    (``update`` + ``compute`` + ``reset``: MaxVio_batch) and one accumulated over a whole validation pass
    (MaxVio_global). Counts are int64 and summed across ranks.

    Args:
        n_layers: MoE layers L.
        n_experts: experts per layer n.
        top_k: experts per token k.
    """

    full_state_update = False
    higher_is_better = False
    is_differentiable = False

    load: torch.Tensor
    tokens: torch.Tensor

    def __init__(self, n_layers: int, n_experts: int, top_k: int, **kwargs) -> None:
        super().__init__(**kwargs)
        if n_layers < 1 or n_experts < 1 or not 1 <= top_k <= n_experts:
            raise ValueError(
                f"ExpertLoad needs n_layers >= 1, n_experts >= 1 and 1 <= top_k <= n_experts, got "
                f"n_layers={n_layers}, n_experts={n_experts}, top_k={top_k}"
            )
        self.n_layers, self.n_experts, self.top_k = n_layers, n_experts, top_k
        self.add_state("load", torch.zeros(n_layers, n_experts, dtype=torch.int64), dist_reduce_fx="sum")
        self.add_state("tokens", torch.zeros((), dtype=torch.int64), dist_reduce_fx="sum")

    def update(self, loads: torch.Tensor, n_tokens: int | None = None) -> None:
        """Add one batch.

        Args:
            loads: ``[L, n]`` tokens routed to each expert of each layer (e.g. stacked ``MoE.last_load``).
            n_tokens: tokens in the batch; default ``loads[0].sum() / k`` (every token takes k experts).
        """
        if loads.shape != (self.n_layers, self.n_experts):
            raise ValueError(f"loads must be [L, n] = [{self.n_layers}, {self.n_experts}], got {tuple(loads.shape)}")
        loads = loads.detach().round().long()
        if n_tokens is None:
            n_tokens = int(loads[0].sum().item()) // self.top_k
        self.load += loads.to(self.load.device)
        self.tokens += n_tokens

    def compute(self) -> dict[str, torch.Tensor]:
        """``{"max_vio": [L] float32, "fraction": [L, n] float32}``; ``fraction = load / (tokens · k)``
        (the share of routed slots per expert, 1/n when balanced)."""
        routed = (self.tokens * self.top_k).double()
        mean_load = routed / self.n_experts
        load = self.load.double()
        return {
            "max_vio": ((load.amax(dim=-1) - mean_load) / mean_load).float(),
            "fraction": (load / routed).float(),
        }

    def _wrap_compute(self, compute: Callable) -> Callable:
        """torchmetrics squeezes one-element results; keep ``[L]`` and ``[L, n]`` also for one layer / expert."""
        wrapped = super()._wrap_compute(compute)

        @functools.wraps(compute)
        def keep_shapes(*args: Any, **kwargs: Any) -> dict[str, torch.Tensor]:
            out = wrapped(*args, **kwargs)
            return {
                "max_vio": out["max_vio"].reshape(self.n_layers),
                "fraction": out["fraction"].reshape(self.n_layers, self.n_experts),
            }

        return keep_shapes
