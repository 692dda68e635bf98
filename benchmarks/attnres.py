"""Attention residuals × activation-checkpointing policies: memory, step time, and quality.

    # memory and step time of one fwd+bwd, every residual rule × every policy (one process per config on CPU)
    python benchmarks/attnres.py speed                       # CPU, small model
    python benchmarks/attnres.py speed --size 300m           # H200: ~300M-parameter hybrid at T = 4096, bf16
    # validation loss at a fixed token budget on the tiny recipe: plain, block S=2, S=4, full, two seeds each
    python benchmarks/attnres.py quality

Activation memory is the peak during forward + backward minus the memory held before it (parameters; the
previous step's gradients are freed): ``torch.cuda.max_memory_allocated`` on GPU; on CPU the growth of the
process's peak resident set over the first step, one fresh process per configuration (a coarser measure:
it includes the gradients and allocator slack).
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import json
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from results import environment, write_section  # noqa: E402

from k3lit.model import K3LM, ModelConfig  # noqa: E402

RESIDUALS = [("plain", 4), ("block_attnres", 4), ("full_attnres", 4)]
POLICIES = ["none", "layer", "block", "selective"]
SIZES = {
    "small": dict(cfg=ModelConfig(vocab_size=2048, dim=256, n_layers=8, layer_pattern="KKKA", n_heads=4, head_dim=64,
                                  mlp_hidden=768), batch=4, seq=512),
    "300m": dict(cfg=ModelConfig(vocab_size=32768, dim=1024, n_layers=20, layer_pattern="KKKA", n_heads=8,
                                 head_dim=128, mlp_hidden=2816), batch=2, seq=4096),
}


def measure(size: str, residual: str, block: int, policy: str, repeats: int) -> dict:
    """Activation memory (MiB) and median fwd+bwd time (ms) of one configuration, in this process."""
    spec = SIZES[size]
    cuda = torch.cuda.is_available()
    dev = "cuda" if cuda else "cpu"
    cfg = dataclasses.replace(spec["cfg"], residual=residual, attnres_block_size=block, activation_checkpointing=policy)
    torch.manual_seed(0)
    model = K3LM(cfg).to(dev)
    n_params = sum(p.numel() for p in model.parameters())
    idx = torch.randint(0, cfg.vocab_size, (spec["batch"], spec["seq"] + 1), device=dev)

    def step() -> None:
        with torch.autocast(dev, dtype=torch.bfloat16, enabled=cuda):
            logits, _ = model(idx[:, :-1])
            loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), idx[:, 1:].flatten())
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


def run_speed(size: str, repeats: int) -> list[dict]:
    rows = []
    for residual, block in RESIDUALS:
        for policy in POLICIES:
            if torch.cuda.is_available():
                row = measure(size, residual, block, policy, repeats)
                torch.cuda.empty_cache()
            else:  # a fresh process per configuration, so its peak resident set is this configuration's own
                code = (f"import json, sys; sys.path.insert(0, {str(Path(__file__).parent)!r}); import attnres; "
                        f"print(json.dumps(attnres.measure({size!r}, {residual!r}, {block}, {policy!r}, {repeats})))")
                out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
                row = json.loads(out.stdout.strip().splitlines()[-1])
            rows.append(row)
            print(row, flush=True)
    return rows


def speed_table(rows: list[dict], size: str) -> str:
    spec = SIZES[size]
    base = {(r["residual"], r["policy"]): r for r in rows}
    mem_label = "activation MiB" if torch.cuda.is_available() else "peak RSS growth MiB"
    lines = [
        f"{environment()}; model {size} ({rows[0]['params_m']:.0f}M parameters, pattern "
        f"{spec['cfg'].layer_pattern}, dense), batch {spec['batch']} × T {spec['seq']}"
        + (", bf16 autocast" if torch.cuda.is_available() else ", float32"),
        "",
        f"| residual | policy | {mem_label} | vs none | fwd+bwd ms | vs none | vs plain (same policy) |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        none = base[(r["residual"], "none")]
        plain = base[("plain", r["policy"])]
        name = f"{r['residual']} (S={r['block']})" if r["residual"] == "block_attnres" else r["residual"]
        lines.append(
            f"| {name} | {r['policy']} | {r['act_mib']:.0f} | {r['act_mib'] / none['act_mib']:.2f}x | {r['ms']:.1f} | "
            f"{r['ms'] / none['ms']:.2f}x | {r['ms'] / plain['ms']:.3f}x |"
        )
    return "\n".join(lines)


def run_quality(steps: int, seeds: list[int]) -> str:
    """Validation loss of the tiny recipe (smaller, for CPU) at a fixed token budget per residual rule."""
    variants = [("plain", 4), ("block_attnres", 2), ("block_attnres", 4), ("full_attnres", 1)]
    common = ["--model.dim=128", "--model.n_layers=4", "--model.n_heads=2", "--data.seq_len=128",
              "--data.batch_size=16", f"--trainer.max_steps={steps}", f"--trainer.val_check_interval={steps}",
              "--trainer.limit_val_batches=40", "--trainer.max_time=null", "--trainer.enable_progress_bar=false",
              "--trainer.enable_model_summary=false"]
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
    lines = [f"{environment()}; tiny recipe at dim 128, 4 layers (8 sublayers), T 128, {steps} steps "
             f"({tokens / 1e6:.2f}M tokens), seeds {seeds}; validation loss (nats/token) on 40 held-out batches",
             "", "| residual | " + " | ".join(f"seed {s}" for s in seeds) + " | mean |",
             "|---|" + "---|" * (len(seeds) + 1)]
    for (residual, block), losses in results.items():
        name = {"plain": "plain", "full_attnres": "full AttnRes"}.get(residual, f"block AttnRes S={block}")
        lines.append(f"| {name} | " + " | ".join(f"{v:.4f}" for v in losses) + f" | {statistics.mean(losses):.4f} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("mode", choices=["speed", "quality"])
    parser.add_argument("--size", choices=list(SIZES), default="small")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2])
    args = parser.parse_args()
    if args.mode == "speed":
        rows = run_speed(args.size, args.repeats)
        where = "H200" if torch.cuda.is_available() else "CPU"
        write_section(f"Attention residuals × checkpointing ({where}, {args.size})", speed_table(rows, args.size))
    else:
        write_section("Attention residuals: quality (CPU)", run_quality(args.steps, args.seeds))


if __name__ == "__main__":
    main()
