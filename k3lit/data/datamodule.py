"""``K3DataModule``: token blocks from a prepared corpus, streamed by litdata.

Resuming: Lightning's fit loop stores ``state_dict()`` of every train dataloader that has ``state_dict`` and
``load_state_dict`` (``StreamingDataLoader`` has both) in the checkpoint under
``loops.fit_loop.state_dict.combined_loader`` and hands it back to the new loader on ``ckpt_path=...``; the
loader then skips the samples already yielded and continues with the next batch of the same shuffled order.
Lightning fetches no batch ahead for loaders with a length (this one has one), so the saved position is exactly
the batches consumed. ``tests/data/test_datamodule.py`` pins this with a real ``Trainer`` run.

Training order: the chunks in a seeded random order, and each chunk's blocks in a full random permutation
(``item_shuffle_window=0``), so each batch mixes its chunk's whole range; with ``shuffle_documents`` (the default)
a chunk is a sample of the whole corpus. litdata's default shuffles a chunk in aligned windows of 256 consecutive
blocks, so that 16 batches of 16 blocks in a row would come from one stretch of a few files. A checkpoint written
under another window resumes with the window it was written with (:class:`_ResumableLoader`), so its order goes
on.

Distributed: litdata reads the rank and world size from ``torch.distributed`` when a ``StreamingDataset`` is
built. The datasets are therefore built in ``train_dataloader``/``val_dataloader`` (after Lightning has set up
the process group), never in ``__init__``, so each rank streams its own share.
"""

from __future__ import annotations

import tempfile
from collections.abc import Sequence
from pathlib import Path

import lightning as L
import numpy as np
import torch
from litdata import StreamingDataLoader, StreamingDataset
from litdata.streaming.item_loader import TokensLoader
from litdata.streaming.shuffle import resolve_item_shuffle_window

from k3lit.data.corpus import Split
from k3lit.data.prepare import PreparedCorpus, prepare_corpus
from k3lit.data.tokenizer import (
    HFTokenizer,
    Tokenizer,
    load_tokenizer,
    parse_tokenizer_spec,
    spec_eos_id,
    spec_vocab_size,
)


def tokenizer_from_state(state: dict) -> Tokenizer:
    """Rebuild the tokenizer saved by :meth:`K3DataModule.state_dict` (e.g. ``checkpoint["K3DataModule"]``)."""
    if state.get("tokenizer_json") is None:
        return load_tokenizer(state["tokenizer_spec"])
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "tokenizer.json"
        path.write_text(state["tokenizer_json"])
        return HFTokenizer(path, spec=state["tokenizer_spec"])


def collate_tokens(items: Sequence[np.ndarray | torch.Tensor]) -> torch.Tensor:
    """Stack ``B`` token blocks (``uint16``/``int32`` arrays ``[seq_len + 1]``) into ``LongTensor [B, seq_len + 1]``."""
    return torch.from_numpy(np.stack([np.asarray(x) for x in items]).astype(np.int64))


class K3DataModule(L.LightningDataModule):
    """Token blocks of ``seq_len + 1`` from a corpus prepared by :func:`k3lit.data.prepare.prepare_corpus`.

    Batches are ``LongTensor [batch_size, seq_len + 1]``; a model trains on ``x[:, :-1] -> x[:, 1:]``. Blocks
    are consecutive, non-overlapping slices of the split's token stream, where documents are joined by the
    tokenizer's eos token; the tail of each chunk shorter than one block is dropped.

    Args:
        corpus: a built-in corpus, or paths to text files (.txt/.md/.py/any text: one document each), ``.jsonl``
            files (field ``"text"``), ``.parquet`` files (column ``"text"``), folders of those, or a list of any
            of these. Built-in, no download: ``"stdlib"``, the running Python's standard library sources without
            tests (731 files, 12 MB on CPython 3.11: for CPU runs; a GPU run goes through it in seconds and
            memorises it); ``"python"``, every ``.py``, ``.pyi``, ``.md`` and ``.rst`` file of the running
            interpreter's installation, the standard library with its tests and the environment's
            ``site-packages`` (the project itself, hidden and cache folders are never read), deduplicated by
            content, without files over 1 MiB, non-UTF-8 or binary files and files with lines over 4096 bytes
            (12,499 files, 195 MB, 53M tokens with ``bpe:16384`` on CPython 3.11 with this project's dependencies:
            for GPU runs; :mod:`k3lit.data.python_corpus`). Both split by file, by a hash of the file's path
            relative to its root, so the same on every machine with the same files.
        tokenizer: ``"byte"`` (UTF-8 bytes + eos, vocabulary 257), ``"bpe:<vocab_size>"`` (byte-level BPE
            trained on the train split when preparing) or a path to a Hugging Face ``tokenizers`` JSON file.
        cache_dir: folder for prepared token chunks; entries are keyed by corpus, tokenizer and split, so
            one folder serves many corpora.
        seq_len: tokens the model sees per sequence (>= 1); blocks hold ``seq_len + 1`` tokens.
        batch_size: sequences per batch on each device (>= 1).
        num_workers: dataloader worker processes (0 = load in the training process).
        val_fraction: fraction of documents held out for validation, in (0, 1); the split hashes each
            document's relative path, so it is the same on every machine and run.
        seed: seed of the training order (shuffled chunks and blocks, new order each epoch).
        prepare_workers: litdata processes used when tokenizing (the chunk layout, hence the training order,
            depends on it; 1 keeps runs reproducible).
        shuffle_documents: tokenize the files in a seeded random order, so each chunk is a sample of the whole
            corpus instead of a stretch of its sorted paths (:func:`k3lit.data.prepare.prepare_corpus`); False:
            sorted by path. Each order has a cache entry of its own.

    Raises:
        ValueError: an argument out of range or an unknown tokenizer spec; the message says what to change.
        FileNotFoundError: a tokenizer JSON path that does not exist (corpus paths are checked when preparing).
    """

    def __init__(
        self,
        corpus: str | list[str] = "stdlib",
        tokenizer: str = "byte",
        cache_dir: str = ".cache/k3lit/data",
        seq_len: int = 256,
        batch_size: int = 16,
        num_workers: int = 0,
        val_fraction: float = 0.05,
        seed: int = 42,
        prepare_workers: int = 1,
        shuffle_documents: bool = True,
    ) -> None:
        super().__init__()
        if isinstance(corpus, str) and not corpus.strip() or not isinstance(corpus, str) and not corpus:
            raise ValueError(
                "`corpus` is empty: use 'stdlib', 'python' or a path (or list of paths) to text/jsonl/parquet data."
            )
        for name, value, low in (
            ("seq_len", seq_len, 1),
            ("batch_size", batch_size, 1),
            ("prepare_workers", prepare_workers, 1),
            ("num_workers", num_workers, 0),
        ):
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise ValueError(f"{name}={value!r} must be an integer >= {low}.")
        if not 0.0 < val_fraction < 1.0:
            raise ValueError(
                f"val_fraction={val_fraction} must be in (0, 1), e.g. 0.05 to hold out 5% of the documents."
            )
        parse_tokenizer_spec(tokenizer)  # raises ValueError naming the accepted forms
        self.save_hyperparameters()
        self.corpus = corpus
        self.tokenizer_spec = tokenizer
        self.cache_dir = cache_dir
        self.seq_len = seq_len
        self.batch_size = batch_size
        self.num_workers = num_workers
        self.val_fraction = val_fraction
        self.seed = seed
        self.prepare_workers = prepare_workers
        self.shuffle_documents = shuffle_documents
        self._vocab_size = spec_vocab_size(tokenizer)  # reads a JSON file, prepares nothing
        self._prepared: PreparedCorpus | None = None

    # -- what the model needs before any data exists --------------------------------------------------------
    @property
    def vocab_size(self) -> int:
        """Embedding size the model needs: 257 for ``byte``, N for ``bpe:N``, max id + 1 for a JSON file."""
        return self._vocab_size

    @property
    def eos_id(self) -> int:
        """The end-of-document id that joins documents in the token stream (:func:`spec_eos_id`)."""
        return spec_eos_id(self.tokenizer_spec)

    # -- things that need the prepared corpus --------------------------------------------------------------
    @property
    def prepared(self) -> PreparedCorpus:
        """The prepared corpus; prepares it on first use if ``prepare_data`` has not run in this process."""
        if self._prepared is None:
            self._prepared = prepare_corpus(
                corpus=self.corpus,
                tokenizer=self.tokenizer_spec,
                cache_dir=self.cache_dir,
                val_fraction=self.val_fraction,
                prepare_workers=self.prepare_workers,
                shuffle_documents=self.shuffle_documents,
            )
        return self._prepared

    @property
    def tokenizer(self) -> Tokenizer:
        """The tokenizer of the prepared tokens (for ``bpe:N`` it is the one trained during prepare)."""
        return self.prepared.tokenizer

    @property
    def val_bytes_per_token(self) -> float:
        """UTF-8 bytes per token of the whole validation split (eos tokens counted as tokens)."""
        return self.prepared.bytes_per_token("val")

    @property
    def token_bytes(self) -> torch.Tensor:
        """int64 ``[vocab_size]``: UTF-8 bytes of text each token id stands for, 0 for eos
        (:meth:`~k3lit.data.tokenizer.Tokenizer.token_bytes`); ``table[targets].sum()`` is the bytes a batch's
        targets encode, the denominator of its bits per byte."""
        return torch.from_numpy(self.tokenizer.token_bytes())

    def state_dict(self) -> dict:
        """Saved in every Lightning checkpoint: the tokenizer itself (its JSON for HF/BPE tokenizers), so a
        checkpoint decodes text without the data cache it was trained from."""
        tok = self.tokenizer
        path = getattr(tok, "path", None)
        return {"tokenizer_spec": tok.spec, "tokenizer_json": path.read_text() if path is not None else None}

    def load_state_dict(self, state: dict) -> None:
        """Nothing to restore: the data position lives in the train loader's own state."""

    def describe(self) -> str:
        """Human-readable summary of the prepared corpus: cache folder, tokenizer, tokens and bytes per split."""
        p = self.prepared
        lines = [
            f"cache: {p.root}",
            f"tokenizer: {p.meta['tokenizer']} (vocab {p.meta['vocab_size']}, eos {p.meta['eos_id']})",
        ]
        for split in ("train", "val"):
            s = p.meta["splits"][split]
            lines.append(
                f"{split}: {s['n_documents']:,} documents, {s['n_tokens']:,} tokens, {s['n_bytes']:,} bytes "
                f"({p.bytes_per_token(split):.3f} bytes/token), {s['n_tokens'] // (self.seq_len + 1):,} blocks of "
                f"{self.seq_len + 1}"
            )
        return "\n".join(lines)

    def prepare_data(self) -> None:
        """Tokenize the corpus into the cache unless a finished entry exists (Lightning: local rank 0 only)."""
        self._prepared = None
        _ = self.prepared

    def setup(self, stage: str | None = None) -> None:
        """Check the prepared splits hold at least one ``seq_len + 1`` block each (every rank)."""
        prepared = self.prepared
        for split in ("train", "val"):
            n = prepared.meta["splits"][split]["n_tokens"]
            if n < self.seq_len + 1:
                raise ValueError(
                    f"The {split} split has {n} tokens, fewer than one block of seq_len + 1 = {self.seq_len + 1}. "
                    f"Lower seq_len, {'raise val_fraction' if split == 'val' else 'lower val_fraction'}, or add "
                    "text to the corpus."
                )

    # -- loaders ------------------------------------------------------------------------------------------
    def _dataset(self, split: Split, shuffle: bool) -> StreamingDataset:
        return StreamingDataset(
            input_dir=str(self.prepared.split_dir(split)),
            item_loader=TokensLoader(block_size=self.seq_len + 1),
            shuffle=shuffle,
            seed=self.seed,
            drop_last=True if shuffle else None,
            item_shuffle_window=FULL_PERMUTATION,
        )

    def _loader(self, split: Split, shuffle: bool) -> StreamingDataLoader:
        return _ResumableLoader(
            self._dataset(split, shuffle),
            batch_size=self.batch_size,
            num_workers=self.num_workers,
            collate_fn=collate_tokens,
            drop_last=shuffle,
            pin_memory=torch.cuda.is_available(),
            persistent_workers=self.num_workers > 0,
        )

    def train_dataloader(self) -> StreamingDataLoader:
        """Shuffled (seeded) full batches ``LongTensor [batch_size, seq_len + 1]``; stateful for resuming."""
        return self._loader("train", shuffle=True)

    def val_dataloader(self) -> StreamingDataLoader:
        """Validation blocks in file order, ``LongTensor [<= batch_size, seq_len + 1]`` (last batch may be short)."""
        return self._loader("val", shuffle=False)


FULL_PERMUTATION = 0
"""litdata's ``item_shuffle_window`` for a full random permutation of each chunk's blocks."""


class _ResumableLoader(StreamingDataLoader):
    """``StreamingDataLoader`` that resumes a checkpoint written under another in-chunk shuffle window (litdata's
    default of 256, before k3lit asked for :data:`FULL_PERMUTATION`) with that window, so the run continues the
    order it started with, where litdata would refuse the state. The dataset's window is litdata's private
    ``_item_shuffle_window`` (litdata 0.2.76), set here only."""

    def load_state_dict(self, obj: dict) -> None:
        saved = (obj.get("dataset") or {}).get("item_shuffle_window")
        if saved is not None and isinstance(self.dataset, StreamingDataset):
            self.dataset.item_shuffle_window = saved
            self.dataset._item_shuffle_window = resolve_item_shuffle_window(saved)
        super().load_state_dict(obj)
