"""Prepare a corpus: tokenize each split with ``litdata.optimize`` into ``TokensLoader`` chunks, once.

Cache layout (``<cache_dir>/<key>/``)::

    meta.json        counts per split, tokenizer spec, vocab size, eos id, token dtype (written last)
    tokenizer.json   the trained tokenizer, for ``bpe:N`` specs only
    train/, val/     litdata chunks (``index.json`` + ``chunk-*.bin``), documents joined by the eos token

``key`` hashes the format version, the corpus (every file's path, size and mtime), ``val_fraction``, the
tokenizer (its fingerprint; for ``bpe:N`` the spec and the ``tokenizers`` version, as the BPE is trained from
the corpus) and, when set, the shuffled file order. A second run with the same inputs finds ``meta.json`` and
returns at once; touching, adding or removing a corpus file, or changing the tokenizer, gives a new key and a
fresh build. A build is written into
``<cache_dir>/.build-<key>-<pid>/`` and renamed into place at the end, so an interrupted prepare never leaves
a half-written cache entry (the leftover build folder is removed by the next prepare). The ``"python"`` corpus keeps
its scan of the installed sources beside the entries (``python-scan-<fingerprint>.json``), so finding an entry
again walks the folders but reads no source file.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import multiprocessing
import os
import random
import shutil
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np
import tokenizers
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

from k3lit.data.corpus import Split, doc_hash, iter_documents, iter_split, resolve_corpus, split_cut
from k3lit.data.corpus_file import CorpusFile
from k3lit.data.tokenizer import HFTokenizer, Tokenizer, load_tokenizer, parse_tokenizer_spec

FORMAT_VERSION = 1
"""Bump when the cache layout or the tokenization changes; old entries are then ignored."""

META_FILE = "meta.json"
SPLITS: tuple[Split, Split] = ("train", "val")
_CHUNK_TOKENS = 1 << 24  # 16 Mi tokens per chunk: 32 MiB as uint16; TokensLoader drops < 1 block per chunk
DOCUMENT_ORDER_SEED = 20261205  # of the file permutation of ``shuffle_documents``


@dataclass(frozen=True)
class PreparedCorpus:
    """A finished cache entry.

    Attributes:
        root: the entry's folder, ``<cache_dir>/<key>``.
        meta: contents of ``meta.json`` (see :func:`prepare_corpus`).
    """

    root: Path
    meta: dict[str, Any]

    def split_dir(self, split: Split) -> Path:
        """Folder of the litdata chunks of ``split`` (give it to ``StreamingDataset``)."""
        return self.root / split

    @property
    def key(self) -> str:
        return self.root.name

    @property
    def vocab_size(self) -> int:
        return int(self.meta["vocab_size"])

    def bytes_per_token(self, split: Split = "val") -> float:
        """UTF-8 bytes of text per token in ``split`` (eos tokens counted as tokens)."""
        s = self.meta["splits"][split]
        return s["n_bytes"] / s["n_tokens"]

    @cached_property
    def tokenizer(self) -> Tokenizer:
        """The tokenizer the tokens were made with."""
        return _tokenizer_for_entry(self.meta["tokenizer"], self.root)


def _tokenizer_for_entry(spec: str, root: Path) -> Tokenizer:
    kind, _ = parse_tokenizer_spec(spec)
    if kind == "bpe":
        return HFTokenizer(root / "tokenizer.json", spec=spec)
    return load_tokenizer(spec)


def _corpus_fingerprint(files: Sequence[CorpusFile]) -> str:
    h = hashlib.sha256()
    for f in files:
        h.update(f"{f.path}\0{f.key}\0{f.kind}\0{f.size}\0{f.mtime_ns}\n".encode())
    return h.hexdigest()


def _tokenizer_key(spec: str) -> str:
    kind, _ = parse_tokenizer_spec(spec)
    if kind == "bpe":  # trained from the corpus, which is already in the key
        return f"{spec}|tokenizers={tokenizers.__version__}"
    return load_tokenizer(spec).fingerprint()


def cache_key(files: Sequence[CorpusFile], tokenizer: str, val_fraction: float, shuffle_documents: bool) -> str:
    """Name of the cache entry for these inputs (24 hex digits; entries in file order keep the key they had before
    the order was a setting)."""
    fields = {"format": FORMAT_VERSION, "corpus": _corpus_fingerprint(files), "val_fraction": val_fraction,
              "tokenizer": _tokenizer_key(tokenizer)}
    if shuffle_documents:
        fields["order"] = f"shuffled:{DOCUMENT_ORDER_SEED}"
    return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:24]


def file_order(n_files: int, shuffle_documents: bool) -> list[int]:
    """The order in which the corpus's files (sorted by key) are tokenized into the chunks: as sorted, or a
    permutation seeded by :data:`DOCUMENT_ORDER_SEED` (the same on every machine)."""
    order = list(range(n_files))
    if shuffle_documents:
        random.Random(DOCUMENT_ORDER_SEED).shuffle(order)
    return order


def find_prepared(
    corpus: str | Sequence[str] = "stdlib",
    tokenizer: str = "byte",
    cache_dir: str | os.PathLike = ".cache/k3lit/data",
    val_fraction: float = 0.05,
    shuffle_documents: bool = True,
) -> PreparedCorpus | None:
    """The finished cache entry for these arguments, or ``None`` if it must be built. Reads no documents."""
    files = resolve_corpus(corpus, memo_dir=cache_dir)
    root = Path(cache_dir) / cache_key(files, tokenizer, val_fraction, shuffle_documents)
    meta_path = root / META_FILE
    if not meta_path.is_file():
        return None
    return PreparedCorpus(root=root, meta=json.loads(meta_path.read_text()))


def _token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16) if vocab_size <= np.iinfo(np.uint16).max + 1 else np.dtype(np.int32)


class _TokenizeFile:
    """``litdata.optimize`` worker function: file index -> token arrays of its documents in one split.

    Picklable (a plain object with paths and ints), so it works with the ``spawn`` start method; the tokenizer
    is loaded once per worker process. With ``done_path`` each finished file appends one byte to that file, which
    the preparing process reads for its progress bar (any start method, any number of workers).
    """

    def __init__(
        self,
        files: list[CorpusFile],
        split: Split,
        cut: int,
        spec: str,
        root: str,
        dtype: str,
        done_path: str | None = None,
    ) -> None:
        self.files, self.split, self.cut, self.spec, self.root, self.dtype = files, split, cut, spec, root, dtype
        self.done_path = done_path
        self._tok: Tokenizer | None = None

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_tok": None}

    def __call__(self, index: int):
        if self._tok is None:
            self._tok = _tokenizer_for_entry(self.spec, Path(self.root))
        want_val = self.split == "val"
        texts = [t for key, t in iter_documents(self.files[index]) if (doc_hash(key) < self.cut) == want_val]
        eos = self._tok.eos_id
        for start in range(0, len(texts), 256):  # batch for the parallel HF encoder, bound memory for big files
            for ids in self._tok.encode_batch(texts[start : start + 256]):
                ids.append(eos)
                yield np.asarray(ids, dtype=self.dtype)
        if self.done_path is not None:
            with open(self.done_path, "ab") as f:
                f.write(b"\0")


@contextlib.contextmanager
def _files_progress(description: str, total: int, done_path: Path, enabled: bool) -> Iterator[None]:
    """A rich progress bar of ``total`` files while the body runs, advanced by the size of ``done_path`` (bytes
    appended by :class:`_TokenizeFile`). Does nothing unless ``enabled``."""
    if not enabled:
        yield
        return
    def done() -> int:
        return done_path.stat().st_size if done_path.exists() else 0

    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
               TimeRemainingColumn())
    with Progress(*columns) as bar:
        task = bar.add_task(description, total=total)
        stop = threading.Event()

        def poll() -> None:
            while not stop.wait(0.25):
                bar.update(task, completed=done())

        poller = threading.Thread(target=poll, daemon=True)
        poller.start()
        try:
            yield
        finally:
            stop.set()
            poller.join()
            bar.update(task, completed=done())


def _remove_stale_builds(cache_dir: Path) -> None:
    for p in cache_dir.glob(".build-*"):
        try:
            pid = int(p.name.rsplit("-", 1)[1])
            os.kill(pid, 0)  # raises if that process is gone
        except (ValueError, IndexError, ProcessLookupError):
            shutil.rmtree(p, ignore_errors=True)
        except PermissionError:  # alive, someone else's
            pass


def _optimize_split(fn: _TokenizeFile, inputs: list[int], out: Path, workers: int, start_method: str) -> None:
    import litdata
    from litdata.streaming.item_loader import TokensLoader

    # litdata wipes its scratch folders (default: <tmp>/chunks, <tmp>/data) at start and sets the global
    # multiprocessing start method: keep the scratch private to this build and restore the start method.
    scratch = out.parent / f".scratch-{out.name}"
    saved_env = {k: os.environ.get(k) for k in ("DATA_OPTIMIZER_CACHE_FOLDER", "DATA_OPTIMIZER_DATA_CACHE_FOLDER")}
    saved_method = multiprocessing.get_start_method(allow_none=True)
    os.environ["DATA_OPTIMIZER_CACHE_FOLDER"] = str(scratch / "chunks")
    os.environ["DATA_OPTIMIZER_DATA_CACHE_FOLDER"] = str(scratch / "data")
    try:
        litdata.optimize(
            fn=fn,
            inputs=inputs,
            output_dir=str(out),
            chunk_size=_CHUNK_TOKENS,
            item_loader=TokensLoader(),
            num_workers=workers,
            reorder_files=False,
            keep_data_ordered=True,
            start_method=start_method,
            verbose=False,
        )
    finally:
        for k, v in saved_env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        multiprocessing.set_start_method(saved_method, force=True)
        shutil.rmtree(scratch, ignore_errors=True)


def _count_tokens(split_dir: Path) -> int:
    index = json.loads((split_dir / "index.json").read_text())
    return sum(int(c["dim"]) for c in index["chunks"])


def prepare_corpus(
    corpus: str | Sequence[str] = "stdlib",
    tokenizer: str = "byte",
    cache_dir: str | os.PathLike = ".cache/k3lit/data",
    val_fraction: float = 0.05,
    prepare_workers: int = 1,
    shuffle_documents: bool = True,
    start_method: str | None = None,
    force: bool = False,
    verbose: bool = True,
) -> PreparedCorpus:
    """Tokenize ``corpus`` into litdata ``TokensLoader`` chunks under ``cache_dir``, or reuse a finished entry.

    Arguments match :class:`k3lit.data.K3DataModule` so a ``k3lit prepare`` command can pass them straight on.

    Args:
        corpus: ``"stdlib"``, paths to text/jsonl/parquet files or folders, or a list of those
            (see :func:`k3lit.data.corpus.resolve_corpus`).
        tokenizer: ``"byte"``, ``"bpe:<vocab_size>"`` (trained here on the train split, saved in the entry) or a
            path to a ``tokenizers`` JSON file.
        cache_dir: parent folder of the cache entries.
        val_fraction: expected fraction of documents held out for validation, in (0, 1).
        prepare_workers: litdata worker processes. Chunk order (and so the shuffled stream) depends on it; the
            default 1 keeps it reproducible, HF tokenizers still encode on all cores inside that worker.
        shuffle_documents: tokenize the files in a seeded random order (:func:`file_order`; False: sorted by
            key). A chunk (16 Mi tokens) then holds a sample of the whole corpus rather than one stretch of its
            sorted folders, so training, which reads one or two chunks at a time, sees the corpus's mix throughout,
            and a validation pass over the split's first blocks reads a random sample of the held-out files. Each
            order has its own cache entry; the split into train and validation is the same.
        start_method: multiprocessing start method of litdata's workers. ``None``: ``"fork"`` on Linux (starts
            at once; the workers only run numpy and ``tokenizers``, never torch ops, so forking a process with
            torch's thread pool up is safe), else ``"spawn"`` (about 5 s per split to start, and the calling
            script needs an ``if __name__ == "__main__":`` guard).
        force: rebuild even if a finished entry exists.
        verbose: print the corpus size before, a progress bar of the files tokenized per split (rich; on a
            terminal also the BPE trainer's bars) and one line about what was done.

    Returns:
        The entry. ``meta`` holds ``format_version``, ``key``, ``corpus`` (the spec), ``n_files``, ``tokenizer``
        (spec), ``tokenizer_fingerprint``, ``vocab_size``, ``eos_id``, ``dtype``, ``val_fraction``,
        ``val_cut`` and ``splits = {"train"|"val": {"n_tokens", "n_bytes", "n_documents"}}`` where ``n_bytes``
        counts UTF-8 bytes of document text and ``n_tokens`` includes one eos per document.

    Raises:
        FileNotFoundError: a corpus path or tokenizer file does not exist.
        ValueError: bad ``val_fraction``, tokenizer spec or ``prepare_workers``; an empty corpus; a corpus with
            fewer than two documents; a malformed jsonl line or parquet file.
    """
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"val_fraction={val_fraction} must be in (0, 1), e.g. 0.05 for 5% of the documents.")
    if prepare_workers < 1:
        raise ValueError(f"prepare_workers={prepare_workers} must be >= 1.")
    parse_tokenizer_spec(tokenizer)
    if start_method is None:
        start_method = "fork" if sys.platform == "linux" else "spawn"
    t0 = time.perf_counter()
    files = resolve_corpus(corpus, memo_dir=cache_dir)
    cache_dir = Path(cache_dir)
    key = cache_key(files, tokenizer, val_fraction, shuffle_documents)
    root = cache_dir / key
    if (root / META_FILE).is_file() and not force:
        return PreparedCorpus(root=root, meta=json.loads((root / META_FILE).read_text()))

    cache_dir.mkdir(parents=True, exist_ok=True)
    _remove_stale_builds(cache_dir)
    build = cache_dir / f".build-{key}-{os.getpid()}"
    shutil.rmtree(build, ignore_errors=True)
    build.mkdir()
    try:
        cut = split_cut(files, val_fraction)
        stats = {s: {"n_tokens": 0, "n_bytes": 0, "n_documents": 0} for s in SPLITS}
        for file in files:
            for doc_key, text in iter_documents(file):
                s = stats["val" if doc_hash(doc_key) < cut else "train"]
                s["n_bytes"] += len(text.encode("utf-8"))
                s["n_documents"] += 1

        kind, _ = parse_tokenizer_spec(tokenizer)
        if verbose:
            sizes = ", ".join(f"{s} {v['n_bytes'] / 1e6:,.1f} MB ({v['n_documents']:,} docs)" for s, v in stats.items())
            training = "; training the BPE on the train split" if kind == "bpe" else ""
            print(f"k3lit prepare: {len(files):,} files: {sizes}{training}", flush=True)
        tok = load_tokenizer(
            tokenizer,
            bpe_path=build / "tokenizer.json" if kind == "bpe" else None,
            train_texts=iter_split(files, "train", cut) if kind == "bpe" else None,
            show_progress=verbose and sys.stderr.isatty(),
        )
        dtype = _token_dtype(tok.vocab_size)
        for split in SPLITS:
            done_path = build / f".done-{split}"
            fn = _TokenizeFile(
                files, split, cut, tokenizer, str(build), dtype.name, str(done_path) if verbose else None
            )
            label = f"tokenizing {split} ({prepare_workers} worker{'s' if prepare_workers > 1 else ''})"
            with _files_progress(label, len(files), done_path, verbose):
                _optimize_split(fn, file_order(len(files), shuffle_documents), build / split, prepare_workers,
                                start_method)
            done_path.unlink(missing_ok=True)
            stats[split]["n_tokens"] = _count_tokens(build / split)

        meta = {
            "format_version": FORMAT_VERSION,
            "key": key,
            "corpus": corpus if isinstance(corpus, str) else list(corpus),
            "n_files": len(files),
            "tokenizer": tokenizer,
            "tokenizer_fingerprint": tok.fingerprint(),
            "vocab_size": tok.vocab_size,
            "eos_id": tok.eos_id,
            "dtype": dtype.name,
            "val_fraction": val_fraction,
            "val_cut": cut,
            "shuffle_documents": shuffle_documents,
            "splits": stats,
            "build_seconds": round(time.perf_counter() - t0, 3),
        }
        (build / META_FILE).write_text(json.dumps(meta, indent=2) + "\n")
        if root.exists():  # force=True, or another process finished the same entry meanwhile
            shutil.rmtree(root, ignore_errors=True)
        try:
            os.replace(build, root)
        except OSError:
            if not (root / META_FILE).is_file():  # lost a race to a finished entry: use it, else re-raise
                raise
    finally:
        shutil.rmtree(build, ignore_errors=True)
    if verbose:
        tr, va = stats["train"], stats["val"]
        print(
            f"k3lit prepare: {len(files)} files -> {root} in {meta['build_seconds']:.1f}s; "
            f"train {tr['n_tokens']:,} tokens ({tr['n_documents']} docs), val {va['n_tokens']:,} tokens "
            f"({va['n_documents']} docs), {stats['val']['n_bytes'] / max(1, va['n_tokens']):.3f} bytes/token"
        )
    return PreparedCorpus(root=root, meta=meta)
