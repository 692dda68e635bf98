"""Reading k3lit checkpoints outside training: a single ``.ckpt`` file, or the folder that FSDP2 and
expert-parallel runs write through torch distributed checkpoint (one ``.distcp`` shard per rank, ``.metadata``,
and Lightning's ``meta.pt`` with the hyper-parameters, loops and data position)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

__all__ = ["check_checkpoint", "is_sharded_checkpoint", "checkpoint_hparams", "load_model_checkpoint"]

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


def load_model_checkpoint(path: str | Path) -> dict[str, Any]:
    """The checkpoint without its optimizer states, as one CPU dict: ``state_dict`` with full (unsharded) float
    tensors, hyper-parameters, the data module's state and the rest of what Lightning saved. Each weight is read
    once and no optimizer moment is read: a file is memory-mapped (its optimizer tensors stay on disk), a sharded
    folder is read with ``torch.distributed.checkpoint.load`` into tensors allocated for the ``state_dict`` entries
    only (no process group needed).

    Raises:
        FileNotFoundError: ``path`` is neither a file nor a sharded checkpoint folder.
    """
    p = check_checkpoint(path)
    if p.is_file():
        ckpt = torch.load(p, map_location="cpu", weights_only=False, mmap=True)
        ckpt.pop("optimizer_states", None)
        return ckpt
    metadata = dcp.FileSystemReader(p).read_metadata()
    weights = {}
    for flat, where in metadata.planner_data.items():  # flattened key -> its path in the saved nested dict
        entry = metadata.state_dict_metadata[flat]
        if where[0] == "state_dict" and isinstance(entry, TensorStorageMetadata):
            weights[where[1]] = torch.empty(entry.size, dtype=entry.properties.dtype)
    dcp.load({"state_dict": weights}, checkpoint_id=p, no_dist=True)
    ckpt = torch.load(p / META, map_location="cpu", weights_only=False)
    ckpt["state_dict"] = weights
    return ckpt
