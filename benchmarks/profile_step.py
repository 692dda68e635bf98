"""Where a training step's time goes: torch.profiler over a few optimizer steps of a recipe's model.

    python benchmarks/profile_step.py --recipe recipes/small.yaml                      # the recipe as written
    python benchmarks/profile_step.py --recipe recipes/small.yaml --set residual=plain n_experts=0
    python benchmarks/profile_step.py --recipe recipes/small.yaml --trace trace.json  # Chrome/Perfetto trace

Prints the wall time per step, the summed device-kernel time per step (the gap between the two is time the
GPU waits for the host: launch-bound Python), and the operators with the most self device time. The step is
``benchmarks/throughput.py``'s (bf16 autocast, float32 weights, fused AdamW, clipping, balancer update).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path

import torch
import yaml
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent))
from throughput import build_model, make_step, recipe_config  # noqa: E402


def overrides(pairs: list[str]) -> dict:
    """``["residual=plain", "n_experts=0"]`` -> ``{"residual": "plain", "n_experts": 0}`` (YAML values)."""
    out = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep:
            raise SystemExit(f"--set takes field=value pairs of ModelConfig, got {pair!r}")
        out[key] = yaml.safe_load(value)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--recipe", default="recipes/small.yaml")
    p.add_argument("--set", nargs="*", default=[], help="ModelConfig overrides, field=value")
    p.add_argument("--batch", type=int)
    p.add_argument("--seq", type=int)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--rows", type=int, default=30)
    p.add_argument("--trace", help="also write a Chrome trace here")
    a = p.parse_args()
    cfg, data = recipe_config(Path(a.recipe), None)
    cfg = dataclasses.replace(cfg, **overrides(a.set))
    batch, seq = a.batch or int(data.get("batch_size", 16)), a.seq or int(data.get("seq_len", 2048))
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = build_model(cfg, device, False)
    step = make_step(model, device)
    x = torch.randint(0, cfg.vocab_size, (batch, seq + 1), device=device)
    for _ in range(3):  # compile kernels, prime the allocator
        step(x)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    with profile(activities=activities) as prof:
        t0 = time.perf_counter()
        for _ in range(a.steps):
            step(x)
        if device == "cuda":
            torch.cuda.synchronize()
        wall = (time.perf_counter() - t0) / a.steps
    events = prof.key_averages()
    sort = "self_device_time_total" if device == "cuda" else "self_cpu_time_total"
    kernels = [e for e in events if e.device_type == DeviceType.CUDA]  # kernel rows, not the ops launching them
    kernel_us = sum(e.self_device_time_total for e in kernels) / a.steps if kernels else float("nan")
    print(f"config: {a.recipe} {' '.join(a.set)} batch {batch} x {seq}")
    print(f"wall per step {1e3 * wall:.1f} ms; device kernels per step {kernel_us / 1e3:.1f} ms")
    print(events.table(sort_by=sort, row_limit=a.rows, max_name_column_width=60))
    if a.trace:
        prof.export_chrome_trace(a.trace)


if __name__ == "__main__":
    main()
