"""One file of a corpus: where it is, the key its documents' split hashes start from, and how it holds documents
(:class:`CorpusFile`); every corpus, built-in or the user's, is a sorted list of them."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

__all__ = ["CorpusFile", "Kind"]

Kind = Literal["text", "jsonl", "parquet"]


@dataclass(frozen=True)
class CorpusFile:
    """One file of a corpus.

    Attributes:
        path: absolute path.
        key: path relative to the corpus root, POSIX style; the split hash of its documents starts from it.
        kind: ``"text"`` (whole file is one document), ``"jsonl"`` or ``"parquet"`` (one document per record).
        size: bytes on disk.
        mtime_ns: modification time; with ``size`` it fingerprints the file for the cache.
    """

    path: Path
    key: str
    kind: Kind
    size: int
    mtime_ns: int

    @classmethod
    def from_path(cls, path: Path, key: str, kind: Kind | None = None) -> CorpusFile:
        """The file at ``path`` under ``key``; ``kind`` defaults to the one its suffix names (``.jsonl``,
        ``.parquet``, anything else ``"text"``)."""
        st = path.stat()
        return cls(path=path.resolve(), key=key, kind=kind or _kind_of(path), size=st.st_size, mtime_ns=st.st_mtime_ns)


def _kind_of(path: Path) -> Kind:
    suffix = path.suffix.lower()
    if suffix == ".jsonl":
        return "jsonl"
    if suffix == ".parquet":
        return "parquet"
    return "text"
