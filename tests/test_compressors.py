"""``benchmarks/compressors.py``: the corpus table on a small folder, with and without a prepared tokenizer."""

from __future__ import annotations

import gzip


def _corpus(root):
    root.mkdir()
    for i in range(12):
        (root / f"mod_{i}.py").write_text("".join(f"def f_{i}_{j}(x):\n    return x + {j}\n" for j in range(50)))
    return root


def test_report_rows_and_tokens(tmp_path):
    from benchmarks.compressors import bits_per_byte, corpus_report

    corpus = str(_corpus(tmp_path / "src"))
    plain = corpus_report(corpus, 0.25, ["val", "train"])
    rows = [r for r in plain.splitlines() if r.startswith("| val") or r.startswith("| train")]
    files = [int(r.split(" | ")[1]) for r in rows]
    assert sum(files) == 12 and min(files) >= 1 and "12 files" in plain
    report = corpus_report(corpus, 0.25, ["val"], tokenizer="byte", cache_dir=str(tmp_path / "cache"))
    head, row, train_row = report.splitlines()[0], report.splitlines()[2], report.splitlines()[3]
    assert "tokens (byte)" in head and "Prepare (byte" in report
    assert train_row.startswith("| train | ") and train_row.endswith(" — | — |")  # not compressed
    cells = [c.strip() for c in row.strip("|").split("|")]
    n_files, n_tokens = int(cells[1]), int(cells[3].replace(",", ""))
    assert cells[0] == "val" and n_files == files[0]
    val_bytes = float(cells[4]) * n_tokens  # bytes/token x tokens: text bytes of the split
    assert abs(n_tokens - n_files - val_bytes) < 0.01 * val_bytes  # one byte token per byte + one eos per file
    data = b"x = 1\n" * 1000
    assert bits_per_byte(data)["gzip -9"] == 8 * len(gzip.compress(data, compresslevel=9)) / len(data)
