import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from k3lit.data.corpus import (
    doc_hash,
    iter_documents,
    iter_split,
    resolve_corpus,
    split_cut,
    split_of,
)
from k3lit.data.stdlib_corpus import stdlib_files, stdlib_root


def test_split_is_deterministic_and_disjoint(text_corpus):
    files = resolve_corpus(str(text_corpus))
    cut = split_cut(files, 0.25)
    train = set(iter_split(files, "train", cut))
    val = set(iter_split(files, "val", cut))
    assert train and val and not train & val
    assert len(train) + len(val) == len(files)
    # same answer from a fresh resolve and from the key alone: no dependence on order, machine or run
    assert [split_of(f.key, 0.25) for f in files] == [split_of(f.key, 0.25) for f in resolve_corpus(str(text_corpus))]
    assert split_of("pkg0/mod_0.py", 0.25) == split_of("pkg0/mod_0.py", 0.25)
    assert [doc_hash(k) for k in ("a", "b")] == [0xCA978112CA1BBDCA, 0x3E23E8160039594A]  # pinned sha256 prefix


def test_split_keeps_files_in_place_when_corpus_grows(text_corpus):
    before = {f.key: split_of(f.key, 0.3) for f in resolve_corpus(str(text_corpus))}
    (text_corpus / "extra.txt").write_text("more text\n")
    after = {f.key: split_of(f.key, 0.3) for f in resolve_corpus(str(text_corpus))}
    assert all(after[k] == v for k, v in before.items())


def test_tiny_corpus_still_gets_both_splits(tmp_path):
    for i in range(3):
        (tmp_path / f"f{i}.txt").write_text(f"doc {i}\n")
    files = resolve_corpus(str(tmp_path))
    for frac in (0.001, 0.999):
        cut = split_cut(files, frac)
        assert len(list(iter_split(files, "val", cut))) >= 1 and len(list(iter_split(files, "train", cut))) >= 1


def test_folder_of_mixed_files(tmp_path, jsonl_file):
    root = tmp_path / "mixed"
    (root / "sub").mkdir(parents=True)
    (root / "a.md").write_text("# title\n")
    (root / "sub" / "b.txt").write_text("plain")
    (root / ".hidden.txt").write_text("skip me")
    (root / "blob.bin").write_bytes(b"\x00\x01binary")
    (root / "empty.txt").write_text("")
    (root / "docs.jsonl").write_text(jsonl_file.read_text())
    pq.write_table(pa.table({"text": ["row zero", None, "row two"], "n": [0, 1, 2]}), root / "t.parquet")
    files = resolve_corpus(str(root))
    assert [(f.key, f.kind) for f in files] == [
        ("a.md", "text"),
        ("docs.jsonl", "jsonl"),
        ("sub/b.txt", "text"),
        ("t.parquet", "parquet"),
    ]
    docs = [d for f in files for d in iter_documents(f)]
    assert ("a.md", "# title\n") in docs and ("t.parquet#2", "row two") in docs and ("t.parquet#0", "row zero") in docs
    assert sum(k.startswith("docs.jsonl#") for k, _ in docs) == 50
    assert docs[1] == ("docs.jsonl#1", json.loads(jsonl_file.read_text().splitlines()[0])["text"])


def test_list_of_paths_and_duplicates(text_corpus, jsonl_file):
    one = text_corpus / "pkg0" / "mod_0.py"
    files = resolve_corpus([str(text_corpus), str(one), str(jsonl_file)])
    assert len(files) == 24 + 1  # the file named twice counts once
    assert any(f.key == "docs.jsonl" for f in files)


def test_missing_path_and_empty_corpus(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist.*Set `corpus`"):
        resolve_corpus(str(tmp_path / "nope"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="contains no non-empty"):
        resolve_corpus(str(tmp_path / "empty"))
    (tmp_path / "empty" / "blank.txt").write_text("")
    with pytest.raises(ValueError, match="contains no non-empty"):
        resolve_corpus(str(tmp_path / "empty"))
    with pytest.raises(ValueError, match="list is empty"):
        resolve_corpus([])
    (tmp_path / "one.txt").write_text("only one")
    with pytest.raises(ValueError, match="at least 2"):
        split_cut(resolve_corpus(str(tmp_path / "one.txt")), 0.1)
    with pytest.raises(ValueError, match=r"val_fraction=1.5 must be in \(0, 1\)"):
        split_cut(resolve_corpus(str(tmp_path / "one.txt")), 1.5)


def test_bad_records(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "ok"}\n{"body": "no text"}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:2: expected an object"):
        list(iter_documents(resolve_corpus(str(bad))[0]))
    nocol = tmp_path / "nocol.parquet"
    pq.write_table(pa.table({"body": ["x"]}), nocol)
    with pytest.raises(ValueError, match="no 'text' column"):
        list(iter_documents(resolve_corpus(str(nocol))[0]))


def test_stdlib_selection():
    files = stdlib_files()
    keys = {f.key for f in files}
    assert "json/decoder.py" in keys and "os.py" in keys
    assert not any(part in {"test", "tests", "idle_test", "site-packages"} for k in keys for part in k.split("/"))
    assert all(f.path.is_relative_to(stdlib_root()) for f in files)
    assert 2e6 < sum(f.size for f in files) < 40e6
