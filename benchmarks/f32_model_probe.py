"""Where the float32 model test's gradient error comes from, on the GPU, and how far float32 itself errs there.

``tests/test_model.py::test_gpu_attnres_model_as_accurate_as_float32_pytorch`` compares the gradients of a float32
block-AttnRes model on CUDA (KDA and the AttnRes reads on their Triton kernels) with the same float32 model in
PyTorch, both against the float64 loop. This script runs that test's draws for one seed and splits the kernels'
error by component, next to the five float32 PyTorch runs whose median is the test's yardstick:

- ``kernels``: KDA and the AttnRes reads on the kernels (what the test measures);
- ``KDA kernels``: KDA on its kernels, the AttnRes reads in PyTorch;
- ``AttnRes kernels``: the AttnRes reads on their kernels, KDA in PyTorch (the chunked form);
- ``PyTorch GPU``, ``PyTorch CPU``: both in PyTorch, float32, on the GPU and on the CPU;
- ``PyTorch GPU, weights 1 ulp (i)``: PyTorch on the GPU on a neighbouring model, every weight moved one float32
  ulp up or down at random (three draws of the moves), against that model's own float64 reference;
- ``yardstick``: the test's measure of float32's error, the median of the five PyTorch columns
  (``tests/test_model.py::float32_yardstick``); ``ratio``: the kernels' error over it (the test allows 3 on three
  of five draws).

    python benchmarks/f32_model_probe.py --seed 1414577420 --block 3 [--json out.json]

Prints one row per draw of relative RMS errors of all parameter gradients against the float64 loop.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests")]

import test_model as tm  # noqa: E402

from benchmarks.results import versions  # noqa: E402
from k3lit.testing import rel_rms  # noqa: E402

KERNEL_RUNS = {  # column: (KDA backend, AttnRes reads on their kernels)
    "kernels": ("triton", True),
    "KDA kernels": ("triton", False),
    "AttnRes kernels": ("torch", True),
}


def draw_errors(seed: int, block: int) -> dict[str, float]:
    """Gradient errors for the model and batch the test builds from ``seed``: the :data:`KERNEL_RUNS`, the five
    PyTorch runs of ``float32_pytorch_errors`` (prefixed "PyTorch"), ``yardstick`` (the test's: their median) and
    ``ratio`` (the kernels' error over it)."""
    torch.manual_seed(seed)
    cfg = dict(residual="block_attnres", attnres_block_size=block, n_layers=6, dim=96, n_experts=0)
    model = tm.build(**cfg)
    idx = torch.randint(0, tm.TINY.vocab_size, (2, 37))
    state = model.state_dict()
    ref = tm.float64_reference(cfg, state, idx)
    err = {name: rel_rms(tm.float32_run(cfg, state, idx, "cuda", kda=kda, attn_res_kernels=attn)[1], ref[1])
           for name, (kda, attn) in KERNEL_RUNS.items()}
    runs = tm.float32_pytorch_errors(cfg, state, idx, ref, seed)
    err.update({f"PyTorch {name}": grad_err for name, (_, grad_err) in runs.items()})
    err["yardstick"] = tm.float32_yardstick(runs)[1]
    err["ratio"] = err["kernels"] / err["yardstick"]
    return err


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seed", type=int, default=1414577420)
    ap.add_argument("--block", type=int, default=3)
    ap.add_argument("--draws", type=int, default=5)
    ap.add_argument("--json", help="also write the rows here")
    args = ap.parse_args()
    rows = []
    for d in range(args.draws):
        err = draw_errors(args.seed + d, args.block)
        if not rows:
            print("| draw | " + " | ".join(err) + " |\n" + "|---" * (len(err) + 1) + "|")
        rows.append({"seed": args.seed + d, **err})
        print(f"| {args.seed + d} | " + " | ".join(f"{v:.2e}" for v in list(err.values())[:-1])
              + f" | {err['ratio']:.2f} |", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({**versions(), "block": args.block, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
