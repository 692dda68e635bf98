"""Training and validation metrics."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torchmetrics import Metric

__all__ = ["ExpertLoad"]


class ExpertLoad(Metric):
    """Per-layer MoE load: MaxVio and the token fraction per expert (docs/MATH.md §2).

    ``MaxVio_l = (max_j load_lj - mean_load) / mean_load`` with ``mean_load = tokens · k / n``, where
    ``tokens`` counts the tokens routed through each layer. Use one instance per training batch
    (``update`` + ``compute`` + ``reset``: MaxVio_batch) and one accumulated over a whole validation pass
    (MaxVio_global). Counts are int64 and summed across the ranks of ``process_group`` (a torchmetrics
    argument; default: the whole world, which is right whenever every rank routes its own tokens -- data and
    expert parallelism alike; count loads *before* the expert-parallel dispatch, as ``MoE.last_load`` does,
    else the exchanged tokens would be counted twice).

    Also kept per layer: re-routed and dropped (token, expert) slots (capacity mode) and the router entropy
    summed over updates, for ``reroute_rate``, ``drop_rate`` (per routed slot ``tokens · k``) and ``entropy``.

    Args:
        n_layers: MoE layers L.
        n_experts: experts per layer n.
        top_k: experts per token k.
        **kwargs: torchmetrics ``Metric`` arguments (``process_group``, ``sync_on_compute``, ...).
    """

    full_state_update = False
    higher_is_better = False
    is_differentiable = False

    load: torch.Tensor
    tokens: torch.Tensor
    rerouted: torch.Tensor
    dropped: torch.Tensor
    entropy_sum: torch.Tensor
    updates: torch.Tensor

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
        self.add_state("rerouted", torch.zeros(n_layers, dtype=torch.int64), dist_reduce_fx="sum")
        self.add_state("dropped", torch.zeros(n_layers, dtype=torch.int64), dist_reduce_fx="sum")
        self.add_state("entropy_sum", torch.zeros(n_layers, dtype=torch.float64), dist_reduce_fx="sum")
        self.add_state("updates", torch.zeros((), dtype=torch.int64), dist_reduce_fx="sum")

    def update(
        self,
        loads: torch.Tensor,
        n_tokens: int | torch.Tensor | None = None,
        rerouted: torch.Tensor | None = None,
        dropped: torch.Tensor | None = None,
        entropy: torch.Tensor | None = None,
    ) -> None:
        """Add one batch.

        Args:
            loads: ``[L, n]`` tokens routed to each expert of each layer (e.g. stacked ``MoE.last_load``).
            n_tokens: tokens in the batch, an int or a 0-d tensor (no host sync); default ``loads[0].sum() / k``
                (every token takes k experts; pass it explicitly in capacity mode, where dropped slots are
                missing from the loads).
            rerouted, dropped: ``[L]`` slot counts of the batch (default 0).
            entropy: ``[L]`` mean router entropy of the batch (default 0).
        """
        if loads.shape != (self.n_layers, self.n_experts):
            raise ValueError(f"loads must be [L, n] = [{self.n_layers}, {self.n_experts}], got {tuple(loads.shape)}")
        loads = loads.detach().round().long()
        if n_tokens is None:
            n_tokens = loads[0].sum() // self.top_k
        self.load += loads.to(self.load.device)
        self.tokens += torch.as_tensor(n_tokens, device=self.tokens.device).round().long()
        if rerouted is not None:
            self.rerouted += rerouted.detach().round().long().to(self.load.device)
        if dropped is not None:
            self.dropped += dropped.detach().round().long().to(self.load.device)
        if entropy is not None:
            self.entropy_sum += entropy.detach().double().to(self.load.device)
        self.updates += 1

    def compute(self) -> dict[str, torch.Tensor]:
        """``{"max_vio": [L], "fraction": [L, n], "reroute_rate": [L], "drop_rate": [L], "entropy": [L]}``
        float32; ``fraction = load / (tokens · k)`` (the share of routed slots per expert, 1/n when
        balanced), rates per routed slot, entropy averaged over updates (and ranks)."""
        routed = (self.tokens * self.top_k).double()
        mean_load = routed / self.n_experts
        load = self.load.double()
        return {
            "max_vio": ((load.amax(dim=-1) - mean_load) / mean_load).float(),
            "fraction": (load / routed).float(),
            "reroute_rate": (self.rerouted.double() / routed).float(),
            "drop_rate": (self.dropped.double() / routed).float(),
            "entropy": (self.entropy_sum / self.updates.clamp(min=1)).float(),
        }

    def _wrap_compute(self, compute: Callable) -> Callable:
        """torchmetrics squeezes one-element results; keep ``[L]`` and ``[L, n]`` also for one layer / expert."""
        wrapped = super()._wrap_compute(compute)

        @functools.wraps(compute)
        def keep_shapes(*args: Any, **kwargs: Any) -> dict[str, torch.Tensor]:
            out = wrapped(*args, **kwargs)
            shaped = {k: v.reshape(self.n_layers) for k, v in out.items() if k != "fraction"}
            return {**shaped, "fraction": out["fraction"].reshape(self.n_layers, self.n_experts)}

        return keep_shapes
