"""A Lightning training step of K3LitModule makes k3lit issue no host sync: on a GPU each one (``.item()``, a
tensor in an ``if``, ``.cpu()``, data-dependent shapes) stalls the CPU until the device has drained its queue.

On CPU nothing waits, so the syncs are counted instead: every aten op that reads a value back to the host
(``_local_scalar_dense`` behind ``.item()``/``bool()``/``float()``, ``nonzero`` & co.) and every ``.cpu()`` /
``.tolist()`` / ``.numpy()``, attributed to the innermost caller outside torch, Lightning and torchmetrics.
Lightning's own syncs (it converts progress-bar values to numbers after every batch, and logged values when it
writes them) and torch's (the CPU AdamW loop reads its step counters) are not k3lit's to remove.
"""

from __future__ import annotations

import collections
import os
import traceback
from pathlib import Path

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import Callback
from torch.utils._python_dispatch import TorchDispatchMode

import k3lit
from k3lit.model import ModelConfig
from k3lit.train.callbacks import K3ThroughputMonitor
from k3lit.train.module import K3LitModule

K3LIT = os.path.dirname(k3lit.__file__) + os.sep
LIBRARIES = tuple(os.path.dirname(m.__file__) + os.sep for m in (torch, L, __import__("torchmetrics")))
SYNC_OPS = {"_local_scalar_dense", "nonzero", "masked_select", "_unique2", "unique_consecutive", "unique_dim",
            "repeat_interleave", "equal", "is_nonzero"}


class HostSyncs(TorchDispatchMode):
    """Counts host syncs whose innermost caller outside the libraries lies in the k3lit package, while ``on``."""

    def __init__(self) -> None:
        super().__init__()
        self.on = False
        self.where: collections.Counter[str] = collections.Counter()

    def record(self) -> None:
        if not self.on:
            return
        for frame in reversed(traceback.extract_stack()[:-2]):
            if frame.filename == __file__ or not frame.filename.startswith(LIBRARIES):
                if frame.filename.startswith(K3LIT):
                    self.where[f"{Path(frame.filename).name}:{frame.lineno} {frame.line}"] += 1
                return

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        if func.__name__.split(".")[0] in SYNC_OPS:
            self.record()
        return func(*args, **(kwargs or {}))


@pytest.fixture
def host_syncs(monkeypatch) -> HostSyncs:
    mode = HostSyncs()
    for name in ("cpu", "tolist", "numpy"):  # copies to the host that no aten op shows on a CPU tensor
        method = getattr(torch.Tensor, name)

        def counted(self, *args, _method=method, **kwargs):  # noqa: ANN001, ANN202
            mode.record()
            return _method(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, counted)
    with mode:
        yield mode


class CountAfterFirstStep(Callback):
    """Switches the counter on after the first optimizer step (set-up and first-call work excluded) and off when
    training ends (teardown moves the model to the CPU)."""

    def __init__(self, counter: HostSyncs) -> None:
        self.counter = counter

    def on_train_batch_start(self, trainer: L.Trainer, *args) -> None:  # noqa: ANN002
        self.counter.on = trainer.global_step >= 1

    def on_train_end(self, trainer: L.Trainer, *args) -> None:  # noqa: ANN002
        self.counter.on = False


@pytest.mark.parametrize("balancer,capacity", [("quantile", None), ("quantile_hist", None), ("aux_free", None),
                                               ("aux_loss", None), ("quantile", "causal"),
                                               ("quantile", "quantile")])
def test_training_steps_issue_no_host_sync_from_k3lit(tmp_path, host_syncs, balancer, capacity):
    cfg = ModelConfig(vocab_size=64, dim=32, n_layers=3, layer_pattern="KA", n_heads=2, head_dim=16, mlp_hidden=32,
                      n_experts=4, top_k=2, expert_dim=16, n_shared_experts=1, first_dense_layers=1,
                      balancer=balancer, attnres_block_size=2, capacity_factor=1.1 if capacity else None,
                      capacity_mode=capacity or "forward")
    data = torch.randint(0, cfg.vocab_size, (16, 17))
    trainer = L.Trainer(accelerator="cpu", devices=1, precision="bf16-mixed", max_steps=4, accumulate_grad_batches=2,
                        log_every_n_steps=2, gradient_clip_val=1.0, default_root_dir=tmp_path,
                        callbacks=[K3ThroughputMonitor(window_size=2), CountAfterFirstStep(host_syncs)],
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    module = K3LitModule(cfg)
    trainer.fit(module, torch.utils.data.DataLoader(data, batch_size=2))
    assert trainer.global_step == 4
    assert not host_syncs.where, f"host syncs per 3 optimizer steps: {dict(host_syncs.where)}"
    # the statistics are still there, on the device, and logged
    assert module.last_expert_fraction.shape == (2, 4)
    assert "train/max_vio/layer1" in trainer.logged_metrics


class SyncsByStep(TorchDispatchMode):
    """Every host sync, whoever issues it (k3lit, Lightning, the progress displays), by the optimizer steps done
    when it happened; ``torch.optim`` on CPU reads its step counters (a fused CUDA optimizer does not) and is left
    out."""

    def __init__(self) -> None:
        super().__init__()
        self.step: int | None = None
        self.steps: collections.Counter[int] = collections.Counter()

    def record(self) -> None:
        optim = os.path.dirname(torch.optim.__file__) + os.sep
        if self.step is not None and not any(f.filename.startswith(optim) for f in traceback.extract_stack()):
            self.steps[self.step] += 1

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        if func.__name__.split(".")[0] in SYNC_OPS:
            self.record()
        return func(*args, **(kwargs or {}))


class StepOf(Callback):
    def __init__(self, counter: SyncsByStep) -> None:
        self.counter = counter

    def on_train_batch_start(self, trainer: L.Trainer, *args) -> None:  # noqa: ANN002
        self.counter.step = trainer.global_step if trainer.global_step >= 1 else None

    def on_train_end(self, trainer: L.Trainer, *args) -> None:  # noqa: ANN002
        self.counter.step = None


@pytest.mark.parametrize("display", ["lines", "bar"])
def test_only_logging_steps_sync_with_the_progress_display(tmp_path, monkeypatch, display):
    import io

    from rich.console import Console

    from k3lit.train.progress import ProgressLines, StepProgressBar

    cfg = ModelConfig(vocab_size=64, dim=32, n_layers=3, layer_pattern="KA", n_heads=2, head_dim=16, mlp_hidden=32,
                      n_experts=4, top_k=2, expert_dim=16, n_shared_experts=1, first_dense_layers=1,
                      attnres_block_size=2)
    counter = SyncsByStep()
    for name in ("cpu", "tolist", "numpy", "item", "__float__"):
        method = getattr(torch.Tensor, name)

        def counted(self, *args, _method=method, **kwargs):  # noqa: ANN001, ANN202
            counter.record()
            return _method(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, counted)
    shown = ProgressLines() if display == "lines" else StepProgressBar(Console(file=io.StringIO(), width=200))
    trainer = L.Trainer(accelerator="cpu", devices=1, precision="bf16-mixed", max_steps=9, log_every_n_steps=4,
                        gradient_clip_val=1.0, default_root_dir=tmp_path, enable_checkpointing=False,
                        callbacks=[K3ThroughputMonitor(window_size=2), shown, StepOf(counter)],
                        enable_model_summary=False)
    data = torch.randint(0, cfg.vocab_size, (18, 17))
    with counter:
        trainer.fit(K3LitModule(cfg), torch.utils.data.DataLoader(data, batch_size=2))
    assert trainer.global_step == 9
    # Lightning logs (and the displays read) after the optimizer steps 4 and 8 and the last, 9: 3, 7 and 8 steps
    # were done at the start of those batches
    assert {3, 7} <= set(counter.steps) <= {3, 7, 8}, dict(counter.steps)
