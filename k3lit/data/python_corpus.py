"""The built-in ``"python"`` corpus: the Python and text sources of the running interpreter's installation.

Where ``"stdlib"`` is the standard library without its tests (about 12 MB, sized for CPU runs), ``"python"`` takes
everything the interpreter and its environment install, so that a GPU run does not go through it many times:

- roots: the standard library folder (``sysconfig`` path ``"stdlib"``, tests included) and every ``sys.path``
  entry named ``site-packages`` or ``dist-packages`` (the environment's installed packages). Other ``sys.path``
  entries (the current folder, ``PYTHONPATH``) are never walked, so a project checkout, its runs and its data
  cache are not part of the corpus; neither are hidden folders (``.cache``, ...) and ``__pycache__``.
- files: non-empty ``.py``, ``.pyi``, ``.md`` and ``.rst`` files; links to folders are not followed.
- left out, each for a reason recorded in :class:`PythonScan` ``skipped``:

  - ``"project"``: this project's own sources when installed (``k3lit/``, ``k3lit-*.dist-info`` at the top of a
    site folder) and editable-install hooks (``__editable__*``: generated files that hold the machine's own
    paths); a checkout on ``PYTHONPATH`` or installed in editable mode is outside the roots anyway;
  - ``"too_big"``: files over :data:`MAX_FILE_BYTES` (1 MiB; generated stubs and tables such as torch's
    ``_VF.pyi``);
  - ``"binary"``: files with a NUL byte;
  - ``"not_utf8"``: files that are not valid UTF-8 (the standard library's tests of other source encodings);
  - ``"long_line"``: files with a line over :data:`MAX_LINE_BYTES` (4096) bytes: serialized data in a string
    literal (protobuf descriptors, JSON-schema validators, keyword tables), not code or prose;
  - ``"duplicate"``: a file whose bytes (SHA-256) equal those of a file with a smaller key (vendored copies such
    as ``pip/_vendor``, packages installed under two names).

Keys are ``stdlib/<path>`` and ``site-packages/<path>``, relative to the root, so the train/validation split
(:func:`k3lit.data.corpus.split_of`) is the same on every machine with the same files; when a key occurs in two
site folders, the one earlier on ``sys.path`` (the one ``import`` finds) is kept.

On CPython 3.11 with this project's dependencies installed the corpus is 12,499 files, 195 MB (53.6M tokens with
``bpe:16384``; ``benchmarks/RESULTS.md``, "Corpus: python").
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from k3lit.data.corpus_file import CorpusFile
from k3lit.data.stdlib_corpus import stdlib_root

__all__ = ["PYTHON", "PythonScan", "SourceRoot", "python_files", "python_roots", "scan_python_sources"]

PYTHON = "python"
"""Name of this built-in corpus."""

SUFFIXES = frozenset({".py", ".pyi", ".md", ".rst"})
"""File name endings the corpus takes (compared in lower case)."""

MAX_FILE_BYTES = 1 << 20
"""Files larger than this (bytes) are left out."""

MAX_LINE_BYTES = 4096
"""Files with a line longer than this (bytes, without the newline) are left out."""

PROJECT = "k3lit"
"""Import name of this project: its package and distribution in a site folder are left out."""

Reason = Literal["project", "too_big", "binary", "not_utf8", "long_line", "duplicate"]

_SITE_DIR_NAMES = frozenset({"site-packages", "dist-packages"})
_SKIP_DIRS = frozenset({"__pycache__"})


@dataclass(frozen=True)
class SourceRoot:
    """A folder the corpus walks.

    Attributes:
        label: first part of the keys of its files (``"stdlib"`` or ``"site-packages"``).
        path: the folder.
    """

    label: str
    path: Path


@dataclass(frozen=True)
class PythonScan:
    """What :func:`scan_python_sources` found.

    Attributes:
        files: the corpus, sorted by key (``kind="text"``, one document per file).
        skipped: keys of the files left out, by reason (see the module docstring), each list sorted; a folder
            left out whole (``"project"``) appears once, its key ending in ``/``.
    """

    files: list[CorpusFile]
    skipped: dict[Reason, list[str]] = field(default_factory=dict)

    @property
    def n_bytes(self) -> int:
        """Bytes of the kept files."""
        return sum(f.size for f in self.files)


def python_roots() -> list[SourceRoot]:
    """The roots of the ``"python"`` corpus: the standard library, then the site folders in ``sys.path`` order."""
    roots = [SourceRoot("stdlib", stdlib_root())]
    seen = {roots[0].path.resolve()}
    for entry in sys.path:
        path = Path(entry or ".")
        if path.name in _SITE_DIR_NAMES and path.is_dir() and path.resolve() not in seen:
            seen.add(path.resolve())
            roots.append(SourceRoot("site-packages", path))
    return roots


def _is_project_entry(name: str, top_level: bool) -> bool:
    if name.startswith("__editable__"):
        return True
    return top_level and (name == PROJECT or name.startswith(f"{PROJECT}-") and name.endswith(".dist-info"))


def _walk(root: SourceRoot) -> tuple[list[tuple[str, Path, int, int]], list[str]]:
    """``(key, path, size, mtime_ns)`` of the candidate files under ``root`` and the keys of project entries, in walk
    order."""
    found, project = [], []
    base = root.path
    for dirpath, dirnames, filenames in os.walk(base):
        here = Path(dirpath)
        top = here == base
        keep = []
        for d in sorted(dirnames):
            if d.startswith(".") or d in _SKIP_DIRS or d in _SITE_DIR_NAMES:
                continue  # site folders nested in a root are roots of their own when on sys.path
            if _is_project_entry(d, top):
                project.append(f"{root.label}/{(here / d).relative_to(base).as_posix()}/")
                continue
            keep.append(d)
        dirnames[:] = keep
        for name in sorted(filenames):
            path = here / name
            if name.startswith(".") or Path(name).suffix.lower() not in SUFFIXES:
                continue
            key = f"{root.label}/{path.relative_to(base).as_posix()}"
            if _is_project_entry(name, top):
                project.append(key)
                continue
            try:
                st = path.stat()  # follows links; a dangling link raises
            except OSError:
                continue
            if path.is_file() and st.st_size > 0:
                found.append((key, path, st.st_size, st.st_mtime_ns))
    return found, project


def _inspect(path: Path, size: int) -> tuple[Reason | None, bytes]:
    """``(reason to leave the file out or None, SHA-256 digest of its bytes)``; big files are not read."""
    if size > MAX_FILE_BYTES:
        return "too_big", b""
    data = path.read_bytes()
    if b"\0" in data:
        return "binary", b""
    try:
        data.decode("utf-8")
    except UnicodeDecodeError:
        return "not_utf8", b""
    if max(map(len, data.split(b"\n"))) > MAX_LINE_BYTES:
        return "long_line", b""
    return None, hashlib.sha256(data).digest()


def scan_python_sources(roots: Sequence[SourceRoot] | None = None, workers: int | None = None,
                        memo_dir: str | os.PathLike | None = None) -> PythonScan:
    """Collect, filter and deduplicate the sources under ``roots`` (see the module docstring for the rules).

    Reads every candidate file once (about 250 MB, 3 s on 2 cores for this project's environment); the result
    depends only on the files' relative paths and bytes, not on the walk order or the machine. With ``memo_dir``
    the result is also kept there (``python-scan-<fingerprint>.json``), under a fingerprint of every candidate's
    key, path, size and modification time and of the rules: a later scan of unchanged files only walks the
    folders (under a second here) and reads none of them; any added, removed or modified candidate, or a kept
    result that cannot be read back, scans afresh.

    Args:
        roots: folders to walk, in priority order for keys found in two of them; default :func:`python_roots`.
        workers: threads reading and hashing files; default ``min(8, os.cpu_count())``.
        memo_dir: folder for the kept result (created if missing); ``None`` keeps nothing.

    Raises:
        ValueError: a root is not a folder.
    """
    roots = python_roots() if roots is None else list(roots)
    for root in roots:
        if not root.path.is_dir():
            raise ValueError(f"Corpus root {str(root.path)!r} ({root.label}) is not a folder.")
    project: list[str] = []
    candidates: dict[str, tuple[Path, int, int]] = {}
    for root in roots:
        found, entries = _walk(root)
        project.extend(entries)
        for key, path, size, mtime_ns in found:
            candidates.setdefault(key, (path, size, mtime_ns))  # the earlier root wins, as for imports
    keys = sorted(candidates)
    memo = None if memo_dir is None else Path(memo_dir) / f"python-scan-{_fingerprint(keys, candidates, project)}.json"
    if memo is not None and memo.is_file():
        try:
            return _load_scan(memo)
        except (OSError, ValueError, KeyError, TypeError):  # unreadable or damaged: scan afresh and rewrite it
            pass
    skipped: dict[Reason, list[str]] = {"project": project}
    with ThreadPoolExecutor(max_workers=workers or min(8, os.cpu_count() or 1)) as pool:
        results = list(pool.map(lambda k: _inspect(*candidates[k][:2]), keys))
    first_of: dict[bytes, str] = {}
    files = []
    for key, (reason, digest) in zip(keys, results):
        if reason is None and digest in first_of:
            reason = "duplicate"
        if reason is not None:
            skipped.setdefault(reason, []).append(key)
            continue
        first_of[digest] = key
        files.append(CorpusFile.from_path(candidates[key][0], key, "text"))
    scan = PythonScan(files=files, skipped={r: sorted(k) for r, k in skipped.items() if k})
    if memo is not None:
        _save_scan(scan, memo)
    return scan


_MEMO_VERSION = 1  # bump when the rules or the memo's layout change


def _fingerprint(keys: list[str], candidates: dict[str, tuple[Path, int, int]], project: list[str]) -> str:
    h = hashlib.sha256(f"{_MEMO_VERSION}|{sorted(SUFFIXES)}|{MAX_FILE_BYTES}|{MAX_LINE_BYTES}|{PROJECT}\n".encode())
    h.update("\0".join(sorted(project)).encode())
    for key in keys:
        path, size, mtime_ns = candidates[key]
        h.update(f"{key}\0{path}\0{size}\0{mtime_ns}\n".encode())
    return h.hexdigest()[:24]


def _save_scan(scan: PythonScan, memo: Path) -> None:
    """Write ``scan`` to ``memo`` atomically (a partial file is never read back)."""
    memo.parent.mkdir(parents=True, exist_ok=True)
    record = {"files": [[str(f.path), f.key, f.size, f.mtime_ns] for f in scan.files], "skipped": scan.skipped}
    tmp = memo.with_name(f".{memo.name}.{os.getpid()}")
    tmp.write_text(json.dumps(record))
    os.replace(tmp, memo)


def _load_scan(memo: Path) -> PythonScan:
    record = json.loads(memo.read_text())
    files = [CorpusFile(path=Path(p), key=k, kind="text", size=size, mtime_ns=mtime) for p, k, size, mtime
             in record["files"]]
    return PythonScan(files=files, skipped=record["skipped"])


def python_files(memo_dir: str | os.PathLike | None = None) -> list[CorpusFile]:
    """The ``"python"`` corpus of the running interpreter: :func:`scan_python_sources` over :func:`python_roots`,
    its result kept in ``memo_dir`` if given."""
    return scan_python_sources(memo_dir=memo_dir).files
