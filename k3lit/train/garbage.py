"""Python's cyclic garbage collector at fixed optimizer steps instead of whenever allocations trigger it."""

from __future__ import annotations

import gc
from typing import Any

import lightning as L
from lightning.pytorch.callbacks import Callback
from typing_extensions import override

__all__ = ["GarbageCollection"]


class GarbageCollection(Callback):
    """Collect garbage every ``every_n_steps`` optimizer steps, on a heap frozen after compilation.

    A collection of Python's oldest generation scans every live object. After ``torch.compile`` the process holds
    millions of them (dynamo's, inductor's and Triton's), and a pass that starts in the middle of a step stalls the
    host while the device drains the work it was given: a training step that issues its kernels from Python
    (``benchmarks/RESULTS.md``, "Host time per step") then leaves the device idle. So, during training:

    - the automatic collector is off;
    - at the end of the first optimizer step (compilation done) one full collection runs and ``gc.freeze()`` moves
      every survivor to the permanent generation, which no later collection scans;
    - every ``every_n_steps`` optimizer steps a full collection runs over the objects made since (few: a step
      makes short-lived objects, freed by reference counting).

    At the end of training the collector is restored as it was (unfrozen; enabled if it was).

    Args:
        every_n_steps: optimizer steps between collections; 0 leaves Python's collector alone.

    Raises:
        ValueError: ``every_n_steps`` negative.
    """

    def __init__(self, every_n_steps: int = 100) -> None:
        if every_n_steps < 0:
            raise ValueError(f"GarbageCollection(every_n_steps={every_n_steps}): must be >= 0 (0: off)")
        self.every_n_steps = every_n_steps
        self._was_enabled: bool | None = None
        self._collected_at = 0  # the optimizer step of the latest collection (micro-batches share a step)

    @override
    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.every_n_steps:
            self._was_enabled, self._collected_at = gc.isenabled(), 0
            gc.disable()

    @override
    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        step = trainer.global_step  # 0 until the first optimizer step ends
        first = self._collected_at == 0
        if self._was_enabled is None or step == self._collected_at or (not first and step % self.every_n_steps):
            return
        gc.collect()
        if first:
            gc.freeze()
        self._collected_at = step

    @override
    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._restore()

    @override
    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        self._restore()

    def _restore(self) -> None:
        if self._was_enabled is None:
            return
        gc.unfreeze()
        if self._was_enabled:
            gc.enable()
        self._was_enabled = None
