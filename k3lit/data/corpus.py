"""Corpora: the built-in ``"stdlib"`` and ``"python"`` corpora and the user's own text, jsonl and parquet files or
folders.

Built-in corpora need no download: ``"stdlib"`` (:mod:`k3lit.data.stdlib_corpus`) is the standard library's
``.py`` files without tests, about 12 MB, for CPU runs; ``"python"`` (:mod:`k3lit.data.python_corpus`) is every
``.py``, ``.pyi``, ``.md`` and ``.rst`` file of the interpreter's installation (standard library with tests and the
installed packages), filtered and deduplicated, about 195 MB with this project's dependencies, for GPU runs.

A corpus is a sorted list of :class:`~k3lit.data.corpus_file.CorpusFile`. Each file holds documents: a text file
is one document, a ``.jsonl`` file one document per line (field ``"text"``), a ``.parquet`` file one per row
(column ``"text"``).

The train/validation split is by document and deterministic: a document's *key* (its path relative to the corpus
root, plus ``#<line or row>`` inside jsonl/parquet files) is hashed with SHA-256 and the document goes to
validation when the hash, read as a fraction of ``2**64``, is below ``val_fraction``. So a text file never
straddles the two splits, the split does not depend on the machine, the file order or the other files, and
adding a file leaves every other file where it was.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Literal

from k3lit.data.corpus_file import CorpusFile
from k3lit.data.python_corpus import PYTHON, python_files
from k3lit.data.stdlib_corpus import STDLIB, stdlib_files

Split = Literal["train", "val"]

_SNIFF_BYTES = 8192
_HASH_SPACE = 2**64
_CORPUS_HELP = (
    "Set `corpus` to 'stdlib' or 'python' (the built-in corpora) or to text files (.txt/.md/.py/...), .jsonl files "
    "(field 'text'), .parquet files (column 'text'), or folders of those."
)


def _looks_binary(path: Path) -> bool:
    with open(path, "rb") as f:
        return b"\0" in f.read(_SNIFF_BYTES)


def _folder_files(root: Path) -> list[CorpusFile]:
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith(".") and d != "__pycache__")
        for name in sorted(filenames):
            path = Path(dirpath) / name
            if name.startswith(".") or not path.is_file():
                continue
            file = CorpusFile.from_path(path, path.relative_to(root).as_posix())
            if file.kind == "text" and _looks_binary(path):
                continue
            files.append(file)
    return files


def resolve_corpus(corpus: str | Sequence[str], memo_dir: str | os.PathLike | None = None) -> list[CorpusFile]:
    """Expand a corpus spec into its files, sorted by key, duplicates removed.

    Args:
        corpus: ``"stdlib"``, ``"python"``, a path, or a list of those. A file is taken whatever its suffix
            (``.jsonl`` and ``.parquet`` hold records, anything else is one text document). A folder is walked
            recursively, skipping hidden entries, ``__pycache__`` and files whose first 8 KiB contain a NUL byte
            (binaries). Keys of a folder's files are relative to that folder; a file named directly has its name as key.
        memo_dir: where the ``"python"`` corpus keeps its scan (:func:`k3lit.data.python_corpus.scan_python_sources`),
            so that resolving it again reads no file; ``None``: read them every time.

    Raises:
        FileNotFoundError: a path does not exist.
        ValueError: the spec is empty, or it names no usable files (e.g. only empty or binary files).
    """
    specs = [corpus] if isinstance(corpus, (str, os.PathLike)) else list(corpus)
    if not specs:
        raise ValueError(f"The corpus list is empty. {_CORPUS_HELP}")
    found: dict[Path, CorpusFile] = {}
    for spec in specs:
        spec = os.fspath(spec)
        if spec == STDLIB:
            entries = stdlib_files()
        elif spec == PYTHON:
            entries = python_files(memo_dir)
        else:
            path = Path(spec).expanduser()
            if not path.exists():
                raise FileNotFoundError(
                    f"Corpus path {spec!r} does not exist (looked at {str(path.absolute())!r}). {_CORPUS_HELP}"
                )
            entries = _folder_files(path) if path.is_dir() else [CorpusFile.from_path(path, path.name)]
        for entry in entries:
            found.setdefault(entry.path, entry)
    files = sorted(found.values(), key=lambda f: (f.key, str(f.path)))
    files = [f for f in files if f.size > 0]
    if not files:
        raise ValueError(f"The corpus {corpus!r} contains no non-empty text, jsonl or parquet files. {_CORPUS_HELP}")
    return files


def doc_hash(key: str) -> int:
    """Split hash of a document key: the first 8 bytes of its SHA-256, an int in ``[0, 2**64)``."""
    return int.from_bytes(hashlib.sha256(key.encode("utf-8")).digest()[:8], "big")


def val_cut(val_fraction: float) -> int:
    """Documents whose :func:`doc_hash` is below this go to validation."""
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"val_fraction={val_fraction} must be in (0, 1), e.g. 0.05 for 5% of the documents.")
    return int(val_fraction * _HASH_SPACE)


def split_of(key: str, val_fraction: float) -> Split:
    """``"val"`` if the document with this key is held out, else ``"train"``."""
    return "val" if doc_hash(key) < val_cut(val_fraction) else "train"


def iter_documents(file: CorpusFile) -> Iterator[tuple[str, str]]:
    """Yield ``(key, text)`` for each non-empty document of ``file``.

    Text files are decoded as UTF-8 with undecodable bytes replaced by U+FFFD. Keys: ``file.key`` for a text
    file, ``f"{file.key}#{n}"`` for line ``n`` (1-based) of a jsonl file or row ``n`` (0-based) of a parquet file.

    Raises:
        ValueError: a jsonl line that is not a JSON object with a string ``"text"``, or a parquet file
            without a ``"text"`` column; the message names the file and line.
    """
    if file.kind == "text":
        text = file.path.read_bytes().decode("utf-8", errors="replace")
        if text:
            yield file.key, text
    elif file.kind == "jsonl":
        with open(file.path, encoding="utf-8", errors="replace") as f:
            for n, line in enumerate(f, start=1):
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as err:
                    msg = f"{file.path}:{n}: not valid JSON ({err}). Write one JSON object per line."
                    raise ValueError(msg) from None
                text = record.get("text") if isinstance(record, dict) else None
                if not isinstance(text, str):
                    raise ValueError(
                        f'{file.path}:{n}: expected an object with a string field "text", got {line[:80]!r}. '
                        'Write one {"text": "..."} object per line.'
                    )
                if text:
                    yield f"{file.key}#{n}", text
    else:
        import pyarrow.parquet as pq

        pf = pq.ParquetFile(file.path)
        if "text" not in pf.schema_arrow.names:
            raise ValueError(
                f"{file.path}: no 'text' column (columns: {pf.schema_arrow.names}). Rename the text column to 'text'."
            )
        row = 0
        for batch in pf.iter_batches(columns=["text"], batch_size=4096):
            for text in batch.column(0).to_pylist():
                if isinstance(text, str) and text:
                    yield f"{file.key}#{row}", text
                row += 1


def iter_split(files: Sequence[CorpusFile], split: Split, cut: int) -> Iterator[str]:
    """Texts of the documents of ``files`` in ``split``, given the cut from :func:`split_cut`."""
    want_val = split == "val"
    for file in files:
        for key, text in iter_documents(file):
            if (doc_hash(key) < cut) == want_val:
                yield text


def split_cut(files: Sequence[CorpusFile], val_fraction: float) -> int:
    """The hash cut for ``files``: :func:`val_cut` unless that leaves a split empty.

    With few documents no hash may fall below ``val_fraction`` (or all may): then the single document with the
    smallest hash becomes validation (or the one with the largest stays in training), still deterministic.

    Raises:
        ValueError: ``val_fraction`` outside (0, 1), or the corpus has fewer than two documents.
    """
    cut = val_cut(val_fraction)
    hashes = [doc_hash(key) for file in files for key, _ in iter_documents(file)]
    if len(hashes) < 2:
        raise ValueError(
            f"The corpus has {len(hashes)} non-empty document(s); a train/validation split needs at least 2. "
            "Add more files, or split a big text file into several files (or into lines of a .jsonl file)."
        )
    lo, hi = min(hashes), max(hashes)
    if lo >= cut:  # nothing held out: hold out the lowest hash
        return lo + 1
    if hi < cut:  # nothing left to train on: keep the highest hash for training
        return hi
    return cut
