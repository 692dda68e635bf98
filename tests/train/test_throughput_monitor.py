"""K3ThroughputMonitor: the dense peak of Hopper GPUs from k3lit's table, without Lightning's 'FLOPs not found';
training timed without a device sync per step."""

import csv
import time
import warnings
from types import SimpleNamespace

import lightning as L
import pytest
import torch
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.plugins.precision import MixedPrecision
from lightning.pytorch.trainer.states import RunningStage, TrainerFn

from k3lit.model import ModelConfig
from k3lit.train.callbacks import K3ThroughputMonitor
from k3lit.train.flops import compute_dtype
from k3lit.train.module import K3LitModule


def fake_trainer(precision: str) -> SimpleNamespace:
    return SimpleNamespace(precision=precision, precision_plugin=MixedPrecision(precision, "cuda"),
                           strategy=SimpleNamespace(root_device=torch.device("cuda", 0)), enable_validation=True,
                           world_size=1, state=SimpleNamespace(stage=RunningStage.TRAINING))


@pytest.mark.parametrize("name,peak", [("NVIDIA H200", 989.4e12), ("NVIDIA H100 80GB HBM3", 989.4e12)])
def test_hopper_peak_without_lightnings_warning(monkeypatch, name, peak):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *_: name)
    monitor = K3ThroughputMonitor()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        monitor.setup(fake_trainer("bf16-mixed"), None, TrainerFn.FITTING)
    assert not [w for w in caught if "FLOPs not found" in str(w.message)]
    assert monitor.available_flops == peak


def test_an_unknown_gpu_is_still_reported_once(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *_: "NVIDIA Imaginary 9000")
    monitor = K3ThroughputMonitor()
    with pytest.warns(UserWarning, match="FLOPs not found for 'NVIDIA Imaginary 9000'") as caught:
        monitor.setup(fake_trainer("bf16-mixed"), None, TrainerFn.FITTING)
    assert sum("FLOPs not found" in str(w.message) for w in caught) == 1 and monitor.available_flops is None


@pytest.mark.parametrize("precision,dtype", [("bf16-mixed", torch.bfloat16), ("bf16-true", torch.bfloat16),
                                             ("16-mixed", torch.float16), ("16-true", torch.float16),
                                             ("32-true", torch.float32), ("64-true", torch.float64)])
def test_compute_dtype_of_lightning_precisions(precision, dtype):
    assert compute_dtype(precision) == dtype


class SlowValidation(K3LitModule):
    def validation_step(self, batch, batch_idx):  # noqa: ANN001, ANN201
        time.sleep(1.0)
        return super().validation_step(batch, batch_idx)


def test_training_is_timed_on_logging_steps_only_and_without_validation(tmp_path, monkeypatch):
    """The clock (a device sync on GPUs) is read after the optimizer steps that write logs, never inside gradient
    accumulation; the rates cover whole logging intervals; validation's wall time is not training time."""
    cfg = ModelConfig(vocab_size=64, dim=32, n_layers=2, layer_pattern="KA", n_heads=2, head_dim=16, mlp_hidden=32,
                      n_experts=4, top_k=2, expert_dim=16, first_dense_layers=1, attnres_block_size=2)
    clocks: list[tuple[str, int]] = []
    clock = K3ThroughputMonitor._clock

    def counted(trainer):  # noqa: ANN001, ANN202
        clocks.append((trainer.state.stage.value, trainer.global_step))
        return clock(trainer)

    monkeypatch.setattr(K3ThroughputMonitor, "_clock", staticmethod(counted))
    batch, seq = 2, 16
    data = torch.randint(0, cfg.vocab_size, (48, seq + 1))
    loader = torch.utils.data.DataLoader(data, batch_size=batch)
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=12, accumulate_grad_batches=2, log_every_n_steps=4,
                        val_check_interval=20, limit_val_batches=2, check_val_every_n_epoch=None,
                        logger=CSVLogger(tmp_path, name="", version=""), callbacks=[K3ThroughputMonitor()],
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(SlowValidation(cfg), loader, loader)
    train = [s for stage, s in clocks if stage == "train"]
    assert train == [4, 8, 12], clocks  # after optimizer steps 4, 8 and 12 (batches 8, 16, 24): none in between
    assert sum(stage == "validate" for stage, _ in clocks) == 2 + 2  # its start and end, and each of its batches
    with open(tmp_path / "metrics.csv") as f:
        rows = [r for r in csv.DictReader(f) if r.get("train/time")]
    assert [int(r["step"]) for r in rows] == [3, 7, 11]
    # window_size 2: the last logged rate covers steps 9-12 alone, which the validation after batch 20 (step 10)
    # interrupted for 2 x 1 s; the interval before it (steps 5-8) had none
    last = rows[-1]
    elapsed = float(last["train/time"]) - float(rows[-2]["train/time"])
    before = float(rows[-2]["train/time"]) - float(rows[-3]["train/time"])
    assert float(last["train/device/items_per_sec"]) == pytest.approx(4 * 2 * batch * seq / elapsed)
    assert elapsed < before + 1.5


def test_validation_rates_are_logged_at_the_step_of_the_validation_values(tmp_path):
    """In metrics.csv a validation's throughput rows carry the step its val/* values carry (the training step it
    follows), not the count of validation batches."""
    cfg = ModelConfig(vocab_size=64, dim=32, n_layers=2, layer_pattern="KA", n_heads=2, head_dim=16, mlp_hidden=32,
                      n_experts=4, top_k=2, expert_dim=16, first_dense_layers=1, attnres_block_size=2)
    data = torch.randint(0, cfg.vocab_size, (48, 17))
    loader = torch.utils.data.DataLoader(data, batch_size=2)
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=6, log_every_n_steps=1, val_check_interval=3,
                        limit_val_batches=5, check_val_every_n_epoch=None,
                        logger=CSVLogger(tmp_path, name="", version=""), callbacks=[K3ThroughputMonitor()],
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(K3LitModule(cfg), loader, loader)
    with open(tmp_path / "metrics.csv") as f:
        table = list(csv.DictReader(f))
    rates = {int(r["step"]) for r in table if r.get("validate/device/items_per_sec")}
    values = {int(r["step"]) for r in table if r.get("val/loss")}
    assert rates and rates == values, (rates, values)
