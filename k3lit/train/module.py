"""K3LitModule: next-token training of a K3LM with balancer updates once per optimizer step."""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from contextlib import nullcontext
from typing import Any, Literal

import lightning as L
import torch
from lightning.pytorch.callbacks import Timer
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torchmetrics import MeanMetric, SumMetric
from typing_extensions import override

from k3lit import lightning_compat as compat
from k3lit.model import K3LM, ModelConfig
from k3lit.nn.moe import MoE, update_balancers
from k3lit.train.checkpoint import load_initial_weights
from k3lit.train.loss import compiled_next_token_loss, next_token_loss
from k3lit.train.metrics import ExpertLoad
from k3lit.train.optim import OptimConfig

COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")  # torch.compile's

# Checkpoints store the two configs as hyper-parameters; allow them under torch.load(weights_only=True).
torch.serialization.add_safe_globals([ModelConfig, OptimConfig])


class K3LitModule(L.LightningModule):
    """Trains a :class:`K3LM` on ``[B, T + 1]`` int64 token batches (inputs ``[:, :-1]``, targets ``[:, 1:]``).

    Logs ``train/loss`` (nats per token), ``train/grad_norm`` (the total gradient norm before clipping, with
    ``gradient_clip_val`` and norm clipping), ``val/loss`` and ``val/bpb`` (bits per UTF-8 byte of the held-out
    text, so runs with different tokenizers compare: the pass's summed nats / ln 2 / the UTF-8 bytes its targets
    stand for, by the datamodule's ``token_bytes`` table; not logged without one) with ``val/elapsed_s`` (seconds
    since training started, as ``trainer.max_time`` counts them), and per MoE layer ``i``: ``train/max_vio/layer{i}``
    (MaxVio of each training batch), ``val/max_vio/layer{i}`` (MaxVio_global over the validation pass) and
    ``val/expert_frac/layer{i}/e{j}`` (token fraction per expert), ``train/router_entropy/layer{i}`` and, in
    capacity mode, ``train/drop_rate/layer{i}`` and ``train/reroute_rate/layer{i}``. Train MoE metrics are
    accumulated over every micro-batch of an optimizer step (on every rank) and logged once per step, so
    ``train/max_vio`` is MaxVio_batch of the whole global batch; loads are recorded by the MoE forward but not
    by its recomputation inside backward, so nothing is counted twice.

    The MoE balancers (quantile bias, sign bias) update once per optimizer step in
    :meth:`on_before_optimizer_step`, after every micro-batch of that step has been routed, so no batch is
    routed by a bias derived from itself.

    Args:
        model: the architecture.
        optim: optimizer and schedule (defaults of :class:`OptimConfig` when None).
        compile: ``torch.compile`` in :meth:`configure_model`, each sublayer on its own (regional compilation,
            :meth:`~k3lit.model.K3LM.compile_sublayers`; under a sharding strategy the FSDP2 hooks sit between
            sublayers, as in torchtitan), and the loss on its own (:func:`k3lit.train.loss.compiled_next_token_loss`).
            None (default): on for one CUDA device without a sharding strategy, where
            it pays (benchmarks/RESULTS.md, "Throughput"), off otherwise.
            Training steps only: validation runs the same modules eagerly
            (``torch.compiler.set_stance("force_eager")``), since a no-grad graph would compile a second time for
            tens of seconds (``small`` on an H200) to save a few milliseconds a batch.
        compile_scope: ``sublayers`` (default): the few distinct sublayer graphs compile in half the time of the
            whole model or less, for a step a percent or two slower (benchmarks/RESULTS.md, "Throughput");
            ``model``: the whole model as one graph on a single device (KDA, the short convolution and AttnRes are
            custom ops inside it), for long runs where the last percent of step time outweighs the start-up. A
            sharding strategy always compiles sublayers.
        compile_mode: ``torch.compile``'s ``mode`` (None: its default), e.g.
            ``reduce-overhead``: CUDA graphs, so that the host replays each compiled region's forward and backward
            as graphs instead of launching their kernels one by one (the step's shapes are static): half the host
            time of ``small``'s step, the same device time (benchmarks/RESULTS.md, "Host time per step (H200)").
        empty_init: build the K3LM on the meta device (no memory); :meth:`configure_model` shards it and
            materialises only this rank's shards. For sharding strategies (``k3lit fit`` sets it under a
            ``ModelParallelStrategy``); not saved as a hyper-parameter, so checkpoints load into a full model.
        init_weights: a checkpoint (file or sharded folder) whose model weights and balancer buffers
            :meth:`configure_model` loads, once the model is materialised and sharded; everything else (optimizer,
            schedule, step count, data position) starts afresh. Its architecture must be ``model``'s (``k3lit fit
            --init_weights`` takes it from the checkpoint) and its tokenizer the data module's. Not saved as a
            hyper-parameter (the run's config.yaml records it).

    Raises:
        ValueError: an unknown ``compile_scope`` or ``compile_mode``.
    """

    def __init__(
        self,
        model: ModelConfig,
        optim: OptimConfig | None = None,
        compile: bool | None = None,
        compile_mode: str | None = None,
        compile_scope: Literal["sublayers", "model"] = "sublayers",
        empty_init: bool = False,
        init_weights: str | None = None,
    ) -> None:
        super().__init__()
        if compile_scope not in ("sublayers", "model"):
            raise ValueError(f"compile_scope={compile_scope!r}: choose 'sublayers' or 'model'")
        if compile_mode is not None and compile_mode not in COMPILE_MODES:
            raise ValueError(f"compile_mode={compile_mode!r}: choose one of {', '.join(COMPILE_MODES)} "
                             "(torch.compile's modes), or None for its default")
        self.compile_model = compile
        self.compile_mode = compile_mode
        self.compile_scope = compile_scope
        self.save_hyperparameters(ignore=["empty_init", "init_weights"])
        self.init_weights = init_weights
        self.model_config = model
        self.optim_config = optim or OptimConfig()
        with torch.device("meta") if empty_init else nullcontext():
            self.model = K3LM(model)
        self.val_loss = MeanMetric()
        self.val_targets, self.val_bytes = SumMetric(), SumMetric()  # target tokens and the UTF-8 bytes they encode
        self.last_val_bytes: int | None = None  # bytes of the last validation pass's targets (all ranks)
        self._byte_table: torch.Tensor | None = None  # int64 [vocab] bytes per token id, from the datamodule
        self._train_started = time.monotonic()
        self._step_logs: list[tuple[Callable[[], dict[str, torch.Tensor]], bool]] = []  # see _log_step
        self._loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = next_token_loss  # compiled with the model
        self.warmup_end_s: float | None = None  # the run's elapsed seconds when warm-up ended (max_time schedule)
        n_moe = len(self.model.moe_layers())
        if n_moe:
            self.train_load = ExpertLoad(n_moe, model.n_experts, model.top_k)
            self.val_load = ExpertLoad(n_moe, model.n_experts, model.top_k)

    def compiles(self) -> bool:
        """Whether :meth:`configure_model` compiles: ``compile`` as given, or for None whether the model trains on
        one CUDA device without a device mesh (the trainer's root device: the model is still on the CPU then)."""
        if self.compile_model is not None:
            return bool(self.compile_model)
        try:
            device = self.trainer.strategy.root_device
        except RuntimeError:  # not attached to a Trainer
            device = self.device
        return device.type == "cuda" and self.device_mesh is None

    @override
    def configure_model(self) -> None:
        """When :meth:`compiles`: ``torch.compile`` in place (state-dict names unchanged): every sublayer (before
        FSDP2 wraps them when a device mesh exists), or the whole model (``compile_scope="model"``, no mesh). Then,
        under a model-parallel strategy (a device mesh exists), shard the model with FSDP2. A model built with
        ``empty_init=True`` is then materialised: each rank allocates its shards (the whole model without a mesh) on
        the strategy's root device and initialises them (:func:`k3lit.parallel.init_sharded`)."""
        if self.compiles() and not getattr(self, "_compiled", False):
            whole = self.compile_scope == "model" and self.device_mesh is None
            if whole:
                self.model.compile(mode=self.compile_mode)
            else:
                self.model.compile_sublayers(mode=self.compile_mode)
            self._loss_fn = compiled_next_token_loss()  # outside the model's graphs: compiled on its own
            self._compiled = True
            rank_zero_info("k3lit: torch.compile on the " + ("whole model" if whole else "sublayers")
                           + ": the first steps compile it (--compile=false: eager)")
        if self.device_mesh is not None and not getattr(self, "_parallelized", False):
            from k3lit.parallel import parallelize

            parallelize(self.model, self.device_mesh)
            self._parallelized = True
        if any(p.is_meta for p in self.model.parameters()):
            self.model.to_empty(device=self.trainer.strategy.root_device)
            if self.device_mesh is None:
                self.model.init_weights()
            else:
                from k3lit.parallel import init_sharded

                init_sharded(self.model, self.device_mesh)
        if self.init_weights is not None and not getattr(self, "_weights_loaded", False):
            load_initial_weights(self.model, self.init_weights, self._data_tokenizer())
            self._weights_loaded = True

    def _data_tokenizer(self) -> dict | None:
        """The trainer's data module's tokenizer state (``K3DataModule.state_dict()``), None without one."""
        try:
            dm = self.trainer.datamodule
        except RuntimeError:  # not attached to a Trainer
            return None
        state = dm.state_dict() if dm is not None else None
        return state if state and "tokenizer_spec" in state else None

    @override
    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.model(idx)[0]

    def _loss(self, batch: torch.Tensor) -> torch.Tensor:
        x, y = batch[:, :-1], batch[:, 1:]
        return self._loss_fn(self.model(x)[0], y)

    @override
    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        loss = self._loss(batch)
        self._step_logs = []  # this micro-batch's; the MoE statistics and grad norm follow on the step's last one
        self._log_step(lambda: {"train/loss": loss.detach()})  # not prog_bar: Lightning reads those every batch
        aux = self.model.aux_loss()
        if aux is not None:
            self._log_step(lambda: {"train/aux_loss": aux.detach()})
            loss = loss + aux
        if moes := self.model.moe_layers():
            self._update_load(self.train_load, moes)  # every micro-batch; logged once per optimizer step
            for moe in moes:  # a compiled forward's balancer statistics, before the next micro-batch's replaces them
                moe.collect_balancer_stats()
        return loss

    @staticmethod
    def _update_load(metric: ExpertLoad, moes: list[MoE]) -> None:
        """Add the latest forward of every MoE layer (this rank's tokens, recorded outside recomputation)."""
        stats = {k: torch.stack([m.last_stats[k] for m in moes]) for k in ("rerouted", "dropped", "entropy")}
        loads = torch.stack([m.last_load for m in moes])  # [L_moe, n_experts]
        metric.update(loads, moes[0].last_stats["tokens"], **stats)  # 0-d tensor: no host sync

    @override
    def on_train_start(self) -> None:
        """A run resumed from a checkpoint trains with its own ``optim`` settings, not the restored ones."""
        self._train_started = time.monotonic()
        if self.trainer.ckpt_path:
            self.optim_config.apply(self.trainer.optimizers[0], self.trainer.lr_scheduler_configs[0].scheduler)

    def _log_step(self, values: Callable[[], dict[str, torch.Tensor]]) -> None:
        """Log this step's training values (``values()``: 0-d device tensors, no host sync) if Lightning will write
        them: on every ``log_every_n_steps``-th step (always outside a trainer). Each ``self.log`` call costs the
        host about half a millisecond (Lightning's result store moves the value's state to its device), so the
        other steps log nothing; their values are kept for :meth:`on_train_batch_end`, which logs them if a
        callback stops training at this step, so the last row Lightning writes holds this step's values."""
        logged = self._trainer is None or compat.should_update_logs(self.trainer)
        self._step_logs.append((values, logged))
        for name, value in values().items() if logged else ():
            self.log(name, value)

    @override
    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        if self.trainer.should_stop and not compat.accumulating(self.trainer):
            for values, logged in self._step_logs:
                for name, value in values().items() if not logged else ():
                    self.log(name, value)

    @override
    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        """Balancer updates, then the step's MoE statistics, computed and logged on the device without a host
        sync: Lightning turns logged values into numbers when it writes them (every ``log_every_n_steps``); the
        progress displays read theirs on those steps too (:func:`k3lit.train.progress.shown_metrics`)."""
        moes = self.model.moe_layers()
        update_balancers(moes)
        if moes and self.train_load.update_called:  # a Python count of this rank's updates: no host sync
            # MaxVio_batch over the whole optimizer-step batch: all micro-batches, all ranks (synced in compute)
            stats = self.train_load.compute()
            self.train_load.reset()
            self.last_expert_fraction = stats["fraction"].detach()  # [L_moe, n] on the device, for ExpertLoadPlots
            names = {"max_vio": "max_vio", "entropy": "router_entropy"}
            if self.model_config.capacity_factor is not None:
                names.update(drop_rate="drop_rate", reroute_rate="reroute_rate")
            self._log_step(lambda: {f"train/{name}/layer{i}": stats[key][i] for key, name in names.items()
                                    for i in range(len(stats["max_vio"]))})

    @override
    def configure_gradient_clipping(
        self, optimizer: torch.optim.Optimizer, gradient_clip_val: float | None = None,
        gradient_clip_algorithm: str | None = None,
    ) -> None:
        """Gradient clipping; with norm clipping, logs the total gradient norm before clipping as
        ``train/grad_norm`` on logging steps (a 0-d device tensor: no host sync on the other steps).

        - Norm clipping over DTensor gradients on different meshes (expert and dense shards) goes through
          :func:`k3lit.parallel.clip_grad_norm_`.
        - Norm clipping under Lightning's plain or mixed precision runs torch's ``clip_grad_norm_`` here, as the
          plugin would (under ``16-mixed`` the scaler has unscaled the gradients before this hook), so that its
          norm can be logged. That also covers the fused AdamW (which :meth:`OptimConfig.build` picks for plain
          CUDA parameters) under ``bf16-mixed``, which the plugin refuses (RuntimeError "does not allow for
          gradient clipping") although there is nothing to unscale; under ``16-mixed`` with clipping
          :meth:`configure_optimizers` builds no fused AdamW.
        - Value clipping with that fused AdamW under ``bf16-mixed``: torch's ``clip_grad_value_``, for the same
          reason. Every other case is Lightning's.
        """
        from lightning.pytorch.plugins.precision import MixedPrecision, Precision
        from torch.distributed.tensor import DTensor

        params = [p for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        algorithm = gradient_clip_algorithm or "norm"
        plugin = self.trainer.precision_plugin
        norm = None
        if gradient_clip_val and algorithm == "norm" and any(isinstance(p, DTensor) for p in params):
            from k3lit.parallel import clip_grad_norm_

            norm = clip_grad_norm_(params, float(gradient_clip_val))
        elif gradient_clip_val and algorithm == "norm" and type(plugin) in (Precision, MixedPrecision):
            norm = torch.nn.utils.clip_grad_norm_(params, float(gradient_clip_val))
        elif (gradient_clip_val and algorithm == "value" and optimizer.defaults.get("fused")
              and isinstance(plugin, MixedPrecision) and plugin.scaler is None):
            torch.nn.utils.clip_grad_value_(params, float(gradient_clip_val))
        else:
            super().configure_gradient_clipping(optimizer, gradient_clip_val, gradient_clip_algorithm)
        if norm is not None:
            self._log_step(lambda: {"train/grad_norm": norm})

    @override
    def on_validation_start(self) -> None:
        table = getattr(getattr(self.trainer, "datamodule", None), "token_bytes", None)
        self._byte_table = None if table is None else table.to(self.device)

    @override
    def validation_step(self, batch: torch.Tensor, batch_idx: int) -> None:
        with torch.compiler.set_stance("force_eager"):  # see ``compile`` in the class docstring
            loss = self._loss(batch)
        targets = batch[:, 1:]
        self.val_loss.update(loss, weight=targets.numel())
        if self._byte_table is not None:
            self.val_targets.update(targets.numel())
            self.val_bytes.update(self._byte_table[targets].sum())
        if moes := self.model.moe_layers():
            self._update_load(self.val_load, moes)

    @override
    def on_validation_epoch_end(self) -> None:
        loss = self.val_loss.compute()  # token-weighted mean over the whole pass, synced across ranks
        self.val_loss.reset()
        self.log("val/loss", loss, prog_bar=True)
        if self.trainer.state.fn == "fit" and not self.trainer.sanity_checking:  # held-out loss against wall-clock
            self.log("val/elapsed_s", self._elapsed_s())
        if self._byte_table is not None:  # sum nats / ln 2 / sum bytes over the very targets validated
            targets, n_bytes = self.val_targets.compute(), self.val_bytes.compute()
            self.val_targets.reset()
            self.val_bytes.reset()
            self.last_val_bytes = int(n_bytes)
            if self.last_val_bytes:
                self.log("val/bpb", loss * targets / (math.log(2) * n_bytes), prog_bar=True)
        if self.model.moe_layers():
            stats = self.val_load.compute()
            self.val_load.reset()
            self.last_val_expert_fraction = stats["fraction"].detach().cpu()
            for i, v in enumerate(stats["max_vio"]):
                self.log(f"val/max_vio/layer{i}", v)
                for j, f in enumerate(stats["fraction"][i]):
                    self.log(f"val/expert_frac/layer{i}/e{j}", f)

    @override
    def configure_optimizers(self) -> dict[str, Any]:
        # with clipping, a gradient scaler (16-mixed) must unscale first, which a fused AdamW (it unscales in its
        # step) does not allow
        scaler = getattr(self.trainer.precision_plugin, "scaler", None)
        fused = scaler is None or not self.trainer.gradient_clip_val
        opt, sched = self.optim_config.build(self.model, float(self.trainer.estimated_stepping_batches), fused=fused,
                                             time_progress=self._time_progress)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    def _time_progress(self, step: int) -> float:
        """The part of ``trainer.max_time`` after warm-up spent after ``step`` optimizer steps, in [0, 1]:
        ``(t - t_w) / (T - t_w)`` of the run's elapsed time t (Lightning's ``Timer``: the whole run, resumes and
        validation included), its budget T and the elapsed time t_w when warm-up ended; 0 during warm-up, before
        training starts and without a time limit."""
        timer = self._timer()
        remaining = timer.time_remaining() if timer is not None else None
        if remaining is None or step < self.optim_config.warmup_steps or self.trainer.state.fn != "fit":
            return 0.0
        elapsed = timer.time_elapsed()
        if self.warmup_end_s is None:
            self.warmup_end_s = elapsed
        budget = elapsed + remaining - self.warmup_end_s
        return min(max((elapsed - self.warmup_end_s) / budget, 0.0), 1.0) if budget > 0 else 1.0

    def _elapsed_s(self) -> float:
        """Seconds since training started: Lightning's ``Timer`` (resumes included) under ``max_time``, else this
        process's training time."""
        timer = self._timer()
        return timer.time_elapsed() if timer is not None else time.monotonic() - self._train_started

    def _timer(self) -> Timer | None:
        """Lightning's ``Timer`` of the attached trainer (present under ``trainer.max_time``), else None."""
        return next((c for c in self.trainer.callbacks if isinstance(c, Timer)), None) if self._trainer else None

    @override
    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        checkpoint["k3lit_warmup_end_s"] = self.warmup_end_s

    @override
    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        self.warmup_end_s = checkpoint.get("k3lit_warmup_end_s")
