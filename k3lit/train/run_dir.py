"""The files a run folder keeps one of (``metrics.csv``, ``checkpoints/last.ckpt``): a fresh run moves an earlier
run's aside instead of deleting it or writing a second file beside it."""

from __future__ import annotations

import os
from typing import Any

from lightning.pytorch.utilities.rank_zero import rank_zero_warn

__all__ = ["move_aside"]


def move_aside(fs: Any, path: str, stem: str) -> str:
    """Move ``path`` (an fsspec filesystem's file) to the first free ``<stem>.<n><ext>`` beside it, n = 1, 2, …,
    with a warning naming both; returns the new path."""
    folder, ext = os.path.dirname(path), os.path.splitext(path)[1]
    n = 1
    while fs.exists(aside := os.path.join(folder, f"{stem}.{n}{ext}")):
        n += 1
    fs.mv(path, aside)
    rank_zero_warn(f"{path} of an earlier run was moved to {aside}: this run starts from scratch (pass "
                   "--ckpt_path last to continue a run)")
    return aside
