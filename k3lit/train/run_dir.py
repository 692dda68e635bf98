"""The files a run folder keeps one of (``metrics.csv``, ``checkpoints/last.ckpt``, the TensorBoard event files, the
``expert_load`` heatmaps): a fresh run moves an earlier run's aside instead of deleting them or writing its own
beside them."""

from __future__ import annotations

import os
from typing import Any

from lightning.pytorch.utilities.rank_zero import rank_zero_warn

__all__ = ["move_aside", "move_events_aside"]


def move_aside(fs: Any, path: str, stem: str) -> str:
    """Move ``path`` (an fsspec filesystem's file or folder) to the first free ``<stem>.<n><ext>`` beside it,
    n = 1, 2, … (a folder has no ``ext``), with a warning naming both; returns the new path."""
    folder = os.path.dirname(path)
    aside = _free(fs, folder, stem, "" if fs.isdir(path) else os.path.splitext(path)[1])
    fs.mv(path, aside, recursive=True)
    _warn(path, aside)
    return aside


def move_events_aside(fs: Any, folder: str) -> str | None:
    """Move the TensorBoard event files (``events.out.tfevents.*``) directly in ``folder`` into the first free
    ``tensorboard.<n>`` folder inside it, where TensorBoard shows them as a run of their own; returns that folder,
    None when there were none."""
    events = sorted(p for p in fs.glob(os.path.join(folder, "events.out.tfevents.*")) if fs.isfile(p))
    if not events:
        return None
    aside = _free(fs, folder, "tensorboard", "")
    fs.makedirs(aside, exist_ok=True)
    for path in events:
        fs.mv(path, os.path.join(aside, os.path.basename(path)))
    _warn(f"the TensorBoard events in {folder}", aside)
    return aside


def _free(fs: Any, folder: str, stem: str, ext: str) -> str:
    n = 1
    while fs.exists(aside := os.path.join(folder, f"{stem}.{n}{ext}")):
        n += 1
    return aside


def _warn(what: str, aside: str) -> None:
    rank_zero_warn(f"moved {what} of an earlier run to {aside}: this run starts from scratch (pass "
                   "--ckpt_path last to continue a run)")
