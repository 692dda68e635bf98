"""Yardsticks for held-out bits per byte: what gzip and xz need for the text a validation pass reads.

The first ``n_blocks`` blocks of ``seq_len + 1`` tokens of a prepared corpus's held-out split (the blocks a
single-process validation of ``n_blocks`` reads, in file order), decoded to UTF-8 and compressed whole with
``gzip -9`` and ``xz -9e``. A result is computed once per (corpus, block length, block count) and kept in the
corpus's cache entry (``<cache_dir>/<key>/reference_bpb.json``).
"""

from __future__ import annotations

import gzip
import json
import lzma
import os
from pathlib import Path

import numpy as np
from litdata import StreamingDataset
from litdata.streaming.item_loader import TokensLoader

from k3lit.data.prepare import PreparedCorpus

__all__ = ["compressed_bpb", "validation_text", "reference_bpb"]

CACHE_FILE = "reference_bpb.json"


def compressed_bpb(data: bytes) -> dict[str, float]:
    """``{"gzip -9": bpb, "xz -9e": bpb}``: compressed size of ``data`` in bits per input byte.

    Raises:
        ValueError: ``data`` is empty.
    """
    if not data:
        raise ValueError("compressed_bpb needs at least one byte")
    return {
        "gzip -9": 8 * len(gzip.compress(data, compresslevel=9)) / len(data),
        "xz -9e": 8 * len(lzma.compress(data, preset=9 | lzma.PRESET_EXTREME)) / len(data),
    }


def validation_text(prepared: PreparedCorpus, seq_len: int, n_blocks: int) -> bytes:
    """UTF-8 text of the held-out split's first ``n_blocks`` blocks of ``seq_len + 1`` tokens (fewer if the split
    holds fewer), decoded together (documents joined without their eos tokens)."""
    dataset = StreamingDataset(input_dir=str(prepared.split_dir("val")),
                               item_loader=TokensLoader(block_size=seq_len + 1), shuffle=False)
    n = min(n_blocks, len(dataset))
    ids = np.concatenate([np.asarray(dataset[i]) for i in range(n)]) if n else np.zeros(0, dtype=np.int64)
    return prepared.tokenizer.decode(ids.tolist()).encode("utf-8")


def reference_bpb(prepared: PreparedCorpus, seq_len: int, n_blocks: int) -> dict[str, float]:
    """``{"bytes": n, "gzip -9": bpb, "xz -9e": bpb}`` for :func:`validation_text` (read from the corpus's cache
    entry when computed before; written there otherwise, unless the folder is read-only).

    Raises:
        ValueError: the blocks decode to no text.
    """
    path = Path(prepared.root) / CACHE_FILE
    key = f"{seq_len + 1}x{n_blocks}"
    cached = json.loads(path.read_text()) if path.is_file() else {}
    if key not in cached:
        data = validation_text(prepared, seq_len, n_blocks)
        cached[key] = {"bytes": len(data), **compressed_bpb(data)}
        tmp = path.with_name(f".{CACHE_FILE}.{os.getpid()}")
        try:
            tmp.write_text(json.dumps(cached, indent=1) + "\n")
            os.replace(tmp, path)  # whole file or none: another run may read it meanwhile
        except OSError:  # a read-only cache: computed again next time
            tmp.unlink(missing_ok=True)
    return cached[key]
