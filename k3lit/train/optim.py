"""Optimizer and learning-rate schedule settings: AdamW, or Muon on the hidden matrices with AdamW on the rest;
linear warmup and cosine decay for both, ending with the run's step limit or its time budget."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

from k3lit.train.newton_schulz import NS_COEFFICIENTS, NS_DTYPES, BatchedBlocks, ns_dtype

OPTIMIZERS = ("adamw", "muon")
__all__ = ["NS_COEFFICIENTS", "OPTIMIZERS", "MuonAdamW", "OptimConfig", "muon_matrices"]


@dataclass
class OptimConfig:
    """The optimizer and its schedule (``--optim.<field>`` on the CLI).

    Attributes:
        name: ``adamw`` (every parameter by AdamW) or ``muon`` (the hidden matrices by Muon with the update
            scaled to AdamW's RMS, everything else by AdamW; see :func:`muon_matrices` and :class:`MuonAdamW`).
        lr: peak learning rate (of both parts under ``muon``).
        min_lr_ratio: final learning rate as a fraction of ``lr`` at the end of the cosine, which comes with
            ``trainer.max_steps`` or, when the time limit ends the run first, with ``trainer.max_time``.
        warmup_steps: optimizer steps of linear warmup from 0.
        weight_decay: decoupled weight decay on matrices (not on norms, biases or pseudo-queries).
        beta1, beta2, eps: AdamW moments.
        momentum, ns_steps: Muon's Nesterov momentum and Newton-Schulz iterations (``muon`` only).
        ns_dtype: the dtype of Muon's Newton-Schulz products: ``auto`` (bfloat16 on GPUs as in
            ``torch.optim.Muon``, float32 on the CPU), ``bfloat16`` or ``float32``
            (:func:`k3lit.train.newton_schulz.ns_dtype`).
    """

    name: str = "adamw"
    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 50
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    momentum: float = 0.95
    ns_steps: int = 5
    ns_dtype: str = "auto"

    def __post_init__(self) -> None:
        if self.name not in OPTIMIZERS:
            raise ValueError(f"OptimConfig.name={self.name!r}: choose one of {OPTIMIZERS}")
        if not self.lr > 0:
            raise ValueError(f"OptimConfig.lr={self.lr}: must be positive")
        if not 0 <= self.min_lr_ratio <= 1:
            raise ValueError(f"OptimConfig.min_lr_ratio={self.min_lr_ratio}: must lie in [0, 1]")
        if self.warmup_steps < 0:
            raise ValueError(f"OptimConfig.warmup_steps={self.warmup_steps}: must be >= 0")
        if not 0 <= self.momentum < 1:
            raise ValueError(f"OptimConfig.momentum={self.momentum}: must lie in [0, 1)")
        if not 1 <= self.ns_steps < 100:
            raise ValueError(f"OptimConfig.ns_steps={self.ns_steps}: must lie in [1, 99]")
        if self.ns_dtype not in NS_DTYPES:
            raise ValueError(f"OptimConfig.ns_dtype={self.ns_dtype!r}: choose one of {NS_DTYPES}")

    def lr_factor(self, step: int, total_steps: float, time_progress: float = 0.0) -> float:
        """Multiplier of ``lr`` after ``step`` optimizer steps: linear warmup over ``warmup_steps``, then a cosine
        from 1 to ``min_lr_ratio`` whose progress is the larger of the steps' and the clock's,

            p = min(1, max((step - warmup_steps) / (total_steps - warmup_steps), time_progress)),
            factor = min_lr_ratio + (1 - min_lr_ratio) (1 + cos(pi p)) / 2,

        so the decay ends with whichever limit ends the run first: ``total_steps`` (may be ``inf``: no step limit)
        or a time budget, of which ``time_progress`` in [0, 1] is the part after warm-up spent so far (0 without
        one)."""
        if step < self.warmup_steps:
            return (step + 1) / self.warmup_steps
        span = max(total_steps - self.warmup_steps, 1)
        progress = min(max((step - self.warmup_steps) / span, time_progress), 1.0)
        return self.min_lr_ratio + (1 - self.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    def build(
        self, model: nn.Module, total_steps: float, fused: bool = True,
        time_progress: Callable[[int], float] | None = None,
    ) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LambdaLR]:
        """The optimizer over ``model`` and its step-wise schedule (one schedule for every parameter group):
        :meth:`lr_factor` of ``total_steps`` (``inf``: no step limit) and, where given, of the clock's progress
        ``time_progress(step)``.

        ``adamw``: AdamW, decay only on parameters with >= 2 dims. ``muon``: :class:`MuonAdamW`, the matrices of
        :func:`muon_matrices` by Muon (with decay), the other parameters by AdamW as under ``adamw``.

        The fused AdamW kernel (one launch per parameter group and step, like ``benchmarks/throughput.py``) when
        ``fused`` and every AdamW parameter is a plain CUDA tensor; elsewhere torch's default: ``foreach`` for
        DTensor parameters (FSDP2, expert meshes), the per-parameter loop on CPU (whose numerics the CPU tests
        pin). ``fused=False`` where a gradient scaler must unscale the gradients before they are clipped (fp16
        autocast).
        """
        matrices = muon_matrices(model) if self.name == "muon" else {}
        rest = [p for p in model.parameters() if p.requires_grad and p not in matrices]
        decay = [p for p in rest if p.dim() >= 2]
        no_decay = [p for p in rest if p.dim() < 2]
        adamw_groups = [{"params": decay, "weight_decay": self.weight_decay},
                        {"params": no_decay, "weight_decay": 0.0}]
        adamw = dict(lr=self.lr, betas=(self.beta1, self.beta2), eps=self.eps,
                     fused=True if fused and _fused_supported(decay + no_decay) else None)
        if self.name == "adamw":
            opt: torch.optim.Optimizer = torch.optim.AdamW(adamw_groups, **adamw)
        else:
            layouts: dict[tuple[int, tuple[int, ...]], list[nn.Parameter]] = {}
            for p, layout in matrices.items():
                layouts.setdefault(layout, []).append(p)
            muon_groups = [{"params": ps, "split_dim": dim, "split_sizes": list(sizes)}
                           for (dim, sizes), ps in layouts.items()]
            opt = MuonAdamW(adamw_groups, muon_groups, weight_decay=self.weight_decay, momentum=self.momentum,
                            ns_steps=self.ns_steps, ns_dtype=self.ns_dtype, **adamw)
        clock = time_progress or (lambda step: 0.0)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: self.lr_factor(s, total_steps, clock(s)))
        return opt, sched

    def apply(self, opt: torch.optim.Optimizer, sched: torch.optim.lr_scheduler.LambdaLR) -> None:
        """Set this config on an optimizer and schedule of :meth:`build` whose states were restored from a
        checkpoint (which restores the saved lr, betas, eps, weight decay, momentum and the schedule's base lr):
        the current step keeps its place in the schedule, now computed with this config's values.

        Raises:
            ValueError: the checkpoint's optimizer is not the one this config names (its state cannot continue).
        """
        saved = "muon" if isinstance(opt, MuonAdamW) else "adamw"
        if saved != self.name:
            raise ValueError(f"optim.name={self.name!r}, but the optimizer restored from the checkpoint is "
                             f"{saved!r}: resume with --optim.name={saved}")
        sched.base_lrs = [self.lr] * len(opt.param_groups)
        for group, factor in zip(opt.param_groups, sched.lr_lambdas, strict=True):
            group.update(lr=self.lr * factor(sched.last_epoch), initial_lr=self.lr, betas=(self.beta1, self.beta2),
                         eps=self.eps)
            if group.get("muon"):
                group.update(weight_decay=self.weight_decay, momentum=self.momentum, ns_steps=self.ns_steps)
        if isinstance(opt, MuonAdamW):
            opt.ns_dtype = self.ns_dtype
        opt.param_groups[0]["weight_decay"] = self.weight_decay  # the AdamW matrices; the second group has none
        sched._last_lr = [group["lr"] for group in opt.param_groups]


def muon_matrices(model: nn.Module) -> dict[nn.Parameter, tuple[int, tuple[int, ...]]]:
    """The parameters of ``model`` that Muon trains, each with its block layout ``(dim, sizes)``: the weight is
    split along ``dim`` (-2 or -1) into blocks of ``sizes`` (one block: the whole width), and every block of
    every leading index is orthogonalised on its own.

    - The weight of every ``nn.Linear`` except the LM head (and so the router, the attention, KDA and MLP
      projections, the shared experts): ``[out, in]``.
    - Fused projections are split into the matrices they fuse: softmax attention's ``qkv`` and KDA's
      ``qkv_proj`` into q, k and v (three maps with their own roles and scales; orthogonalising their
      concatenation would equalise the singular values across them), KDA's ``down_proj`` into the beta logits,
      the decay-gate down and the output-gate down projections, SwiGLU's ``w_gate_up`` into gate and up. A
      projection spanning several heads stays one matrix (as a separate projection per head would be the same
      function with a different update: the heads share one input space and are trained as one map).
    - The stacked experts (``[n, D, 2F]`` gate | up split on the last dim, ``[n, F, D]``): each expert's matrices.

    The embedding, the LM head (tied or not), norms, biases, KDA's gate bias, the AttnRes pseudo-queries and
    the short-convolution kernels are left to AdamW.
    """
    from k3lit.nn.attention import SoftmaxAttention
    from k3lit.nn.kda import KimiDeltaAttention
    from k3lit.nn.mlp import SwiGLU
    from k3lit.nn.moe import GroupedExperts

    out: dict[nn.Parameter, tuple[int, tuple[int, ...]]] = {}
    head = getattr(model, "lm_head", None)
    for m in model.modules():
        if isinstance(m, nn.Linear) and m is not head:
            out[m.weight] = (-2, (m.weight.shape[0],))
        elif isinstance(m, GroupedExperts):
            f = m.w_down.shape[1]
            out[m.w_gate_up] = (-1, (f, f))
            out[m.w_down] = (-1, (m.w_down.shape[-1],))
    for m in model.modules():
        if isinstance(m, SoftmaxAttention | KimiDeltaAttention):
            inner = m.n_heads * m.head_dim
            out[m.qkv.weight if isinstance(m, SoftmaxAttention) else m.qkv_proj.weight] = (-2, (inner,) * 3)
        if isinstance(m, KimiDeltaAttention):
            out[m.down_proj.weight] = (-2, (m.n_heads, m.head_dim, m.head_dim))
        elif isinstance(m, SwiGLU):
            out[m.w_gate_up.weight] = (-2, (m.hidden_dim, m.hidden_dim))
    return {p: layout for p, layout in out.items() if p.requires_grad}


class MuonAdamW(torch.optim.Optimizer):
    """One optimizer (one state dict, one schedule) of two kinds of parameter groups: AdamW groups, stepped by
    an inner :class:`torch.optim.AdamW` that shares this optimizer's groups and state, and Muon groups
    (``group["muon"]`` true), stepped as :class:`torch.optim.Muon` with ``adjust_lr_fn="match_rms_adamw"``.

    A Muon step per parameter: ``buf <- lerp(buf, g, 1 - momentum)``, Nesterov ``u = lerp(g, buf, momentum)``,
    each block ``B`` (``[A, C]``) of ``u`` orthogonalised by torch's Newton-Schulz iteration (``ns_dtype``) and
    scaled by ``0.2 sqrt(max(A, C))``, then ``p <- p (1 - lr wd) - lr U``. Blocks come from the group's layout
    (``split_dim``, ``split_sizes``, see :func:`muon_matrices`), with every leading index (expert) on its own;
    torch's Muon takes whole 2-D matrices only.

    DTensor parameters (FSDP2 shards, expert-parallel experts, both): the Newton-Schulz iteration needs whole
    matrices, so each parameter's Nesterov update is gathered (``full_tensor``: one parameter at a time, the
    whole stacked experts of a layer for an expert weight), orthogonalised on every rank alike, and each rank
    keeps its own shard of the result. The momentum buffer stays sharded like the parameter.

    Args:
        adamw_groups: parameter groups for AdamW (each may set its ``weight_decay``).
        muon_groups: parameter groups for Muon, each with ``split_dim`` and ``split_sizes``.
        lr, betas, eps, fused: AdamW's settings (``lr`` also Muon's, before the RMS matching).
        weight_decay: Muon's decoupled weight decay.
        momentum, ns_steps: Muon's momentum and Newton-Schulz iterations.
        ns_dtype: the iteration's dtype, one of :data:`~k3lit.train.newton_schulz.NS_DTYPES` (``auto``: by the
            parameters' device, :func:`~k3lit.train.newton_schulz.ns_dtype`).

    Raises:
        RuntimeError: torch has no ``torch.optim.Muon`` (before 2.9).
        ValueError: an unknown ``ns_dtype``.
    """

    def __init__(
        self,
        adamw_groups: list[dict[str, Any]],
        muon_groups: list[dict[str, Any]],
        lr: float,
        betas: tuple[float, float],
        eps: float,
        weight_decay: float,
        momentum: float,
        ns_steps: int,
        fused: bool | None = None,
        ns_dtype: str = "auto",
    ) -> None:
        if not hasattr(torch.optim, "Muon"):
            raise RuntimeError(f"optim.name=muon needs torch >= 2.9 (torch.optim.Muon); this is {torch.__version__}")
        if ns_dtype not in NS_DTYPES:
            raise ValueError(f"MuonAdamW: ns_dtype={ns_dtype!r}: choose one of {NS_DTYPES}")
        self.ns_dtype = ns_dtype
        self._adamw = torch.optim.AdamW(adamw_groups, lr=lr, betas=betas, eps=eps, fused=fused)
        muon = dict(muon=True, weight_decay=weight_decay, momentum=momentum, ns_steps=ns_steps)
        groups = self._adamw.param_groups + [{**muon, **g} for g in muon_groups]
        super().__init__(groups, dict(lr=lr, muon=False))
        self._share()
        self._blocks_key: tuple | None = None  # the parameters _blocks and _param_pieces were built for
        self._blocks: BatchedBlocks | None = None
        self._param_pieces: list[torch.Tensor] = []

    def _share(self) -> None:
        """Point the inner AdamW at this optimizer's AdamW groups and state (after construction and loading)."""
        self._adamw.param_groups = [g for g in self.param_groups if not g["muon"]]
        self._adamw.state = self.state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:  # noqa: D102
        super().load_state_dict(state_dict)
        self._share()

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        """One step of every group; ``closure`` (re-evaluating the loss with gradients) runs first, once."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._adamw.step()
        self._muon_steps([g for g in self.param_groups if g["muon"]])
        return loss

    def _muon_steps(self, groups: list[dict[str, Any]]) -> None:
        """Momentum, Nesterov update and decay of every Muon parameter by multi-tensor (``foreach``) ops, one per
        distinct momentum or decay; the orthogonalisation of every block batched by block shape
        (:class:`~k3lit.train.newton_schulz.BatchedBlocks`, kept from step to step while the parameters are plain
        tensors), the scaled blocks subtracted from the parameters' pieces in place by one multi-tensor op."""
        entries = [(p, g) for g in groups for p in g["params"] if p.grad is not None]
        if not entries:
            return
        for p, _ in entries:
            if "momentum_buffer" not in self.state[p]:
                self.state[p]["momentum_buffer"] = torch.zeros_like(p.grad, memory_format=torch.preserve_format)
        nesterov: dict[torch.Tensor, torch.Tensor] = {}
        for momentum in {g["momentum"] for _, g in entries}:
            ps = [p for p, g in entries if g["momentum"] == momentum]
            grads, bufs = [p.grad for p in ps], [self.state[p]["momentum_buffer"] for p in ps]
            torch._foreach_lerp_(bufs, grads, 1 - momentum)
            nesterov.update(zip(ps, torch._foreach_lerp(grads, bufs, momentum), strict=True))
        sharded = any(isinstance(p, DTensor) for p, _ in entries)
        # every rank orthogonalises the whole Nesterov update of a DTensor parameter and keeps its own shard
        updates = [nesterov[p].full_tensor() if isinstance(p, DTensor) else nesterov[p] for p, _ in entries]
        blocks = self._batched_blocks(entries, updates, keep=not sharded)
        pieces = [u.split(g["split_sizes"], g["split_dim"]) if len(g["split_sizes"]) > 1 else (u,)
                  for u, (_, g) in zip(updates, entries, strict=True)]
        ortho = blocks.run([pieces[i][j] for i, j in blocks.order])
        # torch's _adjust_lr (match_rms_adamw), to the bit: lr * (0.2 sqrt(max(a, c)))
        torch._foreach_mul_(ortho, [float(entries[i][1]["lr"]) * r
                                    for (i, _), r in zip(blocks.order, blocks.rms_scale, strict=True)])
        for decay in {1 - float(g["lr"]) * g["weight_decay"] for _, g in entries}:
            torch._foreach_mul_([p for p, g in entries if 1 - float(g["lr"]) * g["weight_decay"] == decay], decay)
        if not sharded:
            torch._foreach_sub_(self._param_pieces, ortho)
            return
        full = [torch.empty_like(u) for u in updates]
        torch._foreach_copy_(_piece_views(full, entries, blocks.order), ortho)
        full = [distribute_tensor(u, p.device_mesh, p.placements, src_data_rank=None) if isinstance(p, DTensor) else u
                for (p, _), u in zip(entries, full, strict=True)]
        torch._foreach_sub_([p for p, _ in entries], full)

    def _batched_blocks(self, entries: list[tuple[torch.Tensor, dict[str, Any]]], updates: list[torch.Tensor],
                        keep: bool) -> BatchedBlocks:
        """The :class:`BatchedBlocks` of these updates; with ``keep`` (plain parameters), kept with the views of
        the parameters' pieces (``_param_pieces``, in its order) until the parameters or their layouts change."""
        key = keep and (self.ns_dtype, *((id(p), p.data_ptr(), g["split_dim"], tuple(g["split_sizes"]), g["ns_steps"])
                                         for p, g in entries))
        if key and key == self._blocks_key:
            return self._blocks
        device = updates[0].device
        blocks = BatchedBlocks([(u.shape, g["split_dim"], g["split_sizes"], g["ns_steps"], u.dtype)
                                for u, (_, g) in zip(updates, entries, strict=True)], device,
                               ns_dtype(self.ns_dtype, device))
        if keep:
            self._blocks_key, self._blocks = key, blocks
            self._param_pieces = _piece_views([p.detach() for p, _ in entries], entries, blocks.order)
        return blocks


def _piece_views(tensors: list[torch.Tensor], entries: list[tuple[torch.Tensor, dict[str, Any]]],
                 order: list[tuple[int, int]]) -> list[torch.Tensor]:
    """Views ``[blocks, a, c]`` of the pieces ``order`` names of ``tensors`` (one per entry, its full shape), split as
    the entry's group says."""
    split = [t.split(g["split_sizes"], g["split_dim"]) for t, (_, g) in zip(tensors, entries, strict=True)]
    return [split[i][j].view(-1, *split[i][j].shape[-2:]) for i, j in order]


def _fused_supported(params: list[torch.Tensor]) -> bool:
    """Every parameter a plain (not DTensor) CUDA tensor: the case the fused AdamW kernel is used for."""
    return bool(params) and all(p.is_cuda and not isinstance(p, DTensor) for p in params)
