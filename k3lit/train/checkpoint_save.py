"""Checkpoint saves that a killed process cannot leave half-written.

Lightning writes a checkpoint straight to its final path. A sharded folder (torch distributed checkpoint, FSDP2 and
expert-parallel runs) is overwritten shard by shard, and a single file goes through Lightning's ``_atomic_save``, which
serialises the whole checkpoint in memory, writes it to a new file in the system temporary folder and moves that into
place: a rename where the temporary folder shares the checkpoint's filesystem, a copy into the final path where it does
not (a node-local ``/tmp``, checkpoints on a shared filesystem), and nothing is fsynced. A process killed in the middle
(a time limit, out of memory, a failed node) can leave ``last.ckpt`` truncated, or a folder holding shards of two
steps, and ``--ckpt_path last`` then fails.

:class:`K3Trainer` writes every checkpoint at a local path to ``<path>.partial`` beside it (a file with plain
``torch.save``, :class:`DirectCheckpointIO`), fsyncs it, and only then puts it in place (:func:`commit`): ``os.replace``
over a file; for a folder, the old one is renamed to ``<path>.replaced``, the new one renamed in, the old one removed.
At every instant the old or the new checkpoint is whole at ``<path>``, or, between the two renames of a folder, at
``<path>.partial``; :func:`settle`, which ``k3lit fit`` runs as it starts and :class:`K3Trainer` before every save,
finishes such a swap and removes what a killed save left behind. Paths that are URLs keep Lightning's saving.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.plugins.io import AsyncCheckpointIO, TorchCheckpointIO
from lightning.pytorch.trainer.states import TrainerFn, TrainerStatus
from typing_extensions import override

__all__ = ["K3Trainer", "DirectCheckpointIO", "staged_paths", "commit", "settle", "settle_folder", "is_local_path"]

PARTIAL, REPLACED = ".partial", ".replaced"


def is_local_path(path: str | os.PathLike) -> bool:
    """Whether ``path`` is a plain filesystem path, not a URL (``s3://``, ``file://``, any fsspec protocol)."""
    return "://" not in str(path)


def staged_paths(path: str | Path) -> tuple[Path, Path]:
    """``(<path>.partial, <path>.replaced)``: where a save writes the new checkpoint, and where a folder swap moves the
    old one for the instant between its two renames."""
    p = Path(path)
    return p.with_name(p.name + PARTIAL), p.with_name(p.name + REPLACED)


def commit(path: str | Path) -> None:
    """Put the checkpoint written whole at ``<path>.partial`` in place of ``path`` (see the module docstring): fsync
    it, then ``os.replace`` a file, or swap a folder through ``<path>.replaced``; fsync the parent folder. Run on one
    process, once every process has written its part.

    Raises:
        FileNotFoundError: nothing at ``<path>.partial``.
    """
    path = Path(path)
    partial, replaced = staged_paths(path)
    _fsync_tree(partial)
    if partial.is_file() and not _is_real_dir(path):
        os.replace(partial, path)
    elif not os.path.lexists(path):
        os.rename(partial, path)
    else:  # a folder on either side: no single rename replaces it
        os.rename(path, replaced)
        os.rename(partial, path)
        _fsync_dir(path.parent)  # the new one is durably in place before the old one goes
        _remove(replaced)
    _fsync_dir(path.parent)


def settle(path: str | Path) -> None:
    """Leave ``path`` with a whole checkpoint, or none, and nothing of an interrupted save beside it: a folder swap
    killed between its two renames is finished (its new checkpoint was whole), a ``.partial`` that a killed save left is
    removed. For the processes that write ``path`` (``k3lit fit``), never while a save is running; several processes of
    one job may run it at once."""
    path = Path(path)
    partial, replaced = staged_paths(path)
    if os.path.lexists(replaced):
        for whole in (partial, replaced):  # the new checkpoint; the old one only if the new one is gone too
            if os.path.lexists(path):
                break
            try:
                os.rename(whole, path)
            except FileNotFoundError:  # another process of the job moved it
                pass
        _fsync_dir(path.parent)
        _remove(replaced)  # only once a checkpoint is at path, so another process never finds neither
    _remove(partial)


def settle_folder(folder: str | Path) -> None:
    """:func:`settle` every ``*.ckpt`` (the names Lightning gives checkpoints) of ``folder`` that has a ``.partial``
    or ``.replaced`` beside it; other files are left alone."""
    folder = Path(folder)
    if folder.is_dir():
        for name in {p.name.removesuffix(PARTIAL).removesuffix(REPLACED) for p in folder.iterdir()
                     if p.name.endswith((".ckpt" + PARTIAL, ".ckpt" + REPLACED))}:
            settle(folder / name)


class DirectCheckpointIO(TorchCheckpointIO):
    """Lightning's :class:`TorchCheckpointIO` that writes a local file with ``torch.save`` straight into it and fsyncs
    it: no copy of the checkpoint in memory or in the system temporary folder. Not atomic by itself: :class:`K3Trainer`
    hands it the ``.partial`` path. Remote paths keep Lightning's writing."""

    stages_itself = False  # K3Trainer stages the save: this IO gets <path>.partial

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], path: str | os.PathLike,
                        storage_options: Any | None = None) -> None:
        if storage_options is not None or not is_local_path(path):
            return super().save_checkpoint(checkpoint, path, storage_options)
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path, "wb") as f:
            torch.save(checkpoint, f)
            f.flush()
            os.fsync(f.fileno())


class K3Trainer(L.Trainer):
    """Lightning's Trainer whose :meth:`save_checkpoint` (every checkpoint of a run: ``last.ckpt``, SLURM requeue,
    any ``ModelCheckpoint``) never leaves a half-written checkpoint at a local path, a single file or a sharded folder
    alike (see the module docstring). A checkpoint IO that stages its writes itself (``stages_itself``:
    :class:`~k3lit.train.checkpoint_background.BackgroundCheckpointIO`) gets the final path; its write may still run
    when the save returns during ``fit``, and has finished when it returns outside ``fit``. Remote paths and
    Lightning's asynchronous checkpoint IO keep Lightning's saving."""

    @override
    def save_checkpoint(self, filepath: str | os.PathLike, weights_only: bool | None = None,
                        storage_options: Any | None = None) -> None:
        io = self.strategy.checkpoint_io
        if self.model is None or not is_local_path(filepath) or isinstance(io, AsyncCheckpointIO):
            return super().save_checkpoint(filepath, weights_only, storage_options)
        if getattr(io, "stages_itself", False):
            super().save_checkpoint(filepath, weights_only, storage_options)
            if not (self.state.fn == TrainerFn.FITTING and self.state.status == TrainerStatus.RUNNING):
                io.wait()
            return None
        if self.is_global_zero:
            settle(filepath)  # no stale .partial of a killed save under the new one
        self.strategy.barrier("K3Trainer.save_checkpoint")
        # every process writes its part (a shard, or nothing but rank 0's file); Lightning's ends with a barrier
        super().save_checkpoint(staged_paths(filepath)[0], weights_only, storage_options)
        if self.is_global_zero:
            commit(filepath)
        self.strategy.barrier("K3Trainer.save_checkpoint")
        return None


def _is_real_dir(p: Path) -> bool:
    return p.is_dir() and not p.is_symlink()


def _remove(p: Path) -> None:
    """Remove a file, link or folder; nothing if it is gone (another process may remove it at the same time)."""
    if _is_real_dir(p):
        shutil.rmtree(p, ignore_errors=True)
    else:
        p.unlink(missing_ok=True)


def _fsync_tree(p: Path) -> None:
    """fsync a file, or every file of a folder and the folder's own entries."""
    if not _is_real_dir(p):
        with open(p, "rb") as f:
            os.fsync(f.fileno())
        return
    for root, _, files in os.walk(p):
        for name in files:
            with open(os.path.join(root, name), "rb") as f:
                os.fsync(f.fileno())
        _fsync_dir(Path(root))


def _fsync_dir(d: Path) -> None:
    """fsync a folder's entries (renames, new files); skipped on filesystems that cannot open a folder for it."""
    try:
        fd = os.open(d, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
