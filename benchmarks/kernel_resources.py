"""Registers, spills and shared memory of every k3lit Triton kernel, compiled for the H200 (sm_90a) on any machine.

Each launcher runs on ``meta`` tensors of the benchmark shapes while :func:`k3lit.kernels.aot.record_launches`
records its launches; every launch is then compiled by Triton and ptxas for sm_90a (no GPU needed). A kernel
that spills its register tile to local memory, or needs so many registers that few warps fit on an SM, shows
here before it is timed.

    python benchmarks/kernel_resources.py            # table on stdout, section in RESULTS.md
    python benchmarks/kernel_resources.py --json r.json --no-write

Must run without ``TRITON_INTERPRET`` (the kernels must be defined as compilable JIT functions).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import subprocess
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.results import write_section  # noqa: E402
from k3lit.kernels import aot  # noqa: E402

REGS_PER_SM = 65536
META = torch.device("meta")


def _kda(B: int, T: int, H: int, K: int, V: int, gate: bool, l2: bool) -> list[aot.Launch]:
    from k3lit.kernels.kda import chunk, fused_recurrent

    bf = dict(device=META, dtype=torch.bfloat16)
    q, k = torch.empty(B, T, H, K, **bf), torch.empty(B, T, H, K, **bf)
    v = torch.empty(B, T, H, V, **bf)
    g = torch.empty(B, T, H, K, **bf) if gate else torch.empty(B, T, H, K, device=META)
    beta = torch.empty(B, T, H, **bf)
    bias = torch.empty(H * K, device=META) if gate else None
    fusion = (bias, -5.0 if gate else None, l2)
    names = ("_intra_fwd", "_scan_fwd", "_out_fwd", "_scan_bwd", "_main_bwd")
    with aot.record_launches(chunk, *names) as launches:
        o, _, Gc, Aq, Mi, W, Kd, Qg, h, D, Rn = chunk.chunk_fwd(q, k, v, g, beta, K**-0.5, None, False, None, 32,
                                                               *fusion)
        chunk.chunk_bwd(q, k, v, g, beta, Gc, Aq, Mi, W, Kd, Qg, h, D, Rn, torch.empty_like(o), None, False,
                        K**-0.5, None, 32, *fusion)
    with aot.record_launches(fused_recurrent, "_fused_recurrent_fwd") as decode:
        state = torch.empty(B, H, K, V, device=META)
        one = [x[:, :1] for x in (q, k, v, g.float(), beta)]
        fused_recurrent.fused_recurrent_fwd(*one, K**-0.5, state, state, None)
    return launches + decode


def _attn_res(N: int, M: int, D: int) -> list[aot.Launch]:
    from k3lit.kernels.attn_res import mix

    sources = [torch.empty(M, D, device=META, dtype=torch.float32 if i == 0 else torch.bfloat16) for i in range(N)]
    query = torch.empty(D, device=META)
    with aot.record_launches(mix, "_mix_fwd", "_mix_bwd") as launches:
        out, src_stats, row_stats = mix.mix_fwd(sources, query, 1e-6)
        mix.mix_bwd(sources, query, src_stats, row_stats, torch.empty_like(out))
    return launches


def _short_conv(B: int, T: int, C: int) -> list[aot.Launch]:
    from k3lit.kernels.short_conv import conv

    x = torch.empty(B, T, C, device=META, dtype=torch.bfloat16)
    w = torch.empty(C, 4, device=META)
    with aot.record_launches(conv, "_fwd", "_bwd") as launches:
        conv.conv_fwd(x, w)
        conv.conv_bwd(x, w, torch.empty_like(x))
    return launches


def configs() -> dict[str, list[aot.Launch]]:
    """Benchmark shapes (bf16): KDA as issue 3's B4·T4096·H16 and K = V = 128 / 256 (plain inputs, and with the
    gate and q/k L2 norm fused), the depth mix at N = 11 over B2·T4096·D1024, the q|k|v short convolution of
    the small recipe (B16·T2048, 3·8·128 channels), and one with more than 2^31 elements."""
    return {
        "KDA K=V=128": _kda(4, 4096, 16, 128, 128, False, False),
        "KDA K=V=128, gate + q/k L2 norm fused": _kda(4, 4096, 16, 128, 128, True, True),
        "KDA K=V=256": _kda(1, 8192, 32, 256, 256, False, False),
        "AttnRes mix N=11 D=1024": _attn_res(11, 2 * 4096, 1024),
        "short conv C=3072": _short_conv(16, 2048, 3072),
        "short conv, B·T·C >= 2^31 (int64 offsets)": _short_conv(8, 32768, 8192),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--json", help="also write the rows as JSON to this path")
    p.add_argument("--no-write", action="store_true", help="do not touch RESULTS.md")
    p.add_argument("--only", help="compile only configurations whose name contains this text")
    args = p.parse_args()
    if os.environ.get("TRITON_INTERPRET") == "1":
        sys.exit("unset TRITON_INTERPRET: the kernels must be compilable JIT functions")
    rows = []
    for name, launches in configs().items():
        if args.only and args.only not in name:
            continue
        for launch in launches:
            r = aot.compile_launch(launch)
            blocks = REGS_PER_SM // (r.registers * 32 * r.num_warps)
            rows.append({"config": name, **dataclasses.asdict(r), "blocks_per_sm_by_registers": blocks})
            print(f"{name:40s} {r.name:22s} regs {r.registers:3d}  spill st/ld {r.spill_stores:4d}/"
                  f"{r.spill_loads:4d} B  smem {r.shared_bytes / 1024:5.1f} KiB  warps {r.num_warps:2d}  "
                  f"blocks/SM {blocks}", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    if args.no_write:
        return
    import triton
    from triton.backends.nvidia.compiler import get_ptxas

    ptxas = subprocess.run([get_ptxas(90).path, "--version"], capture_output=True, text=True).stdout
    ptxas = ptxas.strip().splitlines()[-1]
    lines = [
        f"{datetime.date.today()} · compiled offline (no GPU) for sm_90a (H200) by `python "
        f"benchmarks/kernel_resources.py` · triton {triton.__version__} · ptxas {ptxas}. Per thread: registers "
        "(255 is the limit), bytes spilled to local memory (stores / loads); per block: static shared memory; "
        "blocks/SM = how many blocks the register file holds (65,536 registers).",
        "",
        "| configuration | kernel | registers | spill stores / loads (B) | shared KiB | warps | blocks/SM |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(f"| {r['config']} | `{r['name']}` | {r['registers']} | {r['spill_stores']} / {r['spill_loads']} "
                     f"| {r['shared_bytes'] / 1024:.1f} | {r['num_warps']} | {r['blocks_per_sm_by_registers']} |")
    write_section("Kernel resources on sm_90a (compiled offline)", "\n".join(lines))


if __name__ == "__main__":
    main()
