"""Optimizer and learning-rate schedule settings: AdamW with linear warmup and cosine decay."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn


@dataclass
class OptimConfig:
    """AdamW and its schedule (``--optim.<field>`` on the CLI).

    Attributes:
        lr: peak learning rate.
        min_lr_ratio: final learning rate as a fraction of ``lr`` at the end of the cosine.
        warmup_steps: optimizer steps of linear warmup from 0.
        weight_decay: decoupled weight decay on matrices (not on norms, biases or pseudo-queries).
        beta1, beta2, eps: AdamW moments.
    """

    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 50
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8

    def __post_init__(self) -> None:
        if not self.lr > 0:
            raise ValueError(f"OptimConfig.lr={self.lr}: must be positive")
        if not 0 <= self.min_lr_ratio <= 1:
            raise ValueError(f"OptimConfig.min_lr_ratio={self.min_lr_ratio}: must lie in [0, 1]")
        if self.warmup_steps < 0:
            raise ValueError(f"OptimConfig.warmup_steps={self.warmup_steps}: must be >= 0")

    def lr_factor(self, step: int, total_steps: int) -> float:
        """Multiplier of ``lr`` at optimizer step ``step`` of ``total_steps``: linear warmup, cosine decay."""
        if step < self.warmup_steps:
            return (step + 1) / self.warmup_steps
        span = max(total_steps - self.warmup_steps, 1)
        progress = min((step - self.warmup_steps) / span, 1.0)
        return self.min_lr_ratio + (1 - self.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    def build(
        self, model: nn.Module, total_steps: int, fused: bool = True
    ) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LambdaLR]:
        """AdamW over ``model`` (decay only on parameters with >= 2 dims) and its step-wise schedule.

        The fused AdamW kernel (one launch per parameter group and step, like ``benchmarks/throughput.py``) when
        ``fused`` and every parameter is a plain CUDA tensor; elsewhere torch's default: ``foreach`` for DTensor
        parameters (FSDP2, expert meshes), the per-parameter loop on CPU (whose numerics the CPU tests pin).
        ``fused=False`` where a gradient scaler must unscale the gradients before they are clipped (fp16 autocast).
        """
        decay = [p for p in model.parameters() if p.requires_grad and p.dim() >= 2]
        no_decay = [p for p in model.parameters() if p.requires_grad and p.dim() < 2]
        opt = torch.optim.AdamW(
            [{"params": decay, "weight_decay": self.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
            lr=self.lr,
            betas=(self.beta1, self.beta2),
            eps=self.eps,
            fused=True if fused and _fused_supported(decay + no_decay) else None,
        )
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: self.lr_factor(s, total_steps))
        return opt, sched

    def apply(self, opt: torch.optim.Optimizer, sched: torch.optim.lr_scheduler.LambdaLR) -> None:
        """Set this config on an optimizer and schedule of :meth:`build` whose states were restored from a
        checkpoint (which restores the saved lr, betas, eps, weight decay and the schedule's base lr): the
        current step keeps its place in the schedule, now computed with this config's values."""
        sched.base_lrs = [self.lr] * len(opt.param_groups)
        for group, factor in zip(opt.param_groups, sched.lr_lambdas, strict=True):
            group.update(lr=self.lr * factor(sched.last_epoch), initial_lr=self.lr, betas=(self.beta1, self.beta2),
                         eps=self.eps)
        opt.param_groups[0]["weight_decay"] = self.weight_decay  # the matrices; the other group has none
        sched._last_lr = [group["lr"] for group in opt.param_groups]


def _fused_supported(params: list[torch.Tensor]) -> bool:
    """Every parameter a plain (not DTensor) CUDA tensor: the case the fused AdamW kernel is used for."""
    from torch.distributed.tensor import DTensor

    return bool(params) and all(p.is_cuda and not isinstance(p, DTensor) for p in params)
