"""Every Triton kernel compiles for the H200 (sm_90a) on this CPU machine: Triton's compiler and the ptxas it
ships need no GPU. The interpreter tests check what the kernels compute; this checks that the GPU compiler
accepts them at the benchmark shapes (the interpreter runs code the GPU compiler can reject) and that ptxas
reports their resources."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_all_kernels_compile_for_sm90(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path / "cache")  # compile for real, not from an earlier run's cache
    out = tmp_path / "resources.json"
    run = subprocess.run([sys.executable, "benchmarks/kernel_resources.py", "--no-write", "--json", str(out)],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-4000:]
    rows = json.loads(out.read_text())
    compiled = {(r["config"], r["name"]) for r in rows}
    # the scan kernels each shape gets from plan._scan_plan (transposed from 64 / 96 sequence-heads)
    plain_fwd, transposed_fwd = ("_scan_fwd", "_out_fwd"), ("_scan_fwd_t",)
    kda_scans = {
        "KDA K=V=128": (*transposed_fwd, "_scan_bwd"),
        "KDA K=V=128, gate + q/k L2 norm fused": (*transposed_fwd, "_scan_bwd"),
        "KDA K=V=64, gate + q/k L2 norm fused (`small`: B16 T2048 H12)": (*transposed_fwd, "_scan_bwd_t"),
        "KDA K=V=256": (*plain_fwd, "_scan_bwd"),
        "KDA K=V=128, float32 inputs (3xTF32 products)": (*plain_fwd, "_scan_bwd"),
        "KDA K=V=256, float32 inputs, B1 H96": (*plain_fwd, "_scan_bwd"),  # never transposed: 408 KB
    }
    kda_other = ("_prep_fwd", "_main_bwd", "_fused_recurrent_fwd")
    expected = {(c, n) for c, scans in kda_scans.items() for n in (*scans, *kda_other)}
    expected |= {("KDA K=V=128, B1 H16 (plain scans, 16-wide forward blocks)", n) for n in (*plain_fwd, "_scan_bwd")}
    expected |= {("KDA K=V=128, B1 H96 (transposed scans)", n) for n in (*transposed_fwd, "_scan_bwd_t")}
    expected |= {("KDA K=V=128, no backward, split, u_dtype work", n) for n in ("_intra_fwd", "_wy_fwd")}
    expected |= {("KDA K=V=256, plain scan writing the output", "_scan_fwd")}
    expected |= {("KDA K=V=128, B2 H16, no backward (plain scan writing the output)", "_scan_fwd")}
    expected |= {("KDA K=V=256, B8 H32 (transposed forward scan)", "_scan_fwd_t")}
    expected |= {("KDA K=V=256, B8 H32, no backward (128-wide transposed forward scan)", "_scan_fwd_t")}
    expected |= {("KDA K=V=128, intra and wy in two kernels", n) for n in ("_intra_fwd", "_wy_fwd")}
    expected |= {(f"KDA K=V=128, {s}", "_prep_fwd")
                 for s in ("inverse by substitution", "no backward, inverse by substitution", "no backward")}
    expected |= {("KDA K=V=128, pipeline segments", n) for n in ("_out_fwd", "_main_bwd")}
    expected |= {("KDA K=V=64 (`small`), `_main_bwd` on 8 warps, `_prep_fwd` on 2", n)
                 for n in ("_prep_fwd", "_main_bwd")}
    expected |= {("KDA K=V=64 (`small`), `_main_bwd` keeping its key results in float32 scratch", "_main_bwd")}
    expected |= {("AttnRes mix N=11 D=1024", "_mix_fwd"), ("AttnRes mix N=11 D=1024", "_mix_bwd"),
                 ("short conv C=3072", "_fwd"), ("short conv C=3072", "_bwd_p"),
                 ("short conv C=3072", "_bwd_dx")}
    expected |= {("short conv, B·T·C >= 2^31 (int64 offsets)", n) for n in ("_fwd", "_bwd_p", "_bwd_dx")}
    expected |= {("MoE routing m=32768 n=16 k=2, causal capacity 4506", n)
                 for n in ("_free_choices", "_admit", "_block_counts", "_place")}
    expected |= {("AttnRes two-phase N=6 S=4 D=1024", n)
                 for n in ("_inter_fwd", "_inter_bwd_logits", "_inter_bwd_sources", "_merge_fwd", "_merge_bwd")}
    assert compiled == expected
    for r in rows:
        assert 0 < r["registers"] <= 255 and r["num_warps"] in (1, 2, 4, 8), r
        assert r["blocks_per_sm"] >= 1, r  # launchable on an H200 (shared memory, registers)
