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

from k3lit.model import ModelConfig
from k3lit.train import optim
from k3lit.train.module import K3LitModule

CFG = ModelConfig(vocab_size=64, dim=32, n_layers=2, layer_pattern="KA", n_heads=2, head_dim=16, mlp_hidden=32,
                  n_experts=0, attnres_block_size=2)


class GradNormAfterStep(Callback):
    """Records the total gradient norm each optimizer step used (a step post-hook: clipped, not yet zeroed)."""

    def __init__(self) -> None:
        self.norms: list[float] = []
        self.fused: bool | None = None

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        opt = trainer.optimizers[0]
        self.fused = bool(opt.defaults.get("fused"))
        opt.register_step_post_hook(lambda o, args, kwargs: self.norms.append(float(torch.linalg.vector_norm(
            torch.stack([p.grad.norm() for g in o.param_groups for p in g["params"] if p.grad is not None])))))


@pytest.mark.parametrize("algorithm,clip", [("norm", 1e-3), ("value", 1e-5)])
def test_bf16_mixed_clips_with_the_fused_adamw(tmp_path, monkeypatch, seed, algorithm, clip):
    monkeypatch.setattr(optim, "_fused_supported", lambda params: True)
    probe = GradNormAfterStep()
    trainer = L.Trainer(accelerator="cpu", devices=1, precision="bf16-mixed", max_steps=2, gradient_clip_val=clip,
                        gradient_clip_algorithm=algorithm, default_root_dir=tmp_path, callbacks=[probe],
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        logger=False)
    data = torch.randint(0, CFG.vocab_size, (8, 17))
    trainer.fit(K3LitModule(CFG), torch.utils.data.DataLoader(data, batch_size=4))
    assert probe.fused and len(probe.norms) == 2
    n_grads = sum(p.numel() for p in trainer.lightning_module.parameters())
    bound = clip * (1 + 1e-3) if algorithm == "norm" else clip * n_grads**0.5
    assert all(0 < n <= bound for n in probe.norms)
