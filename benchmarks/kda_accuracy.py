"""KDA accuracy against fla over many draws: is ours no worse than fla's own error on every draw, or on one?

``benchmarks/kda.py`` compares the two on one draw of inputs per case (seed 0), where errors a percent or two apart
are within the draw's spread. This script draws fresh bf16 inputs and output gradients per seed at one shape
(``kda.py``'s inputs: unit q and k, g = -5 sigmoid(2 x), an initial state) and reports, for o, the final state and
every gradient, the relative RMS error against the float64 token-by-token reference: the mean over the seeds of
ours and fla's, and on how many seeds ours is the lower. The table goes to ``benchmarks/RESULTS.md``, section
"KDA accuracy over draws". ::

    python benchmarks/kda_accuracy.py [--seeds 8] [--shape 2x1024x16x128] [--no-fla] [--json out.json]
    python benchmarks/kda_accuracy.py --from-json benchmarks/kda_accuracy_h200.json   # the stored H200 run

With ``--no-fla`` only ours is run (fla's column is then left out); ``--json`` keeps every draw's errors.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from benchmarks.kda import TOL, errors, inputs, load_fla, make_fla, ours, reference  # noqa: E402
from benchmarks.results import command, environment, load_json, versions, write_section  # noqa: E402

TITLE = "KDA accuracy over draws"


def draw(impls: dict, B: int, T: int, H: int, D: int, seed: int, device: str = "cuda") -> dict[str, dict[str, float]]:
    """Errors ``{impl: {"o", "ht", "dq", ...: relative RMS error}}`` of every implementation in ``impls`` (name:
    callable like :func:`benchmarks.kda.ours`) on the bf16 inputs and output gradients drawn from ``seed`` at
    B x T x H x D (K = V = D) on ``device``."""
    torch.manual_seed(seed)
    xs = inputs(B, T, H, D, D, device=device, h0=True)
    ref = reference(xs)  # one float64 reference, and one dO and dht, for every implementation
    return {name: errors(fn, xs, ref) for name, fn in impls.items()}


def table(runs: list[dict[str, dict[str, float]]]) -> list[str]:
    """Markdown rows from :func:`draw`'s records: the mean error of each implementation per output, and, when fla
    ran, on how many draws k3lit's error is the lower."""
    impls = list(runs[0])
    lines = ["| impl | " + " | ".join(TOL) + " |", "|---|" + "---|" * len(TOL)]
    for name in impls:
        lines.append(f"| {name} | " + " | ".join(f"{sum(r[name][n] for r in runs) / len(runs):.3e}" for n in TOL)
                     + " |")
    if "fla" in impls:
        lines.append("| k3lit lower on | " + " | ".join(
            f"{sum(r['k3lit'][n] < r['fla'][n] for r in runs)}/{len(runs)}" for n in TOL) + " |")
    return lines


def section(stored: dict) -> str:
    """The RESULTS.md section from a stored run: ``{"versions"`` (:func:`benchmarks.results.versions`, with
    ``"fla"`` where fla ran), ``"command"``, ``"shape"`` ([B, T, H, D]), ``"runs"`` (one :func:`draw` per seed)``}``."""
    meta, (B, T, H, D), runs = stored["versions"], stored["shape"], stored["runs"]
    return "\n".join([
        f"Written by `benchmarks/kda_accuracy.py`. {environment(meta)}"
        + (f" · fla-core {meta['fla']}" if "fla" in meta else "") + f". Command: {stored['command']}.", "",
        f"B{B} T{T} H{H} D{D}, bf16 inputs and output gradients drawn from seeds 0-{len(runs) - 1} (the inputs of "
        "`benchmarks/kda.py`, with an initial state); relative RMS error against the float64 token-by-token "
        "reference, mean over the draws; `k3lit lower on`: the draws on which k3lit's error is below fla's.", "",
        *table(runs)])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", type=int, default=8)
    ap.add_argument("--shape", default="2x1024x16x128", metavar="BxTxHxD")
    ap.add_argument("--no-fla", action="store_true")
    ap.add_argument("--json", help="also write every draw's errors here")
    ap.add_argument("--from-json", "--from_json",
                    help="write the section from the records of an earlier run (no measuring)")
    ap.add_argument("--results", default=os.path.join(ROOT, "benchmarks", "RESULTS.md"))
    args = ap.parse_args()
    if args.from_json:
        body = section(load_json(args.from_json, ()))
        write_section(TITLE, body, args.results)
        print(body)
        return
    B, T, H, D = (int(x) for x in args.shape.split("x"))
    impls = {"k3lit": ours}
    fla = None if args.no_fla else load_fla()
    if fla is not None:
        impls["fla"] = make_fla(fla)
    runs = [draw(impls, B, T, H, D, s) for s in range(args.seeds)]
    meta = versions() | ({"fla": __import__("fla").__version__} if fla is not None else {})
    stored = {"versions": meta, "command": command(), "shape": [B, T, H, D], "runs": runs}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(stored, f, indent=1)
    body = section(stored)
    write_section(TITLE, body, args.results)
    print(body)


if __name__ == "__main__":
    main()
