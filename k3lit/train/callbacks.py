"""Training callbacks: tokens/s and MFU from our FLOPs formula; SLURM requeue at a step boundary; ``last.ckpt``
every N steps and at the end of training.

All are in K3CLI's default callbacks; each is a no-op where it does not apply (no FLOPs peak known for the
device: no MFU; not inside a SLURM job: no signal handler).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import threading
import time
import warnings
from datetime import timedelta
from typing import Any

import lightning as L
import torch
from lightning.fabric.plugins.environments import SLURMEnvironment
from lightning.fabric.utilities.cloud_io import get_filesystem
from lightning.fabric.utilities.exceptions import MisconfigurationException
from lightning.pytorch.callbacks import Callback, ModelCheckpoint, ThroughputMonitor
from lightning.pytorch.trainer.states import RunningStage, TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_only, rank_zero_warn
from typing_extensions import override

from k3lit import lightning_compat as compat
from k3lit.train.checkpoint_background import finish_writes
from k3lit.train.flops import compute_dtype, peak_flops, training_flops
from k3lit.train.run_dir import move_aside

__all__ = ["K3ThroughputMonitor", "LastCheckpoint", "SlurmRequeue"]


class K3ThroughputMonitor(ThroughputMonitor):
    """Lightning's :class:`ThroughputMonitor` fed with k3lit's FLOPs count and token lengths, timing training
    without a host sync per step.

    Logged (rank zero, on the steps that write logs: every ``log_every_n_steps``), with Lightning's names:
    ``train/device/items_per_sec`` = tokens/s per device (``train/items_per_sec`` all devices, when several),
    ``train/device/flops_per_sec`` and ``train/device/mfu`` = model FLOPs / dense peak (:func:`peak_flops`; not
    logged where the peak is unknown, e.g. on CPUs), and the same for validation. FLOPs per batch come from
    :func:`k3lit.train.flops.training_flops` (see that module for the formula) for the shape of each batch
    ``[B, T + 1]``.

    Lightning's monitor synchronises the device after every batch to read its clock, which keeps the host from
    queueing the next step while the device works. Here training batches are only counted on the host; the device
    is synchronised and the clock read on the steps that write logs (where Lightning turns the logged values into
    numbers, a sync anyway), so the rates cover whole logging intervals. Validation is timed per batch, as
    Lightning does, and its wall time (from its start to its end, both synchronised) is left out of the training
    rates.

    Args:
        window_size: logging steps in the rolling average: the figures cover the optimizer steps between the
            oldest and the newest of the last ``window_size`` logging steps (2, the least: the last interval of
            ``log_every_n_steps``); nothing is logged before ``window_size`` logging steps have passed.
        available_flops: override the per-device peak FLOP/s used for MFU.
    """

    def __init__(self, window_size: int = 2, available_flops: float | None = None) -> None:
        super().__init__(
            batch_size_fn=lambda b: b.shape[0],
            length_fn=lambda b: b.shape[0] * (b.shape[1] - 1),
            window_size=window_size,
        )
        self.window_size = window_size
        self._override_flops = available_flops
        self._flops_cache: dict[tuple[int, int], float] = {}
        self._flops_since: dict[RunningStage, float] = {}  # FLOPs since the stage's last recorded time
        self._val_started: float | None = None
        self.last_metrics: dict[str, float] = {}  # what was last logged, for ProgressLines and RunSummary

    @override
    def _update(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, iter_num: int) -> None:
        """Count ``batch``; on a logging step of training, and after every other stage's batch, synchronise the
        device and record the elapsed time with the counts (a private hook of Lightning's monitor: see
        :mod:`k3lit.lightning_compat`)."""
        stage = trainer.state.stage
        self._lengths[stage] += self.length_fn(batch)
        self._samples[stage] += self.batch_size_fn(batch)
        self._batches[stage] += 1
        self._flops_since[stage] = self._flops_since.get(stage, 0.0) + pl_module.flops_per_batch
        if stage == RunningStage.TRAINING and not (compat.should_update_logs(trainer)
                                                   and not compat.accumulating(trainer)):
            return
        compat.throughputs(self)[stage].update(
            time=self._clock(trainer) - self._t0s[stage], batches=self._batches[stage],
            samples=self._samples[stage], lengths=self._lengths[stage], flops=self._flops_since[stage])
        self._flops_since[stage] = 0.0

    @staticmethod
    def _clock(trainer: L.Trainer) -> float:
        """Host seconds once the device has finished the work queued so far."""
        if trainer.strategy.root_device.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter()

    @override
    def _compute(self, trainer: L.Trainer, iter_num: int | None = None) -> None:
        """Lightning's (log the rolling throughput to the loggers), keeping what it logged in :attr:`last_metrics`;
        validation's at the training step it follows. (A private hook of Lightning's monitor: see
        :mod:`k3lit.lightning_compat`.)"""
        if not compat.should_update_logs(trainer):
            return
        stage = trainer.state.stage
        throughput = compat.throughputs(self)[stage]
        metrics = {f"{stage.value}{throughput.separator}{k}": v for k, v in throughput.compute().items()}
        # validation's rates at the step its val/* values are logged at, not at its own batch count
        compat.log_metrics(trainer, metrics, step=iter_num if stage == RunningStage.TRAINING else None)
        self.last_metrics.update(metrics)

    @override
    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        with warnings.catch_warnings():  # Lightning's table lacks Hopper's dense peaks; peak_flops has them and
            warnings.filterwarnings("ignore", message="FLOPs not found")  # warns itself for an unknown chip
            super().setup(trainer, pl_module, stage)
        peak = self._override_flops or peak_flops(trainer.strategy.root_device, compute_dtype(trainer.precision))
        self.available_flops = peak
        for throughput in compat.throughputs(self).values():
            throughput.available_flops = peak

    @override
    def _start(self, trainer: L.Trainer) -> None:
        super()._start(trainer)
        self._flops_since[trainer.state.stage] = 0.0

    def _set_flops(self, pl_module: L.LightningModule, batch: Any) -> None:
        shape = (int(batch.shape[0]), int(batch.shape[1]) - 1)
        if shape not in self._flops_cache:
            self._flops_cache[shape] = training_flops(pl_module.model_config, *shape)
        flops = self._flops_cache[shape]
        # Validation is a forward only: a third of the training work.
        pl_module.flops_per_batch = flops if pl_module.training else flops / 3

    @override
    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, *_: Any) -> None:
        self._set_flops(pl_module, batch)

    @override
    def on_validation_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any,
                                  *_: Any, **__: Any) -> None:
        self._set_flops(pl_module, batch)

    @override
    @rank_zero_only
    def on_validation_start(self, trainer: L.Trainer, *_: Any) -> None:
        if trainer.sanity_checking:
            return
        self._val_started = self._clock(trainer) if trainer.state.fn == TrainerFn.FITTING else None
        self._start(trainer)

    @override
    @rank_zero_only
    def on_validation_end(self, trainer: L.Trainer, *_: Any) -> None:
        """Leave the validation's wall time out of the training clock."""
        if trainer.sanity_checking or self._val_started is None:
            return
        self._t0s[RunningStage.TRAINING] += self._clock(trainer) - self._val_started
        self._val_started = None


class SlurmRequeue(Callback):
    """Checkpoint and requeue a SLURM job on its warning signal, at the next optimizer-step boundary.

    Lightning's ``SLURMEnvironment(auto_requeue=True)`` saves its checkpoint *inside* the signal handler,
    i.e. at whatever point of the step the signal lands: possibly between a backward and its optimizer step,
    and, with several processes, issuing the checkpoint's collectives while another rank is inside a
    gradient all-reduce. Here the handler only raises a flag; after each optimizer step every rank agrees
    (one boolean all-reduce) whether any rank was signalled, and if so all of them write the checkpoint the
    next job resumes from, ``<ModelCheckpoint.dirpath>/last.ckpt`` (found by ``--ckpt_path last``, and
    sharded through torch distributed checkpoint under FSDP2), and training stops; once it has ended on
    every rank, rank zero runs ``scontrol requeue $SLURM_JOB_ID`` (which kills and requeues the job).
    Installing the handler in ``setup`` (before the Trainer registers its own) keeps Lightning's in-handler
    save from running.

    Active only inside a SLURM job (:meth:`SLURMEnvironment.detect`) and only while fitting.

    Args:
        signum: the signal ``#SBATCH --signal`` sends (default SIGUSR1).
    """

    def __init__(self, signum: int = signal.SIGUSR1) -> None:
        self.signum = signal.Signals(signum)
        self._signalled = False
        self._armed = False
        self._previous: Any = None
        self.requeued_at_step: int | None = None

    def _on_signal(self, signum: int, frame: Any) -> None:
        self._signalled = True

    @override
    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if stage != "fit" or not SLURMEnvironment.detect():
            return
        if threading.current_thread() is not threading.main_thread():
            rank_zero_warn("SlurmRequeue: not in the main thread, so no signal handler; requeue is off")
            return
        self._previous = signal.signal(self.signum, self._on_signal)
        self._armed = True

    @override
    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self._armed:
            rank_zero_info(f"k3lit: {self.signum.name} will checkpoint at the next step and requeue job "
                           f"{self._job_id()} (restart {os.environ.get('SLURM_RESTART_COUNT', '0')})")

    @override
    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if not self._armed or (batch_idx + 1) % trainer.accumulate_grad_batches:
            return
        if not trainer.strategy.reduce_boolean_decision(self._signalled, all=False):
            return
        path = self._checkpoint_path(trainer)
        trainer.save_checkpoint(path)  # every rank: sharded checkpoints write one shard per rank
        finish_writes(trainer)  # on disk before the job can be requeued
        self.requeued_at_step = trainer.global_step
        rank_zero_info(f"k3lit: saved {path} at step {trainer.global_step}; requeueing job {self._job_id()}")
        trainer.should_stop = True
        self._signalled = False

    @override
    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        # Requeue only now: `scontrol requeue` kills the job at once, so every checkpoint write of this run
        # (ours, and ModelCheckpoint's at the end of the epoch) must be complete on every rank first.
        if self.requeued_at_step is None:
            return
        finish_writes(trainer)
        trainer.strategy.barrier("SlurmRequeue")
        if trainer.is_global_zero:
            out = subprocess.run(["scontrol", "requeue", self._job_id()], capture_output=True, text=True)
            if out.returncode:
                rank_zero_warn(f"scontrol requeue {self._job_id()} failed ({out.returncode}): {out.stderr.strip()}")

    @override
    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if self._armed and threading.current_thread() is threading.main_thread():
            signal.signal(self.signum, self._previous if self._previous is not None else signal.SIG_DFL)
        self._armed = False

    @staticmethod
    def _job_id() -> str:
        array_id = os.environ.get("SLURM_ARRAY_JOB_ID")
        job = f"{array_id}_{os.environ['SLURM_ARRAY_TASK_ID']}" if array_id else os.environ["SLURM_JOB_ID"]
        if not re.fullmatch(r"[0-9_]+", job):
            raise ValueError(f"unexpected SLURM job id {job!r}")
        return job

    @staticmethod
    def _checkpoint_path(trainer: L.Trainer) -> str:
        for cb in trainer.checkpoint_callbacks:
            if isinstance(cb, ModelCheckpoint) and cb.dirpath:
                path = os.path.join(cb.dirpath, cb.CHECKPOINT_NAME_LAST + cb.FILE_EXTENSION)
                # Its own: a later save_last overwrites this file instead of writing last-v1.ckpt beside it.
                cb.last_model_path = path
                return path
        # No ModelCheckpoint: Lightning resumes from default_root_dir/hpc_ckpt_<n>.ckpt by itself under SLURM.
        return compat.hpc_save_path(trainer)


class LastCheckpoint(ModelCheckpoint):
    """``last.ckpt`` every ``every_n_train_steps`` steps (or every ``train_time_interval`` of training) **and** when
    training ends (max_steps, max_time, a stop).

    Lightning's triggers are exclusive: with a step or time trigger set nothing is saved at the end of training,
    and after validation ``last`` is written only next to a top-k file. So the periodic save uses the step or time
    trigger and :meth:`on_train_end` writes the final state unless this step is already saved.

    There is one ``last.ckpt`` per folder, the one ``--ckpt_path last``, ``k3lit generate`` and ``make generate``
    read: a run that does not resume (``resume=False``) first moves an earlier run's ``last.ckpt`` aside to
    ``previous.<n>.ckpt`` (with a warning naming it), where Lightning would write ``last-v1.ckpt`` beside it.

    Raises:
        MisconfigurationException: both or neither of ``every_n_train_steps`` and ``train_time_interval`` (Lightning's
            check), or a negative interval.
    """

    def __init__(self, dirpath: str | os.PathLike, every_n_train_steps: int | None = None, resume: bool = False,
                 train_time_interval: timedelta | None = None) -> None:
        if (every_n_train_steps is None) == (train_time_interval is None):
            raise MisconfigurationException("LastCheckpoint: give every_n_train_steps or train_time_interval, not "
                                            f"both or neither (got {every_n_train_steps}, {train_time_interval})")
        super().__init__(dirpath=dirpath, save_last=True, save_top_k=0, every_n_train_steps=every_n_train_steps,
                         train_time_interval=train_time_interval, enable_version_counter=False)
        self.resume = resume

    @override
    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        super().setup(trainer, pl_module, stage)
        last = os.path.join(self.dirpath, self.CHECKPOINT_NAME_LAST + self.FILE_EXTENSION)
        fs = get_filesystem(last)
        if stage == "fit" and not self.resume and trainer.is_global_zero and fs.exists(last):
            move_aside(fs, last, "previous")

    @override
    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        compat.save_last_checkpoint(self, trainer)  # skips when this global step was saved already
