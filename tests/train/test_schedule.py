"""The learning-rate schedule: linear warm-up, then a cosine that ends with the run's step limit or its time budget,
whichever ends the run first."""

import math

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import Callback

from k3lit.model import ModelConfig
from k3lit.train.module import K3LitModule
from k3lit.train.optim import OptimConfig


def cosine(cfg: OptimConfig, p: float) -> float:
    return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * p))


def test_lr_factor_follows_the_limit_that_comes_first():
    cfg = OptimConfig(warmup_steps=10, min_lr_ratio=0.1)
    assert cfg.lr_factor(4, 110, time_progress=0.9) == pytest.approx(0.5)  # warm-up ignores the clock
    assert cfg.lr_factor(60, 110) == pytest.approx(cosine(cfg, 0.5))  # steps only
    assert cfg.lr_factor(60, 110, time_progress=0.75) == pytest.approx(cosine(cfg, 0.75))  # the clock is ahead
    assert cfg.lr_factor(60, 110, time_progress=0.25) == pytest.approx(cosine(cfg, 0.5))  # the steps are ahead
    assert cfg.lr_factor(60, math.inf, time_progress=0.25) == pytest.approx(cosine(cfg, 0.25))  # no step limit
    assert cfg.lr_factor(500, 110, time_progress=2.0) == pytest.approx(0.1)


class LearningRates(Callback):
    def __init__(self) -> None:
        self.lrs: list[float] = []

    def on_train_batch_end(self, trainer: L.Trainer, *args) -> None:  # noqa: ANN002
        self.lrs.append(trainer.optimizers[0].param_groups[0]["lr"])


def fit(tmp_path, module: K3LitModule, ckpt_path: str | None = None, **trainer_args) -> LearningRates:
    """Train ``module`` on random tokens, then save ``end.ckpt``; the learning rate after every batch."""
    lrs = LearningRates()
    data = torch.randint(0, 64, (4096, 17))
    trainer = L.Trainer(accelerator="cpu", devices=1, logger=False, callbacks=[lrs], enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path,
                        **trainer_args)
    trainer.fit(module, torch.utils.data.DataLoader(data, batch_size=2), ckpt_path=ckpt_path)
    trainer.save_checkpoint(tmp_path / "end.ckpt")
    return lrs


def model() -> ModelConfig:
    return ModelConfig(vocab_size=64, dim=32, n_layers=1, layer_pattern="A", n_heads=2, head_dim=16, mlp_hidden=32)


def test_a_time_budget_decays_the_schedule_to_its_end(tmp_path):
    """With max_time and no step limit, warm-up runs in steps and the cosine reaches min_lr_ratio when the time is
    spent; a resumed run continues from the same warm-up end on the restored clock."""
    optim = OptimConfig(lr=1e-3, warmup_steps=3, min_lr_ratio=0.1)
    module = K3LitModule(model(), optim)
    lrs = fit(tmp_path, module, max_steps=-1, max_time={"seconds": 5}).lrs
    # after optimizer step s the schedule is at s: (s + 1) / 3 in warm-up, then the cosine from the warm-up's end
    assert lrs[:3] == pytest.approx([2e-3 / 3, 1e-3, 1e-3])
    assert len(lrs) > 5 and all(b <= a for a, b in zip(lrs[3:], lrs[4:]))
    assert lrs[-1] < 1e-3 * cosine(optim, 0.8)  # the last step ends near the budget: p close to 1
    warmup_end = module.warmup_end_s
    assert 0 < warmup_end < 5
    # resumed with a larger budget: the saved warm-up end carries over (not the resumed step's time), and the
    # cosine, now over (8 s - t_w), steps back up and decays to its end again
    resumed = K3LitModule(model(), optim)
    lrs_resumed = fit(tmp_path, resumed, ckpt_path=str(tmp_path / "end.ckpt"), max_steps=-1,
                      max_time={"seconds": 8}).lrs
    assert resumed.warmup_end_s == warmup_end
    assert lrs_resumed[0] > lrs[-1] and lrs_resumed[-1] < 1e-3 * cosine(optim, 0.8)

def test_without_a_time_limit_the_steps_alone_set_the_schedule(tmp_path):
    optim = OptimConfig(lr=1e-3, warmup_steps=2, min_lr_ratio=0.1)
    lrs = fit(tmp_path, K3LitModule(model(), optim), max_steps=10).lrs
    expected = [optim.lr * optim.lr_factor(s, 10) for s in range(1, 11)]
    assert lrs == pytest.approx(expected)
