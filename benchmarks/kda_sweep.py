"""Where the time of k3lit's KDA kernels goes, and a sweep of their launch configs.

For each shape: every kernel's device time in one bf16 forward+backward (torch.profiler, mean of a few
steps). Then, for the first shapes, each candidate override of ``k3lit.kernels.kda.chunk.launch_cfg`` (block
sizes, warps, pipeline stages of one kernel family) and the time of the kernels it changes. The configs
chosen from this go into ``launch_cfg`` by hand; nothing is written to RESULTS.md.

Usage: ``python benchmarks/kda_sweep.py [--no-sweep]``.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from benchmarks.kda import G_MIN, inputs  # noqa: E402
from k3lit.kernels.kda import chunk, kda_triton  # noqa: E402

SWEEP_SHAPES = [(8, 2048, 16, 128), (1, 65536, 16, 128)]  # (B, T, H, D)
BREAKDOWN_SHAPES = SWEEP_SHAPES + [(1, 8192, 96, 128), (8, 2048, 32, 256)]
KERNELS = {"cumsum": ("_cumsum_fwd",), "intra": ("_intra_fwd",), "scan_fwd": ("_scan_fwd",), "out": ("_out_fwd",),
           "scan_bwd": ("_scan_bwd",), "dA": ("_dA_bwd",), "dqkg": ("_dqkg_bwd",)}
CANDIDATES = [  # most informative first: a run may stop part-way
    ("intra", dict(num_warps=8)), ("dqkg", dict(BK=32, num_warps=4)), ("dA", dict(num_warps=8)),
    ("scan_fwd", dict(BV=16)), ("scan_bwd", dict(BV=16)), ("dA", dict(BV=64)), ("dqkg", dict(BK=32, num_warps=8)),
    ("intra", dict(BK=64, num_warps=8)), ("scan_fwd", dict(num_warps=8)), ("scan_bwd", dict(num_warps=8)),
    ("out", dict(num_warps=4)), ("scan_fwd", dict(BV=64)),
]


def kernel_ms(B: int, T: int, H: int, D: int, steps: int = 5) -> dict[str, float]:
    """Device ms per forward+backward step of every kernel (name -> ms) on fresh bf16 inputs."""
    xs = inputs(B, T, H, D, D, requires_grad=True)
    do = torch.randn(B, T, H, D, device="cuda", dtype=torch.bfloat16)

    def step():
        o, _ = kda_triton(*xs, g_min=G_MIN)
        o.backward(do)

    step()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    return {e.key: e.self_device_time_total / steps / 1e3 for e in prof.key_averages() if e.self_device_time_total > 0}


@contextlib.contextmanager
def with_override(family: str, override: dict[str, int]):
    """``launch_cfg`` with ``override`` merged into one kernel family's entry, inside the block."""
    base = chunk.launch_cfg
    chunk.launch_cfg = lambda K, V: {**base(K, V), family: {**base(K, V)[family], **override}}
    try:
        yield
    finally:
        chunk.launch_cfg = base


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--no-sweep", action="store_true", help="only the per-kernel breakdown")
    args = ap.parse_args()
    torch.manual_seed(0)
    print("| B | T | H | D | kernel | ms | share |\n|---|---|---|---|---|---|---|")
    base = {}
    for shape in BREAKDOWN_SHAPES:
        try:
            t = kernel_ms(*shape)
        except Exception as exc:  # noqa: BLE001 - report and go on with the other shapes
            print(f"| {' | '.join(map(str, shape))} | failed: {exc!r} | | |")
            continue
        base[shape] = t
        total = sum(t.values())
        for name, ms in sorted(t.items(), key=lambda x: -x[1]):
            if ms > 0.01 * total:
                print(f"| {' | '.join(map(str, shape))} | {name[:40]} | {ms:.3f} | {ms / total:.0%} |")
        print(f"| {' | '.join(map(str, shape))} | total (all kernels) | {total:.3f} | |", flush=True)
    if args.no_sweep:
        return
    print("\n| B | T | H | D | family | override | kernels ms (base -> override) |\n|---|---|---|---|---|---|---|")
    for family, override in CANDIDATES:
        for shape in SWEEP_SHAPES:
            try:
                with with_override(family, override):
                    t = kernel_ms(*shape, steps=3)
            except Exception as exc:  # noqa: BLE001 - e.g. out of shared memory for one candidate
                print(f"| {' | '.join(map(str, shape))} | {family} | {override} | failed: {type(exc).__name__} |")
                continue
            cells = ", ".join(f"{k} {base.get(shape, {}).get(k, float('nan')):.3f} -> {t.get(k, float('nan')):.3f}"
                              for k in KERNELS[family])
            print(f"| {' | '.join(map(str, shape))} | {family} | {override} | {cells} |", flush=True)


if __name__ == "__main__":
    main()
