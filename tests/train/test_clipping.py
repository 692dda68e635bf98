"""Gradient clipping in K3LitModule under bf16-mixed with the fused AdamW it picks for plain CUDA parameters.

Lightning's AMP plugin refuses to clip for an optimizer that unscales gradients in its step (the fused AdamW), even
under bf16, where there is no scaler; K3LitModule clips itself then. The CPU has a fused AdamW kernel too, so the
test lets :meth:`OptimConfig.build` pick it for CPU parameters and runs the real Trainer, plugin and kernel.
"""

from __future__ import annotations

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.plugins.precision import MixedPrecision

from k3lit.model import ModelConfig
from k3lit.train import optim
from k3lit.train.module import K3LitModule

CFG = ModelConfig(vocab_size=64, dim=32, n_layers=2, layer_pattern="A", n_heads=2, head_dim=16, mlp_hidden=32,
                  n_experts=0, attnres_block_size=2)


class GradsAfterStep(Callback):
    """Records the gradients' total norm before clipping, and their total norm and largest magnitude at each optimizer
    step (a step post-hook: after clipping, before the next zeroing), and whether the optimizer is fused."""

    def __init__(self) -> None:
        self.norms: list[float] = []
        self.maxima: list[float] = []
        self.norms_before: list[float] = []  # at on_before_optimizer_step: before clipping
        self.logged_norm: torch.Tensor | None = None  # the trainer's last logged train/grad_norm
        self.fused: bool | None = None

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        opt = trainer.optimizers[0]
        self.fused = bool(opt.defaults.get("fused"))
        opt.register_step_post_hook(self.record)

    def on_before_optimizer_step(self, trainer: L.Trainer, pl_module: L.LightningModule, opt) -> None:  # noqa: ANN001
        self.norms_before.append(self.total_norm(opt))

    @staticmethod
    def total_norm(opt: torch.optim.Optimizer) -> float:
        grads = [p.grad for g in opt.param_groups for p in g["params"] if p.grad is not None]
        return float(torch.linalg.vector_norm(torch.stack([x.norm() for x in grads])))

    def record(self, opt: torch.optim.Optimizer, args: tuple, kwargs: dict) -> None:
        grads = [p.grad for g in opt.param_groups for p in g["params"] if p.grad is not None]
        self.norms.append(self.total_norm(opt))
        self.maxima.append(max(float(x.abs().max()) for x in grads))


def fit(tmp_path, clip: float | None, algorithm: str | None = None, **trainer_kw) -> GradsAfterStep:
    probe = GradsAfterStep()
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=2, gradient_clip_val=clip,
                        gradient_clip_algorithm=algorithm, default_root_dir=tmp_path, callbacks=[probe],
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        logger=False, log_every_n_steps=1, **trainer_kw)
    data = torch.randint(0, CFG.vocab_size, (8, 17))
    trainer.fit(K3LitModule(CFG), torch.utils.data.DataLoader(data, batch_size=4))
    assert len(probe.norms) == 2
    probe.logged_norm = trainer.logged_metrics.get("train/grad_norm")
    return probe


@pytest.fixture
def fused_on_cpu(monkeypatch):
    """Let OptimConfig.build pick the fused AdamW for CPU parameters, as it does for CUDA ones."""
    monkeypatch.setattr(optim, "_fused_supported", lambda params: True)


@pytest.mark.parametrize("algorithm,clip", [("norm", 1e-3), ("value", 1e-5)])
def test_bf16_mixed_clips_with_the_fused_adamw(tmp_path, fused_on_cpu, seed, algorithm, clip):
    probe = fit(tmp_path, clip, algorithm, precision="bf16-mixed")
    assert probe.fused
    if algorithm == "norm":
        assert all(0 < n <= clip * (1 + 1e-3) for n in probe.norms)
    else:
        assert all(0 < m <= clip for m in probe.maxima)


@pytest.mark.parametrize("clip", [1e-3, None])
def test_fp16_scaler_unscales_before_clipping(tmp_path, fused_on_cpu, seed, clip):
    """With a gradient scaler, Lightning unscales and then clips, which needs an AdamW that is not fused; without
    clipping the fused AdamW takes the scaler itself."""
    scaler = MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu", init_scale=1.0))
    probe = fit(tmp_path, clip, plugins=[scaler])
    assert probe.fused == (clip is None)
    if clip is not None:
        assert all(0 < n <= clip * (1 + 1e-3) for n in probe.norms)


@pytest.mark.parametrize("precision,fused", [("32-true", False), ("bf16-mixed", True)])
def test_norm_clipping_logs_the_norm_before_clipping(tmp_path, monkeypatch, seed, precision, fused):
    monkeypatch.setattr(optim, "_fused_supported", lambda params: fused)
    probe = fit(tmp_path, 1e-3, "norm", precision=precision)
    assert probe.fused == fused
    assert probe.norms_before[-1] > 10 * 1e-3  # the last step was clipped, so the two norms differ
    torch.testing.assert_close(float(probe.logged_norm), probe.norms_before[-1], rtol=1e-5, atol=0)


def test_value_clipping_logs_no_norm(tmp_path, fused_on_cpu, seed):
    assert fit(tmp_path, 1e-5, "value", precision="bf16-mixed").logged_norm is None
