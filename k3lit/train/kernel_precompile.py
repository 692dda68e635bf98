"""A callback that compiles the run's Triton kernels in background processes from the start of ``fit``."""

from __future__ import annotations

import os

import lightning as L
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from typing_extensions import override

from k3lit.train.flops import compute_dtype

__all__ = ["KernelPrecompile"]


class KernelPrecompile(Callback):
    """At the start of ``fit`` on a CUDA device, start compiling the Triton kernels the model's training step and
    eager validation will launch (:mod:`k3lit.kernels.precompile`: the KDA op, the short convolution and the
    attention-residual reads at the data module's ``[batch_size, seq_len]`` and the precision's compute dtype) in
    worker processes, so that they compile side by side and while torch.compile traces the model, instead of one
    after another at their first launches. On an already filled Triton cache the workers find every kernel there
    and exit.

    One set of workers per node (local rank zero); nothing on CPUs, under ``TRITON_INTERPRET=1``, for models
    with neither Triton KDA layers nor attention residuals, or with a data module that has no ``batch_size`` and
    ``seq_len``. Workers still compiling when ``fit`` ends are stopped. A failure to plan or start them is a warning,
    never an error: the kernels then compile at their first launches, as without this callback.

    Args:
        workers: worker processes (None: half the CPUs, at most 8; 0: off).
    """

    def __init__(self, workers: int | None = None) -> None:
        if workers is not None and workers < 0:
            raise ValueError(f"KernelPrecompile: workers must be >= 0 or None, got {workers}")
        self.workers = workers
        self._job = None

    @override
    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if (stage != "fit" or self._job is not None or self.workers == 0 or trainer.local_rank != 0
                or trainer.strategy.root_device.type != "cuda" or os.environ.get("TRITON_INTERPRET") == "1"):
            return
        config = getattr(pl_module, "model_config", None)
        batch, seq_len = (getattr(trainer.datamodule, a, None) for a in ("batch_size", "seq_len"))
        if config is None or batch is None or seq_len is None:
            return
        import triton

        from k3lit.kernels import precompile

        try:
            target = triton.runtime.driver.active.get_current_target()
            items = precompile.plan(config, batch, seq_len, compute_dtype(trainer.precision), target)
            self._job = precompile.start(items, target, self.workers) if items else None
        except Exception as e:  # noqa: BLE001 - a speed-up that fails must not stop the run
            rank_zero_warn(f"k3lit: no background kernel compilation ({type(e).__name__}: {e}); the kernels "
                           "compile at their first launches")
            return
        if self._job is not None:
            rank_zero_info(f"k3lit: compiling {len(items)} Triton kernels in {self._job.workers} background "
                           "processes")

    @override
    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if self._job is not None:
            self._job.close()
            self._job = None
