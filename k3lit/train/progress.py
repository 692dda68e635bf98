"""Progress of a run in optimizer steps, against what will end it: ``max_steps`` or ``max_time``, whichever comes
first, with the time left estimated from the run's own pace.

Two displays of the same figures: :class:`StepProgressBar` (a live rich bar, for a terminal) and
:class:`ProgressLines` (one plain line every ``log_every_n_steps`` steps, for a log file: a SLURM job,
``make train > log``). K3CLI picks one by whether stdout is a terminal.
"""

from __future__ import annotations

import logging
import math
import sys
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import lightning as L
from lightning.pytorch.callbacks import ProgressBar, Timer
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from rich.console import Console
from rich.progress import BarColumn, Progress, TaskID, TextColumn
from typing_extensions import override

from k3lit.train.callbacks import K3ThroughputMonitor

__all__ = ["Horizon", "StepPace", "run_horizon", "ProgressLines", "StepProgressBar"]


def clock(seconds: float) -> str:
    """``seconds`` as ``H:MM:SS``."""
    return str(timedelta(seconds=max(0, round(seconds))))


@dataclass(frozen=True)
class Horizon:
    """Where a run stands and where it will end.

    Attributes:
        step: optimizer steps done (``trainer.global_step``).
        end_step: the step the run is expected to end at: ``max_steps`` (or the steps ``max_epochs`` allow), or,
            when ``max_time`` comes first, the step reached at the current pace when the time is up; None when
            nothing bounds the run (or the pace is not known yet and only ``max_time`` does).
        seconds_left: wall time until the end at the current pace; when ``max_time`` comes first, its remaining
            time plus the validation Lightning runs once the time is up (as long as the last one took); None until
            the pace is known (and without ``max_time``).
        limit: what ends the run: ``"max_steps"``, ``"max_epochs"``, ``"max_time"``, or None.
    """

    step: int
    end_step: int | None
    seconds_left: float | None
    limit: str | None

    def steps_text(self) -> str:
        """``step 301/1000``; ``step 301/~540 (max_time)`` when the time limit comes first; ``step 301`` unbounded."""
        if self.end_step is None:
            return f"step {self.step}" + (" (max_time)" if self.limit == "max_time" else "")
        if self.limit == "max_time":
            return f"step {self.step}/~{self.end_step} (max_time)"
        return f"step {self.step}/{self.end_step}"

    def eta_text(self) -> str | None:
        """``0:06:02 left``, or None when unknown."""
        return None if self.seconds_left is None else f"{clock(self.seconds_left)} left"


class StepPace:
    """Wall seconds per optimizer step of this process's training, measured from the first step it is told of
    (the end of the first step: its start-up, compilation and worker start, is left out) and including
    everything since (periodic validation and checkpoints too, which the rest of the run also pays); and the
    wall seconds of the latest validation pass (:attr:`validation_seconds`)."""

    def __init__(self) -> None:
        self._start: tuple[float, int] | None = None
        self._validation_start: float | None = None
        self.seconds_per_step: float | None = None
        self.validation_seconds: float | None = None

    def validation_started(self, now: float | None = None) -> None:
        """A validation pass starts (at ``now``, ``time.monotonic()`` by default)."""
        self._validation_start = time.monotonic() if now is None else now

    def validation_ended(self, now: float | None = None) -> None:
        """The validation pass started last ends: its duration becomes :attr:`validation_seconds`."""
        if self._validation_start is not None:
            self.validation_seconds = (time.monotonic() if now is None else now) - self._validation_start
            self._validation_start = None

    def update(self, step: int, now: float | None = None) -> None:
        """Record that ``step`` optimizer steps are done at time ``now`` (``time.monotonic()`` by default)."""
        now = time.monotonic() if now is None else now
        if self._start is None:
            self._start = (now, step)
        elif step > self._start[1]:
            self.seconds_per_step = (now - self._start[0]) / (step - self._start[1])


def _step_limit(trainer: L.Trainer) -> tuple[int | None, str | None]:
    if trainer.max_steps is not None and trainer.max_steps >= 0:
        return trainer.max_steps, "max_steps"
    total = trainer.estimated_stepping_batches  # from max_epochs; inf without a bound
    return (None, None) if math.isinf(total) else (int(total), "max_epochs")


def run_horizon(trainer: L.Trainer, seconds_per_step: float | None,
                validation_seconds: float | None = None) -> Horizon:
    """Where ``trainer``'s run will end at ``seconds_per_step`` (None: not known yet), from ``max_steps`` (or
    ``max_epochs``) and the time ``max_time`` leaves (Lightning's :class:`~lightning.pytorch.callbacks.Timer`,
    which counts a resumed run's earlier time too). When the time is up Lightning validates once more, outside
    ``max_time``: ``validation_seconds`` (the latest pass; None: none seen) is added to the time left then."""
    step = trainer.global_step
    cap, limit = _step_limit(trainer)
    timer = next((c for c in trainer.callbacks if isinstance(c, Timer)), None)
    remaining = None if timer is None else timer.time_remaining()
    remaining = None if remaining is None else max(0.0, remaining)
    steps_time = None if cap is None or seconds_per_step is None else max(0, cap - step) * seconds_per_step
    if remaining is not None and (cap is None or (steps_time is not None and remaining < steps_time)):
        end = None if not seconds_per_step else step + int(remaining / seconds_per_step)
        if end is not None and cap is not None:
            end = min(end, cap)
        return Horizon(step, end, remaining + (validation_seconds or 0.0), "max_time")
    return Horizon(step, cap, steps_time, limit)


TRAIN_SHOWN = ("train/loss", "train/max_vio/layer0")


def shown_metrics(trainer: L.Trainer, prefix: str) -> dict[str, float]:
    """The metrics a progress display shows, by name. ``"train/"``: :data:`TRAIN_SHOWN` from
    ``trainer.callback_metrics``, where they stay device tensors (logged without ``prog_bar``, which Lightning
    would turn into numbers after every batch, a host sync each): reading them waits for the device, so the
    displays call this on logging steps only. ``"val/"``: Lightning's progress-bar metrics of that prefix, numbers
    once per validation."""
    if prefix == "train/":
        metrics = trainer.callback_metrics
        return {k: float(metrics[k]) for k in TRAIN_SHOWN if k in metrics}
    return {k: v for k, v in trainer.progress_bar_metrics.items() if k.startswith(prefix)}


def _throughput(trainer: L.Trainer) -> float | None:
    """Tokens/s per device that the K3ThroughputMonitor logged last (it logs straight to the loggers, so its values
    never reach ``trainer.callback_metrics``)."""
    tps = next((m.last_metrics.get("train/device/items_per_sec") for m in trainer.callbacks
                if isinstance(m, K3ThroughputMonitor)), None)
    return None if tps is None else float(tps)


class ProgressLines(ProgressBar):
    """One line per ``every_n_steps`` optimizer steps on rank zero, e.g.
    ``step 120/1000 · train/loss 3.412 · train/max_vio/layer0 0.21 · 2,950 tok/s per device · 0:06:02 left``
    (``step 120/~540 (max_time)`` when ``max_time`` ends the run first), and one per validation (``val/...``
    metrics): the progress of a run whose stdout is a file (a SLURM job, ``make train > log``), where a live
    progress bar prints nothing useful.

    A Lightning ``ProgressBar``, so the trainer adds no tqdm bar beside it. The tok/s figure is the latest that a
    :class:`~k3lit.train.callbacks.K3ThroughputMonitor` computed (none before its ``window_size``-th logging step); the
    monitor must come before this callback in ``trainer.callbacks`` to report the same step (K3CLI orders them
    so), else it is one line old. The time left is :func:`run_horizon`'s at this run's :class:`StepPace`.

    Args:
        every_n_steps: optimizer steps between lines; default the trainer's ``log_every_n_steps``.
    """

    def __init__(self, every_n_steps: int | None = None) -> None:
        super().__init__()
        self.every_n_steps = every_n_steps
        self.pace = StepPace()
        self._enabled = True
        self._last_step = -1

    def disable(self) -> None:
        self._enabled = False

    def enable(self) -> None:
        self._enabled = True

    def _line(self, trainer: L.Trainer, prefix: str) -> str:
        metrics = [f"{k} {v:.4g}" for k, v in sorted(shown_metrics(trainer, prefix).items())]
        if trainer.state.fn != TrainerFn.FITTING:  # `k3lit validate`: no run to the end of, no step of its own
            return " · ".join(["validation", *metrics])
        horizon = run_horizon(trainer, self.pace.seconds_per_step, self.pace.validation_seconds)
        parts = [horizon.steps_text(), *metrics]
        if prefix == "train/":
            if (tps := _throughput(trainer)) is not None:
                parts.append(f"{tps:,.0f} tok/s per device")
            if (eta := horizon.eta_text()) is not None:
                parts.append(eta)
        return " · ".join(parts)

    @override
    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        every = self.every_n_steps or trainer.log_every_n_steps
        step = trainer.global_step  # advances once per optimizer step, not per micro-batch
        if step == self._last_step:
            return
        self._last_step = step
        self.pace.update(step)
        if self._enabled and step > 0 and step % every == 0:
            rank_zero_info(self._line(trainer, "train/"))

    @override
    def on_validation_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not trainer.sanity_checking:
            self.pace.validation_started()
            if self._enabled:  # a line before a pass that may take minutes, so the log does not look stuck
                batches = sum(trainer.num_val_batches)
                count = f" {batches:,} batch{'es' if batches != 1 else ''}" if math.isfinite(batches) else ""
                where = f"step {trainer.global_step} · " if trainer.state.fn == TrainerFn.FITTING else ""
                rank_zero_info(f"{where}validating{count}")

    @override
    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not trainer.sanity_checking:
            self.pace.validation_ended()
            if self._enabled:
                rank_zero_info(self._line(trainer, "val/"))


def _short(name: str) -> str:
    return name.removeprefix("train/")


class StepProgressBar(ProgressBar):
    """A live rich bar of optimizer steps against the run's end (:func:`run_horizon`), with the time left, the
    :func:`shown_metrics` (``train/`` prefix dropped: ``loss``, ``max_vio/layer0``, as of the latest logging step;
    ``val/bpb``...) and tok/s per device; a second bar counts validation batches while validation runs. Rank zero only.

    Args:
        console: where to draw; default a rich ``Console()`` on stdout.
        refresh_per_second: redraws per second.
    """

    def __init__(self, console: Console | None = None, refresh_per_second: int = 4) -> None:
        super().__init__()
        self.console = console
        self.refresh_per_second = refresh_per_second
        self.pace = StepPace()
        self._enabled = True
        self._progress: Progress | None = None
        self._train: TaskID | None = None
        self._val: TaskID | None = None
        self._handlers: list[tuple[logging.StreamHandler, Any]] = []
        self._last_step = -1
        self._train_shown: dict[str, float] = {}

    def disable(self) -> None:
        self._enabled = False

    def enable(self) -> None:
        self._enabled = True

    @override
    def print(self, *args: Any, **kwargs: Any) -> None:
        if self._progress is not None:
            self._progress.console.print(*args, **kwargs)
        else:
            print(*args, **kwargs)

    def _start(self) -> Progress:
        if self._progress is None:
            self._progress = Progress(TextColumn("[bold]{task.description}"), BarColumn(),
                                      TextColumn("{task.fields[info]}"), console=self.console or Console(),
                                      refresh_per_second=self.refresh_per_second)
            streams = (sys.stdout, sys.stderr)
            self._progress.start()  # from here sys.stdout and sys.stderr print above the bar
            # Log handlers keep the streams they were made with: point those on stdout/stderr (Lightning's messages)
            # to the bar's for as long as it runs, so a message does not break the bar's lines.
            for handler in logging.getLogger("lightning.pytorch").handlers + logging.getLogger().handlers:
                if type(handler) is logging.StreamHandler and handler.stream in streams:
                    new = sys.stdout if handler.stream is streams[0] else sys.stderr
                    if new is not handler.stream:
                        self._handlers.append((handler, handler.setStream(new)))
        return self._progress

    def _stop(self) -> None:
        if self._progress is not None:
            self._progress.stop()
        for handler, stream in self._handlers:
            handler.setStream(stream)
        self._handlers.clear()
        self._progress, self._train, self._val = None, None, None

    def _info(self, trainer: L.Trainer, horizon: Horizon) -> str:
        parts = [horizon.steps_text()]
        if (eta := horizon.eta_text()) is not None:
            parts.append(eta)
        shown = {**self._train_shown, **shown_metrics(trainer, "val/")}
        parts += [f"{_short(k)} {v:.4g}" for k, v in sorted(shown.items())]
        if (tps := _throughput(trainer)) is not None:
            parts.append(f"{tps:,.0f} tok/s")
        return " · ".join(parts)

    def _refresh_train(self, trainer: L.Trainer) -> None:
        if self._progress is None or self._train is None:
            return
        horizon = run_horizon(trainer, self.pace.seconds_per_step, self.pace.validation_seconds)
        self._progress.update(self._train, completed=horizon.step, total=horizon.end_step,
                              info=self._info(trainer, horizon))

    @override
    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self._enabled:
            self._train = self._start().add_task("train", total=None, info="")
            self._refresh_train(trainer)

    @override
    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        step = trainer.global_step  # advances once per optimizer step, not per micro-batch
        if step != self._last_step:
            self._last_step = step
            self.pace.update(step)
            if step % trainer.log_every_n_steps == 0:  # values shown from logging step to logging step
                self._train_shown = shown_metrics(trainer, "train/")
            self._refresh_train(trainer)

    def _eval_start(self, trainer: L.Trainer, name: str) -> None:
        if self._enabled:
            total = self.total_val_batches
            self._val = self._start().add_task(name, total=None if math.isinf(total) else total, info="")

    @override
    def on_sanity_check_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._eval_start(trainer, "sanity check")

    @override
    def on_sanity_check_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._eval_end()

    @override
    def on_validation_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not trainer.sanity_checking:
            self.pace.validation_started()
            self._eval_start(trainer, "validate")

    @override
    def on_validation_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any,
                                **kwargs: Any) -> None:
        if self._progress is not None and self._val is not None:
            self._progress.advance(self._val)

    def _eval_end(self) -> None:
        if self._progress is not None and self._val is not None:
            self._progress.remove_task(self._val)
        self._val = None

    @override
    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not trainer.sanity_checking:
            self.pace.validation_ended()
            self._eval_end()
            self._refresh_train(trainer)  # with the new val/ metrics

    @override
    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._train_shown = shown_metrics(trainer, "train/")
        self._refresh_train(trainer)
        self._stop()

    @override
    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        self._stop()

    @override
    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        self._stop()
