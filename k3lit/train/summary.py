"""RunSummary: what a ``fit`` reached and where its outputs are, printed once when it ends.

    k3lit fit: max_steps reached at step 1000 in 0:09:00
      steps          1000
      tokens         4,096,000 (this run)
      wall time      0:09:00 (validation 0:00:29)
      set-up         9.4 s from the process's start to training's: interpreter start and imports 4.6; arguments
                     and recipe 0.4; data module 0.3; trainer 0.2; model 1.6; the device and data preparation 0.1;
                     the model onto its devices and the optimizer 0.1; model summary and data loaders 2.1 s
      first step     2.1 s after training started (compilation included)
      tokens/s       7,586 (all devices, validation excluded)
      MFU            unknown (no peak FLOP/s known for cpu)
      recent rate    7,950 tokens/s per device (the last 20 steps logged)
      held-out bpb   2.751 (val/bpb at step 1000, over the 226,527 bytes its targets encode)
      same bytes     gzip -9 1.724 · xz -9e 1.243 bits/byte on the text of the 320 validation blocks (227,404
                     bytes, each block's first token included)
      MaxVio_global  layer0 0.23 · layer1 0.26 · layer2 0.43 · layer3 0.98 · layer4 0.57
      checkpoint     runs/tiny/checkpoints/last.ckpt
      plots          runs/tiny/expert_load/step0001000.png · TensorBoard: .venv/bin/tensorboard --logdir runs/tiny
      sample         .venv/bin/k3lit generate --ckpt runs/tiny/checkpoints/last.ckpt

A rich table on a terminal, plain log lines otherwise (as :class:`~k3lit.train.progress.ProgressLines`). Rank
zero only. ``val/bpb`` divides the validation pass's nats by the UTF-8 bytes its targets encode (every rank's); the
"same bytes" row measures the compressors on the text of those blocks (:mod:`k3lit.train.reference_bpb`;
single-process runs: the very blocks validated, several processes: as many blocks from the split's start as rank
zero validated).
"""

from __future__ import annotations

import os
import shlex
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback, Timer
from lightning.pytorch.loggers import TensorBoardLogger
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from rich.console import Console
from rich.table import Table
from typing_extensions import override

from k3lit.data import K3DataModule
from k3lit.train.callbacks import K3ThroughputMonitor, SlurmRequeue
from k3lit.train.csv_log import RunCSVLogger
from k3lit.train.expert_plots import ExpertLoadPlots
from k3lit.train.flops import compute_dtype, peak_flops, training_flops
from k3lit.train.progress import clock
from k3lit.train.reference_bpb import reference_bpb

__all__ = ["RunSummary", "SETUP_MARKS"]

SETUP_MARKS = {  # the set-up's marks in the order they happen, each with what runs before it
    "imported": "interpreter start and imports",
    "parsed": "arguments and recipe",
    "data": "data module",
    "trainer": "trainer",
    "model": "model",
    "setup": "the device and data preparation",
    "fit_start": "the model onto its devices and the optimizer",
    "train_start": "model summary and data loaders",
}


class RunSummary(Callback):
    """Print, when ``fit`` ends, the steps and tokens trained, wall time, the set-up before training (where the
    process's age is known: Linux; split at :data:`SETUP_MARKS`), the first optimizer step's time (start-up:
    compilation, the first batch), tokens/s, MFU (where the device's peak is known), the last validation's
    ``val/bpb`` with gzip and xz on the same text, MaxVio_global per MoE layer, and the checkpoint, plots and logs
    with the command that samples from the checkpoint.

    Args:
        rich: a rich table (True) or plain log lines (False); default: a table when stdout is a terminal.
        console: where the table goes; default a rich ``Console()`` on stdout.
        compressors: also compress the validation text with gzip and xz (computed once per corpus and cached).

    Attributes:
        rows: the ``(label, value)`` rows of the last summary (rank zero), for programs.
    """

    def __init__(self, rich: bool | None = None, console: Console | None = None, compressors: bool = True) -> None:
        self.rich = rich
        self.console = console
        self.compressors = compressors
        self.title = ""
        self.rows: list[tuple[str, str]] = []
        self._ages: dict[str, float | None] = {}  # the process's age at each SETUP_MARKS mark reached
        self._reset()

    def _reset(self) -> None:
        self._start = time.monotonic()
        self._start_step = 0
        self._tokens = 0
        self._flops = 0.0
        self._flops_cache: dict[tuple[int, int], float] = {}
        self._val_seconds = 0.0
        self._val_start: float | None = None
        self._val_blocks = 0
        self._val_step: int | None = None
        self._first_step_s: float | None = None

    def record_age(self, mark: str, age: float | None = None) -> None:
        """Record set-up mark ``mark`` (one of :data:`SETUP_MARKS`; the CLI records those before Lightning's hooks,
        this callback the rest) at the process's ``age`` in seconds (default: now, :func:`process_age_s`).

        Raises:
            ValueError: an unknown ``mark``.
        """
        if mark not in SETUP_MARKS:
            raise ValueError(f"record_age: mark {mark!r} is not one of {', '.join(SETUP_MARKS)}")
        self._ages[mark] = process_age_s() if age is None else age

    @override
    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if stage == "fit":
            self.record_age("setup")

    @override
    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.record_age("fit_start")

    @override
    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._reset()
        self._start_step = trainer.global_step
        self.record_age("train_start")

    def _setup_row(self) -> str:
        """The set-up row: the process's age at training's start, then the seconds between the recorded marks,
        each part named by what ran in it (the parts of unrecorded marks joined with the next)."""
        parts, names, before = [], [], 0.0
        for mark, what in SETUP_MARKS.items():
            names.append(what)
            age = self._ages.get(mark)
            if age is not None:
                parts.append(f"{', '.join(names)} {age - before:.1f}")
                names, before = [], age
        return f"{self._ages['train_start']:.1f} s from the process's start to training's: {'; '.join(parts)} s"

    @override
    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if self._first_step_s is None and trainer.global_step > self._start_step:  # the first optimizer step
            if trainer.strategy.root_device.type == "cuda":
                torch.cuda.synchronize()  # once: the device has finished the step too
            self._first_step_s = time.monotonic() - self._start
        shape = (int(batch.shape[0]), int(batch.shape[1]) - 1)  # [B, T + 1] blocks: T tokens predicted each
        self._tokens += shape[0] * shape[1]
        config = getattr(pl_module, "model_config", None)
        if config is not None:
            if shape not in self._flops_cache:
                self._flops_cache[shape] = training_flops(config, *shape)
            self._flops += self._flops_cache[shape]

    @override
    def on_validation_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not trainer.sanity_checking:
            self._val_start = time.monotonic()
            self._val_blocks = 0

    @override
    def on_validation_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                                batch_idx: int, dataloader_idx: int = 0) -> None:
        if not trainer.sanity_checking:
            self._val_blocks += int(batch.shape[0])

    @override
    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not trainer.sanity_checking and self._val_start is not None:
            self._val_seconds += time.monotonic() - self._val_start
            self._val_start = None
            self._val_step = trainer.global_step

    @override
    def on_fit_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not trainer.is_global_zero:
            return
        self.title, self.rows = self._title(trainer), self._rows(trainer)
        as_table = sys.stdout.isatty() if self.rich is None else self.rich
        if as_table:
            table = Table(title=self.title, show_header=False, title_justify="left")
            table.add_column(style="bold")
            table.add_column()
            for label, value in self.rows:
                table.add_row(label, value)
            (self.console or Console()).print(table)
        else:
            rank_zero_info("\n".join([self.title] + [f"  {label:<14} {value}" for label, value in self.rows]))

    # -- the figures -----------------------------------------------------------------------------------------------
    def _title(self, trainer: L.Trainer) -> str:
        timer = next((c for c in trainer.callbacks if isinstance(c, Timer)), None)
        remaining = None if timer is None else timer.time_remaining()
        if any(isinstance(c, SlurmRequeue) and c.requeued_at_step is not None for c in trainer.callbacks):
            why = "requeued by SLURM"
        elif 0 <= trainer.max_steps <= trainer.global_step:
            why = "max_steps reached"
        elif remaining is not None and remaining <= 0:
            why = "max_time reached"
        elif trainer.interrupted:
            why = "interrupted"
        else:
            why = "stopped"
        return f"k3lit fit: {why} at step {trainer.global_step} in {clock(time.monotonic() - self._start)}"

    def _rows(self, trainer: L.Trainer) -> list[tuple[str, str]]:
        wall = time.monotonic() - self._start
        train_seconds = max(wall - self._val_seconds, 1e-9)
        world = trainer.world_size
        metrics = trainer.callback_metrics
        steps = f"{trainer.global_step}"
        if self._start_step:
            steps += f" (this run {trainer.global_step - self._start_step}, resumed at step {self._start_step})"
        rows = [
            ("steps", steps),
            ("tokens", f"{self._tokens * world:,} (this run)"),
            ("wall time", f"{clock(wall)} (validation {clock(self._val_seconds)})"),
            *([("set-up", self._setup_row())] if self._ages.get("train_start") is not None else []),
            ("first step", "none" if self._first_step_s is None else
             f"{self._first_step_s:.1f} s after training started (compilation included)"),
            ("tokens/s", f"{self._tokens * world / train_seconds:,.0f} (all devices, validation excluded)"),
            ("MFU", self._mfu(trainer, train_seconds)),
        ]
        if (recent := self._recent(trainer)) is not None:
            rows.append(("recent rate", recent))
        bpb = metrics.get("val/bpb")
        if bpb is None or self._val_step is None:
            ckpt, config = _last_checkpoint(trainer), Path(trainer.default_root_dir) / "config.yaml"
            every = " --trainer.limit_val_batches=1.0" if trainer.limit_val_batches == 0 else ""  # the run's: none
            how = (f": {runnable('k3lit')} validate --config {shlex.quote(str(config))} --ckpt_path "
                   f"{shlex.quote(ckpt)}{every}") if ckpt and config.is_file() else ""
            rows.append(("held-out bpb", f"no validation ran{how}"))
        else:
            n_bytes = getattr(trainer.lightning_module, "last_val_bytes", None)
            over = f", over the {n_bytes:,} bytes its targets encode" if n_bytes else ""
            rows.append(("held-out bpb", f"{float(bpb):.4g} (val/bpb at step {self._val_step}{over})"))
            if (same := self._same_bytes(trainer)) is not None:
                rows.append(("same bytes", same))
        vio = sorted((int(k.rsplit("layer", 1)[1]), float(v)) for k, v in metrics.items()
                     if k.startswith("val/max_vio/layer"))
        if vio and self._val_step is not None:
            rows.append(("MaxVio_global", " · ".join(f"layer{i} {v:.2f}" for i, v in vio)))
        rows += self._outputs(trainer)
        return rows

    @staticmethod
    def _recent(trainer: L.Trainer) -> str | None:
        """The K3ThroughputMonitor's latest rolling window: the pace once compilation and warm-up are behind (the
        whole-run figures above include them); None before its first window."""
        monitor = next((m for m in trainer.callbacks if isinstance(m, K3ThroughputMonitor)), None)
        tps = None if monitor is None else monitor.last_metrics.get("train/device/items_per_sec")
        if tps is None:
            return None
        mfu = monitor.last_metrics.get("train/device/mfu")
        return (f"{float(tps):,.0f} tokens/s per device" + ("" if mfu is None else f", MFU {100 * float(mfu):.1f}%")
                + f" (the last {(monitor.window_size - 1) * trainer.log_every_n_steps} steps)")

    def _mfu(self, trainer: L.Trainer, train_seconds: float) -> str:
        monitor = next((m for m in trainer.callbacks if isinstance(m, K3ThroughputMonitor)), None)
        if monitor is not None:  # its peak (or its override); asking again would repeat an unknown chip's warning
            peak = monitor.available_flops
        else:
            peak = peak_flops(trainer.strategy.root_device, compute_dtype(trainer.precision))
        if not peak:
            return f"unknown (no peak FLOP/s known for {trainer.strategy.root_device.type})"
        if not self._flops:
            return "unknown (no FLOPs count for this model)"
        return f"{100 * self._flops / (train_seconds * peak):.1f}% (of {peak / 1e12:.4g} TFLOP/s per device)"

    def _same_bytes(self, trainer: L.Trainer) -> str | None:
        """gzip and xz bits per byte on the validation blocks' own text (None where not computable)."""
        dm = getattr(trainer, "datamodule", None)
        if not self.compressors or not isinstance(dm, K3DataModule) or not self._val_blocks:
            return None
        ref = reference_bpb(dm.prepared, dm.seq_len, self._val_blocks)
        return (f"gzip -9 {ref['gzip -9']:.4g} · xz -9e {ref['xz -9e']:.4g} bits/byte on the text of the "
                f"{self._val_blocks} validation blocks ({ref['bytes']:,} bytes, each block's first token included)")

    def _outputs(self, trainer: L.Trainer) -> list[tuple[str, str]]:
        rows = []
        ckpt = _last_checkpoint(trainer)
        rows.append(("checkpoint", ckpt or "none written"))
        plots = [p for cb in trainer.callbacks if isinstance(cb, ExpertLoadPlots) for p in cb.written]
        board = next((lg.log_dir for lg in trainer.loggers if isinstance(lg, TensorBoardLogger)), None)
        if plots or board:
            where = [str(plots[-1])] if plots else []
            if board:
                where.append(f"TensorBoard: {runnable('tensorboard')} --logdir {shlex.quote(str(board))}")
            rows.append(("plots", " · ".join(where)))
        csv = next((lg.experiment.metrics_file_path for lg in trainer.loggers if isinstance(lg, RunCSVLogger)), None)
        if csv and os.path.isfile(csv):  # none when no step was logged
            rows.append(("metrics", csv))
        if ckpt:
            rows.append(("sample", f"{runnable('k3lit')} generate --ckpt {shlex.quote(ckpt)}"))
        return rows


def _last_checkpoint(trainer: L.Trainer) -> str | None:
    """The path of the checkpoint this run wrote last (None when it wrote none)."""
    return next((cb.last_model_path or cb.best_model_path for cb in trainer.checkpoint_callbacks
                 if getattr(cb, "last_model_path", "") or getattr(cb, "best_model_path", "")), None)


def runnable(script: str) -> str:
    """How a shell in the working folder starts the console script ``script``: its bare name where ``PATH`` finds
    it; otherwise its path beside the running interpreter, where ``make install`` puts it in a virtual environment
    that is not activated (``.venv/bin/k3lit``: relative to the working folder when inside it), shell-quoted;
    otherwise the bare name."""
    if shutil.which(script):
        return script
    beside = Path(sys.executable).parent / script
    if not beside.is_file():
        return script
    cwd = Path.cwd()
    return shlex.quote(str(beside.relative_to(cwd) if beside.is_relative_to(cwd) else beside))


def process_age_s() -> float | None:
    """Seconds since this process started (interpreter start included), from Linux's ``/proc``: the system's
    uptime less the process's start time (``/proc/self/stat`` field 22, in clock ticks after boot); None where
    ``/proc`` does not hold them."""
    try:
        fields = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()  # field 3 onwards: the name may hold
        ticks = int(fields[19])  # spaces and parentheses
        uptime = float(Path("/proc/uptime").read_text().split()[0])
        return max(0.0, uptime - ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return None
