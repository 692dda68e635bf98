"""KDA kernels: k3lit's Triton kernels vs fla ``chunk_kda(safe_gate=True, lower_bound=-5)`` vs torch SDPA.

Correctness first: ours (and fla, when installed) against the float64 token-by-token reference on the
same bf16 inputs; on a red gate no timing is reported. Then bf16 forward and forward+backward median times
of all three in one process (``triton.testing.do_bench``), tokens/s and TFLOP/s, written to
``benchmarks/RESULTS.md`` (section "KDA kernels"; other sections are kept).

fla autotunes each kernel at its first call (every candidate config compiled, then timed). To fit a short GPU
lease without changing what fla chooses: ``--fla-compile-worker I/P`` processes fill ``TRITON_CACHE_DIR``
with the compiled candidates in parallel (benchmarks/triton_warm.py; they time nothing), then the timing
process autotunes fla as usual (every candidate timed by fla's own autotuner on the idle GPU) and, fla
passing ``cache_results``, stores its choices in ``TRITON_CACHE_DIR``. Carrying that folder to the next run
on the same software skips the autotuning there. Each worker also runs fla once per shape on the GPU: 12 of
them run a 140 GB H200 out of memory at the D = 256 shape (its candidates are then compiled, slowly, by the
timing process); 6 workers run it without trouble. ::

    export TRITON_CACHE_DIR=/tmp/tc
    for i in $(seq 0 5); do python benchmarks/kda.py --fla-compile-worker $i/6 & done; wait
    python benchmarks/kda.py

FLOP model (the same for both KDA implementations, so TFLOP/s compare like with like; C fixed at fla's 64
whatever chunk our kernels use): per token and head, forward = 6CK + 4CV + 6KV (A_kk, A_qk, W, U, W S, Q S,
Aq Delta, state update) and forward+backward = 3x forward. SDPA causal: forward 2 T^2 D per head (half of
4 T^2 D), backward 2.5x.

``--fused-inputs`` times the op as the layer calls it, from raw q, k and the gate pre-activation e: ours with
the gate ``g_min * sigmoid(e + bias)`` and the q/k L2 norm fused into the kernels, ours with both done in
PyTorch first, and fla with its in-kernel L2 norm and the gate in PyTorch (fla's in-kernel gate is another
formula); section "KDA with fused gate and q/k L2 norm".

Usage: ``python benchmarks/kda.py [--quick] [--no-fla] [--no-sdpa] [--fused-inputs] [--time-anyway]
[--shapes BxTxHxD ...] [--fla-compile-worker I/P] [--results benchmarks/RESULTS.md]``.
"""

from __future__ import annotations

import argparse
import datetime
import math
import os
import sys
import time

import torch
import torch.nn.functional as F

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from benchmarks.results import command, write_section  # noqa: E402
from k3lit.kernels.kda import kda_triton  # noqa: E402
from k3lit.ops.kda import kda_reference  # noqa: E402
from k3lit.testing import rel_rms  # noqa: E402

G_MIN = -5.0
GRADS = ("dq", "dk", "dv", "dg", "dbeta", "dh0")  # of q, k, v, g, beta, h0, in that order
TOL = {"o": 0.005, "ht": 0.005, "dq": 0.008, "dk": 0.008, "dv": 0.008, "dg": 0.02, "dbeta": 0.02, "dh0": 0.008}
SHAPES = [  # (B, T, H, D)
    (8, 2048, 16, 128),
    (4, 4096, 16, 128),
    (2, 8192, 16, 128),
    (1, 16384, 16, 128),
    (1, 32768, 16, 128),
    (1, 65536, 16, 128),
    (1, 8192, 96, 128),
    (8, 2048, 32, 256),
]


def load_fla():
    try:
        from fla.ops.kda import chunk_kda

        return chunk_kda
    except Exception as e:  # noqa: BLE001 - report any import failure and run without fla
        print(f"fla not available: {e!r}")
        return None


def ours(q, k, v, g, beta, h0=None, cu=None):
    return kda_triton(q, k, v, g, beta, None, h0, h0 is not None, cu, g_min=G_MIN)


def make_fla(chunk_kda):
    def run(q, k, v, g, beta, h0=None, cu=None):
        return chunk_kda(q, k, v, g, beta, scale=q.shape[-1] ** -0.5, initial_state=h0,
                         output_final_state=h0 is not None, safe_gate=True, lower_bound=G_MIN, cu_seqlens=cu)

    return run


def inputs(B, T, H, K, V, device="cuda", requires_grad=False, h0=False):
    q = F.normalize(torch.randn(B, T, H, K, device=device), dim=-1).bfloat16()
    k = F.normalize(torch.randn(B, T, H, K, device=device), dim=-1).bfloat16()
    v = torch.randn(B, T, H, V, device=device).bfloat16()
    g = G_MIN * torch.sigmoid(torch.randn(B, T, H, K, device=device) * 2)
    beta = torch.sigmoid(torch.randn(B, T, H, device=device)).bfloat16()
    xs = [q, k, v, g, beta]
    if h0:
        xs.append(torch.randn(B, H, K, V, device=device) * 0.5)
    return [x.requires_grad_(requires_grad) for x in xs]


def reference(xs, cu=None):
    """The float64 token-by-token reference on the values ``xs`` (q, k, v, g, beta, h0), with random output
    gradients dO and dht drawn here: ``{"o", "ht", "do", "dht", "dq", "dk", "dv", "dg", "dbeta", "dh0"}``."""
    r = [x.detach().double().requires_grad_() for x in xs]
    o_r, ht_r = kda_reference(*r[:5], None, r[5], True, cu)
    do, dht = torch.randn_like(o_r), torch.randn_like(ht_r)
    ((o_r * do).sum() + (ht_r * dht).sum()).backward()
    return {"o": o_r, "ht": ht_r, "do": do, "dht": dht, **{n: x.grad for n, x in zip(GRADS, r)}}


def errors(fn, xs, ref, cu=None):
    """Relative RMS errors of o, ht and every gradient of ``fn`` against :func:`reference` ``ref`` of the same
    values (each implementation backpropagates the reference's dO and dht)."""
    a = [x.detach().clone().requires_grad_() for x in xs]
    o, ht = fn(*a, cu=cu) if cu is not None else fn(*a)
    ((o.double() * ref["do"]).sum() + (ht.double() * ref["dht"]).sum()).backward()
    out = {"o": rel_rms(o, ref["o"]), "ht": rel_rms(ht, ref["ht"])}
    out.update({n: rel_rms(x.grad, ref[n]) for n, x in zip(GRADS, a)})
    return out


def correctness_cases() -> list[tuple[str, tuple[int, int, int, int, int], torch.Tensor | None]]:
    """(name, (B, T, H, K, V), cu_seqlens); H = 16 so that fla reuses the timing shapes' autotuning."""
    cu = torch.tensor([0, 17, 300, 301, 1024], device="cuda", dtype=torch.int64)
    return [("B2 T1024 H16 D128", (2, 1024, 16, 128, 128), None), ("B1 T1000 H16 D64", (1, 1000, 16, 64, 64), None),
            ("varlen 4 seqs T1024 H16 D128", (1, 1024, 16, 128, 128), cu)]


def correctness(fla_fn) -> tuple[bool, list[str]]:
    torch.manual_seed(0)
    cases = correctness_cases()
    lines = ["| case | impl | " + " | ".join(TOL) + " |", "|---|---|" + "---|" * len(TOL)]
    ok = True
    for name, shape, c in cases:
        B, T, H, K, V = shape
        xs = inputs(B, T, H, K, V, h0=True)
        if c is not None:
            xs[5] = xs[5].new_zeros(4, H, K, V).normal_()
        # each new head size costs fla a full autotuning: compare it at D = 128 only.
        impls = [("k3lit", ours)] + ([("fla", fla_fn)] if fla_fn is not None and K == 128 else [])
        ref = reference(xs, c)
        for impl, fn in impls:
            try:
                e = errors(fn, xs, ref, c)
            except Exception as exc:  # noqa: BLE001
                print(f"{impl} failed on {name}: {exc!r}")
                if impl == "k3lit":
                    raise
                continue
            if impl == "k3lit":
                ok &= all(e[n] <= TOL[n] for n in TOL)
            lines.append(f"| {name} | {impl} | " + " | ".join(f"{e[n]:.2e}" for n in TOL) + " |")
            print(lines[-1], flush=True)
    return ok, lines


def raw_inputs(B, T, H, D, device="cuda", dtype=torch.bfloat16):
    """Unnormalised q, k, the gate pre-activation e, v, beta (bf16) and a float32 gate bias [H * D], all
    requiring grad: what the KDA layer hands the op."""
    xs = [torch.randn(B, T, H, D, device=device) * 2, torch.randn(B, T, H, D, device=device),
          torch.randn(B, T, H, D, device=device), torch.randn(B, T, H, D, device=device) * 2,
          torch.sigmoid(torch.randn(B, T, H, device=device))]
    xs = [x.to(dtype) for x in xs] + [torch.randn(H * D, device=device)]
    return [x.requires_grad_() for x in xs]


def variants(fla_fn=None) -> dict:
    """Callables ``(q, k, v, e, beta, bias) -> (o, None)`` for ``--fused-inputs``."""
    from k3lit.ops.kda import fuse_inputs

    def fused(q, k, v, e, beta, bias):
        return kda_triton(q, k, v, e, beta, g_min=G_MIN, use_gate_in_kernel=True, gate_bias=bias,
                          use_qk_l2norm_in_kernel=True)

    def unfused(q, k, v, e, beta, bias):
        q, k, g = fuse_inputs(q, k, e, G_MIN, True, bias, True)
        return kda_triton(q, k, v, g, beta, g_min=G_MIN)

    out = {"k3lit fused": fused, "k3lit unfused": unfused}
    if fla_fn is not None:
        def fla_l2(q, k, v, e, beta, bias):
            _, _, g = fuse_inputs(q, k, e, G_MIN, True, bias, False)
            return fla_fn(q, k, v, g, beta, scale=q.shape[-1] ** -0.5, safe_gate=True, lower_bound=G_MIN,
                          use_qk_l2norm_in_kernel=True)

        out["fla (L2 in kernel)"] = fla_l2
    return out


def fused_inputs_table(fla_fn, shapes) -> list[str]:
    """Markdown rows: median fwd+bwd ms of every variant at each shape."""
    fns = variants(fla_fn)
    lines = ["Median fwd+bwd ms (triton.testing.do_bench) from raw bf16 q, k, e (unnormalised) and a float32 "
             "gate bias, gradients to all of them; speedup = unfused / fused.", "",
             "| B | T | H | D | " + " | ".join(fns) + " | fused speedup |", "|---" * (5 + len(fns)) + "|"]
    for B, T, H, D in shapes:
        xs = raw_inputs(B, T, H, D)
        do = torch.randn(B, T, H, D, device="cuda", dtype=torch.bfloat16)
        ms = {}
        for name, fn in fns.items():
            fn(*xs)[0].backward(do)  # compile / autotune outside the timing
            ms[name] = bench(lambda fn=fn, xs=xs, do=do: fn(*xs)[0].backward(do))
        row = (f"| {B} | {T} | {H} | {D} | " + " | ".join(f"{t:.2f}" for t in ms.values())
               + f" | {ms['k3lit unfused'] / ms['k3lit fused']:.2f}x |")
        print(row, flush=True)
        lines.append(row)
    return lines


def bench(fn, rep=100):
    import triton.testing

    return triton.testing.do_bench(fn, warmup=25, rep=rep, return_mode="median")


def time_kda(fn, B, T, H, D):
    """Median (fwd ms, fwd+bwd ms) of ``fn`` on fresh bf16 inputs, after one untimed call."""
    xs = inputs(B, T, H, D, D, requires_grad=True)
    t0 = time.time()
    fn(*xs)[0].sum().backward()
    torch.cuda.synchronize()
    print(f"  first fwd+bwd call at {(B, T, H, D)}: {time.time() - t0:.1f} s", flush=True)
    with torch.no_grad():
        fwd = bench(lambda: fn(*xs))
    do = torch.randn(B, T, H, D, device="cuda", dtype=torch.bfloat16)

    def fb():
        o, _ = fn(*xs)
        o.backward(do)

    fwdbwd = bench(fb)
    return fwd, fwdbwd


def time_sdpa(B, T, H, D):
    q, k, v = (torch.randn(B, H, T, D, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    with torch.no_grad():
        fwd = bench(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True))
    do = torch.randn_like(q)

    def fb():
        F.scaled_dot_product_attention(q, k, v, is_causal=True).backward(do)

    return fwd, bench(fb)


def warm_fla(fla_fn, shapes, with_correctness=True) -> None:
    """One fwd+bwd of fla at every shape the benchmark uses (compile worker: fills the Triton cache)."""
    for _, (B, T, H, K, V), cu in correctness_cases() if with_correctness else []:
        if K == 128:
            xs = inputs(B, T, H, K, V, requires_grad=True, h0=True)
            if cu is not None:
                xs[5] = xs[5].new_zeros(cu.numel() - 1, H, K, V).normal_()
            fla_fn(*xs, cu=cu)[0].sum().backward()
    for B, T, H, D in shapes:
        xs = inputs(B, T, H, D, D, requires_grad=True)
        fla_fn(*xs)[0].sum().backward()
    torch.cuda.synchronize()


def kda_flops(B, T, H, D, C=64):
    return B * T * H * (6 * C * D + 4 * C * D + 6 * D * D)


def target_status(speedups: list[tuple[float, float]]) -> str:
    """The target line: fwd >= 1.5x and fwd+bwd >= 1.25x fla at every shape timed."""
    fwd = min(s[0] for s in speedups)
    fb = min(s[1] for s in speedups)
    met = fwd >= 1.5 and fb >= 1.25  # a NaN (fla failed) compares False: not met
    return (f"**Target (fwd >= 1.5x and f+b >= 1.25x fla at every shape): {'met' if met else 'not met'}** "
            f"(lowest fwd speedup {fwd:.2f}x, lowest f+b speedup {fb:.2f}x).")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="only the first two shapes")
    ap.add_argument("--no-fla", action="store_true")
    ap.add_argument("--no-sdpa", action="store_true")
    ap.add_argument("--results", default=os.path.join(ROOT, "benchmarks", "RESULTS.md"))
    ap.add_argument("--time-anyway", action="store_true", help="print timings even on a red correctness gate")
    ap.add_argument("--fla-compile-worker", metavar="I/P", help="only compile share I of P of fla's candidates")
    ap.add_argument("--fused-inputs", action="store_true", help="only the fused gate / L2 norm table")
    ap.add_argument("--shapes", nargs="+", metavar="BxTxHxD",
                    help="time only these shapes (fla's correctness rows skipped) into their own section")
    args = ap.parse_args()
    only = [tuple(int(x) for x in sh.split("x")) for sh in args.shapes] if args.shapes else None
    section = "KDA kernels" + (f" ({', '.join(args.shapes)})" if only else "")
    import triton

    if args.fused_inputs:
        fla_fn = None if args.no_fla else load_fla()
        head = (f"Date {datetime.date.today()}, GPU {torch.cuda.get_device_name()}, torch {torch.__version__}, "
                f"triton {triton.__version__}" + (", fla-core " + __import__("fla").__version__ if fla_fn else "")
                + f". Command: {command()}.")
        lines = fused_inputs_table(fla_fn, SHAPES[:2] if args.quick else SHAPES[:6])
        write_section("KDA with fused gate and q/k L2 norm", "\n".join([head, "", *lines]), args.results)
        return
    if args.fla_compile_worker:
        from benchmarks.triton_warm import compile_only

        compile_only(*map(int, args.fla_compile_worker.split("/")))
        warm_fla(make_fla(load_fla()), only or SHAPES, with_correctness=only is None)
        return
    fla_fn = None if args.no_fla else load_fla()
    fla_run = make_fla(fla_fn) if fla_fn is not None else None
    gpu = torch.cuda.get_device_name()
    head = (f"Date {datetime.date.today()}, GPU {gpu}, torch {torch.__version__}, triton {triton.__version__}"
            + (", fla-core " + __import__("fla").__version__ if fla_fn is not None else ", fla not installed")
            + f". Command: {command()}. bf16 inputs, g = -5 sigmoid(.) float32, K = V = D.")
    ok, lines = correctness(None if only else fla_run)
    body = [head, "", "Correctness: relative RMS error against the float64 token-by-token reference on the same "
            "bf16 inputs (tolerances: " + ", ".join(f"{n} {t}" for n, t in TOL.items()) + ").", "", *lines, ""]
    if not ok:
        body.append("**Gate red: k3lit's errors exceed the tolerances; no timings reported.**")
        write_section(section, "\n".join(body), args.results)
        print("\n".join(body))
        if not args.time_anyway:
            sys.exit(1)
        print("timing anyway (--time-anyway); these timings are not results")
    body += ["Median ms (triton.testing.do_bench), all columns from this one process; speedup = fla / k3lit; "
             "TFLOP/s by the FLOP model in benchmarks/kda.py; Mtok/s = B T / time. fla autotuned by its own "
             "autotuner in this process (candidates compiled ahead by --fla-compile-worker processes) or reused "
             "its stored choices from an earlier run on the same software (TRITON_CACHE_DIR).", "",
             "| B | T | H | D | k3lit fwd | fla fwd | SDPA fwd | fwd speedup | k3lit f+b | fla f+b | SDPA f+b "
             "| f+b speedup | k3lit f+b Mtok/s | k3lit f+b TFLOP/s | fla f+b TFLOP/s |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    shapes = only or (SHAPES[:2] if args.quick else SHAPES)
    speedups = []
    for B, T, H, D in shapes:
        t0 = time.time()
        ours_t = time_kda(ours, B, T, H, D)
        fla_t = (math.nan, math.nan)
        if fla_run is not None:
            try:
                fla_t = time_kda(fla_run, B, T, H, D)
            except Exception as exc:  # noqa: BLE001
                print(f"fla failed at {(B, T, H, D)}: {exc!r}")
        sdpa_t = (math.nan, math.nan) if args.no_sdpa else time_sdpa(B, T, H, D)
        fl = kda_flops(B, T, H, D)
        row = (f"| {B} | {T} | {H} | {D} | {ours_t[0]:.2f} | {fla_t[0]:.2f} | {sdpa_t[0]:.2f} | "
               f"{fla_t[0] / ours_t[0]:.2f}x | {ours_t[1]:.2f} | {fla_t[1]:.2f} | {sdpa_t[1]:.2f} | "
               f"{fla_t[1] / ours_t[1]:.2f}x | {B * T / ours_t[1] / 1e3:.1f} | {3 * fl / ours_t[1] / 1e9:.1f} | "
               f"{3 * fl / fla_t[1] / 1e9:.1f} |")
        body.append(row)
        speedups.append((fla_t[0] / ours_t[0], fla_t[1] / ours_t[1]))
        print(row, f"({time.time() - t0:.0f} s)", flush=True)
        torch.cuda.empty_cache()
        write_section(section, "\n".join(body), args.results)
    if fla_run is not None:
        body += ["", target_status(speedups)]
    write_section(section, "\n".join(body), args.results)
    print("\n".join(body))


if __name__ == "__main__":
    main()
