"""Messages from Lightning and its dependencies that a k3lit user cannot act on, kept out of ``k3lit`` runs.

* Lightning's tips to install ``litlogger`` / ``litmodels`` (log records starting with the tip marker);
* deprecation warnings raised inside Lightning's own code (``DeprecationWarning`` and ``FutureWarning`` attributed
  to a ``lightning`` module: e.g. its use of torch's deprecated ``LeafSpec``): only a Lightning release fixes them;
* "Your `IterableDataset` has `__len__` defined": litdata's ``StreamingDataset`` is an ``IterableDataset`` with a
  length, and it gives every dataloader worker its own share of the chunks (the case the warning is about cannot
  occur);
* "It is recommended to use `self.log('val/...', ..., sync_dist=True)`": K3LitModule's validation values are
  torchmetrics results, already reduced over all ranks when logged (``sync_dist`` would add one all-reduce per
  value: per expert and layer for ``val/expert_frac``);
* torch distributed checkpoint's "Detected an existing checkpoint in ..., overwriting": a sharded
  ``last.ckpt`` is one folder that every save rewrites, by design;
* "callbacks used to create the checkpoint need to be provided", when the only ones it names are k3lit's
  ``LastCheckpoint`` (whose state key holds its interval, so another ``val_check_interval`` or ``k3lit validate``
  names it; it keeps nothing a resumed run needs) and Lightning's ``Timer`` (absent when ``max_time`` is lifted);
* "The `srun` command is available on your system but is not used", outside a SLURM job (no ``SLURM_JOB_ID``):
  a login node or a machine with SLURM's client installed, where nothing was meant to run under ``srun``. Inside
  a job the warning passes, since there a multi-process run started without ``srun`` hangs (``k3lit slurm``
  writes job scripts that use it).

Other warnings pass: :func:`quiet_third_party` filters only these, and :func:`quiet_validate`, for ``k3lit
validate``, also Lightning's "The dirpath has changed from ...": restoring the checkpoint's ``LastCheckpoint``
state in another folder, for a command that writes no checkpoint.
"""

from __future__ import annotations

import logging
import os
import warnings

__all__ = ["quiet_third_party", "quiet_validate"]

TIP_MARKER = "💡 Tip:"
# Lightning's rank-zero messages come through one of these loggers (whichever Lightning package was imported last).
RANK_ZERO_LOGGERS = ("lightning.pytorch.utilities.rank_zero", "lightning.fabric.utilities.rank_zero")


class _DropTips(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(TIP_MARKER)


_DROP_TIPS = _DropTips()


def quiet_third_party() -> None:
    """Install the filters (process-wide; calling again adds nothing)."""
    for name in RANK_ZERO_LOGGERS:
        logging.getLogger(name).addFilter(_DROP_TIPS)
    for category in (DeprecationWarning, FutureWarning):
        warnings.filterwarnings("ignore", category=category, module=r"(lightning|pytorch_lightning|lightning_fabric)\.")
    warnings.filterwarnings("ignore", message=r"Your `IterableDataset` has `__len__` defined")
    warnings.filterwarnings("ignore", message=r"It is recommended to use `self\.log\('val/")
    warnings.filterwarnings("ignore", message=r"Detected an existing checkpoint in .*, overwriting since")
    if "SLURM_JOB_ID" not in os.environ:
        warnings.filterwarnings("ignore", message=r"The `srun` command is available on your system but is not used")
    ours = r"""['"](LastCheckpoint\{[^}]*\}|Timer)['"]"""
    warnings.filterwarnings("ignore", message=r"Be aware that when using `ckpt_path`, callbacks used to create the "
                            rf"checkpoint need to be provided .*: \[{ours}(, {ours})*\]\.$")


def quiet_validate() -> None:
    """The filter of ``k3lit validate`` on top of :func:`quiet_third_party` (process-wide)."""
    warnings.filterwarnings("ignore", message=r"The dirpath has changed from ")
