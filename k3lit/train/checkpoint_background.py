"""Checkpoint writes that overlap training: a host snapshot taken in stream order, written by a background thread.

Writing ``small``'s ``last.ckpt`` (158M parameters and their AdamW moments, about 1.9 GB) and fsyncing it takes
seconds, during which a synchronous save stalls training. :class:`BackgroundCheckpointIO` only enqueues the copies:
every CUDA tensor of the checkpoint is copied into a pinned host buffer with a non-blocking copy on the current
stream, so the copy reads the values of this step whatever the next steps' kernels write later (stream order);
CPU tensors are cloned and other values deep-copied on the calling thread. A single writer thread waits for the
copies (a CUDA event), writes ``<path>.partial`` with ``torch.save``, fsyncs it and puts it in place
(:func:`~k3lit.train.checkpoint_save.commit`), so the checkpoint at ``path`` is whole at every instant, as with a
synchronous save. The pinned buffers are reused from save to save (one host copy of the checkpoint per run); where
that copy would take half the host's free memory or more, the checkpoint is written synchronously instead.

Ordering: a save first waits for the previous write, so at most one write is in flight; removing a checkpoint and
the strategy's teardown (the end of ``fit``) wait too, and :func:`finish_writes` waits for whoever needs the file
on disk now (a SLURM requeue). A failed write raises its exception from the next save, removal, wait or teardown.
"""

from __future__ import annotations

import copy
import os
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import lightning as L
import torch
from typing_extensions import override

from k3lit.train.checkpoint_save import DirectCheckpointIO, commit, is_local_path, settle, staged_paths

__all__ = ["BackgroundCheckpointIO", "finish_writes"]


class BackgroundCheckpointIO(DirectCheckpointIO):
    """:class:`DirectCheckpointIO` whose :meth:`save_checkpoint` returns once the checkpoint is snapshotted; a
    background thread writes it atomically (module docstring). Remote paths and ``storage_options`` are written
    synchronously by Lightning's code. ``k3lit fit`` uses it with the strategies that save one file from rank zero
    (one device, DDP); sharded folders (FSDP2, expert parallel) are written synchronously by
    :class:`~k3lit.train.checkpoint_save.K3Trainer`."""

    stages_itself = True  # K3Trainer hands it the final path: it writes <path>.partial and commits by itself

    def __init__(self) -> None:
        super().__init__()
        self._executor: ThreadPoolExecutor | None = None
        self._pending: Future | None = None
        self._buffers: list[torch.Tensor] = []  # pinned host copies of the CUDA tensors, in snapshot order

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], path: str | os.PathLike,
                        storage_options: Any | None = None) -> None:
        self.wait()
        if storage_options is not None or not is_local_path(path):
            return super().save_checkpoint(checkpoint, path, storage_options)
        settle(path)  # no stale .partial of a killed save under the new one
        if _cuda_bytes(checkpoint) - sum(b.nbytes for b in self._buffers) > _available_host_bytes() // 2:
            # a host copy would take half the free memory or more (a large model on a small host): write it now
            self._write(checkpoint, None, Path(path))
            return None
        snapshot, copied = self.snapshot(checkpoint)
        if self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="k3lit-checkpoint")
        self._pending = self._executor.submit(self._write, snapshot, copied, Path(path))

    def snapshot(self, checkpoint: Any) -> tuple[Any, torch.cuda.Event | None]:
        """A copy of ``checkpoint`` that later training cannot change: the same nesting of dicts, lists and tuples,
        CUDA tensors as pinned host tensors filled by non-blocking copies (complete once the returned event is,
        None when there was none), CPU tensors cloned, other values deep-copied. Tensors that share memory (tied
        weights) stay one tensor. Runs on the caller's thread; must not overlap a write (:meth:`save_checkpoint`
        waits first)."""
        memo: dict[tuple, torch.Tensor] = {}
        used: list[torch.Tensor] = []
        cuda: list[torch.device] = []

        def host(t: torch.Tensor) -> torch.Tensor:
            key = (t.device, t.untyped_storage().data_ptr(), t.storage_offset(), t.shape, t.stride(), t.dtype)
            if key in memo:
                return memo[key]
            if t.is_cuda and type(t) is torch.Tensor:
                i = len(used)
                old = self._buffers[i] if i < len(self._buffers) else None
                fits = old is not None and (old.shape, old.stride(), old.dtype) == (t.shape, t.stride(), t.dtype)
                buf = old if fits else torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, pin_memory=True)
                buf.copy_(t.detach(), non_blocking=True)
                used.append(buf)
                if t.device not in cuda:
                    cuda.append(t.device)
            else:
                buf = t.detach().to("cpu", copy=True)
            memo[key] = buf
            return buf

        def walk(obj: Any) -> Any:
            if isinstance(obj, torch.Tensor):
                return host(obj)
            if isinstance(obj, dict):
                out = copy.copy(obj)  # keeps the mapping's type (OrderedDict, Lightning's AttributeDict)
                for k in out:
                    out[k] = walk(out[k])
                return out
            if type(obj) in (list, tuple):
                return type(obj)(walk(v) for v in obj)
            return copy.deepcopy(obj)

        snap = walk(checkpoint)
        self._buffers = used
        event = None
        if len(cuda) == 1:
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(cuda[0]))
        else:  # several devices in one process (not a k3lit layout): wait for their copies here
            for d in cuda:
                torch.cuda.current_stream(d).synchronize()
        return snap, event

    def _write(self, snapshot: dict[str, Any], copied: torch.cuda.Event | None, path: Path) -> None:
        if copied is not None:
            copied.synchronize()
        partial = staged_paths(path)[0]
        try:
            DirectCheckpointIO.save_checkpoint(self, snapshot, partial)
        except BaseException:
            partial.unlink(missing_ok=True)  # the previous checkpoint stays at path, nothing half-written beside it
            raise
        commit(path)

    def wait(self) -> None:
        """Return once no write is in flight; raise the exception of a write that failed."""
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.result()

    @override
    def remove_checkpoint(self, path: str | os.PathLike) -> None:
        self.wait()
        super().remove_checkpoint(path)

    @override
    def teardown(self) -> None:
        self.wait()
        if self._executor is not None:
            self._executor.shutdown()
            self._executor = None
        super().teardown()


def _cuda_bytes(obj: Any) -> int:
    """Bytes of the CUDA tensors in ``obj`` (nested dicts, lists and tuples)."""
    if isinstance(obj, torch.Tensor):
        return obj.nbytes if obj.is_cuda else 0
    if isinstance(obj, dict):
        return sum(_cuda_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(_cuda_bytes(v) for v in obj)
    return 0


def _available_host_bytes() -> int:
    """Memory the host can give without swapping: Linux's ``MemAvailable`` (free memory plus the page cache it can
    drop; a run that writes checkpoints fills the cache, so the free pages alone would understate it); a very large
    number where it cannot be read."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024  # kB
    except (OSError, ValueError, IndexError):
        pass
    return 2**62


def finish_writes(trainer: L.Trainer) -> None:
    """Wait until every checkpoint ``trainer`` saved is on disk (a no-op unless its strategy's checkpoint IO is a
    :class:`BackgroundCheckpointIO`). Raises the exception of a write that failed."""
    io = trainer.strategy.checkpoint_io
    if isinstance(io, BackgroundCheckpointIO):
        io.wait()
