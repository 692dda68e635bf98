import json
import os

import numpy as np
import pytest
from litdata import StreamingDataset
from litdata.streaming.item_loader import TokensLoader

from k3lit.data.prepare import find_prepared, prepare_corpus
from k3lit.data.tokenizer import ByteTokenizer


def _prep(corpus, cache, tokenizer="byte", **kw):
    return prepare_corpus(str(corpus), tokenizer, cache_dir=cache, val_fraction=0.25, verbose=False, **kw)


def _all_tokens(split_dir) -> np.ndarray:
    ds = StreamingDataset(str(split_dir), item_loader=TokensLoader(block_size=1))
    return np.concatenate([np.asarray(ds[i]) for i in range(len(ds))])


def test_prepare_writes_meta_and_tokens(text_corpus, tmp_path):
    p = _prep(text_corpus, tmp_path / "cache")
    meta = json.loads((p.root / "meta.json").read_text())
    assert meta == p.meta and meta["tokenizer"] == "byte" and meta["vocab_size"] == 257 and meta["dtype"] == "uint16"
    total_bytes = sum(f.stat().st_size for f in text_corpus.rglob("*.py"))
    tr, va = meta["splits"]["train"], meta["splits"]["val"]
    assert tr["n_bytes"] + va["n_bytes"] == total_bytes and tr["n_documents"] + va["n_documents"] == 24
    assert tr["n_tokens"] == tr["n_bytes"] + tr["n_documents"]  # byte tokens + one eos per document
    tokens = _all_tokens(p.split_dir("val"))
    assert len(tokens) == va["n_tokens"] and (tokens == 256).sum() == va["n_documents"] and tokens[-1] == 256
    docs = ByteTokenizer().decode(tokens.tolist())
    assert "def " in docs and "héllo" in docs
    assert not list((tmp_path / "cache").glob(".build-*"))  # nothing left behind
    assert find_prepared(str(text_corpus), "byte", tmp_path / "cache", 0.25).root == p.root


def test_second_prepare_reuses_cache(text_corpus, tmp_path):
    first = _prep(text_corpus, tmp_path / "cache")
    marker = (first.root / "meta.json").stat().st_mtime_ns
    again = _prep(text_corpus, tmp_path / "cache")
    assert again.root == first.root and (again.root / "meta.json").stat().st_mtime_ns == marker
    forced = _prep(text_corpus, tmp_path / "cache", force=True)
    assert forced.root == first.root and (forced.root / "meta.json").stat().st_mtime_ns != marker


def test_changed_corpus_or_tokenizer_rebuilds(text_corpus, tmp_path):
    cache = tmp_path / "cache"
    first = _prep(text_corpus, cache)
    f = text_corpus / "pkg0" / "mod_0.py"
    f.write_text(f.read_text() + "# one more line\n")
    changed = _prep(text_corpus, cache)
    assert changed.root != first.root
    assert sum(changed.meta["splits"][s]["n_bytes"] for s in ("train", "val")) == sum(
        first.meta["splits"][s]["n_bytes"] for s in ("train", "val")
    ) + len("# one more line\n")
    bpe = _prep(text_corpus, cache, tokenizer="bpe:300")
    assert bpe.root not in (first.root, changed.root) and (bpe.root / "tokenizer.json").is_file()
    assert bpe.meta["splits"]["train"]["n_tokens"] < changed.meta["splits"]["train"]["n_tokens"]
    assert bpe.tokenizer.vocab_size <= 300 and bpe.tokenizer.spec == "bpe:300"
    # the trained tokenizer is cached with the tokens and decodes them back to the corpus text
    tokens = _all_tokens(bpe.split_dir("train")).tolist()
    text = bpe.tokenizer.decode(tokens)
    assert f.read_text() in text or any(g.read_text() in text for g in text_corpus.rglob("*.py"))
    assert _prep(text_corpus, cache, tokenizer="bpe:300").root == bpe.root
    assert len(list(p for p in cache.iterdir() if not p.name.startswith("."))) == 3


def test_jsonl_prepare(jsonl_file, tmp_path):
    p = _prep(jsonl_file, tmp_path / "cache")
    assert p.meta["splits"]["train"]["n_documents"] + p.meta["splits"]["val"]["n_documents"] == 50


def test_interrupted_build_leaves_no_entry(text_corpus, tmp_path, monkeypatch):
    import k3lit.data.prepare as prep

    def boom(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(prep, "_optimize_split", boom)
    with pytest.raises(KeyboardInterrupt):
        _prep(text_corpus, tmp_path / "cache")
    assert os.listdir(tmp_path / "cache") == []
    monkeypatch.undo()
    assert (_prep(text_corpus, tmp_path / "cache").root / "meta.json").is_file()


def test_prepare_errors(tmp_path, text_corpus):
    with pytest.raises(FileNotFoundError, match="Corpus path"):
        _prep(tmp_path / "missing", tmp_path / "cache")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="no non-empty"):
        _prep(tmp_path / "empty", tmp_path / "cache")
    with pytest.raises(ValueError, match="Unknown tokenizer spec"):
        _prep(text_corpus, tmp_path / "cache", tokenizer="sentencepiece")
    with pytest.raises(ValueError, match="val_fraction"):
        prepare_corpus(str(text_corpus), cache_dir=tmp_path / "cache", val_fraction=0.0)


def test_stdlib_prepare(stdlib_prepared):
    meta = stdlib_prepared.meta
    tr, va = meta["splits"]["train"], meta["splits"]["val"]
    assert tr["n_tokens"] > 1_000_000 and va["n_tokens"] > 50_000 and va["n_documents"] >= 10
    assert 0.99 < stdlib_prepared.bytes_per_token("val") <= 1.0


def test_verbose_prepare_shows_progress_and_leaves_no_counters(text_corpus, tmp_path, capsys):
    p = prepare_corpus(str(text_corpus), "byte", cache_dir=tmp_path / "cache", val_fraction=0.25, prepare_workers=2)
    out = capsys.readouterr().out
    assert "24 files: train" in out and "tokenizing train (2 workers)" in out and "tokenizing val" in out
    assert "24/24" in out  # the bar reached every file of the corpus in each split
    assert not list(p.root.rglob(".done-*")) and f"-> {p.root}" in out


def test_shuffled_documents_are_the_same_documents_in_a_seeded_order(text_corpus, tmp_path):
    """`shuffle_documents` (the default): a cache entry of its own holding each split's documents, the same ones as
    in path order, in an order that is not the sorted one and is the same on a second build."""
    from k3lit.data import K3DataModule

    ordered = _prep(text_corpus, tmp_path / "cache", shuffle_documents=False)
    shuffled = _prep(text_corpus, tmp_path / "cache")  # the default
    again = _prep(text_corpus, tmp_path / "other")
    assert shuffled.root != ordered.root
    assert shuffled.meta["shuffle_documents"] and not ordered.meta["shuffle_documents"]
    assert find_prepared(str(text_corpus), "byte", tmp_path / "cache", 0.25).root == shuffled.root
    for split in ("train", "val"):
        assert shuffled.meta["splits"][split] == ordered.meta["splits"][split]
        a, b = _all_tokens(ordered.split_dir(split)), _all_tokens(shuffled.split_dir(split))
        docs_a, docs_b = _split_docs(a), _split_docs(b)
        assert sorted(docs_a) == sorted(docs_b) and len(docs_a) > 2
        assert np.array_equal(b, _all_tokens(again.split_dir(split)))
    assert _split_docs(_all_tokens(ordered.split_dir("train"))) != _split_docs(_all_tokens(shuffled.split_dir("train")))
    dm = K3DataModule(corpus=str(text_corpus), cache_dir=str(tmp_path / "cache"), val_fraction=0.25,
                      shuffle_documents=False)
    assert dm.prepared.root == ordered.root


def _split_docs(tokens: np.ndarray) -> list[tuple[int, ...]]:
    """A split's documents as token tuples (each ends with the eos token, 256)."""
    ends = np.flatnonzero(tokens == 256)
    return [tuple(d.tolist()) for d in np.split(tokens, ends + 1) if len(d)]
