"""``metrics.csv`` that survives a resume: one file per run directory, continued by ``--ckpt_path``."""

from __future__ import annotations

import csv
import os

from lightning.fabric.loggers.logger import rank_zero_experiment
from lightning.fabric.utilities.cloud_io import get_filesystem
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.loggers.csv_logs import ExperimentWriter
from typing_extensions import override

from k3lit import lightning_compat as compat
from k3lit.train.run_dir import move_aside

__all__ = ["RunCSVLogger"]


class RunCSVLogger(CSVLogger):
    """Lightning's ``CSVLogger`` writing ``<save_dir>/metrics.csv`` without deleting an earlier file there.

    Lightning's writer removes an existing ``metrics.csv`` when it starts (and warns so for any non-empty
    folder), which erased the steps before a resume. Here a run that continues from a checkpoint
    (``append=True``) appends its rows to the file, widening the header when new metric columns appear; a fresh
    run moves an earlier file aside to ``metrics.<n>.csv`` (with a warning naming it) and starts a new one.
    Rows of the steps a resumed run redoes (logged after the checkpoint it resumed from) then appear twice; the
    later rows are the resumed run's.

    Args:
        save_dir: the run directory.
        append: continue the existing ``metrics.csv`` (set before the first metrics are logged).
    """

    def __init__(self, save_dir: str | os.PathLike, append: bool = False) -> None:
        super().__init__(save_dir, name="", version="")
        self.append = append

    @property
    @override
    @rank_zero_experiment
    def experiment(self) -> ExperimentWriter:
        return compat.csv_writer(self) or compat.set_csv_writer(self, _RunWriter(self.log_dir, self.append))


class _RunWriter(ExperimentWriter):
    """Lightning's writer, but keeping (``append``) or moving aside an existing ``metrics.csv``."""

    def __init__(self, log_dir: str, append: bool) -> None:
        self.append = append
        self.fs = get_filesystem(log_dir)
        super().__init__(log_dir)
        if append and self.fs.isfile(self.metrics_file_path):
            with self.fs.open(self.metrics_file_path, "r", newline="") as f:
                header = next(csv.reader(f), [])
            if header != sorted(header):  # save() appends rows in sorted column order
                compat.rewrite_metrics_header(self, sorted(header))
            self.metrics_keys = sorted(header)  # so save() appends under the file's header (or widens it)

    @override
    def _check_log_dir_exists(self) -> None:  # Lightning's deletes metrics.csv here (see k3lit.lightning_compat)
        if not self.append and self.fs.isfile(self.metrics_file_path):
            move_aside(self.fs, self.metrics_file_path, "metrics")
