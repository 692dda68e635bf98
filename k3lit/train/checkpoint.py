"""Reading k3lit checkpoints outside training: a single ``.ckpt`` file, or the folder that FSDP2 and
expert-parallel runs write through torch distributed checkpoint (one ``.distcp`` shard per rank, ``.metadata``,
and Lightning's ``meta.pt`` with the hyper-parameters, loops and data position)."""

from __future__ import annotations

import zipfile
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import nn
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

from k3lit.train.checkpoint_save import staged_paths

__all__ = ["CheckpointError", "check_checkpoint", "checkpoint_hparams", "checkpoint_record", "load_initial_weights",
           "load_model_checkpoint", "tokenizer_error"]

META = "meta.pt"  # Lightning's name for the non-tensor part of a sharded checkpoint
ZIP_RECORD = b"PK\x03\x04"  # how every torch.save archive starts, so every record of a shard


class CheckpointError(ValueError):
    """A checkpoint that exists but cannot be read (truncated, garbage, an incomplete sharded folder). The message is
    one line: ``checkpoint <path> cannot be read: <what is wrong>; <what to pass instead>``."""

    def __init__(self, path: Path, problem: str, fix: str = "pass a checkpoint written by k3lit fit") -> None:
        super().__init__(f"checkpoint {path} cannot be read: {problem}; {fix}".replace("\n", " "))


def check_checkpoint(path: str | Path) -> Path:
    """``path`` as a Path once it is known to be a whole checkpoint: a torch file (its zip directory, which torch writes
    last, is there and lists ``data.pkl``), or a sharded folder whose ``.metadata`` unpickles, whose ``meta.pt`` is such
    a file and whose shards hold every record ``.metadata`` lists, each starting where it says. Reads no tensor. Every
    command that takes a checkpoint (fit, validate, generate, export) calls it before loading anything.

    Raises:
        FileNotFoundError: nothing at ``path``.
        CheckpointError: something at ``path`` that is no whole checkpoint (the message names the file and the fault).
    """
    p = Path(path)
    if not p.exists():
        partial, replaced = staged_paths(p)
        if partial.exists() and replaced.exists():
            raise CheckpointError(p, f"its last save stopped between two renames, {partial} is that checkpoint whole",
                                  f"pass {partial}, or resume with `k3lit fit --ckpt_path`, which moves it in place")
        raise FileNotFoundError(
            f"checkpoint {p} not found: pass a .ckpt file or a sharded checkpoint folder (with .metadata and "
            f"{META}), e.g. runs/<recipe>/checkpoints/last.ckpt"
        )
    if p.is_dir():
        _check_sharded(p)
    else:
        _check_torch_file(p, p)
    return p


def _check_torch_file(f: Path, ckpt: Path) -> None:
    """Raise CheckpointError (for checkpoint ``ckpt``) unless ``f`` is a whole torch.save zip archive."""
    if f.stat().st_size == 0:
        raise CheckpointError(ckpt, f"{_name(f, ckpt)}empty file (0 bytes)")
    try:
        with zipfile.ZipFile(f) as z:
            names = z.namelist()
    except (zipfile.BadZipFile, OSError) as e:
        raise CheckpointError(ckpt, f"{_name(f, ckpt)}truncated or not a torch checkpoint ({e})") from None
    if not any(n == "data.pkl" or n.endswith("/data.pkl") for n in names):
        raise CheckpointError(ckpt, f"{_name(f, ckpt)}not a torch checkpoint (a zip archive without data.pkl)")


def _check_sharded(p: Path) -> None:
    """Raise CheckpointError unless folder ``p`` is a whole sharded checkpoint (see :func:`check_checkpoint`)."""
    for name in (".metadata", META):
        if not (p / name).is_file():
            files = sorted(p.glob("*.ckpt")) or sorted(p.glob("checkpoints/*.ckpt"))  # a checkpoints or run folder
            last = [f for f in files if f.name == "last.ckpt"]
            fix = (f"pass one of its checkpoint files, e.g. {(last or files)[0]}" if files
                   else "pass a checkpoint written by k3lit fit")
            raise CheckpointError(p, f"a folder without {name} (no sharded checkpoint, or an incomplete one)", fix)
    try:
        records = dcp.FileSystemReader(p).read_metadata().storage_data
    except Exception as e:  # noqa: BLE001 - whatever unpickling garbage raises
        raise CheckpointError(p, f".metadata is garbage ({type(e).__name__}: {e})") from None
    _check_torch_file(p / META, p)
    by_file: dict[str, list[tuple[int, int]]] = {}
    for info in records.values():
        by_file.setdefault(info.relative_path, []).append((info.offset, info.length))
    for name, spans in sorted(by_file.items()):
        shard = p / name
        if not shard.is_file():
            raise CheckpointError(p, f"shard {name} is missing")
        size, end = shard.stat().st_size, max(offset + length for offset, length in spans)
        if size < end:
            raise CheckpointError(p, f"shard {name} is truncated ({size} bytes, .metadata lists {end})")
        with open(shard, "rb") as fh:  # each record is one torch.save archive: a zip local-file header
            for offset, _ in sorted(spans):
                fh.seek(offset)
                if fh.read(4) != ZIP_RECORD:
                    raise CheckpointError(p, f"shard {name} is garbage or of another save (no record at byte "
                                             f"{offset}, where .metadata puts one)")


def _name(f: Path, ckpt: Path) -> str:
    """``"meta.pt: "`` for a file inside a sharded checkpoint, nothing for the checkpoint file itself."""
    return "" if f == ckpt else f"{f.name}: "


def checkpoint_record(path: str | Path) -> dict[str, Any]:
    """What a checkpoint (file or sharded folder) that :func:`check_checkpoint` accepted holds besides its tensors,
    read without loading them (a file is memory-mapped; ``weights_only``): ``hyper_parameters``, ``global_step``,
    ``datamodule_hyper_parameters``, the data module's state (``K3DataModule``: the tokenizer), ..."""
    p = Path(path)
    if p.is_dir():
        return torch.load(p / META, map_location="cpu", weights_only=True)
    return torch.load(p, map_location="cpu", weights_only=True, mmap=True)


def checkpoint_hparams(path: str | Path) -> dict[str, Any]:
    """The ``hyper_parameters`` saved with a checkpoint (file or sharded folder) that :func:`check_checkpoint`
    accepted, without loading any weights."""
    return checkpoint_record(path).get("hyper_parameters", {})


def tokenizer_error(path: str | Path, record: dict[str, Any], ours: str, flag: str = "--init_weights") -> ValueError:
    """The error for a checkpoint given to ``flag`` (``record``: :func:`checkpoint_record`) whose tokenizer is not
    this run's (``ours``: its spec), naming the checkpoint's tokenizer and corpus."""
    saved = (record.get("K3DataModule") or {}).get("tokenizer_spec")
    corpus = (record.get("datamodule_hyper_parameters") or {}).get("corpus")
    what = (f"its tokenizer {saved!r} was trained on other text than this run's" if saved == ours else
            f"the checkpoint was trained with tokenizer {saved!r}, this run reads {ours!r}")
    return ValueError(f"{flag} {path}: {what}, so its token ids would stand for other text; set "
                      f"--data.tokenizer={saved} --data.corpus={corpus} (the checkpoint's)")


def load_model_checkpoint(path: str | Path) -> dict[str, Any]:
    """The checkpoint without its optimizer states, as one CPU dict: ``state_dict`` with full (unsharded) float
    tensors, hyper-parameters, the data module's state and the rest of what Lightning saved. Each weight is read
    once and no optimizer moment is read: a file is memory-mapped (its optimizer tensors stay on disk), a sharded
    folder is read with ``torch.distributed.checkpoint.load`` into tensors allocated for the ``state_dict`` entries
    only (no process group needed).

    Raises:
        FileNotFoundError: nothing at ``path``.
        CheckpointError: something at ``path`` that is no whole checkpoint (:func:`check_checkpoint`).
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


def load_initial_weights(model: nn.Module, path: str | Path, tokenizer: dict | None = None) -> None:
    """Copy the weights and buffers (the MoE balancers' bias and threshold) of the checkpoint at ``path``, a file or
    a sharded folder, into ``model`` (a :class:`~k3lit.model.K3LM`, plain or sharded by FSDP2 / expert parallelism:
    each rank keeps its own shards of the full tensors, ``torch.distributed.checkpoint``'s
    ``set_model_state_dict``). Its optimizer states are not read.

    Args:
        model: the model the checkpoint's ``model.*`` entries belong to, materialised (no meta tensors).
        path: the checkpoint.
        tokenizer: this run's ``K3DataModule.state_dict()`` (the tokenizer's spec and JSON); when given, the
            checkpoint's must hold the same tokenizer, else its token ids would stand for other text.

    Raises:
        FileNotFoundError, CheckpointError: as :func:`load_model_checkpoint`.
        ValueError: another tokenizer, or entries whose names or shapes differ from ``model``'s (another
            architecture).
    """
    ckpt = load_model_checkpoint(path)
    saved = ckpt.get("K3DataModule")
    if tokenizer is not None and saved is not None and not _same_tokenizer(saved, tokenizer):
        raise tokenizer_error(path, ckpt, tokenizer.get("tokenizer_spec"))
    weights = {k.removeprefix("model."): v for k, v in ckpt["state_dict"].items() if k.startswith("model.")}
    ours = model.state_dict()
    missing, extra = sorted(ours.keys() - weights.keys()), sorted(weights.keys() - ours.keys())
    shapes = [f"{k} {tuple(weights[k].shape)} (model: {tuple(ours[k].shape)})"
              for k in sorted(ours.keys() & weights.keys()) if tuple(weights[k].shape) != tuple(ours[k].shape)]
    if missing or extra or shapes:
        raise ValueError(f"--init_weights {path}: the checkpoint holds another architecture: missing {missing[:4]}, "
                         f"unexpected {extra[:4]}, other shapes {shapes[:4]}")
    set_model_state_dict(model, weights, options=StateDictOptions(full_state_dict=True, strict=True))
    rank_zero_info(f"k3lit: model weights from {path} (step {ckpt.get('global_step', '?')} of its run); the "
                   "optimizer, schedule, step count and data order start afresh")


def _same_tokenizer(a: dict, b: dict) -> bool:
    """Whether two ``K3DataModule.state_dict()`` hold the same tokenizer: the same JSON (trained BPE, a tokenizer
    file), or for built-in tokenizers without one the same spec."""
    if a.get("tokenizer_json") is not None or b.get("tokenizer_json") is not None:
        return a.get("tokenizer_json") == b.get("tokenizer_json")
    return a.get("tokenizer_spec") == b.get("tokenizer_spec")
