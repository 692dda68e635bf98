"""k3lit's contract with Lightning's internals: the Lightning versions k3lit supports, and every private Lightning
attribute it uses, each behind one function here.

Lightning's public API does not cover everything k3lit does (resolving ``--ckpt_path last`` before ``fit``, a
``last.ckpt`` at the end of training besides every N steps, a ``metrics.csv`` that survives a resume, a
throughput monitor whose figures the progress lines show, a device mesh of its own); what it needs beyond the
public API is reached only through this module. Private names can change in any Lightning release, so:

* importing this module (which every k3lit module that touches Lightning does) raises :class:`ImportError` for a
  Lightning outside :data:`SUPPORTED_LIGHTNING`, the range ``pyproject.toml`` pins (set ``K3LIT_ANY_LIGHTNING=1``
  to try another version anyway: a warning instead of the error);
* it checks that every private method k3lit calls or overrides (:data:`PRIVATE_METHODS`) still exists, and raises
  :class:`ImportError` naming the missing ones, so a renamed hook fails at once instead of silently no longer
  being overridden.
"""

from __future__ import annotations

import os
import warnings
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import lightning
from lightning.pytorch.callbacks import ModelCheckpoint, ThroughputMonitor
from lightning.pytorch.cli import LightningCLI
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.loggers.csv_logs import ExperimentWriter
from lightning.pytorch.loops.fit_loop import _FitLoop
from lightning.pytorch.strategies import ModelParallelStrategy
from lightning.pytorch.trainer.connectors.checkpoint_connector import _CheckpointConnector
from lightning.pytorch.trainer.connectors.logger_connector.logger_connector import _LoggerConnector
from lightning.pytorch.trainer.states import TrainerFn
from packaging.specifiers import SpecifierSet
from packaging.version import Version

if TYPE_CHECKING:
    from lightning.fabric.utilities.throughput import Throughput
    from torch.distributed.device_mesh import DeviceMesh

__all__ = [
    "SUPPORTED_LIGHTNING", "PRIVATE_METHODS", "check_lightning_version", "init_args", "resolve_ckpt_path",
    "hpc_save_path", "time_interval_seconds", "should_update_logs", "accumulating", "log_metrics", "throughputs",
    "save_last_checkpoint", "setup_distributed", "set_device_mesh", "rewrite_metrics_header", "csv_writer",
    "set_csv_writer",
]

SUPPORTED_LIGHTNING = ">=2.5,<2.7"
"""The Lightning versions k3lit is tested with; ``pyproject.toml`` pins the same range (a test checks it)."""

PRIVATE_METHODS: tuple[tuple[type, str], ...] = (
    (LightningCLI, "_parse_ckpt_path"),  # overridden by K3CLI (off: it replaces the whole model section)
    (_CheckpointConnector, "_parse_ckpt_path"),
    (_CheckpointConnector, "hpc_save_path"),
    (_LoggerConnector, "should_update_logs"),
    (_LoggerConnector, "log_metrics"),
    (ThroughputMonitor, "_compute"),  # overridden by K3ThroughputMonitor, like the two below
    (ThroughputMonitor, "_update"),
    (ThroughputMonitor, "_start"),
    (_FitLoop, "_should_accumulate"),
    (ModelCheckpoint, "_should_skip_saving_checkpoint"),
    (ModelCheckpoint, "_save_last_checkpoint"),
    (ModelCheckpoint, "_monitor_candidates"),
    (ModelParallelStrategy, "_setup_distributed"),
    (ExperimentWriter, "_check_log_dir_exists"),  # overridden by RunCSVLogger's writer (Lightning's deletes the file)
    (ExperimentWriter, "_rewrite_with_new_header"),
)
"""(class, name) of every private Lightning method or property k3lit calls or overrides; checked at import."""

ENV_ANY_VERSION = "K3LIT_ANY_LIGHTNING"


def check_lightning_version(version: str) -> None:
    """Raise ImportError unless ``version`` is in :data:`SUPPORTED_LIGHTNING` (with ``K3LIT_ANY_LIGHTNING=1``: warn).

    Raises:
        ImportError: ``version`` is outside the supported range; the message names both and what to install.
    """
    if Version(version) in SpecifierSet(SUPPORTED_LIGHTNING):
        return
    message = (f"k3lit supports lightning{SUPPORTED_LIGHTNING} but lightning {version} is installed: "
               f"pip install 'lightning{SUPPORTED_LIGHTNING}' (or set {ENV_ANY_VERSION}=1 to try this version anyway; "
               "k3lit relies on some of Lightning's private attributes, listed in k3lit/lightning_compat.py)")
    if os.environ.get(ENV_ANY_VERSION) == "1":
        warnings.warn(message, stacklevel=2)
        return
    raise ImportError(message)


def _check_private_methods() -> None:
    missing = [f"{cls.__qualname__}.{name}" for cls, name in PRIVATE_METHODS if getattr(cls, name, None) is None]
    if missing:
        raise ImportError(f"lightning {lightning.__version__} lacks {', '.join(missing)}, which k3lit uses: install "
                          f"lightning{SUPPORTED_LIGHTNING}")


check_lightning_version(lightning.__version__)
_check_private_methods()


# -- checkpoints ---------------------------------------------------------------------------------------------------
def init_args(hparams: dict[str, Any]) -> dict[str, Any]:
    """Constructor arguments from hyper-parameters saved in a checkpoint, without the private entries that
    LightningCLI stores beside them (``_instantiator``, ``_class_path``: names starting with ``_``)."""
    return {k: v for k, v in hparams.items() if not k.startswith("_")}


def resolve_ckpt_path(trainer: lightning.Trainer, fn: TrainerFn, ckpt_path: str) -> str | None:
    """The file or folder that ``trainer.<fn>(ckpt_path=...)`` would load for ``"last"`` or ``"hpc"``; None when there
    is none yet. Lightning warns when ``last`` finds nothing (callers may filter that warning)."""
    return trainer._checkpoint_connector._parse_ckpt_path(fn, ckpt_path, True, False)


def hpc_save_path(trainer: lightning.Trainer) -> str:
    """The next ``hpc_ckpt_<n>.ckpt`` under ``trainer.default_root_dir``: where Lightning resumes from under SLURM."""
    return trainer._checkpoint_connector.hpc_save_path(trainer.default_root_dir)


def save_last_checkpoint(callback: ModelCheckpoint, trainer: lightning.Trainer) -> None:
    """Write ``callback``'s ``last`` checkpoint now, as it would after a save, unless this global step is saved
    already (or saving is off for this trainer state, e.g. during a sanity check)."""
    if not callback._should_skip_saving_checkpoint(trainer):
        callback._save_last_checkpoint(trainer, callback._monitor_candidates(trainer))


def time_interval_seconds(value: str | dict | timedelta) -> float:
    """Seconds of a time-based ``val_check_interval`` as Lightning reads it (``"DD:HH:MM:SS"``, a dict of
    ``timedelta`` arguments or a ``timedelta``; Lightning >= 2.6).

    Raises:
        ValueError: a value Lightning does not read as a time (its message).
    """
    from lightning.pytorch.trainer.setup import _parse_time_interval_seconds

    return _parse_time_interval_seconds(value)


# -- logging -------------------------------------------------------------------------------------------------------
def should_update_logs(trainer: lightning.Trainer) -> bool:
    """Whether this step writes to the loggers (every ``log_every_n_steps`` steps, and when training stops)."""
    return trainer._logger_connector.should_update_logs


def accumulating(trainer: lightning.Trainer) -> bool:
    """Whether the current training batch ends inside gradient accumulation (no optimizer step after it)."""
    return trainer.fit_loop._should_accumulate()


def log_metrics(trainer: lightning.Trainer, metrics: dict[str, Any], step: int | None = None) -> None:
    """Send ``metrics`` straight to every logger of ``trainer`` (as Lightning's ThroughputMonitor does)."""
    trainer._logger_connector.log_metrics(metrics, step=step)


def throughputs(monitor: ThroughputMonitor) -> dict[Any, Throughput]:
    """The monitor's :class:`~lightning.fabric.utilities.throughput.Throughput` per running stage (after setup)."""
    return monitor._throughputs


def rewrite_metrics_header(writer: ExperimentWriter, fieldnames: list[str]) -> None:
    """Rewrite the writer's ``metrics.csv`` under a new header (rows keep their values)."""
    writer._rewrite_with_new_header(fieldnames)


def csv_writer(logger: CSVLogger) -> ExperimentWriter | None:
    """The writer behind ``logger.experiment``; None until it is built (on first use)."""
    return logger._experiment


def set_csv_writer(logger: CSVLogger, writer: ExperimentWriter) -> ExperimentWriter:
    """Make ``writer`` the one behind ``logger.experiment``; returns it."""
    logger._experiment = writer
    return writer


# -- strategies ----------------------------------------------------------------------------------------------------
def setup_distributed(strategy: ModelParallelStrategy) -> None:
    """``ModelParallelStrategy``'s process-group setup (device, seeds, ranks, ``init_process_group``), without its
    mesh."""
    strategy._setup_distributed()


def set_device_mesh(strategy: ModelParallelStrategy, mesh: DeviceMesh) -> None:
    """Make ``mesh`` the strategy's ``device_mesh`` and its LightningModule's (seen in ``configure_model``)."""
    strategy._device_mesh = mesh
    assert strategy.lightning_module is not None
    strategy.lightning_module._device_mesh = mesh
