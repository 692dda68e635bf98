"""K3LitModule logs its per-step training values only on the steps whose logs Lightning writes, and the rows it
writes hold the values of their own step, the last one of a run that a callback stops (as ``max_time`` does)
included."""

from __future__ import annotations

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.loggers.logger import Logger

from k3lit.model import ModelConfig
from k3lit.train.module import K3LitModule

CFG = ModelConfig(vocab_size=64, dim=32, n_layers=3, layer_pattern="KA", n_heads=2, head_dim=16, mlp_hidden=32,
                  n_experts=4, top_k=2, expert_dim=16, n_shared_experts=1, first_dense_layers=1,
                  attnres_block_size=2)


class Rows(Logger):
    """The rows Lightning writes: step -> the training values."""

    name, version = "rows", "0"

    def __init__(self) -> None:
        super().__init__()
        self.rows: dict[int, dict[str, float]] = {}

    def log_metrics(self, metrics: dict, step: int | None = None) -> None:
        self.rows[step] = {k: float(v) for k, v in metrics.items() if k.startswith("train/")}

    def log_hyperparams(self, *args, **kwargs) -> None:  # noqa: ANN002, ANN003
        pass


class Record(Callback):
    """Each step's loss as the module returned it (by row step: the optimizer steps before it), and a stop after
    ``stop_at`` steps, set where Lightning's ``Timer`` sets it."""

    def __init__(self, stop_at: int | None) -> None:
        self.stop_at = stop_at
        self.loss: dict[int, float] = {}

    def on_train_batch_end(self, trainer: L.Trainer, module, outputs, batch, batch_idx) -> None:  # noqa: ANN001
        self.loss[trainer.global_step - 1] = float(outputs["loss"])
        if trainer.global_step == self.stop_at:
            trainer.should_stop = True


class Counted(K3LitModule):
    """Counts ``self.log`` calls by the optimizer steps done when they happen."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__(cfg)
        self.calls: dict[int, int] = {}

    def log(self, name, *args, **kwargs) -> None:  # noqa: ANN001, ANN002, ANN003
        if name.startswith("train/"):
            self.calls[self.trainer.global_step] = self.calls.get(self.trainer.global_step, 0) + 1
        super().log(name, *args, **kwargs)


@pytest.mark.parametrize("stop_at", [None, 6])
def test_rows_hold_their_own_steps_values_and_other_steps_log_nothing(tmp_path, stop_at):
    rows, record = Rows(), Record(stop_at)
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=9, log_every_n_steps=4, gradient_clip_val=1.0,
                        logger=rows, callbacks=[record], default_root_dir=tmp_path, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False)
    torch.manual_seed(0)
    module = Counted(CFG)
    trainer.fit(module, torch.utils.data.DataLoader(torch.randint(0, 64, (40, 17)), batch_size=2))
    written = [3, 7] if stop_at is None else [3, 5]  # every 4th step; with a stop after 6 steps, the 6th
    assert sorted(rows.rows) == written
    for step in written:  # every value, of its own step (an earlier step's grad norm would repeat)
        assert {"train/loss", "train/grad_norm", "train/max_vio/layer0", "train/router_entropy/layer1"} <= set(
            rows.rows[step])
        assert rows.rows[step]["train/loss"] == record.loss[step]
    assert rows.rows[written[1]]["train/grad_norm"] != rows.rows[written[0]]["train/grad_norm"]
    # logged during the written steps only (by optimizer steps done: the log of step 3 happens before its
    # optimizer step, the stop's after it)
    assert set(module.calls) == ({3, 7} if stop_at is None else {3, 6})
