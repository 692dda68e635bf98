"""Where the KDA kernels' time goes, kernel by kernel, and which launch settings are fastest on this GPU.

``benchmarks/kda.py`` times whole calls; this script splits them. For each shape it runs ours (and fla
``chunk_kda(safe_gate=True, lower_bound=-5)`` with ``--fla``) under ``torch.profiler`` and sums every device
kernel's time per call (CUPTI kernel durations: the profiler's host overhead does not enter them), forward and
forward+backward. ``--sweep`` times the alternatives of ``k3lit.kernels.kda.plan.TUNING`` (scan layout, value
block, warps) with ``triton.testing.do_bench``, each checked against the default first.

    python benchmarks/kda_breakdown.py --shapes 1x65536x16x128 8x2048x16x128 [--fla] [--sweep] [--json out.json]
    python benchmarks/kda_breakdown.py --sweep --no-breakdown --variants forward --shapes ...   # FORWARD_VARIANTS

``fwd`` and ``f+b`` are the call's time (``fwd`` without gradients, as inference runs); the per-kernel times after
them add up over streams and exceed it when pipeline segments (``fwd_segments``, ``bwd_segments``) overlap kernels.
Each sweep line is printed as it is timed and ``--json`` is rewritten after each shape, so a run cut short by a
time limit keeps what it measured: split the shapes over several calls as the limit needs.

``--fla-compile-worker I/P`` fills ``TRITON_CACHE_DIR`` with fla's compiled candidates for these shapes (see
benchmarks/kda.py and benchmarks/triton_warm.py); run P of them before the timing process.
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import sys
from collections import Counter, defaultdict

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.kda import bench, inputs, load_fla, make_fla, ours  # noqa: E402
from k3lit.kernels.kda import plan  # noqa: E402
from k3lit.testing import rel_rms  # noqa: E402

#: Alternatives of plan.TUNING timed by --sweep (each a partial update of the defaults).
SWEEP = {
    "default": {},
    "fwd plain": dict(fwd_scan="plain"),
    "fwd transposed": dict(fwd_scan="transposed"),
    "fwd plain bv32": dict(fwd_scan="plain", fwd_bv=32),
    "fwd plain bv64": dict(fwd_scan="plain", fwd_bv=64),
    "bwd plain": dict(bwd_scan="plain"),
    "bwd transposed": dict(bwd_scan="transposed"),
    "main_bwd bv32": dict(main_bwd_bv=32),
    "main_bwd bv64": dict(main_bwd_bv=64),
    "main_bwd 8 warps": dict(main_bwd_warps=8),
    "scan 4 warps": dict(scan_warps=4),
    "scan 8 warps": dict(scan_warps=8),
    "fwd transposed bv32": dict(fwd_scan="transposed", fwd_bv=32),
    "fwd transposed bv16": dict(fwd_scan="transposed", fwd_bv=16),
    "fwd transposed bv128": dict(fwd_scan="transposed", fwd_bv=128),
    "fwd transposed bv128, u work dtype": dict(fwd_scan="transposed", fwd_bv=128, u_dtype="work"),
    "fwd transposed bv128 8 warps": dict(fwd_scan="transposed", fwd_bv=128, scan_warps=8),
    "split intra + wy": dict(fwd_prep="split"),
    "split, intra 1 warp": dict(fwd_prep="split", intra_warps=1),
    "split, intra 4 warps": dict(fwd_prep="split", intra_warps=4),
    "split, intra bk32 4 warps": dict(fwd_prep="split", intra_bk=32, intra_warps=4),
    "split, wy bk32 bv32 2 warps": dict(fwd_prep="split", wy_bk=32, wy_bv=32, wy_warps=2),
    "prep 2 warps": dict(prep_warps=2),
    "prep bk64": dict(wy_bk=64, wy_bv=64),
    "prep bk32 bv64": dict(wy_bv=64),
    "prep bk16": dict(wy_bk=16, wy_bv=16),
    "prep bk16 bv32": dict(wy_bk=16),
    "inverse by substitution": dict(inverse_block=32),
    "inverse 8": dict(inverse_block=8),
    "inverse 4": dict(inverse_block=4),
    "u work dtype": dict(u_dtype="work"),
    "fwd plain fused out": dict(fwd_scan="plain", fwd_plain_out="fused"),
    "fwd plain bv16": dict(fwd_scan="plain", fwd_bv=16),
    "fwd plain fused out bv16": dict(fwd_scan="plain", fwd_plain_out="fused", fwd_bv=16),
    "fwd plain fused out 8 warps": dict(fwd_scan="plain", fwd_plain_out="fused", scan_warps=8),
    "u work, fwd plain fused out": dict(u_dtype="work", fwd_scan="plain", fwd_plain_out="fused"),
    "no segments": dict(fwd_segments=1, bwd_segments=1),
    "segments 4": dict(fwd_segments=4),
    "segments 8": dict(fwd_segments=8),
    "bwd segments 4": dict(bwd_segments=4),
}
#: Settings that leave every result bit-identical (the same arithmetic in the same order, split differently).
BIT_IDENTICAL = {"fwd_segments", "bwd_segments"}
#: The forward's alternatives around the defaults: the per-chunk work split in two kernels, the one kernel's warps
#: and steps (offline: 16-wide steps spill-free at 232-242 registers, still 8 blocks per SM), fewer bytes, the scan
#: writing the output, pipeline segments forced on and off. Timed as a group in sessions 9 and 10 (RESULTS.md, "KDA
#: launch settings").
FORWARD_VARIANTS = ["split intra + wy", "prep 2 warps", "prep bk64", "prep bk32 bv64",
                    "prep bk16", "prep bk16 bv32", "u work dtype",
                    "fwd plain fused out", "u work, fwd plain fused out", "no segments", "segments 4", "segments 8",
                    "bwd segments 4"]
#: The inverse's diagonal blocks (``inverse_block``, default 16) around session 10's defaults: the plain substitution
#: (session 9's kernel), 8- and 4-wide blocks (fewer dependent steps, more doublings); their instruction counts:
#: benchmarks/kda_sass.py. The H200 sweep of session 10 (kda_sweep_h200_s10_inverse.json) found 16 the fastest.
INVERSE_VARIANTS = ["inverse by substitution", "inverse 8", "inverse 4"]
#: ``--variants`` group names.
#: The forward scan's layouts and value blocks, and the scan writing the output, untimed since the scans load G_last
#: ahead (sessions 11-12): candidates where the forward still misses 1.5x fla (T32768, H96, D256; RESULTS.md).
SCAN_VARIANTS = ["fwd plain", "fwd transposed", "fwd transposed bv32", "fwd plain bv64", "fwd plain fused out",
                 "segments 4"]
VARIANT_GROUPS = {"forward": FORWARD_VARIANTS, "inverse": INVERSE_VARIANTS, "scan": SCAN_VARIANTS}


def shape(text: str) -> tuple[int, int, int, int]:
    b, t, h, d = (int(x) for x in text.split("x"))
    return b, t, h, d


def kernel_ms(fn, n: int = 5) -> dict[str, float]:
    """Device time (ms) per call of every kernel ``fn`` launches, from ``n`` profiled calls after a warm-up."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(n):
            fn()
        torch.cuda.synchronize()
    out: dict[str, float] = defaultdict(float)
    for e in prof.key_averages():
        if e.device_type == DeviceType.CUDA:
            out[e.key[:60]] += e.self_device_time_total / n / 1e3
    return dict(sorted(out.items(), key=lambda kv: -kv[1]))


def calls(fn, B: int, T: int, H: int, D: int):
    xs = inputs(B, T, H, D, D, requires_grad=True)
    do = torch.randn(B, T, H, D, device="cuda", dtype=torch.bfloat16)

    def fwd():
        with torch.no_grad():
            fn(*xs)

    def fwd_bwd():
        fn(*xs)[0].backward(do)

    return fwd, fwd_bwd


def breakdown(name: str, fn, shp, report: dict) -> None:
    fwd, fb = calls(fn, *shp)
    for label, f in (("fwd", fwd), ("fwd+bwd", fb)):
        ks = kernel_ms(f)
        report.setdefault(name, {}).setdefault(str(shp), {})[label] = ks
        print(f"{name} {shp} {label}: total {sum(ks.values()):.3f} ms = "
              + ", ".join(f"{k} {v:.3f}" for k, v in list(ks.items())[:8]), flush=True)


def sweep(shapes, report: dict, variants: list[str] | None = None, json_path: str | None = None) -> None:
    defaults = dict(plan.TUNING)
    unknown = set(variants or ()) - set(SWEEP)
    if unknown:
        sys.exit(f"unknown --variants {sorted(unknown)}; known: {list(SWEEP)}")
    for B, T, H, D in shapes:
        xs = inputs(B, T, H, D, D, requires_grad=True)
        do = torch.randn(B, T, H, D, device="cuda", dtype=torch.bfloat16)
        ref = None
        for label, upd in SWEEP.items():
            if variants and label not in variants and label != "default":
                continue
            plan.TUNING.clear()
            plan.TUNING.update(defaults, **upd)
            try:
                o, _ = ours(*xs)
                grads = torch.autograd.grad(o, xs, do)
                with torch.no_grad():  # the forward that the fwd column times (no saves)
                    got = [o, *grads, ours(*xs)[0]]
                if ref is None:
                    ref = got
                err = max(rel_rms(a, b) for a, b in zip(got[:-1], ref[:-1]))
                err_fwd = rel_rms(got[-1], ref[-1])
                with torch.no_grad():
                    f = bench(lambda xs=xs: ours(*xs))
                fb = bench(lambda xs=xs, do=do: ours(*xs)[0].backward(do))
                for x in xs:
                    x.grad = None
                with torch.no_grad():
                    ks = kernel_ms(lambda xs=xs: ours(*xs))
            except Exception as exc:  # noqa: BLE001 - a config that fails to compile is reported, not fatal
                print(f"sweep {label} {(B, T, H, D)}: failed {exc!r}"[:300], flush=True)
                continue
            # pipeline segments change no sum: anything but bit-identical results is a bug
            wrong = set(upd) <= BIT_IDENTICAL and (err != 0 or err_fwd != 0)
            report.setdefault("sweep", {}).setdefault(str((B, T, H, D)), {})[label] = dict(
                fwd=f, fb=fb, diff=err, diff_fwd=err_fwd, fwd_kernels=ks, wrong=wrong)
            print(f"sweep {(B, T, H, D)} {label:22s} fwd {f:.3f} f+b {fb:.3f} ms  (vs default: o and gradients "
                  f"{err:.1e}, o without gradients {err_fwd:.1e}{', MUST BE 0: WRONG' if wrong else ''}) "
                  + " ".join(f"{k} {v:.2f}" for k, v in ks.items() if k.startswith("_")), flush=True)
        if json_path:
            with open(json_path, "w") as fh:
                json.dump(report, fh, indent=1)
    plan.TUNING.clear()
    plan.TUNING.update(defaults)


def table(paths: list[str]) -> str:
    """A markdown table of the sweeps stored by ``--json`` in ``paths``: a row per variant (each file's in its
    order; a variant in several files, such as the default, named by the file too), a column per shape, each cell
    ``fwd / f+b`` median ms with the fastest forward and forward+backward of each shape (over all files) in bold;
    shapes missing in a file are blank."""
    runs = []
    for path in paths:
        with open(path) as f:
            runs.append((os.path.basename(path), json.load(f)["sweep"]))
    shapes = list(dict.fromkeys(s for _, r in runs for s in r))
    labels = [(name, r, list(dict.fromkeys(v for s in r for v in r[s]))) for name, r in runs]
    count = Counter(label for _, _, ls in labels for label in ls)
    rows = [(f"{label} ({name})" if count[label] > 1 else label, {s: r[s].get(label) for s in r})
            for name, r, ls in labels for label in ls]
    best = {s: [min(c[s][k] for _, c in rows if c.get(s)) for k in ("fwd", "fb")] for s in shapes}

    def cell(x: dict | None, s: str) -> str:
        if x is None:
            return ""
        return " / ".join(f"**{x[k]:.2f}**" if x[k] == b else f"{x[k]:.2f}" for k, b in zip(("fwd", "fb"), best[s]))

    head = "| variant | " + " | ".join("B{} T{} H{} D{}".format(*ast.literal_eval(s)) for s in shapes) + " |"
    lines = [head, "|---" * (len(shapes) + 1) + "|"]
    lines += ["| " + label + " | " + " | ".join(cell(c.get(s), s) for s in shapes) + " |" for label, c in rows]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", nargs="+", type=shape, default=[(1, 65536, 16, 128), (8, 2048, 16, 128)],
                    metavar="BxTxHxD", help="shapes, K = V = D (default: 1x65536x16x128 8x2048x16x128)")
    ap.add_argument("--fla", action="store_true", help="also break down fla's chunk_kda")
    ap.add_argument("--sweep", action="store_true", help="time the alternatives of plan.TUNING")
    ap.add_argument("--variants", nargs="+", metavar="NAME",
                    help="sweep only these SWEEP entries (and the default), or groups of them: "
                    + ", ".join(VARIANT_GROUPS))
    ap.add_argument("--no-breakdown", action="store_true", help="skip the per-kernel breakdown (with --sweep)")
    ap.add_argument("--json", help="write every number here")
    ap.add_argument("--fla-compile-worker", metavar="I/P", help="only compile share I of P of fla's candidates")
    ap.add_argument("--table", nargs="+", metavar="JSON", help="print the sweeps stored by --json as one table")
    a = ap.parse_args()
    if a.table:
        print(table(a.table))
        return
    if not torch.cuda.is_available():
        sys.exit("kda_breakdown.py times CUDA kernels: it needs a GPU")
    if a.fla_compile_worker:
        from benchmarks.triton_warm import compile_only

        compile_only(*map(int, a.fla_compile_worker.split("/")))
        fla = make_fla(load_fla())
        for shp in a.shapes:
            calls(fla, *shp)[1]()
        return
    report: dict = {"gpu": torch.cuda.get_device_name(), "tuning": dict(plan.TUNING)}
    if not a.no_breakdown:
        fla = make_fla(load_fla()) if a.fla else None
        for shp in a.shapes:
            breakdown("k3lit", ours, shp, report)
            if fla is not None:
                breakdown("fla", fla, shp, report)
    if a.sweep:
        names = [n for v in a.variants or () for n in VARIANT_GROUPS.get(v, [v])]
        sweep(a.shapes, report, names or None, a.json)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
