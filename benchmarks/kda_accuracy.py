"""KDA accuracy against fla over many draws: is ours no worse than fla's own error, or only on one draw?

``benchmarks/kda.py`` compares the two on one draw of inputs per case (seed 0), where errors a percent or two apart
are within the draw's spread. This script draws fresh bf16 inputs and output gradients per seed at one shape
(``kda.py``'s inputs: unit q and k, g = -5 sigmoid(2 x), an initial state) and prints, for o, the final state and
every gradient, the relative RMS error against the float64 token-by-token reference: the mean over the seeds of
ours and fla's, and on how many seeds ours was the lower. ::

    python benchmarks/kda_accuracy.py [--seeds 8] [--shape 2x1024x16x128] [--no-fla] [--json out.json]

With ``--no-fla`` only ours is run (fla's column is then left out); ``--json`` keeps every draw's errors.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.kda import TOL, errors, inputs, load_fla, make_fla, ours, reference  # noqa: E402
from benchmarks.results import versions  # noqa: E402


def draw(impls: dict, B: int, T: int, H: int, D: int, seed: int) -> dict[str, dict[str, float]]:
    """Errors of every implementation on the inputs and output gradients drawn from ``seed``."""
    torch.manual_seed(seed)
    xs = inputs(B, T, H, D, D, h0=True)
    ref = reference(xs)  # one float64 reference, and one dO and dht, for every implementation
    return {name: errors(fn, xs, ref) for name, fn in impls.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", type=int, default=8)
    ap.add_argument("--shape", default="2x1024x16x128", metavar="BxTxHxD")
    ap.add_argument("--no-fla", action="store_true")
    ap.add_argument("--json", help="also write every draw's errors here")
    args = ap.parse_args()
    B, T, H, D = (int(x) for x in args.shape.split("x"))
    impls = {"k3lit": ours}
    fla = None if args.no_fla else load_fla()
    if fla is not None:
        impls["fla"] = make_fla(fla)
    runs = [draw(impls, B, T, H, D, s) for s in range(args.seeds)]
    print(f"B{B} T{T} H{H} D{D}, {args.seeds} draws, relative RMS error against the float64 reference (mean)")
    print("| impl | " + " | ".join(TOL) + " |")
    print("|---|" + "---|" * len(TOL))
    for name in impls:
        print(f"| {name} | " + " | ".join(f"{sum(r[name][n] for r in runs) / len(runs):.3e}" for n in TOL) + " |")
    if "fla" in impls:
        print("| k3lit lower on | " + " | ".join(
            f"{sum(r['k3lit'][n] < r['fla'][n] for r in runs)}/{len(runs)}" for n in TOL) + " |")
    if args.json:
        with open(args.json, "w") as f:
            env = versions() | ({"fla": __import__("fla").__version__} if fla is not None else {})
            json.dump({**env, "shape": [B, T, H, D], "runs": runs}, f, indent=1)


if __name__ == "__main__":
    main()
