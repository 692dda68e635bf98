"""Routing of one MoE layer with and without a capacity limit, timed on its own, eager and compiled.

    python benchmarks/routing.py --json benchmarks/routing_h200.json      # on the GPU: the small recipe's shape
    python benchmarks/routing.py --from_json benchmarks/routing_h200.json # RESULTS.md section only

At a recipe's routing shape (default ``recipes/small.yaml``: m = 16 x 2048 tokens, n = 16 experts, top-2), the
router's sigmoid scores ``[m, n]`` float32 of a skewed router (some experts overloaded, as early in training) go
through each routing of :class:`k3lit.nn.MoE`, forward and the backward of the gate weights:

- ``top-k``: no capacity (:func:`k3lit.ops.routing.route`);
- ``quantile capacity``: a per-expert score threshold from earlier steps (here each expert's median score);
- ``causal capacity cf``: the count limit admitted in position order (:func:`~k3lit.ops.routing.causal_capacity_route`,
  on CUDA the Triton kernels, two launches); ``causal capacity cf, torch rounds``: the same routing in n + 1 rounds of
  torch operations (``backend="torch"``, the CPU path);
- ``forward capacity cf``: the count limit over the forward's tokens in rounds of a host loop (eager only).

Per routing: median ms (``triton.testing.do_bench`` on CUDA, the median of timed calls on the CPU), eager and under
``torch.compile(fullgraph=True)``; the aten operations one eager call issues (counted with a dispatch mode); the
re-routed share of slots. Compiled and eager routings are checked to choose the same experts before timing.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.profile_step import OpCounter  # noqa: E402
from benchmarks.results import add_output_arguments, command, run_or_load, versions  # noqa: E402
from k3lit.ops.routing import capacity_route, causal_capacity_route, route  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def routings(m: int, n: int, k: int, seq_len: int, cfs: list[float], threshold: torch.Tensor
             ) -> dict[str, tuple[Callable, bool]]:
    """``{name: (fn(scores, bias) -> (expert_idx, weights, rerouted), compilable)}`` of every routing timed."""
    def topk(s: torch.Tensor, b: torch.Tensor) -> tuple:
        idx, w = route(s, b, k)
        return idx, w, torch.zeros((), dtype=torch.int64, device=s.device)

    def quantile(s: torch.Tensor, b: torch.Tensor) -> tuple:
        idx, w, rerouted, _ = capacity_route(s, b, k, min_score=threshold)
        return idx, w, rerouted

    out = {"top-k": (topk, True), "quantile capacity": (quantile, True)}
    for cf in cfs:
        out[f"causal capacity {cf:g}"] = (
            lambda s, b, cf=cf: causal_capacity_route(s, b, k, cf, seq_len)[:3], True)
        out[f"causal capacity {cf:g}, torch rounds"] = (
            lambda s, b, cf=cf: causal_capacity_route(s, b, k, cf, seq_len, backend="torch")[:3], True)
    for cf in cfs:
        out[f"forward capacity {cf:g}"] = (lambda s, b, cf=cf: capacity_route(s, b, k, cf)[:3], False)
    return out


def median_ms(fn: Callable[[], object], device: torch.device, reps: int) -> float:
    """Median milliseconds of ``fn()``: ``triton.testing.do_bench`` on CUDA, else the median of ``reps`` calls."""
    if device.type == "cuda":
        import triton

        return float(triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median"))
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(1e3 * (time.perf_counter() - t0))
    return statistics.median(times)


def measure(a: argparse.Namespace) -> dict:
    """Every routing of :func:`routings` at the recipe's shape (module docstring); the rows and this process's
    versions.

    Raises:
        RuntimeError: a compiled routing chose other experts than its eager run.
    """
    recipe = yaml.safe_load((ROOT / a.recipe).read_text())
    model, data = recipe["model"], recipe["data"]
    n, k = model["n_experts"], model["top_k"]
    seq_len, m = data["seq_len"], data["batch_size"] * data["seq_len"]
    device = torch.device(a.device)
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(m, n, generator=gen) + 2.0 * torch.randn(n, generator=gen)  # a skewed router
    scores = torch.sigmoid(logits).to(device)
    bias = torch.zeros(n, device=device)
    threshold = scores.median(dim=0).values
    grad = torch.randn(m, k, generator=gen).to(device)
    rows = []
    for name, (fn, compilable) in routings(m, n, k, seq_len, a.capacity_factors, threshold).items():
        s = scores.clone().requires_grad_()

        def step(f: Callable = fn, s: torch.Tensor = s) -> None:
            _, w, _ = f(s, bias)
            (w * grad).sum().backward()

        with torch.no_grad(), OpCounter() as counted:
            idx, _, rerouted = fn(scores, bias)
        row = {"routing": name, "eager_ms": median_ms(step, device, a.reps), "aten_ops": sum(counted.counts.values()),
               "rerouted": int(rerouted) / (m * k), "compiled_ms": None}
        if compilable:
            compiled = torch.compile(fn, fullgraph=True, backend=a.backend)
            with torch.no_grad():
                same = torch.equal(compiled(scores, bias)[0], idx)
            if not same:
                raise RuntimeError(f"{name}: the compiled routing chose other experts than eager")
            row["compiled_ms"] = median_ms(lambda c=compiled: step(c), device, a.reps)
        rows.append(row)
        print(row, flush=True)
    return {"recipe": a.recipe, "backend": a.backend, "m": m, "n": n, "k": k, "seq_len": seq_len, "env": versions(),
            "command": command(), "rows": rows}


def table(result: dict) -> str:
    """RESULTS.md's section body: one row per routing."""
    env, backend = result["env"], result.get("backend", "inductor")
    lines = [f"{env['date']}, {env['device']}, torch {env['torch']}, triton {env['triton']}; {result['command']}. "
             f"The routing of one MoE layer of `{Path(result['recipe']).stem}` (m = {result['m']:,} tokens of "
             f"sequences of {result['seq_len']:,}, n = {result['n']} experts, top-{result['k']}) on a skewed "
             "router's float32 scores, forward and the backward of the gate weights, timed on its own; compiled: "
             f"`torch.compile(fullgraph=True, backend={backend!r})` of the routing function, checked to choose the "
             "experts eager does. aten ops: operations one eager forward dispatches (a compiled one launches "
             "fewer, fused kernels).",
             "", "| routing | eager ms | compiled ms | aten ops (eager) | re-routed share |", "|---|---|---|---|---|"]
    for r in result["rows"]:
        compiled = "-" if r["compiled_ms"] is None else f"{r['compiled_ms']:.3f}"
        lines.append(f"| {r['routing']} | {r['eager_ms']:.3f} | {compiled} | {r['aten_ops']} | {r['rerouted']:.4f} |")
    return "\n".join(lines)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--recipe", default="recipes/small.yaml", help="the routing shape: its MoE and data sections")
    p.add_argument("--capacity_factors", type=float, nargs="+", default=[1.1, 1.25])
    p.add_argument("--reps", type=int, default=20, help="timed calls on the CPU (CUDA: do_bench's own)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--backend", default="inductor", help="torch.compile backend of the compiled column")
    add_output_arguments(p, "raw rows")
    return p


def main() -> None:
    run_or_load(parser().parse_args(), measure, "Routing with a capacity limit", table)


if __name__ == "__main__":
    main()
