"""One forward call of the Triton KDA kernels (no gradient) inside an NVTX range named ``measure``, for Nsight
Compute: what bounds each forward kernel (DRAM throughput, occupancy, registers).

    ncu --clock-control none --nvtx --nvtx-include "measure/" --section SpeedOfLight --section Occupancy \\
        --section WarpStateStats --section LaunchStats python benchmarks/kda_ncu.py 8x2048x16x128

The argument is ``BxTxHxD`` (K = V = D), bf16 q, k, v, beta and a float32 log-decay ``-5 sigmoid(.)``; three
warm-up calls compile the kernels outside the range. benchmarks/RESULTS.md ("KDA kernels: against the targets")
quotes a run.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from k3lit.kernels.kda import kda_triton  # noqa: E402


def main() -> None:
    B, T, H, D = (int(x) for x in sys.argv[1].split("x"))
    torch.manual_seed(0)
    q, k = (torch.nn.functional.normalize(torch.randn(B, T, H, D, device="cuda"), dim=-1).bfloat16()
            for _ in range(2))
    v = torch.randn(B, T, H, D, device="cuda").bfloat16()
    g = -5 * torch.sigmoid(torch.randn(B, T, H, D, device="cuda"))
    beta = torch.rand(B, T, H, device="cuda").bfloat16()
    with torch.no_grad():
        for _ in range(3):
            kda_triton(q, k, v, g, beta)
        torch.cuda.synchronize()
        torch.cuda.nvtx.range_push("measure")
        kda_triton(q, k, v, g, beta)
        torch.cuda.nvtx.range_pop()
        torch.cuda.synchronize()


if __name__ == "__main__":
    main()
