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


class StartWeights(Callback):
    """As training starts (after any loading), the full model state (gathered from every rank's shards), the step
    and the optimizer's state size; rank zero saves them to ``<dirpath>/start.pt``."""

    def __init__(self, dirpath: str) -> None:
        self.dirpath = Path(dirpath)

    def on_train_start(self, trainer, pl_module) -> None:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        full = get_model_state_dict(pl_module, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if trainer.is_global_zero:
            torch.save({"state_dict": {k: v.clone() for k, v in full.items()}, "step": trainer.global_step,
                        "optimizer_entries": len(trainer.optimizers[0].state)}, self.dirpath / "start.pt")
