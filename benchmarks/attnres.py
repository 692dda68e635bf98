"""Attention residuals × activation-checkpointing policies: memory, step time, and quality.

    # memory and step time of one fwd+bwd, every residual rule × every policy (one process per config on CPU)
    python benchmarks/attnres.py speed                       # CPU, small model
    python benchmarks/attnres.py speed --size 300m           # H200: ~300M-parameter hybrid at T = 4096, bf16
    # validation loss at a fixed token budget on the tiny recipe: plain, block S=2, S=4, full, two seeds each
    python benchmarks/attnres.py quality
    python benchmarks/attnres.py quality --precision bf16-mixed   # the same under CPU bf16 autocast
    # the depth mix alone: fused Triton kernels vs the PyTorch form, N = 2, 6, 11 sources at B 2 x T 4096 x D 1024
    python benchmarks/attnres.py mix                         # H200 (add --sweep to time each launch setting)
    TRITON_INTERPRET=1 python benchmarks/attnres.py mix --dim 96 --seq 8 --sources 2 3   # CPU smoke run

Activation memory is the peak during forward + backward minus the memory held before it (parameters; the
previous step's gradients are freed): ``torch.cuda.max_memory_allocated`` on GPU; on CPU the growth of the
process's peak resident set over the first step, one fresh process per configuration (a coarser measure:
it includes the gradients and allocator slack).

``mix`` first checks both paths against float64 on the same inputs (largest relative RMS error over the output,
the source gradients and the query gradient), then times forward and forward+backward
(``triton.testing.do_bench`` medians) and converts them to GB/s over the bytes that must move at least: forward
reads every source and writes the output; backward reads every source and the output gradient and writes every
source gradient.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from results import command, environment, write_section  # noqa: E402
from throughput import build_model  # noqa: E402

from k3lit.model import ModelConfig  # noqa: E402
from k3lit.ops.attn_res import attn_res_mix  # noqa: E402
from k3lit.testing import rel_rms  # noqa: E402
from k3lit.train.loss import next_token_loss  # noqa: E402

RESIDUALS = [("plain", 4), ("block_attnres", 4), ("full_attnres", 4)]
POLICIES = ["none", "layer", "block", "selective"]
SIZES = {
    "small": dict(cfg=ModelConfig(vocab_size=2048, dim=256, n_layers=8, layer_pattern="KKKA", n_heads=4, head_dim=64,
                                  mlp_hidden=768), batch=4, seq=512),
    "300m": dict(cfg=ModelConfig(vocab_size=32768, dim=1024, n_layers=20, layer_pattern="KKKA", n_heads=8,
                                 head_dim=128, mlp_hidden=2816), batch=2, seq=4096),
}


def measure(size: str, residual: str, block: int, policy: str, repeats: int, compile_: bool = False,
            batch: int | None = None) -> dict:
    """Activation memory (MiB) and median fwd+bwd time (ms) of one configuration, in this process
    (``compile_``: ``torch.compile`` every sublayer, as ``k3lit fit --compile=true`` does)."""
    spec = dict(SIZES[size], **({"batch": batch} if batch else {}))
    cuda = torch.cuda.is_available()
    dev = "cuda" if cuda else "cpu"
    name, _, n_ckpt = policy.partition(":")  # "block:N": recompute only the first N segments
    cfg = dataclasses.replace(spec["cfg"], residual=residual, attnres_block_size=block, activation_checkpointing=name,
                              checkpoint_blocks=int(n_ckpt) if n_ckpt else None)
    model = build_model(cfg, dev, compile_)
    n_params = sum(p.numel() for p in model.parameters())
    idx = torch.randint(0, cfg.vocab_size, (spec["batch"], spec["seq"] + 1), device=dev)

    def step() -> None:
        with torch.autocast(dev, dtype=torch.bfloat16, enabled=cuda):
            logits, _ = model(idx[:, :-1])
            loss = next_token_loss(logits, idx[:, 1:])
        loss.backward()
        model.zero_grad(set_to_none=True)

    if cuda:
        step()  # warm-up: kernels compiled, allocator primed
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        step()
        torch.cuda.synchronize()
        act_mib = (torch.cuda.max_memory_allocated() - base) / 2**20
        from triton.testing import do_bench

        ms = do_bench(step, warmup=2, rep=repeats * 200, return_mode="median")
    else:  # growth of the peak resident set over the first step (run each configuration in a fresh process)
        rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        step()
        act_mib = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss0) / 1024
        times = []
        for _ in range(repeats):
            t = time.perf_counter()
            step()
            times.append(time.perf_counter() - t)
        ms = 1000 * statistics.median(times)
    return dict(residual=residual, block=block, policy=policy, params_m=n_params / 1e6, act_mib=act_mib, ms=ms)


def run_speed(size: str, repeats: int, residuals: list[str], policies: list[str], compile_: bool,
              batch: int | None) -> list[dict]:
    rows = []
    for residual, block in [r for r in RESIDUALS if r[0] in residuals]:
        for policy in policies:
            if torch.cuda.is_available():
                row = measure(size, residual, block, policy, repeats, compile_, batch)
                torch.cuda.empty_cache()
            else:  # a fresh process per configuration, so its peak resident set is this configuration's own
                code = (f"import json, sys; sys.path.insert(0, {str(Path(__file__).parent)!r}); import attnres; "
                        f"print(json.dumps(attnres.measure({size!r}, {residual!r}, {block}, {policy!r}, {repeats}, "
                        f"{compile_}, {batch})))")
                out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
                if out.returncode:
                    sys.exit(f"{residual} / {policy} failed:\n{out.stderr[-3000:]}")
                row = json.loads(out.stdout.strip().splitlines()[-1])
            rows.append(row)
            print(row, flush=True)
    return rows


def speed_table(rows: list[dict], size: str, compile_: bool, batch: int | None) -> str:
    spec = dict(SIZES[size], **({"batch": batch} if batch else {}))
    base = {(r["residual"], r["policy"]): r for r in rows}
    mem_label = "activation MiB" if torch.cuda.is_available() else "peak RSS growth MiB"
    lines = [
        f"{environment()} · {command()}; model {size} ({rows[0]['params_m']:.0f}M parameters, pattern "
        f"{spec['cfg'].layer_pattern}, dense), batch {spec['batch']} × T {spec['seq']}"
        + (", bf16 autocast" if torch.cuda.is_available() else ", float32")
        + (", every sublayer torch.compile'd" if compile_ else ", eager"),
        "",
        f"| residual | policy | {mem_label} | vs none | fwd+bwd ms | vs none | vs plain (same policy) |",
        "|---|---|---|---|---|---|---|",
    ]
    def ratio(x: float, ref: dict | None, key: str, fmt: str) -> str:  # "-" when the reference row was not run
        return "-" if ref is None else f"{x / ref[key]:{fmt}}x"

    for r in rows:
        none, plain = base.get((r["residual"], "none")), base.get(("plain", r["policy"]))
        name = f"{r['residual']} (S={r['block']})" if r["residual"] == "block_attnres" else r["residual"]
        lines.append(
            f"| {name} | {r['policy']} | {r['act_mib']:.0f} | {ratio(r['act_mib'], none, 'act_mib', '.2f')} | "
            f"{r['ms']:.1f} | {ratio(r['ms'], none, 'ms', '.2f')} | {ratio(r['ms'], plain, 'ms', '.3f')} |"
        )
    if any(r["policy"].startswith("block:") for r in rows):
        lines += ["", "`block:N`: `activation_checkpointing=block` with `checkpoint_blocks=N`, only the first N "
                  "segments recomputed (`block` recomputes every segment but the last)."]
    return "\n".join(lines)


def run_quality(steps: int, seeds: list[int], precision: str = "32-true") -> str:
    """Validation loss of the tiny recipe (smaller, for CPU) at a fixed token budget per residual rule, trained at
    Lightning ``precision``."""
    variants = [("plain", 4), ("block_attnres", 2), ("block_attnres", 4), ("full_attnres", 1)]
    common = ["--model.dim=128", "--model.n_layers=4", "--model.n_heads=2", "--data.seq_len=128",
              "--data.batch_size=16", f"--trainer.max_steps={steps}", f"--trainer.val_check_interval={steps}",
              "--trainer.limit_val_batches=40", "--trainer.max_time=null", "--trainer.enable_progress_bar=false",
              "--trainer.enable_model_summary=false", f"--trainer.precision={precision}"]
    results: dict[tuple[str, int], list[float]] = {}
    for seed in seeds:
        for residual, block in variants:
            with tempfile.TemporaryDirectory() as root:
                cmd = [sys.executable, "-m", "k3lit.cli", "fit", "--config", "recipes/tiny.yaml", *common,
                       f"--model.residual={residual}", f"--model.attnres_block_size={block}",
                       f"--seed_everything={seed}", f"--trainer.default_root_dir={root}"]
                subprocess.run(cmd, check=True, capture_output=True)
                with open(Path(root) / "metrics.csv") as f:
                    val = [float(r["val/loss"]) for r in csv.DictReader(f) if r.get("val/loss")]
            results.setdefault((residual, block), []).append(val[-1])
            print(residual, block, seed, val[-1], flush=True)
    tokens = steps * 16 * 128
    lines = [f"{environment()} · {command()}; tiny recipe at dim 128, 4 layers (8 sublayers), T 128, {steps} steps "
             f"({tokens / 1e6:.2f}M tokens), precision {precision}, seeds {seeds}; validation loss (nats/token) "
             "on 40 held-out batches",
             "", "| residual | " + " | ".join(f"seed {s}" for s in seeds) + " | mean |",
             "|---|" + "---|" * (len(seeds) + 1)]
    for (residual, block), losses in results.items():
        name = {"plain": "plain", "full_attnres": "full AttnRes"}.get(residual, f"block AttnRes S={block}")
        lines.append(f"| {name} | " + " | ".join(f"{v:.4f}" for v in losses) + f" | {statistics.mean(losses):.4f} |")
    return "\n".join(lines)


MIX_LAYOUTS = {"bf16": (torch.bfloat16,), "fp32 emb + bf16": (torch.float32, torch.bfloat16)}


def _median_ms(fn, reset: list[torch.Tensor]) -> float:
    """Median milliseconds of ``fn()``: do_bench on CUDA, a few wall-clock runs elsewhere (smoke runs only)."""
    if torch.cuda.is_available():
        from triton.testing import do_bench

        return do_bench(fn, warmup=25, rep=200, grad_to_none=reset, return_mode="median")
    times = []
    for _ in range(3):
        for t in reset:
            t.grad = None
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return 1000 * statistics.median(times)


def _mix_inputs(n: int, dtypes: tuple, shape: tuple[int, ...]) -> tuple[list[torch.Tensor], torch.Tensor, torch.Tensor]:
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    sources = [(torch.randn(shape, device=dev) * (1 + i / n)).to(dtypes[min(i, len(dtypes) - 1)]).requires_grad_()
               for i in range(n)]
    u = (torch.randn(shape[-1], device=dev) / shape[-1] ** 0.5).requires_grad_()
    return sources, u, torch.randn(shape, device=dev).to(sources[0].dtype)


def mix_case(n: int, layout: str, shape: tuple[int, ...]) -> list[dict]:
    """Accuracy against float64 and the times of both paths for n sources in ``layout``."""
    sources, u, grad = _mix_inputs(n, MIX_LAYOUTS[layout], shape)
    ref_in = [t.detach().double().requires_grad_() for t in (*sources, u)]
    attn_res_mix(ref_in[:-1], ref_in[-1], backend="torch").backward(grad.double())
    ref_out = attn_res_mix(ref_in[:-1], ref_in[-1], backend="torch").detach()
    nbytes = lambda ts: sum(t.numel() * t.element_size() for t in ts)  # noqa: E731
    fwd_bytes = nbytes(sources) + nbytes([grad])  # sources in, output (grad has its shape and dtype) out
    bwd_bytes = 2 * nbytes(sources) + nbytes([grad])
    rows = []
    for backend in ("torch", "triton"):
        for t in (*sources, u):
            t.grad = None
        out = attn_res_mix(sources, u, backend=backend)
        out.backward(grad)
        err = max([rel_rms(out, ref_out), rel_rms(u.grad, ref_in[-1].grad)]
                  + [rel_rms(s.grad, r.grad) for s, r in zip(sources, ref_in)])

        def fwd(backend=backend):
            with torch.no_grad():
                attn_res_mix(sources, u, backend=backend)

        fwd_ms = _median_ms(fwd, [])
        both_ms = _median_ms(lambda backend=backend: attn_res_mix(sources, u, backend=backend).backward(grad),
                             [*sources, u])
        rows.append(dict(layout=layout, n=n, backend=backend, err=err, fwd_ms=fwd_ms, both_ms=both_ms,
                         fwd_gbs=fwd_bytes / fwd_ms / 1e6, both_gbs=(fwd_bytes + bwd_bytes) / both_ms / 1e6))
        print(rows[-1], flush=True)
    return rows


def mix_sweep(n: int, shape: tuple[int, ...], block: int = 4) -> str:
    """Each launch setting of the depth-mix kernels (``k3lit.kernels.attn_res.common.TILES``) varied alone, the
    others at their defaults: median ms of the launchers that use it, over n summaries (fp32 embedding + bf16),
    ``block`` queries for the two-phase kernels."""
    from k3lit.kernels.attn_res.common import TILES
    from k3lit.kernels.attn_res.mix import mix_bwd, mix_fwd
    from k3lit.kernels.attn_res.two_phase import inter_bwd, inter_fwd, merge_bwd, merge_fwd

    blocks, _, grad = _mix_inputs(n, MIX_LAYOUTS["fp32 emb + bf16"], shape)
    blocks = [b.detach() for b in blocks]
    queries = torch.randn(block, shape[-1], device=blocks[0].device) / shape[-1] ** 0.5
    grads, dlse = [grad.float()] * block, torch.randn(block, *shape[:-1], device=grad.device)
    mixes, lse, su, r, mz = inter_fwd(blocks, queries, 1e-6)
    sources = blocks + [blocks[-1]]
    _, src_stats, row_stats = mix_fwd(sources, queries[0], 1e-6)
    launchers = {
        "mix_fwd": lambda: mix_fwd(sources, queries[0], 1e-6),
        "mix_bwd": lambda: mix_bwd(sources, queries[0], src_stats, row_stats, grads[0]),
        "inter_fwd": lambda: inter_fwd(blocks, queries, 1e-6),
        "inter_bwd": lambda: inter_bwd(blocks, queries, su, r, mz, grads, dlse),
        "merge_fwd": lambda: merge_fwd(mixes[1], lse[1], blocks[-1], queries[1], 1e-6),
        "merge_bwd": lambda: merge_bwd(grads[1], mixes[1], lse[1], blocks[-1], queries[1], 1e-6),
    }
    timed = {"inter_bwd_logits": ["inter_bwd"], "inter_bwd_sources": ["inter_bwd"],
             "grid_warps_per_sm": ["mix_bwd", "inter_bwd", "merge_bwd"]}
    lines = [f"launch settings, N = {n}, {block} queries, shape {tuple(shape)}, fp32 emb + bf16: each setting "
             "varied alone (* = default), median ms of the launchers that use it", "",
             "| setting | value | launchers | ms |", "|---|---|---|---|"]
    for key, default in list(TILES.items()):
        names = timed.get(key, [key])
        for value in (8, 16, 32, 64) if key == "grid_warps_per_sm" else (1, 2, 4):
            TILES[key] = value
            try:
                t = sum(_median_ms(launchers[name], []) for name in names)
            finally:
                TILES[key] = default
            lines.append(f"| {key} | {value}{'*' if value == default else ''} | {' + '.join(names)} | {t:.3f} |")
            print(lines[-1], flush=True)
    return "\n".join(lines)


def _phase_times(n: int, shape: tuple[int, ...], block: int) -> tuple[float, ...]:
    """Kernel ms of one block over n summaries: phase 1 fwd, bwd; one merge fwd + bwd; one one-pass read fwd + bwd."""
    from k3lit.kernels.attn_res.mix import mix_bwd, mix_fwd
    from k3lit.kernels.attn_res.two_phase import inter_bwd, inter_fwd, merge_bwd, merge_fwd

    blocks, _, grad = _mix_inputs(n, MIX_LAYOUTS["fp32 emb + bf16"], shape)
    blocks = [b.detach() for b in blocks]
    queries = torch.randn(block, shape[-1], device=blocks[0].device) / shape[-1] ** 0.5
    grads, dlse = [grad.float()] * block, torch.randn(block, *shape[:-1], device=grad.device)
    mixes, lse, su, r, mz = inter_fwd(blocks, queries, 1e-6)
    part, sources = blocks[-1], blocks + [blocks[-1]]
    _, src_stats, row_stats = mix_fwd(sources, queries[0], 1e-6)
    return (_median_ms(lambda: inter_fwd(blocks, queries, 1e-6), []),
            _median_ms(lambda: inter_bwd(blocks, queries, su, r, mz, grads, dlse), []),
            _median_ms(lambda: merge_fwd(mixes[1], lse[1], part, queries[1], 1e-6), [])
            + _median_ms(lambda: merge_bwd(grads[1], mixes[1], lse[1], part, queries[1], 1e-6), []),
            _median_ms(lambda: mix_fwd(sources, queries[0], 1e-6), [])
            + _median_ms(lambda: mix_bwd(sources, queries[0], src_stats, row_stats, grads[0]), []))


def mix_phases(counts: list[int], shape: tuple[int, ...], block: int = 4) -> str:
    """Per residual block of ``block`` sublayers over N summaries (fp32 embedding + bf16): the two-phase kernels
    (phase 1 for all queries, phase 2 for the block - 1 sublayers with a partial sum) against ``block`` one-pass
    reads of N + 1 sources, each forward and backward, kernels alone (launchers, no autograd)."""
    lines = [f"two-phase kernels per block of {block} sublayers, shape {tuple(shape)}, fp32 emb + bf16 (kernel ms)",
             "", f"| N | phase 1 fwd | phase 1 bwd | merge fwd + bwd (x{block - 1}) | two-phase total | "
             f"one-pass fwd + bwd (x{block}) | one-pass total |", "|---|---|---|---|---|---|---|"]
    for n in counts:
        f1, b1, merge, one = _phase_times(n, shape, block)
        lines.append(f"| {n} | {f1:.3f} | {b1:.3f} | {merge:.3f} | {f1 + b1 + (block - 1) * merge:.3f} | "
                     f"{one:.3f} | {block * one:.3f} |")
        print(lines[-1], flush=True)
    return "\n".join(lines)


def run_mix(shape: tuple[int, ...], counts: list[int], sweep: bool) -> str:
    rows = [r for layout in MIX_LAYOUTS for n in counts for r in mix_case(n, layout, shape)]
    lines = [f"{environment()} · {command()}; sources {tuple(shape)}, N sources, output in the first source's "
             "dtype", "",
             "| layout | N | path | max rel. error vs float64 | fwd ms | fwd GB/s | fwd+bwd ms | fwd+bwd GB/s |"
             " Triton speed-up (fwd+bwd) |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        torch_row = next(t for t in rows if t["backend"] == "torch" and (t["layout"], t["n"]) == (r["layout"], r["n"]))
        lines.append(f"| {r['layout']} | {r['n']} | {r['backend']} | {r['err']:.1e} | {r['fwd_ms']:.3f} | "
                     f"{r['fwd_gbs']:.0f} | {r['both_ms']:.3f} | {r['both_gbs']:.0f} | "
                     f"{torch_row['both_ms'] / r['both_ms']:.2f}x |")
    lines += ["", mix_phases(counts, shape)]
    if sweep:
        lines += ["", mix_sweep(max(counts), shape)]
    return "\n".join(lines)



def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("mode", choices=["speed", "quality", "mix"])
    parser.add_argument("--size", choices=list(SIZES), default="small")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--batch", type=int, help="batch size (speed: the size's own; mix: 2)")
    parser.add_argument("--compile", action="store_true", help="speed: torch.compile every sublayer")
    parser.add_argument("--residuals", nargs="+", default=[r for r, _ in RESIDUALS], help="speed: which rules")
    parser.add_argument("--policies", nargs="+", default=POLICIES,
                        help="speed: which checkpoint policies (block:N = block with checkpoint_blocks=N)")
    parser.add_argument("--seq", type=int, default=4096, help="mix: sequence length")
    parser.add_argument("--dim", type=int, default=1024, help="mix: model width D")
    parser.add_argument("--sources", type=int, nargs="+", default=[2, 6, 11], help="mix: source counts N")
    parser.add_argument("--sweep", action="store_true", help="mix: also time each launch setting")
    parser.add_argument("--precision", choices=["32-true", "bf16-mixed"], default="32-true",
                        help="quality: Lightning precision of the training runs")
    args = parser.parse_args()
    if args.mode == "speed":  # the run's rows replace its whole section: list every row the section should keep
        rows = run_speed(args.size, args.repeats, args.residuals, args.policies, args.compile, args.batch)
        where = torch.cuda.get_device_name().removeprefix("NVIDIA ") if torch.cuda.is_available() else "CPU"
        title = (f"Attention residuals × checkpointing ({where}, {args.size}" + (", compiled" if args.compile else "")
                 + (f", batch {args.batch}" if args.batch else "") + ")")
        write_section(title, speed_table(rows, args.size, args.compile, args.batch))
    elif args.mode == "mix":
        if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
            sys.exit("mix times the Triton kernels on CUDA; without a GPU run it with TRITON_INTERPRET=1 and tiny "
                     "sizes (e.g. --dim 96 --seq 8) as a smoke test")
        table = run_mix((args.batch or 2, args.seq, args.dim), args.sources, args.sweep)
        print(table)
        if torch.cuda.is_available():
            gpu = torch.cuda.get_device_name().removeprefix("NVIDIA ")
            write_section(f"Attention residuals: depth-mix kernel ({gpu})", table)
    else:
        where = "CPU" + (f", {args.precision}" if args.precision != "32-true" else "")
        title = f"Attention residuals: quality ({where})"
        write_section(title, run_quality(args.steps, args.seeds, args.precision))


if __name__ == "__main__":
    main()
