"""Host (CPU) time of the KDA forward's launches against its GPU time: is a forward launch-bound?

For each shape and pipeline-segment setting (``plan.TUNING["fwd_segments"]``) it measures the forward without
gradients (the ``fwd`` column of benchmarks/kda.py) three ways:

- ``host``: wall time per call of ``n`` calls queued back to back with no synchronisation (the launcher's Python,
  Triton's argument binding and the CUDA launches), mean;
- ``eager``: ``triton.testing.do_bench`` median of the same call, what benchmarks/kda.py reports;
- ``graph``: the call captured once in a CUDA graph and replayed (``do_bench`` median): the GPU's time with no
  host in the way.

Where ``host`` approaches ``eager`` and ``graph`` is well below it, the GPU waits for the host. ::

    python benchmarks/kda_launch.py [--shapes 8x2048x16x128 1x16384x16x128] [--segments 1 4]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.kda import bench, inputs, ours  # noqa: E402
from k3lit.kernels.kda import plan  # noqa: E402


def host_ms(fn, n: int = 50) -> float:
    """Mean wall time (ms) of ``n`` unsynchronised calls of ``fn`` after a synchronised warm-up."""
    fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(n):
        fn()
    dt = time.perf_counter() - t
    torch.cuda.synchronize()
    return dt / n * 1e3


def graph_ms(fn) -> float:
    """``do_bench`` median (ms) of replaying ``fn`` captured in a CUDA graph (warmed up on a side stream first, as
    capture requires)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return bench(graph.replay)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", nargs="+", default=["8x2048x16x128", "2x8192x16x128", "1x16384x16x128"])
    ap.add_argument("--segments", nargs="+", default=["auto", "1", "4"])
    args = ap.parse_args()
    saved = dict(plan.TUNING)
    print("| B | T | H | D | fwd_segments | host ms | eager ms | graph ms |")
    print("|---|---|---|---|---|---|---|---|")
    for text in args.shapes:
        B, T, H, D = (int(x) for x in text.split("x"))
        xs = inputs(B, T, H, D, D)
        for seg in args.segments:
            plan.TUNING.update(fwd_segments=seg if seg == "auto" else int(seg))

            def fwd(xs=xs):
                with torch.no_grad():
                    return ours(*xs)

            print(f"| {B} | {T} | {H} | {D} | {seg} | {host_ms(fwd):.3f} | {bench(fwd):.3f} | {graph_ms(fwd):.3f} |",
                  flush=True)
    plan.TUNING.clear()
    plan.TUNING.update(saved)


if __name__ == "__main__":
    main()
