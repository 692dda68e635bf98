"""ExpertLoadPlots: a layer x expert heatmap of the MoE load, as PNG files and TensorBoard images.

On by default in ``k3lit fit`` (every ``val_check_interval``: steps, or at each validation when it is a time); to
plot at another interval:

    k3lit fit --config recipes/tiny.yaml --trainer.callbacks+=k3lit.train.expert_plots.ExpertLoadPlots \\
        --trainer.callbacks.every_n_steps=50

Reads ``K3LitModule.last_expert_fraction`` (``[L_moe, n]`` share of routed slots per expert of the latest optimizer
step, synced over ranks by :class:`~k3lit.train.metrics.ExpertLoad`, kept on the training device: copied to the host
only here) every ``every_n_steps`` optimizer steps (or at the end of each validation during ``fit``) and once at the
end of training, and draws ``fraction · n`` (1.0 =
perfectly balanced) with a diverging colour map centred on 1. Files go to ``<log_dir>/expert_load/step{N:07d}.png``; a
TensorBoard logger, if any, gets the same image under ``expert_load/heatmap``. Rank zero only; matplotlib with the Agg
backend. Nothing is written for a model without MoE layers.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.fabric.utilities.cloud_io import get_filesystem
from lightning.pytorch.loggers import TensorBoardLogger
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities import rank_zero_only

from k3lit.train.run_dir import move_aside

__all__ = ["ExpertLoadPlots", "render_heatmap"]


def render_heatmap(fraction: torch.Tensor, title: str, path: Path) -> Any:
    """Draw ``fraction [L, n]`` as a heatmap of ``fraction · n`` into ``path`` (PNG); return ``[H, W, 3]`` uint8 RGB.

    Raises:
        ValueError: ``fraction`` is not 2-D.
    """
    if fraction.dim() != 2:
        raise ValueError(f"fraction must be [L, n], got shape {tuple(fraction.shape)}")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np
    from matplotlib.colors import TwoSlopeNorm

    rel = (fraction.detach().float().cpu() * fraction.shape[1]).numpy()  # load relative to the balanced load
    layers, n = rel.shape
    fig, ax = plt.subplots(figsize=(min(16, 2 + 0.25 * n), 1.5 + 0.45 * layers), dpi=100)
    vmax = max(2.0, float(rel.max()))
    im = ax.imshow(rel, aspect="auto", cmap="RdBu_r", norm=TwoSlopeNorm(vmin=0.0, vcenter=1.0, vmax=vmax),
                   interpolation="nearest")
    ax.set_xlabel("expert")
    ax.set_ylabel("MoE layer")
    ax.set_yticks(range(layers))
    ax.set_title(title)
    fig.colorbar(im, ax=ax, label="load / balanced load")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    fig.canvas.draw()
    rgb = np.asarray(fig.canvas.buffer_rgba())[..., :3].copy()
    plt.close(fig)
    return rgb


class ExpertLoadPlots(L.Callback):
    """Write a layer x expert load heatmap every ``every_n_steps`` optimizer steps and at the end of training.

    Args:
        every_n_steps: plot interval in optimizer steps (>= 1); None: at the end of every validation that runs during
            ``fit`` (the latest training step's load; validation starts on every rank together, so a time-based
            ``val_check_interval`` paces the plots without each rank reading its own clock).
        dirpath: folder for the PNG files; default ``<trainer.log_dir or default_root_dir>/expert_load``. Unless
            ``resume`` is set (``k3lit fit --ckpt_path`` sets it), a run's first plot moves an earlier run's folder
            to ``expert_load.<n>`` (:func:`~k3lit.train.run_dir.move_aside`).

    Raises:
        ValueError: ``every_n_steps < 1``.
    """

    def __init__(self, every_n_steps: int | None = 100, dirpath: str | None = None) -> None:
        if every_n_steps is not None and every_n_steps < 1:
            raise ValueError(f"ExpertLoadPlots: every_n_steps must be >= 1, got {every_n_steps}")
        self.every_n_steps = every_n_steps
        self.dirpath = dirpath
        self.written: list[Path] = []  # rank zero's files
        self._last_step = -1
        self.resume = False  # continue the folder's run (k3lit fit sets it); a fresh run moves earlier plots aside
        self._folder_settled = False

    def _dir(self, trainer: L.Trainer) -> Path:
        """The PNG folder; call on every rank (``trainer.log_dir`` is a collective under a distributed strategy)."""
        return Path(self.dirpath or trainer.log_dir or trainer.default_root_dir) / "expert_load"

    def _plot(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        fraction = getattr(pl_module, "last_expert_fraction", None)  # None on every rank for a model without MoE
        if fraction is None:
            return
        folder = self._dir(trainer)  # on every rank: trainer.log_dir broadcasts
        self._draw(trainer, fraction, folder)

    @rank_zero_only
    def _draw(self, trainer: L.Trainer, fraction: torch.Tensor, folder: Path) -> None:
        if not self._folder_settled:  # a fresh run's first plot: an earlier run's go to expert_load.<n>
            self._folder_settled = True
            if not self.resume and folder.is_dir() and any(folder.iterdir()):
                move_aside(get_filesystem(str(folder)), str(folder), folder.name)
        step = trainer.global_step
        path = folder / f"step{step:07d}.png"
        rgb = render_heatmap(fraction, f"expert load, step {step}", path)
        self.written.append(path)
        for logger in trainer.loggers:
            if isinstance(logger, TensorBoardLogger):
                logger.experiment.add_image("expert_load/heatmap", rgb, global_step=step, dataformats="HWC")

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        if self.every_n_steps is not None and trainer.global_step % self.every_n_steps == 0:
            self._plot_once(trainer, pl_module)

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.every_n_steps is None and trainer.state.fn == TrainerFn.FITTING and not trainer.sanity_checking:
            self._plot_once(trainer, pl_module)

    def _plot_once(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        """Plot this optimizer step unless it is step 0 or plotted already (gradient accumulation calls the batch
        hook several times a step; the decision is the same on every rank)."""
        step = trainer.global_step
        if step > 0 and step != self._last_step:
            self._last_step = step
            self._plot(trainer, pl_module)

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.global_step != self._last_step:
            self._last_step = trainer.global_step
            self._plot(trainer, pl_module)
