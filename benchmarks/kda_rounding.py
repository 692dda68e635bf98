"""Which rounding of the chunked KDA forward makes the output's error (CPU, float64 emulation).

The Triton forward (``k3lit.kernels.kda.chunk_fwd``) rounds its matrix-product operands and some stored tensors to
bfloat16. This script replays the same chunked algorithm in float64 with each of those roundings switchable,
and prints the relative RMS error of the output against the float64 token-by-token recurrence
(``kda_reference``) on the same bf16-valued inputs: with every rounding on, with each one off, and with each one
alone. The rounding points, as the kernels have them (C = 32, rebased at row r = 15 of the chunk)::

    A     operands of A = (K⊙exp(G - G_r)) (K⊙exp(G_r - G))^T      _intra_fwd
    Aq    operands of Aq = (Q⊙exp(G - G_r)) (K⊙exp(G_r - G))^T     _intra_fwd
    Mb    M Diag(beta), operand of W and U                         _wy_fwd
    Kg    K⊙exp(G), operand of W                                   _wy_fwd
    W, Kd, Qg, h, D   stored in bf16                               _wy_fwd, _intra_fwd, the scan
    U     U = M Diag(beta) V stored in bf16: not a rounding of the kernels (they store U in float32); in the
          table, and in the "every rounding" set only with ``--also U`` (what a bf16 U would cost)
    S     the state as operand of W S                              the scan
    Aq_o  Aq as operand of Aq Delta                                _out_fwd / _scan_fwd_t

``--aq tf32`` (the default) rounds the two Aq points to TF32 (10-bit mantissa), as the kernels do; ``--aq bf16``
rounds them to bf16, as the kernels did before, which this script showed to be the largest terms (see the KDA
notes in benchmarks/RESULTS.md for what the H200 measured). Each cell gives the error of o and, in brackets, of
the final state.

    python benchmarks/kda_rounding.py [--T 512] [--K 64] [--seeds 3] [--aq tf32|bf16] [--also U]
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from k3lit.ops.kda import kda_reference  # noqa: E402
from k3lit.testing import rel_rms  # noqa: E402

POINTS = ("A", "Aq", "Mb", "Kg", "W", "U", "Kd", "Qg", "h", "D", "S", "Aq_o")
F64 = torch.float64


def rounded(x: torch.Tensor, mode: str | None) -> torch.Tensor:
    """``x`` rounded to bfloat16 (to nearest even), to TF32 (to nearest, ties away from zero, as PTX's
    ``cvt.rna.tf32.f32``, which branch ``exp/aq-tf32-rna`` uses), or unchanged (None)."""
    if mode == "bf16":
        return x.to(torch.bfloat16).to(F64)
    if mode == "tf32":
        return ((x.float().view(torch.int32) + 0x1000) & ~0x1FFF).view(torch.float32).to(F64)
    return x


def chunked_forward(q, k, v, g, beta, modes: dict[str, str | None], C: int = 32
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """Output ``[T, V]`` and final state ``[K, V]`` of one sequence and head by the kernels' chunked algorithm
    (module docstring), float64 except where ``modes`` rounds."""
    T, K = q.shape
    scale = K**-0.5
    S = torch.zeros(K, v.shape[1], dtype=F64)
    out = torch.empty(T, v.shape[1], dtype=F64)
    for t0 in range(0, T, C):
        n = min(C, T - t0)
        Q, Kc, Vc, b = q[t0:t0 + n], k[t0:t0 + n], v[t0:t0 + n], beta[t0:t0 + n]
        G = torch.cumsum(g[t0:t0 + n], 0)
        Gr = G[min((C - 1) // 2, n - 1)]
        kdn = Kc * torch.exp(Gr - G)
        A = torch.tril(rounded(Kc * torch.exp(G - Gr), modes["A"]) @ rounded(kdn, modes["A"]).T, -1)
        Aq = scale * torch.tril(rounded(Q * torch.exp(G - Gr), modes["Aq"]) @ rounded(kdn, modes["Aq"]).T)
        M = torch.linalg.inv(torch.eye(n, dtype=F64) + b[:, None] * A)
        Mb = rounded(M * b[None, :], modes["Mb"])
        W = rounded(Mb @ rounded(Kc * torch.exp(G), modes["Kg"]), modes["W"])
        U = rounded(Mb @ Vc, modes["U"])
        Kd = rounded(Kc * torch.exp(G[-1] - G), modes["Kd"])
        Qg = rounded(scale * Q * torch.exp(G), modes["Qg"])
        D = rounded(U - W @ rounded(S, modes["S"]), modes["D"])
        out[t0:t0 + n] = Qg @ rounded(S, modes["h"]) + rounded(Aq, modes["Aq_o"]) @ D
        S = S * torch.exp(G[-1])[:, None] + Kd.T @ D
    return out, S


def cases(T: int, K: int, seeds: int) -> list[tuple[tuple[torch.Tensor, ...], torch.Tensor, torch.Tensor]]:
    """Per seed: bf16-valued inputs ``(q, k, v, g, beta)`` of one sequence and head, and their float64 output and
    final state."""
    out = []
    for seed in range(seeds):
        gen = torch.Generator().manual_seed(seed)
        bf = lambda x: x.to(torch.bfloat16).to(F64)  # noqa: E731 - the inputs are bf16 values
        q = bf(F.normalize(torch.randn(T, K, generator=gen, dtype=F64), dim=-1))
        k = bf(F.normalize(torch.randn(T, K, generator=gen, dtype=F64), dim=-1))
        v = bf(torch.randn(T, K, generator=gen, dtype=F64))
        g = (-5 * torch.sigmoid(2 * torch.randn(T, K, generator=gen, dtype=F64))).float().to(F64)
        beta = bf(torch.sigmoid(torch.randn(T, generator=gen, dtype=F64)))
        ref, ht = kda_reference(*(x[None, :, None] for x in (q, k, v, g, beta)), K**-0.5, None, True)
        out.append(((q, k, v, g, beta), ref[0, :, 0], ht[0, 0]))
    return out


def mean_errors(on: set[str], aq: str, data: list) -> tuple[float, float]:
    """Mean relative RMS errors of (o, final state) over ``data`` (:func:`cases`) with the rounding points ``on``."""
    modes = {p: (aq if p in ("Aq", "Aq_o") else "bf16") if p in on else None for p in POINTS}
    errs = [(rel_rms(o, ref), rel_rms(S, ht)) for (xs, ref, ht) in data for o, S in [chunked_forward(*xs, modes)]]
    return sum(e[0] for e in errs) / len(errs), sum(e[1] for e in errs) / len(errs)


def mean_error(on: set[str], aq: str, data: list) -> float:
    """Mean relative RMS error of o over ``data`` (:func:`cases`) with the rounding points ``on``."""
    return mean_errors(on, aq, data)[0]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--T", type=int, default=512)
    ap.add_argument("--K", type=int, default=64, help="K = V")
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--aq", choices=["bf16", "tf32"], default="tf32", help="rounding of the Aq points")
    ap.add_argument("--also", nargs="*", choices=["U"], default=[], help="add these points to the kernels' roundings")
    a = ap.parse_args()
    every, data = (set(POINTS) - {"U"}) | set(a.also), cases(a.T, a.K, a.seeds)
    o, ht = mean_errors(every, a.aq, data)
    also = "".join(f" and {p}" for p in a.also)
    print(f"relative RMS error of o (of the final state), mean of {a.seeds} seeds, T {a.T}, K = V = {a.K}, Aq points "
          f"in {a.aq}: {o:.2e} ({ht:.2e}) with every rounding of the kernels on{also}")
    print("| rounding | every one but this | this one alone | every one and this |\n|---|---|---|---|")
    for p in POINTS:
        rows = [mean_errors(every - {p}, a.aq, data), mean_errors({p}, a.aq, data),
                mean_errors(every | {p}, a.aq, data)]
        print(f"| {p} | " + " | ".join(f"{x:.2e} ({y:.2e})" for x, y in rows) + " |", flush=True)


if __name__ == "__main__":
    main()
