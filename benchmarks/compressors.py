"""Reference points for bits per byte on the built-in corpus: gzip -9 and xz -9e on the same held-out files.

    .venv/bin/python benchmarks/compressors.py            # prints a markdown table

Each split's documents are joined in corpus order (as ``k3lit prepare`` streams them) and compressed whole.
"""

from __future__ import annotations

import argparse
import gzip
import lzma

from k3lit.data.corpus import iter_split, resolve_corpus, split_cut


def bits_per_byte(data: bytes) -> dict[str, float]:
    """gzip -9 and xz -9e compressed size of ``data`` in bits per input byte."""
    n = len(data)
    return {
        "gzip -9": 8 * len(gzip.compress(data, compresslevel=9)) / n,
        "xz -9e": 8 * len(lzma.compress(data, preset=9 | lzma.PRESET_EXTREME)) / n,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--corpus", default="stdlib")
    parser.add_argument("--val_fraction", type=float, default=0.05)
    args = parser.parse_args()
    files = resolve_corpus(args.corpus)
    cut = split_cut(files, args.val_fraction)
    print("| split | MB | gzip -9 bpb | xz -9e bpb |\n|---|---|---|---|")
    for split in ("val", "train"):
        data = "\n".join(iter_split(files, split, cut)).encode()
        r = bits_per_byte(data)
        print(f"| {split} | {len(data) / 1e6:.1f} | {r['gzip -9']:.3f} | {r['xz -9e']:.3f} |", flush=True)


if __name__ == "__main__":
    main()
