"""MoE on one GPU: grouped-matmul experts vs a per-expert loop, and the cost of balancing.

    python benchmarks/moe.py [--tokens 16384] [--dim 2048] [--experts 64] [--top-k 8] [--expert-dim 1024]
                             [--layer-only] [--json out.json]
    python benchmarks/moe.py --from-json benchmarks/moe_h200.json     # the stored H200 run

1. Experts alone (tokens already sorted by expert, bf16): ``grouped_mm`` through
   ``torch.nn.functional.grouped_mm`` vs a Python loop of ``torch.matmul`` over the experts; forward and
   forward+backward. Correctness first: the two outputs must agree (bf16 tolerance) before any time is shown.
2. The whole MoE layer (router, routing, dispatch, experts, float32 combine), forward+backward plus the
   once-per-step ``update_balancer()``, for balancer ``none`` vs ``aux_free`` (sign bias), ``quantile`` (exact
   pooled quantile) and ``quantile_hist`` (1000-bin histogram); overhead = time / time(none) - 1.

Timing: CUDA events around ``reps`` iterations after ``warmup``, median of ``trials`` trials. The tables go to
``benchmarks/RESULTS.md``, section "MoE: experts and balancing overhead".
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time

import torch
import torch.nn.functional as F

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from benchmarks.results import command, load_json, write_section  # noqa: E402
from k3lit.nn.moe import MoE  # noqa: E402
from k3lit.ops.grouped_mm import grouped_mm  # noqa: E402

TITLE = "MoE: experts and balancing overhead"
BALANCER_NAMES = {"none": "none", "aux_free": "aux_free (sign bias)", "quantile": "quantile (exact pooled quantile)",
                  "quantile_hist": "quantile_hist (1000-bin histogram, per micro-batch)"}


def timed(fn, warmup: int = 5, reps: int = 20, trials: int = 5) -> float:  # noqa: ANN001
    """Median milliseconds per call of ``fn``."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    out = []
    for _ in range(trials):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(reps):
            fn()
        end.record()
        torch.cuda.synchronize()
        out.append(start.elapsed_time(end) / reps)
    return statistics.median(out)


def bench_experts(m: int, d: int, f: int, n: int, k: int, dev: str) -> dict:
    g = torch.Generator(device=dev).manual_seed(0)
    rows = m * k
    counts = torch.distributions.Multinomial(rows, torch.ones(n)).sample().long()  # near-uniform jagged groups
    offsets = counts.cumsum(0).to(device=dev, dtype=torch.int32)
    x = torch.randn(rows, d, device=dev, dtype=torch.bfloat16, generator=g)
    w1 = (torch.randn(n, d, 2 * f, device=dev, generator=g) * d**-0.5).bfloat16().requires_grad_()
    w2 = (torch.randn(n, f, d, device=dev, generator=g) * f**-0.5).bfloat16().requires_grad_()
    xg = x.clone().requires_grad_()

    def experts(backend: str) -> torch.Tensor:
        gate, up = grouped_mm(xg, w1, offsets, backend=backend).chunk(2, dim=-1)
        return grouped_mm(F.silu(gate) * up, w2, offsets, backend=backend)

    with torch.no_grad():
        a, b = experts("native").float(), experts("loop").float()
    err = ((a - b).norm() / b.norm()).item()
    assert err < 2e-2, f"grouped_mm native vs loop disagree: rel err {err}"
    res = {"rel_err_native_vs_loop": err}
    for backend in ("native", "loop"):
        with torch.no_grad():
            res[f"{backend}_fwd_ms"] = timed(lambda b=backend: experts(b))

        def fwd_bwd(b: str = backend) -> None:
            experts(b).sum().backward()
            xg.grad = w1.grad = w2.grad = None

        res[f"{backend}_fwd_bwd_ms"] = timed(fwd_bwd)
    flops = 2 * rows * (d * 2 * f + f * d)
    res["native_fwd_tflops"] = flops / res["native_fwd_ms"] / 1e9
    res["speedup_fwd_bwd"] = res["loop_fwd_bwd_ms"] / res["native_fwd_bwd_ms"]
    return res


def bench_layer(m: int, d: int, f: int, n: int, k: int, dev: str, balancers: list[str]) -> dict:
    torch.manual_seed(0)
    x = torch.randn(1, m, d, device=dev, dtype=torch.bfloat16)
    grad = torch.randn_like(x)
    res = {}
    for bal in balancers:
        torch.manual_seed(0)
        moe = MoE(d, n, k, f, n_shared_experts=0, balancer=bal).to(dev, torch.bfloat16).train()
        assert moe.expert_bias.dtype == torch.float32

        def step(moe: MoE = moe) -> None:
            xi = x.detach().requires_grad_()
            moe(xi).backward(grad)
            moe.update_balancer()  # once per optimizer step (one micro-batch per step here)
            for p in moe.parameters():
                p.grad = None

        res[bal] = timed(step)
    base = res["none"]
    return {"ms": res, "overhead_vs_none": {b: res[b] / base - 1 for b in balancers if b != "none"}}


def section(run: dict) -> str:
    """The RESULTS.md section from :func:`main`'s JSON record ``run`` (``"experts"`` may be null: then only the
    layer table; ``"layer_n<N>"`` entries add columns)."""
    sh = run["shape"]
    lines = [f"Written by `benchmarks/moe.py`. {run['date']} · {run['gpu']} · torch {run['torch']} · Python "
             f"{run['python']}. Command: {run['command']}." + (f" {run['note']}" if run.get("note") else ""), "",
             f"m = {sh['m']:,} tokens, D = {sh['d']}, n = {sh['n']} experts, top-k = {sh['k']}, expert_dim F = "
             f"{sh['f']}, bf16 weights and activations, router and combine in float32. CUDA events, median of 5 "
             "trials of 20 iterations after 5 warm-up iterations."]
    e = run.get("experts")
    if e:
        flops = 2 * sh["m"] * sh["k"] * (sh["d"] * 2 * sh["f"] + sh["f"] * sh["d"])  # SwiGLU FLOPs, forward
        lines += ["", "Experts alone (rows already sorted by expert, jagged near-uniform groups; SwiGLU = two grouped "
                  f"matmuls); the two paths' outputs agree to a relative error of {e['rel_err_native_vs_loop']:.1e} "
                  "before timing.", "", "| experts path | fwd ms | fwd+bwd ms | fwd TFLOP/s |", "|---|---|---|---|",
                  f"| `torch.nn.functional.grouped_mm` (k3lit `grouped_mm`, native) | {e['native_fwd_ms']:.2f} | "
                  f"{e['native_fwd_bwd_ms']:.2f} | {flops / e['native_fwd_ms'] / 1e9:.0f} |",
                  f"| per-expert loop of `torch.matmul` | {e['loop_fwd_ms']:.2f} | {e['loop_fwd_bwd_ms']:.2f} | "
                  f"{flops / e['loop_fwd_ms'] / 1e9:.0f} |",
                  f"| speed-up | {e['loop_fwd_ms'] / e['native_fwd_ms']:.2f}x | {e['speedup_fwd_bwd']:.1f}x | |"]
    layers = {sh["n"]: run["layer"]} | {int(k.removeprefix("layer_n")): v for k, v in run.items()
                                         if k.startswith("layer_n")}
    lines += ["", "Whole MoE layer: forward + backward + the once-per-step `update_balancer()` (one micro-batch per "
              "step, one GPU); overhead = time / time(none) - 1.", "",
              "| balancer | " + " | ".join(f"n = {n}: ms | overhead vs none" for n in layers) + " |",
              "|---|" + "---|---|" * len(layers)]
    for bal, name in BALANCER_NAMES.items():
        cells = []
        for layer in layers.values():
            ms = layer["ms"].get(bal)
            over = layer["overhead_vs_none"].get(bal)
            if ms is None:
                cells += ["", ""]
            else:
                cells += [f"{ms:.2f}", "-" if over is None else f"{over:+.1%}"]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    worst = max(v for layer in layers.values() for v in layer["overhead_vs_none"].values())
    lines += ["", f"Target (balancing overhead <= 5%): **{'met' if worst <= 0.05 else 'not met'}** (largest "
              f"{worst:+.1%})."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--dim", type=int, default=2048)
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--expert-dim", type=int, default=1024)
    ap.add_argument("--json", type=str, default=None)
    ap.add_argument("--layer-only", action="store_true", help="skip the experts-alone comparison")
    ap.add_argument("--from-json", "--from_json",
                    help="write the section from the record of an earlier run (no timing)")
    ap.add_argument("--results", default=os.path.join(ROOT, "benchmarks", "RESULTS.md"))
    a = ap.parse_args(argv)
    if a.from_json:
        body = section(load_json(a.from_json, ()))
        write_section(TITLE, body, a.results)
        print(body)
        return
    if not torch.cuda.is_available():
        sys.exit("benchmarks/moe.py needs a CUDA device")
    dev = "cuda"
    torch.backends.cuda.matmul.allow_tf32 = True
    shape = dict(m=a.tokens, d=a.dim, f=a.expert_dim, n=a.experts, k=a.top_k)
    out = {
        "date": time.strftime("%Y-%m-%d"),
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "command": command(None if argv is None else [sys.argv[0], *argv]),
        "shape": shape,
        "experts": None if a.layer_only else bench_experts(**shape, dev=dev),
        "layer": bench_layer(**shape, dev=dev, balancers=["none", "aux_free", "quantile", "quantile_hist"]),
    }
    for n in (256,):
        shape_n = {**shape, "n": n}
        out[f"layer_n{n}"] = bench_layer(**shape_n, dev=dev, balancers=["none", "quantile", "quantile_hist"])
    print(json.dumps(out, indent=1))
    if a.json:
        with open(a.json, "w") as fh:
            json.dump(out, fh, indent=1)
    write_section(TITLE, section(out), a.results)


if __name__ == "__main__":
    main()
