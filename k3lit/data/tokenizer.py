"""Tokenizers: a built-in byte-level one, any Hugging Face ``tokenizers`` JSON file, and BPE training.

A tokenizer spec is one string, the same in a recipe, on the command line and in ``meta.json``:

- ``"byte"``: UTF-8 bytes ``0..255`` plus one end-of-document token ``256`` (vocabulary 257).
- ``"bpe:<vocab_size>"``: a byte-level BPE trained on the corpus' train split during ``prepare`` and cached
  next to the tokens (see :mod:`k3lit.data.prepare`).
- a path to a ``tokenizer.json`` written by the Hugging Face ``tokenizers`` library.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from abc import ABC, abstractmethod
from collections.abc import Iterable, Iterator
from pathlib import Path

import numpy as np
import tokenizers
from tokenizers import decoders, models, pre_tokenizers, trainers

EOS_TOKEN = "<|endoftext|>"
"""End-of-document token that :func:`train_bpe` adds; also the first name :class:`HFTokenizer` looks for."""

_EOS_CANDIDATES = (EOS_TOKEN, "</s>", "<eos>", "<|end_of_text|>", "<|eot_id|>", "[SEP]", "<|im_end|>")
_MIN_BPE_VOCAB = 257  # 256 byte symbols of the byte-level alphabet + the end-of-document token


class Tokenizer(ABC):
    """What the data pipeline needs from a tokenizer.

    Ids are plain Python ints in ``[0, vocab_size)``; ``eos_id`` separates documents in the token stream.
    """

    spec: str
    """The spec string this tokenizer was loaded from (``"byte"``, ``"bpe:N"`` or a path)."""

    @property
    @abstractmethod
    def vocab_size(self) -> int:
        """Number of ids the model's embedding must cover (max id + 1)."""

    @property
    @abstractmethod
    def eos_id(self) -> int:
        """Id of the end-of-document token."""

    @abstractmethod
    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``, without any end-of-document token."""

    @abstractmethod
    def decode(self, ids: Iterable[int]) -> str:
        """Text of ``ids``; special tokens (such as eos) are dropped, invalid UTF-8 becomes U+FFFD."""

    @abstractmethod
    def fingerprint(self) -> str:
        """Stable hex digest of everything that determines ``encode``; used in cache keys."""

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """``[encode(t) for t in texts]``; subclasses may do it in parallel."""
        return [self.encode(t) for t in texts]

    @abstractmethod
    def token_bytes(self) -> np.ndarray:
        """UTF-8 bytes of text each id stands for: ``int64 [vocab_size]``, 0 for eos and other special tokens.

        Summed over a document's ids it gives the document's UTF-8 length, the ``n_bytes`` that prepare counts
        (:mod:`k3lit.data.prepare`), so bits per byte over any set of tokens is ``sum(nats) / ln 2 /
        sum(token_bytes[ids])``."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}(spec={self.spec!r}, vocab_size={self.vocab_size}, eos_id={self.eos_id})"


class ByteTokenizer(Tokenizer):
    """UTF-8 bytes as ids ``0..255``; id ``256`` ends a document. Needs no files and no training."""

    spec = "byte"

    @property
    def vocab_size(self) -> int:
        return 257

    @property
    def eos_id(self) -> int:
        return 256

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Iterable[int]) -> str:
        return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")

    def token_bytes(self) -> np.ndarray:
        table = np.ones(self.vocab_size, dtype=np.int64)
        table[self.eos_id] = 0
        return table

    def fingerprint(self) -> str:
        return hashlib.sha256(b"k3lit-byte-tokenizer-v1").hexdigest()


class HFTokenizer(Tokenizer):
    """Any tokenizer saved as JSON by the Hugging Face ``tokenizers`` library.

    Args:
        path: the ``tokenizer.json`` file.
        eos_token: name of the end-of-document token; by default the first of ``<|endoftext|>``, ``</s>``,
            ``<eos>``, ``<|end_of_text|>``, ``<|eot_id|>``, ``[SEP]``, ``<|im_end|>`` present in the vocabulary.
        spec: spec string to report (defaults to ``path``).

    Raises:
        FileNotFoundError: ``path`` does not exist.
        ValueError: the file is not a tokenizer JSON, or it has no end-of-document token.
    """

    def __init__(self, path: str | os.PathLike, eos_token: str | None = None, spec: str | None = None) -> None:
        self.path = Path(path)
        if not self.path.is_file():
            raise FileNotFoundError(
                f"Tokenizer file {str(self.path)!r} does not exist. Set `tokenizer` to an existing tokenizer.json, "
                "'byte', or 'bpe:<vocab_size>'."
            )
        try:
            self._tok = tokenizers.Tokenizer.from_file(str(self.path))
        except Exception as err:  # the Rust side raises a bare Exception on malformed JSON
            raise ValueError(
                f"{str(self.path)!r} is not a Hugging Face `tokenizers` JSON file ({err}). Point `tokenizer` at a "
                "tokenizer.json saved by `tokenizers.Tokenizer.save`, or use 'byte' / 'bpe:<vocab_size>'."
            ) from err
        self.spec = spec if spec is not None else str(path)
        vocab = self._tok.get_vocab(with_added_tokens=True)
        names = (eos_token,) if eos_token is not None else _EOS_CANDIDATES
        found = [vocab[n] for n in names if n in vocab]
        if not found:
            raise ValueError(
                f"Tokenizer {str(self.path)!r} has no end-of-document token (looked for {list(names)}). Add one to "
                "the tokenizer (e.g. as a special token) or name it with `eos_token`."
            )
        self._eos_id = found[0]
        self._vocab_size = max(vocab.values()) + 1
        self._fingerprint = hashlib.sha256(self.path.read_bytes() + f"\0eos={self._eos_id}".encode()).hexdigest()

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    @property
    def eos_id(self) -> int:
        return self._eos_id

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [e.ids for e in self._tok.encode_batch(texts, add_special_tokens=False)]

    def decode(self, ids: Iterable[int]) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=True)

    def token_bytes(self) -> np.ndarray:
        """See :meth:`Tokenizer.token_bytes`. Exact for byte-level tokenizers (``ByteLevel`` decoder, as
        ``bpe:N`` trains): each character of a vocabulary entry stands for one byte. Other tokenizers count the
        UTF-8 bytes of each id decoded alone, which over- or under-counts ids that hold part of a character
        (byte-fallback pieces) or whose text the decoder changes in context (a leading-space marker)."""
        table = np.zeros(self.vocab_size, dtype=np.int64)
        added = self._tok.get_added_tokens_decoder()  # id -> AddedToken: specials stand for no text
        byte_level = isinstance(self._tok.decoder, decoders.ByteLevel)
        for token, i in self._tok.get_vocab(with_added_tokens=True).items():
            if i in added:
                table[i] = 0 if added[i].special else len(token.encode("utf-8"))
            else:
                table[i] = len(token) if byte_level else len(self.decode([i]).encode("utf-8"))
        return table

    def fingerprint(self) -> str:
        return self._fingerprint


def train_bpe(
    texts: Iterable[str] | Iterator[str], vocab_size: int, path: str | os.PathLike, show_progress: bool = False
) -> HFTokenizer:
    """Train a byte-level BPE (GPT-2 style pre-tokenization) and save it as a ``tokenizers`` JSON file.

    The vocabulary holds the 256 byte symbols, the end-of-document token :data:`EOS_TOKEN` (id 0) and up to
    ``vocab_size - 257`` merges; a small corpus may yield fewer merges than asked for, so the saved tokenizer's
    ``vocab_size`` is ``<= vocab_size``. Training uses all cores through the Rust library.

    Args:
        texts: documents (one string each); consumed once.
        vocab_size: requested vocabulary size, at least 257.
        path: where to write the JSON; written atomically (temporary file, then rename).
        show_progress: show the ``tokenizers`` trainer's progress bars (stderr, on a terminal only).

    Returns:
        The trained tokenizer, loaded from ``path``.

    Raises:
        ValueError: ``vocab_size`` < 257.
    """
    if vocab_size < _MIN_BPE_VOCAB:
        raise ValueError(
            f"BPE vocab_size={vocab_size} is too small: a byte-level BPE needs 256 byte symbols plus the "
            f"end-of-document token. Use 'bpe:<N>' with N >= {_MIN_BPE_VOCAB} (e.g. 'bpe:4096') or 'byte'."
        )
    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=show_progress,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        tok.save(tmp)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return HFTokenizer(path, eos_token=EOS_TOKEN, spec=f"bpe:{vocab_size}")


def parse_tokenizer_spec(spec: str) -> tuple[str, str | int | None]:
    """Split a tokenizer spec into ``(kind, arg)``: ``("byte", None)``, ``("bpe", N)`` or ``("file", path)``.

    Only the form is checked here (a file spec must end in ``.json``); existence is checked when loading.

    Raises:
        ValueError: the spec is none of the three forms, or ``bpe:N`` has a bad N.
    """
    if not isinstance(spec, str) or not spec.strip():
        raise ValueError(f"Tokenizer spec must be a non-empty string, got {spec!r}. {_SPEC_HELP}")
    spec = spec.strip()
    if spec == "byte":
        return "byte", None
    if spec.startswith("bpe:"):
        arg = spec[4:]
        if not arg.isdigit():
            raise ValueError(f"Tokenizer spec {spec!r}: the part after 'bpe:' must be an integer. {_SPEC_HELP}")
        n = int(arg)
        if n < _MIN_BPE_VOCAB:
            raise ValueError(
                f"Tokenizer spec {spec!r}: a byte-level BPE needs vocab_size >= {_MIN_BPE_VOCAB} (256 bytes + eos)."
                f" {_SPEC_HELP}"
            )
        return "bpe", n
    if spec.endswith(".json"):
        return "file", spec
    raise ValueError(f"Unknown tokenizer spec {spec!r}. {_SPEC_HELP}")


_SPEC_HELP = "Use 'byte', 'bpe:<vocab_size>' (e.g. 'bpe:4096'), or a path to a tokenizers JSON file (*.json)."


def spec_vocab_size(spec: str) -> int:
    """Vocabulary size a model needs for ``spec``, known without preparing any data.

    ``byte``: 257. ``bpe:N``: N (the trained tokenizer may use fewer ids, never more). A JSON file: read from it.

    Raises:
        ValueError: bad spec (see :func:`parse_tokenizer_spec`).
        FileNotFoundError: the JSON file does not exist.
    """
    kind, arg = parse_tokenizer_spec(spec)
    if kind == "byte":
        return ByteTokenizer().vocab_size
    if kind == "bpe":
        return int(arg)  # type: ignore[arg-type]
    return HFTokenizer(str(arg)).vocab_size


def spec_eos_id(spec: str) -> int:
    """End-of-document id of ``spec``, known without preparing any data: ``byte``: 256; ``bpe:N``: 0 (:func:`train_bpe`
    puts :data:`EOS_TOKEN` first); a JSON file: read from it.

    Raises:
        ValueError: bad spec (see :func:`parse_tokenizer_spec`), or a JSON file without an end-of-document token.
        FileNotFoundError: the JSON file does not exist.
    """
    kind, arg = parse_tokenizer_spec(spec)
    if kind == "byte":
        return ByteTokenizer().eos_id
    if kind == "bpe":
        return 0
    return HFTokenizer(str(arg)).eos_id


def load_tokenizer(
    spec: str,
    bpe_path: str | os.PathLike | None = None,
    train_texts: Iterable[str] | None = None,
    show_progress: bool = False,
) -> Tokenizer:
    """Build the tokenizer named by ``spec``.

    Args:
        spec: ``"byte"``, ``"bpe:<vocab_size>"`` or a path to a ``tokenizers`` JSON file.
        bpe_path: for ``bpe:N`` only: where the trained tokenizer lives (``prepare`` puts it in the data cache).
            Loaded if it exists, otherwise trained on ``train_texts`` and saved there.
        train_texts: for ``bpe:N`` only: documents to train on when ``bpe_path`` does not exist yet.
        show_progress: for ``bpe:N`` only: show the trainer's progress bars while training.

    Raises:
        ValueError: bad spec; or ``bpe:N`` with neither an existing ``bpe_path`` nor ``train_texts``.
        FileNotFoundError: a JSON spec naming a missing file.
    """
    kind, arg = parse_tokenizer_spec(spec)
    if kind == "byte":
        return ByteTokenizer()
    if kind == "file":
        return HFTokenizer(str(arg))
    if bpe_path is not None and Path(bpe_path).is_file():
        return HFTokenizer(bpe_path, eos_token=EOS_TOKEN, spec=spec)
    if bpe_path is None or train_texts is None:
        raise ValueError(
            f"Tokenizer {spec!r} is trained on the corpus: run `k3lit prepare` (or `prepare_corpus`) first, or pass "
            "both `bpe_path` and `train_texts`."
        )
    return train_bpe(train_texts, int(arg), bpe_path, show_progress)  # type: ignore[arg-type]
