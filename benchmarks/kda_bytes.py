"""Bytes the KDA forward moves per token and head without a backward, per kernel and ``plan.TUNING`` alternative,
and the forward's time they predict at B8 T2048 H16 D128 (CPU; no GPU needed).

The model counts each kernel's loads and stores (every input read once per program, repeated reads of the same tile
assumed served by the cache), bf16 q, k, v, beta and float32 g, K = V = D: ``"split"`` as session 7's kernels wrote
them (``_wy_fwd`` read G and k; since session 13 it reads the K⊙exp(G) that ``_intra_fwd`` stores, 2K bytes
instead of 6K), ``"fused"`` as ``kernels/kda/chunk_fwd.py`` writes ``_prep_fwd``.
The prediction times each kernel at the ms per byte that Nsight Compute measured for its counterpart in session 7
(benchmarks/RESULTS.md, "KDA kernels: against the targets": ``_intra_fwd`` 0.325 ms for 0.64 GB, ``_wy_fwd`` 0.211
for 0.49, ``_scan_fwd_t`` 0.176 for 0.44, at B8 T2048 H16), so it assumes an alternative keeps that achieved rate.

    python benchmarks/kda_bytes.py [--D 128] [--C 32]
"""

from __future__ import annotations

import argparse

#: Session 7's Nsight Compute at B8 T2048 H16 D128, no gradient: (ms, GB moved) per kernel.
MEASURED = {"_intra_fwd": (0.325, 0.64), "_wy_fwd": (0.211, 0.49), "_scan_fwd_t": (0.176, 0.44)}
TOKEN_HEADS = 8 * 2048 * 16
#: The kernel whose measured rate each modelled kernel is timed at.
RATE_OF = {"_intra_fwd": "_intra_fwd", "_prep_fwd": "_intra_fwd", "_wy_fwd": "_wy_fwd", "_scan_fwd_t": "_scan_fwd_t"}


def kernel_bytes(D: int, C: int, u_bf16: bool = False, prep: str = "split") -> dict[str, float]:
    """Bytes per token and head of each forward kernel without a backward (``prep``: "split" or "fused")."""
    K = V = D
    u = 2 * V if u_bf16 else 4 * V
    inputs = 2 * K + 2 * K + 4 * K + 2  # q, k, g, beta
    per_chunk_out = 2 * K + 2 * K  # Kd, Qg
    out = {}
    if prep == "split":
        out["_intra_fwd"] = inputs + 4 * K + per_chunk_out + 4 * C + 4 * C  # G, Kd, Qg, Aq, L
        out["_wy_fwd"] = 4 * C + 2 + 4 * K + 2 * K + 2 * V + 2 * K + u  # L, beta, Gc or g, k, v; W, U
    else:
        out["_prep_fwd"] = inputs + 2 * V + 4 * K / C + per_chunk_out + 4 * C + 2 * K + u
    out["_scan_fwd_t"] = 2 * K + u + 2 * K + 4 * C + 2 * K + 4 * K / C + 2 * V  # W, U, Qg, Aq, Kd, G_last; o
    return out


def predicted_ms(kb: dict[str, float]) -> float:
    """The forward's ms at B8 T2048 H16 D128 if each kernel moves its bytes at its counterpart's measured rate."""
    return sum(b * TOKEN_HEADS * MEASURED[RATE_OF[n]][0] / (MEASURED[RATE_OF[n]][1] * 1e9) for n, b in kb.items())


VARIANTS = {
    '`fwd_prep="split"` (session 7\'s defaults)': {},
    '`fwd_prep="split"`, `u_dtype="work"`': dict(u_bf16=True),
    '`fwd_prep="fused"` (the defaults since session 9)': dict(prep="fused"),
    '`fwd_prep="fused"`, `u_dtype="work"`': dict(prep="fused", u_bf16=True),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--D", type=int, default=128, help="K = V")
    ap.add_argument("--C", type=int, default=32, help="chunk size")
    a = ap.parse_args()
    print(f"KB per token and head without a backward, K = V = {a.D}, C = {a.C}; predicted forward ms at B8 T2048 H16 "
          f"D128 (kernel rates of session 7's Nsight Compute)\n")
    print("| `plan.TUNING` | per-chunk kernels (KB) | scan (KB) | total (KB) | predicted ms |\n|---|---|---|---|---|")
    for name, kw in VARIANTS.items():
        kb = kernel_bytes(a.D, a.C, **kw)
        per_chunk = " + ".join(f"{b / 1e3:.2f}" for n, b in kb.items() if n != "_scan_fwd_t")
        print(f"| {name} | {per_chunk} | {kb['_scan_fwd_t'] / 1e3:.2f} | {sum(kb.values()) / 1e3:.2f} | "
              f"{predicted_ms(kb):.2f} |")


if __name__ == "__main__":
    main()
