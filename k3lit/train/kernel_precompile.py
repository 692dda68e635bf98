"""A callback that compiles the run's Triton kernels in background processes from the start of ``fit``."""

from __future__ import annotations

import os
import warnings

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from typing_extensions import override

from k3lit.train.flops import compute_dtype

__all__ = ["KernelPrecompile"]


class KernelPrecompile(Callback):
    """At the start of ``fit`` on a CUDA device, start compiling the Triton kernels the model's training step and
    eager validation will launch (:mod:`k3lit.kernels.precompile`: the KDA op, the short convolution, the
    attention-residual reads and the MoE layers' routing at the data module's ``[batch_size, seq_len]``, the
    precision's dtypes and the GPU's SM count) in worker processes, so that they compile side by side and while
    torch.compile traces the model, instead of one after another at their first launches. On an already filled
    Triton cache the workers find every kernel there and exit.

    Every local rank reads the same Triton cache folder (:func:`k3lit.kernels.precompile.pin_cache_dir`); one set of
    workers per node (local rank zero). Nothing on CPUs, under ``TRITON_INTERPRET=1``, for models with no Triton KDA
    layer, attention residuals or MoE layer, or with a data module that has no ``batch_size`` and ``seq_len``.
    Workers still compiling when ``fit`` ends, or fails, are stopped. A failure to plan or start them, or a kernel a
    worker could not compile, is a warning, never an error: those kernels compile at their first launches, as
    without this callback. Off with ``workers=0``, e.g. ``--trainer.callbacks+=k3lit.train.kernel_precompile.
    KernelPrecompile --trainer.callbacks.workers=0``.

    Args:
        workers: worker processes (None: half the CPUs, at most 8; 0: off).

    Raises:
        ValueError: ``workers`` < 0.
    """

    def __init__(self, workers: int | None = None) -> None:
        if workers is not None and workers < 0:
            raise ValueError(f"KernelPrecompile: workers must be >= 0 or None, got {workers}")
        self.workers = workers
        self._job = None

    @override
    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if (stage != "fit" or self._job is not None or self.workers == 0
                or trainer.strategy.root_device.type != "cuda" or os.environ.get("TRITON_INTERPRET") == "1"):
            return
        config = getattr(pl_module, "model_config", None)
        batch, seq_len = (getattr(trainer.datamodule, a, None) for a in ("batch_size", "seq_len"))
        if config is None or batch is None or seq_len is None:
            return
        try:
            from k3lit.kernels import precompile

            precompile.pin_cache_dir()  # every rank: torch.compile would move an unset folder per device
            if trainer.local_rank != 0:
                return
            dtype = compute_dtype(trainer.precision)
            params = dtype if str(trainer.precision).endswith("-true") else torch.float32
            target, sms = _gpu(trainer.strategy.root_device)
            items = precompile.plan(config, batch, seq_len, dtype, params, sms, target)
            if items:
                self._job = precompile.start(items, target, self.workers)
                rank_zero_info(f"k3lit: compiling {len(items)} Triton kernels in {self._job.workers} background "
                               "processes")
        except Exception as e:  # noqa: BLE001 - a speed-up that fails must not stop the run
            rank_zero_warn(f"k3lit: no background kernel compilation ({type(e).__name__}: {e}); the kernels "
                           "compile at their first launches")

    def _close(self) -> None:
        if self._job is not None:
            failed, self._job = self._job.close(), None
            for message in failed:
                warnings.warn(f"k3lit: a background kernel compilation failed (the kernel compiled at its launch "
                              f"instead): {message}", stacklevel=2)

    @override
    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        self._close()

    @override
    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        self._close()


def _gpu(device: torch.device) -> tuple[object, int]:
    """Triton's compile target of the current CUDA device and the SM count of ``device``."""
    import triton

    from k3lit.kernels.gpu import sm_count

    return triton.runtime.driver.active.get_current_target(), sm_count(device)
