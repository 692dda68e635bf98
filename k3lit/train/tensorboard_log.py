"""TensorBoard events of one run per folder: a resumed run adds to them, a fresh run moves an earlier run's aside."""

from __future__ import annotations

import os
from typing import Any

from lightning.fabric.utilities.cloud_io import get_filesystem
from lightning.pytorch.loggers import TensorBoardLogger
from lightning.pytorch.loggers.logger import rank_zero_experiment
from typing_extensions import override

from k3lit.train.run_dir import move_events_aside

__all__ = ["RunTensorBoardLogger"]


class RunTensorBoardLogger(TensorBoardLogger):
    """Lightning's ``TensorBoardLogger`` writing its event files straight into ``save_dir`` (no version folders),
    where ``k3lit fit`` keeps one run: before a fresh run's first event it moves an earlier run's event files into
    ``save_dir/tensorboard.<n>/`` (:func:`~k3lit.train.run_dir.move_events_aside`), so ``tensorboard --logdir
    save_dir`` shows the two runs apart; a resumed run (``append``) writes beside its own earlier events.

    Args:
        save_dir: the run folder.
        append: continue the folder's run (set before the first event is written).
    """

    def __init__(self, save_dir: str | os.PathLike, append: bool = False) -> None:
        super().__init__(save_dir, name="", version="")
        self.append = append
        self._events_settled = False

    @property
    @override
    @rank_zero_experiment
    def experiment(self) -> Any:
        if not self._events_settled:
            self._events_settled = True
            if not self.append:
                move_events_aside(get_filesystem(self.log_dir), self.log_dir)
        return super().experiment
