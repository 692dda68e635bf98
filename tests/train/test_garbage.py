"""GarbageCollection: Python's collector off during training, the heap frozen after the first optimizer step, a
full collection every N optimizer steps, the collector restored afterwards."""

from __future__ import annotations

import gc

import lightning as L
import pytest
from lightning.pytorch.demos.boring_classes import BoringModel

from k3lit.train.garbage import GarbageCollection


class _Probe(L.Callback):
    """Records, per optimizer step, whether the collector is on and how many objects are frozen, and the steps
    at which a full (generation 2) collection started."""

    def __init__(self) -> None:
        self.enabled, self.frozen, self.full_at = {}, {}, []
        self._trainer: L.Trainer | None = None

    def _on_gc(self, phase: str, info: dict) -> None:
        if phase == "start" and info["generation"] == 2 and self._trainer is not None:
            self.full_at.append(self._trainer.global_step)

    def on_train_start(self, trainer, pl_module):
        self._trainer = trainer
        gc.callbacks.append(self._on_gc)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.enabled[trainer.global_step] = gc.isenabled()
        self.frozen[trainer.global_step] = gc.get_freeze_count()

    def on_train_end(self, trainer, pl_module):
        gc.callbacks.remove(self._on_gc)
        self._trainer = None


@pytest.mark.parametrize("accumulate", [1, 2])
def test_collects_every_n_optimizer_steps_and_restores(tmp_path, accumulate):
    probe = _Probe()
    trainer = L.Trainer(max_steps=7, accumulate_grad_batches=accumulate, callbacks=[GarbageCollection(3), probe],
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, limit_val_batches=0, default_root_dir=tmp_path)
    assert gc.isenabled() and gc.get_freeze_count() == 0
    trainer.fit(BoringModel())
    assert probe.full_at == [1, 3, 6]  # the freeze after step 1, then steps 3 and 6; none triggered by allocations
    assert not any(probe.enabled.values())
    assert probe.frozen[0] == 0 and all(probe.frozen[s] > 0 for s in range(1, 7))
    assert gc.isenabled() and gc.get_freeze_count() == 0


def test_zero_leaves_the_collector_alone(tmp_path):
    probe = _Probe()
    L.Trainer(max_steps=3, callbacks=[GarbageCollection(0), probe], logger=False, enable_checkpointing=False,
              enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
              default_root_dir=tmp_path).fit(BoringModel())
    assert all(probe.enabled.values()) and not any(probe.frozen.values())


def test_negative_interval_is_refused():
    with pytest.raises(ValueError, match="every_n_steps=-1"):
        GarbageCollection(-1)
