"""Callbacks that record what a `k3lit fit` run did, for tests that run the real command (class paths:
``tests.train.probes.<Name>``)."""

import json
from pathlib import Path

import torch
from lightning.pytorch.callbacks import Callback


class CheckpointSteps(Callback):
    """Before every training batch, the ``global_step`` stored in ``<dirpath>/checkpoints/last.ckpt`` (if any);
    written to ``<dirpath>/checkpoint_steps.json`` when fit ends."""

    def __init__(self, dirpath: str) -> None:
        self.dirpath = Path(dirpath)
        self.seen: list[int] = []

    def on_train_batch_start(self, trainer, *args) -> None:
        last = self.dirpath / "checkpoints" / "last.ckpt"
        if last.is_file():
            step = torch.load(last, map_location="cpu", weights_only=False)["global_step"]
            if not self.seen or self.seen[-1] != step:
                self.seen.append(step)

    def on_fit_end(self, trainer, pl_module) -> None:
        (self.dirpath / "checkpoint_steps.json").write_text(json.dumps(self.seen))
