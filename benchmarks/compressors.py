"""Reference points for bits per byte on a corpus: gzip -9 and xz -9e on the same held-out files.

    .venv/bin/python benchmarks/compressors.py            # prints a markdown table for the stdlib corpus
    .venv/bin/python benchmarks/compressors.py --corpus python --val_fraction 0.02 --compress val \\
        --tokenizer bpe:16384 --prepare_workers 2 --write  # + tokens, prepare time; RESULTS.md section

Each split's documents are joined in corpus order (as ``k3lit prepare`` streams them) and compressed whole
(``--compress``: which splits; the others get a row without compressors). With ``--tokenizer`` the corpus is
prepared (or a finished cache entry reused) and the table adds the tokens per split and the entry's build time.
With ``--write`` the table replaces the section "Corpus: <corpus>" of ``benchmarks/RESULTS.md``, with the date,
the machine, the versions and this command.
"""

from __future__ import annotations

import argparse
import gzip
import lzma
import os
import platform
import shlex
import sys
from importlib.metadata import distributions, version
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.results import versions, write_section  # noqa: E402
from k3lit.data.corpus import iter_split, resolve_corpus, split_cut  # noqa: E402
from k3lit.data.prepare import prepare_corpus  # noqa: E402
from k3lit.data.python_corpus import PYTHON, scan_python_sources  # noqa: E402


def bits_per_byte(data: bytes) -> dict[str, float]:
    """gzip -9 and xz -9e compressed size of ``data`` in bits per input byte."""
    n = len(data)
    return {
        "gzip -9": 8 * len(gzip.compress(data, compresslevel=9)) / n,
        "xz -9e": 8 * len(lzma.compress(data, preset=9 | lzma.PRESET_EXTREME)) / n,
    }


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def environment() -> str:
    """Date, CPU, cores, Python, the number of installed distributions (what the ``python`` corpus reads) and the
    data libraries' versions, one line."""
    libs = " · ".join(f"{name} {version(name)}" for name in ("tokenizers", "litdata"))
    n_dists = len({d.metadata["Name"] for d in distributions()})
    python = f"{platform.python_implementation()} {platform.python_version()} with {n_dists} distributions installed"
    return f"{versions()['date']} · {_cpu_name()}, {os.cpu_count()} cores · {python} · {libs}"


def corpus_report(
    corpus: str,
    val_fraction: float,
    compress: list[str],
    tokenizer: str | None = None,
    cache_dir: str = ".cache/k3lit/data",
    prepare_workers: int = 1,
) -> str:
    """Markdown table (and notes) of the corpus: files and MB per split, the compressors' bits per byte for the
    splits in ``compress`` (val first, then train); tokens and the prepared entry's build time when ``tokenizer``
    is given."""
    files = resolve_corpus(corpus)
    cut = split_cut(files, val_fraction)
    prepared = None
    if tokenizer is not None:
        prepared = prepare_corpus(
            corpus, tokenizer, cache_dir=cache_dir, val_fraction=val_fraction, prepare_workers=prepare_workers
        )
    tok_cols = f" tokens ({tokenizer}) | bytes/token |" if prepared else ""
    lines = [
        f"| split | files | MB |{tok_cols} gzip -9 bpb | xz -9e bpb |",
        "|---|---|---|" + ("---|---|" if prepared else "") + "---|---|",
    ]
    for split in ("val", "train"):
        docs = list(iter_split(files, split, cut))
        data = "\n".join(docs).encode()
        tok = ""
        if prepared:
            s = prepared.meta["splits"][split]
            tok = f" {s['n_tokens']:,} | {prepared.bytes_per_token(split):.3f} |"
        if split in compress:
            r = bits_per_byte(data)
            bpb = f" {r['gzip -9']:.3f} | {r['xz -9e']:.3f} |"
        else:
            bpb = " — | — |"
        lines.append(f"| {split} | {len(docs):,} | {len(data) / 1e6:.1f} |{tok}{bpb}")
    notes = [
        f"{len(files):,} files, {sum(f.size for f in files) / 1e6:.1f} MB; val_fraction {val_fraction} (by file, "
        "a hash of its key)."
    ]
    if corpus == PYTHON:
        skipped = scan_python_sources().skipped
        notes.append("Left out: " + ", ".join(f"{reason} {len(keys):,}" for reason, keys in skipped.items()) + ".")
    if prepared:
        notes.append(
            f"Prepare ({tokenizer}, BPE trained on the whole train split, {prepare_workers} litdata worker(s)): "
            f"{prepared.meta['build_seconds']:.0f} s for the cache entry {prepared.key}."
        )
    return "\n".join(lines) + "\n\n" + " ".join(notes)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--corpus", default="stdlib")
    parser.add_argument("--val_fraction", type=float, default=0.05)
    parser.add_argument("--compress", default="val,train", help="splits to compress: val, train or val,train")
    parser.add_argument("--tokenizer", default=None, help="e.g. bpe:16384: prepare the corpus, add token counts")
    parser.add_argument("--cache_dir", default=".cache/k3lit/data")
    parser.add_argument("--prepare_workers", type=int, default=1)
    parser.add_argument("--write", action="store_true", help="write the section 'Corpus: <corpus>' of RESULTS.md")
    args = parser.parse_args()
    compress = [s.strip() for s in args.compress.split(",") if s.strip()]
    if not compress or any(s not in ("train", "val") for s in compress):
        parser.error(f"--compress {args.compress!r}: use 'val', 'train' or 'val,train'.")
    report = corpus_report(
        args.corpus, args.val_fraction, compress, args.tokenizer, args.cache_dir, args.prepare_workers
    )
    print(report)
    if args.write:
        command = shlex.join(["python", "benchmarks/compressors.py", *sys.argv[1:]])
        write_section(f"Corpus: {args.corpus}", f"{environment()}\n\n`{command}`\n\n{report}")


if __name__ == "__main__":
    main()
