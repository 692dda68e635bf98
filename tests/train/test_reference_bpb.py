"""gzip and xz on the validation text: bits per byte, the decoded blocks, and the cache per corpus."""

import json
import os

import pytest

from k3lit.data.prepare import find_prepared
from k3lit.train import reference_bpb as ref


def test_compressed_bpb_of_repetitive_and_random_bytes():
    assert all(v < 0.1 for v in ref.compressed_bpb(b"abcd" * 10_000).values())
    assert all(v > 7.9 for v in ref.compressed_bpb(os.urandom(50_000)).values())  # incompressible: >= 8 bits
    with pytest.raises(ValueError, match="at least one byte"):
        ref.compressed_bpb(b"")


def test_validation_text_is_the_first_blocks_of_the_split(stdlib_cache):
    prepared = find_prepared("stdlib", "byte", stdlib_cache, 0.05)
    text = ref.validation_text(prepared, seq_len=63, n_blocks=3)
    whole = ref.validation_text(prepared, seq_len=63 * 3 + 2, n_blocks=1)  # the same 192 tokens as one block
    assert text == whole and 0 < len(text) <= 3 * 64  # byte tokenizer: a byte per token, eos tokens dropped


def test_reference_is_computed_once_per_corpus_and_block_count(stdlib_cache, monkeypatch):
    prepared = find_prepared("stdlib", "byte", stdlib_cache, 0.05)
    first = ref.reference_bpb(prepared, seq_len=31, n_blocks=5)
    assert first["bytes"] == len(ref.validation_text(prepared, 31, 5))
    assert json.loads((prepared.root / ref.CACHE_FILE).read_text())["32x5"] == first

    def no_second_compression(data: bytes) -> dict:
        raise AssertionError("compressed again")

    monkeypatch.setattr(ref, "compressed_bpb", no_second_compression)
    assert ref.reference_bpb(prepared, seq_len=31, n_blocks=5) == first
    with pytest.raises(AssertionError, match="compressed again"):  # another block count is another text
        ref.reference_bpb(prepared, seq_len=31, n_blocks=6)
