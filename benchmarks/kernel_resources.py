"""Registers, spills and shared memory of every k3lit Triton kernel, compiled for the H200 (sm_90a) on any machine.

Each launcher runs on ``meta`` tensors of the benchmark shapes while :func:`k3lit.kernels.aot.record_launches`
records its launches; every launch is then compiled by Triton and ptxas for sm_90a (no GPU needed). A kernel
that spills its register tile to local memory, or needs so many registers that few warps fit on an SM, shows
here before it is timed.

    python benchmarks/kernel_resources.py            # table on stdout, section in RESULTS.md
    python benchmarks/kernel_resources.py --json r.json --no-write

Columns: registers per thread, spill stores / loads (bytes per thread), the shared memory Triton requests per
block, warps per block, and resident blocks per SM with the resource that limits them (sm_90 limits below).
Must run without ``TRITON_INTERPRET`` (the kernels must be defined as compilable JIT functions). The numbers
depend on the Triton version (the section title names it; one section per version).
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
from k3lit.kernels.launches import SHORT_CONV_KERNELS, kda_launches, routing_launches  # noqa: E402

# Hopper (sm_90) per-SM limits: 64K 32-bit registers, allocated per warp in 256-register units of
# 8-register-per-thread steps; 228 KiB shared memory with 1 KiB reserved per block; 64 warps; 32 blocks.
REGS_PER_SM, SMEM_PER_SM, SMEM_RESERVED, WARPS_PER_SM, BLOCKS_PER_SM = 65536, 228 * 1024, 1024, 64, 32
META = torch.device("meta")


def _kda(B: int, T: int, H: int, K: int, V: int, gate: bool, l2: bool, dtype: torch.dtype = torch.bfloat16,
         scans_only: bool = False, only: tuple[str, ...] = (), tuning: dict | None = None,
         save: bool = True) -> list[aot.Launch]:
    """The chunked KDA launches at one shape (which scan kernels run depends on it: ``plan._scan_plan``) and the
    one-token decode; ``scans_only``: only the scan kernels and ``_out_fwd``; ``only``: only these kernels;
    ``tuning``: with these ``plan.TUNING`` settings; ``save=False``: the forward without a backward to follow (the
    backward's launches are still recorded, on what it would read)."""
    from k3lit.kernels.kda import fused_recurrent, plan

    if tuning:
        saved = dict(plan.TUNING)
        plan.TUNING.update(tuning)
        try:
            return _kda(B, T, H, K, V, gate, l2, dtype, scans_only, only, None, save)
        finally:
            plan.TUNING.clear()
            plan.TUNING.update(saved)

    recorded = kda_launches(B, T, H, K, V, dtype, -5.0, fused_gate=gate, qk_l2norm=l2, save=save, beta_dtype=dtype)
    launches = list({x.name: x for x in reversed(recorded)}.values())[::-1]  # pipeline segments relaunch a kernel
    if scans_only:
        return [x for x in launches if x.name.startswith(("_scan", "_out"))]
    if only:
        return [x for x in launches if x.name in only]
    with aot.record_launches(fused_recurrent, "_fused_recurrent_fwd") as decode:
        state = torch.empty(B, H, K, V, device=META)
        q, k, g = (torch.empty(B, T, H, K, device=META, dtype=d) for d in (dtype, dtype, torch.float32))
        v, beta = torch.empty(B, T, H, V, device=META, dtype=dtype), torch.empty(B, T, H, device=META, dtype=dtype)
        one = [x[:, :1] for x in (q, k, v, g, beta)]
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


def _attn_res_two_phase(N: int, S: int, M: int, D: int) -> list[aot.Launch]:
    from k3lit.kernels.attn_res import two_phase

    blocks = [torch.empty(M, D, device=META, dtype=torch.float32 if i == 0 else torch.bfloat16) for i in range(N)]
    queries = torch.empty(S, D, device=META)
    names = ("_inter_fwd", "_inter_bwd_logits", "_inter_bwd_sources", "_merge_fwd", "_merge_bwd")
    with aot.record_launches(two_phase, *names) as launches:
        mixes, lse, su, r, mz = two_phase.inter_fwd(blocks, queries, 1e-6)
        two_phase.inter_bwd(blocks, queries, su, r, mz, [torch.empty_like(x) for x in mixes], lse)
        two_phase.merge_bwd(mixes[1], mixes[1], lse[1], blocks[1], queries[1], 1e-6)
        two_phase.merge_fwd(mixes[1], lse[1], blocks[1], queries[1], 1e-6)
    return launches


def _short_conv(B: int, T: int, C: int) -> list[aot.Launch]:
    from k3lit.kernels.short_conv import conv

    x = torch.empty(B, T, C, device=META, dtype=torch.bfloat16)
    w = torch.empty(C, 4, device=META)
    with aot.record_launches(conv, *SHORT_CONV_KERNELS) as launches:
        ys = conv.conv_fwd(x, w, 3)  # a KDA layer's q, k and v
        conv.conv_bwd(x, w, [torch.empty_like(y) for y in ys])
    return launches


def configs() -> dict[str, list[aot.Launch]]:
    """Benchmark shapes (bf16 unless named): KDA at B4·T4096·H16·K128 (plain inputs, and with the gate
    and q/k L2 norm fused) and at ``small``'s B16·T2048·H12·K64 (fused, with three launch settings), fla's
    B1·T8192·H32·K256 shape, and float32 inputs; the scan kernels at two more
    shapes, so that both state layouts of both scans are compiled (``plan._scan_plan`` picks them by shape), and
    the forward alternatives of ``plan.TUNING`` that change kernels;
    the depth mix at N = 11 over B2·T4096·D1024 (the 300m model of benchmarks/attnres.py) and its two-phase
    kernels for a block of 4 sublayers over 6 summaries at batch 8; the q|k|v short
    convolution of that model (3·8·128 = 3072 channels) at B16·T2048, and one with more than 2^31 elements; an MoE
    layer's routing at ``small``'s shape with causal capacity at cf 1.1 (4,506 tokens an expert)."""
    return {
        "KDA K=V=128": _kda(4, 4096, 16, 128, 128, False, False),
        "KDA K=V=128, gate + q/k L2 norm fused": _kda(4, 4096, 16, 128, 128, True, True),
        "KDA K=V=64, gate + q/k L2 norm fused (`small`: B16 T2048 H12)": _kda(16, 2048, 12, 64, 64, True, True),
        "KDA K=V=64 (`small`), `_main_bwd` on 8 warps, `_prep_fwd` on 2": _kda(
            16, 2048, 12, 64, 64, True, True, only=("_prep_fwd", "_main_bwd"),
            tuning=dict(main_bwd_warps=8, prep_warps=2)),
        "KDA K=V=64 (`small`), `_main_bwd` keeping its key results in float32 scratch": _kda(
            16, 2048, 12, 64, 64, True, True, only=("_main_bwd",), tuning=dict(main_bwd_keep="scratch")),
        "KDA K=V=256": _kda(1, 8192, 32, 256, 256, False, False),
        "KDA K=V=128, float32 inputs (3xTF32 products)": _kda(1, 4096, 16, 128, 128, False, False, torch.float32),
        "KDA K=V=256, float32 inputs, B1 H96": _kda(1, 2048, 96, 256, 256, False, False, torch.float32),
        "KDA K=V=128, B1 H16 (plain scans, 16-wide forward blocks)": _kda(1, 65536, 16, 128, 128, False, False,
                                                                          scans_only=True),
        "KDA K=V=128, B1 H96 (transposed scans)": _kda(1, 8192, 96, 128, 128, False, False, scans_only=True),
        "KDA K=V=128, B2 H16, no backward (plain scan writing the output)": _kda(
            2, 8192, 16, 128, 128, False, False, only=("_scan_fwd",), save=False),
        "KDA K=V=128, no backward, split, u_dtype work": _kda(
            4, 4096, 16, 128, 128, False, False, only=("_intra_fwd", "_wy_fwd"),
            tuning=dict(fwd_prep="split", u_dtype="work"), save=False),
        "KDA K=V=256, B8 H32 (transposed forward scan)": _kda(8, 2048, 32, 256, 256, False, False,
                                                              only=("_scan_fwd_t",)),
        "KDA K=V=256, B8 H32, no backward (128-wide transposed forward scan)": _kda(
            8, 2048, 32, 256, 256, False, False, only=("_scan_fwd_t",), save=False),
        "KDA K=V=256, plain scan writing the output": _kda(1, 8192, 32, 256, 256, False, False, only=("_scan_fwd",),
                                                           tuning=dict(fwd_plain_out="fused")),
        "KDA K=V=128, intra and wy in two kernels": _kda(4, 4096, 16, 128, 128, False, False,
                                                         only=("_intra_fwd", "_wy_fwd"), tuning=dict(fwd_prep="split")),
        "KDA K=V=128, inverse by substitution": _kda(4, 4096, 16, 128, 128, False, False, only=("_prep_fwd",),
                                                     tuning=dict(inverse_block=32)),
        "KDA K=V=128, no backward, inverse by substitution": _kda(
            4, 4096, 16, 128, 128, False, False, only=("_prep_fwd",), tuning=dict(inverse_block=32), save=False),
        "KDA K=V=128, no backward": _kda(4, 4096, 16, 128, 128, False, False, only=("_prep_fwd",), save=False),
        "KDA K=V=128, pipeline segments": _kda(4, 4096, 16, 128, 128, False, False,
                                               only=("_out_fwd", "_main_bwd"),
                                               tuning=dict(fwd_segments=4, bwd_segments=4, fwd_scan="plain")),
        "AttnRes mix N=11 D=1024": _attn_res(11, 2 * 4096, 1024),
        "AttnRes two-phase N=6 S=4 D=1024": _attn_res_two_phase(6, 4, 8 * 4096, 1024),
        "short conv C=3072": _short_conv(16, 2048, 3072),
        "short conv, B·T·C >= 2^31 (int64 offsets)": _short_conv(8, 32768, 8256),
        "MoE routing m=32768 n=16 k=2, causal capacity 4506": routing_launches(16 * 2048, 16, 2, 2048, 4506),
    }


def blocks_per_sm(r: aot.Resources) -> tuple[int, str]:
    """Resident blocks per SM on sm_90 for a kernel's registers, shared memory and warps, and which resource
    limits it (``"registers"``, ``"shared memory"``, ``"warps"``)."""
    regs_per_warp = -(-((r.registers + 7) // 8 * 8) * 32 // 256) * 256
    limits = {
        "registers": REGS_PER_SM // (regs_per_warp * r.num_warps),
        "shared memory": SMEM_PER_SM // (r.shared_bytes + SMEM_RESERVED),
        "warps": min(WARPS_PER_SM // r.num_warps, BLOCKS_PER_SM),
    }
    name = min(limits, key=limits.get)
    return limits[name], name


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
            blocks, limit = blocks_per_sm(r)
            rows.append({"config": name, **dataclasses.asdict(r), "blocks_per_sm": blocks, "limited_by": limit})
            print(f"{name:44s} {r.name:22s} regs {r.registers:3d}  spill st/ld {r.spill_stores:4d}/"
                  f"{r.spill_loads:4d} B  smem {r.shared_bytes / 1024:5.1f} KiB  warps {r.num_warps:2d}  "
                  f"blocks/SM {blocks} ({limit})", flush=True)
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
        "(255 is the limit), bytes spilled to local memory (stores / loads); per block: the shared memory Triton "
        "requests, warps; blocks/SM: how many blocks fit on one SM by registers, shared memory and warps, and the "
        "resource that limits it. Numbers differ between Triton versions: the H200 machine runs triton 3.6, "
        "`make install` gets the newest (`pip install --no-deps --target DIR triton==3.6.0` and "
        "`PYTHONPATH=DIR` reproduce the 3.6 table).",
        "",
        "| configuration | kernel | registers | spill stores / loads (B) | shared KiB | warps | blocks/SM |",
        "|---|---|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        lines.append(f"| {r['config']} | `{r['name']}` | {r['registers']} | {r['spill_stores']} / {r['spill_loads']} "
                     f"| {r['shared_bytes'] / 1024:.1f} | {r['num_warps']} | {r['blocks_per_sm']} "
                     f"({r['limited_by']}) |")
    write_section(f"Kernel resources on sm_90a (compiled offline, triton {triton.__version__})", "\n".join(lines))


if __name__ == "__main__":
    main()
