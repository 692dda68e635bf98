"""Reading k3lit checkpoints outside training: a single ``.ckpt`` file, or the folder that FSDP2 and
expert-parallel runs write through torch distributed checkpoint (one ``.distcp`` shard per rank, ``.metadata``,
and Lightning's ``meta.pt`` with the hyper-parameters, loops and data position)."""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

__all__ = ["check_checkpoint", "is_sharded_checkpoint", "checkpoint_hparams", "load_full_checkpoint"]

META = "meta.pt"  # Lightning's name for the non-tensor part of a sharded checkpoint


def is_sharded_checkpoint(path: str | Path) -> bool:
    """Whether ``path`` is a torch-distributed-checkpoint folder written by Lightning (``.metadata`` + ``meta.pt``)."""
    p = Path(path)
    return p.is_dir() and (p / ".metadata").is_file() and (p / META).is_file()


def check_checkpoint(path: str | Path) -> Path:
    """``path`` as a Path if it is a checkpoint file or sharded folder; else FileNotFoundError saying what to pass."""
    p = Path(path)
    if not (p.is_file() or is_sharded_checkpoint(p)):
        raise FileNotFoundError(
            f"checkpoint {p} not found: pass a .ckpt file or a sharded checkpoint folder (with .metadata and "
            f"{META}), e.g. runs/<recipe>/checkpoints/last.ckpt"
        )
    return p


def checkpoint_hparams(path: str | Path) -> dict[str, Any]:
    """The ``hyper_parameters`` saved with a checkpoint (file or sharded folder), without loading any weights.

    Raises:
        FileNotFoundError: ``path`` is neither a file nor a sharded checkpoint folder.
    """
    p = check_checkpoint(path)
    return torch.load(p / META if p.is_dir() else p, map_location="cpu", weights_only=True).get("hyper_parameters", {})


def load_full_checkpoint(path: str | Path) -> dict[str, Any]:
    """The whole checkpoint as one CPU dict: ``state_dict`` with full (unsharded) tensors, optimizer states,
    hyper-parameters and everything else Lightning saved. A sharded folder is gathered with torch's
    ``dcp_to_torch_save`` (it must fit in CPU memory) and merged with its ``meta.pt``.

    Raises:
        FileNotFoundError: ``path`` is neither a file nor a sharded checkpoint folder.
    """
    p = check_checkpoint(path)
    if p.is_file():
        return torch.load(p, map_location="cpu", weights_only=False)
    with tempfile.TemporaryDirectory() as tmp:
        whole = Path(tmp) / "whole.pt"
        dcp_to_torch_save(p, whole)
        ckpt = torch.load(whole, map_location="cpu", weights_only=False)
    ckpt.update(torch.load(p / META, map_location="cpu", weights_only=False))
    return ckpt
