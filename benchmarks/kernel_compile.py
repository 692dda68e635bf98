"""Compile time of the Triton kernels a recipe's training launches, one after another and in background workers.

    python benchmarks/kernel_compile.py --recipes recipes/small.yaml --json benchmarks/kernel_compile_cpu.json
    python benchmarks/kernel_compile.py --from_json benchmarks/kernel_compile_cpu.json    # RESULTS.md section only

No GPU needed. Per recipe, the kernels ``KernelPrecompile`` plans for it (:func:`k3lit.kernels.precompile.plan`:
the recipe's model, ``data.batch_size`` x ``data.seq_len``, bf16 autocast over float32 weights, an H200's sm_90a
and 132 SMs) are compiled twice, each time into an empty Triton cache: one after another in this process, as the
first launches of a run compile them without ``KernelPrecompile``, and by ``--workers`` worker processes
(:func:`k3lit.kernels.precompile.start`, their start-up included), as ``KernelPrecompile`` does. Wall seconds of
each, on this machine's CPU. Must run without ``TRITON_INTERPRET``. Writes RESULTS.md's section "Kernel compile
time (<device>)".
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import torch
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.results import add_output_arguments, command, run_or_load, versions  # noqa: E402
from k3lit.kernels import aot, precompile  # noqa: E402
from k3lit.model import ModelConfig  # noqa: E402


def timed(items: list[precompile.Item], workers: int) -> dict:
    """Seconds to compile ``items`` for the H200 one after another in this process, and in ``workers`` workers, each
    into a new empty Triton cache (``TRITON_CACHE_DIR``, restored after)."""
    saved = os.environ.get("TRITON_CACHE_DIR")
    out = {}
    try:
        for how in ("serial", "workers"):
            with tempfile.TemporaryDirectory(prefix="k3lit-compile-") as cache:
                os.environ["TRITON_CACHE_DIR"] = cache
                t0 = time.perf_counter()
                if how == "serial":
                    for item in items:
                        aot.compile_kernel(item.launch())
                else:
                    precompile.start(items, aot.H200, workers).wait()
                out[f"{how}_s"] = time.perf_counter() - t0
    finally:
        if saved is None:
            os.environ.pop("TRITON_CACHE_DIR", None)
        else:
            os.environ["TRITON_CACHE_DIR"] = saved
    return out


def measure(a: argparse.Namespace) -> dict:
    """Every recipe's planned kernels, timed (module docstring)."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        sys.exit("unset TRITON_INTERPRET: the kernels must be compilable JIT functions")
    rows = []
    for recipe in a.recipes:
        r = yaml.safe_load(Path(recipe).read_text())
        config = ModelConfig(**r["model"])
        items = precompile.plan(config, r["data"]["batch_size"], r["data"]["seq_len"], torch.bfloat16)
        rows.append({"recipe": recipe, "kernels": len(items), "workers": min(a.workers, len(items)),
                     **timed(items, a.workers)})
        print(rows[-1], flush=True)
    return {"env": versions(), "command": command(), "rows": rows}


def table(result: dict) -> str:
    """RESULTS.md's section body."""
    env = result["env"]
    lines = [f"{env['date']}, {env['device']}, torch {env['torch']}, triton {env['triton']}; "
             f"{result['command']}. The kernels `KernelPrecompile` plans for the recipe (its batch, bf16 autocast, "
             "sm_90a, 132 SMs), compiled into an empty Triton cache: one after another in one process, and by the "
             "workers (their start-up included).", "",
             "| recipe | distinct kernels | one after another (s) | workers | in the workers (s) |",
             "|---|---|---|---|---|"]
    for r in result["rows"]:
        lines.append(f"| `{Path(r['recipe']).stem}` | {r['kernels']} | {r['serial_s']:.1f} | {r['workers']} | "
                     f"{r['workers_s']:.1f} |")
    return "\n".join(lines)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--recipes", nargs="+", default=["recipes/small.yaml"])
    p.add_argument("--workers", type=int, default=2, help="worker processes (KernelPrecompile: half the CPUs, <= 8)")
    add_output_arguments(p, "raw rows")
    return p


def main() -> None:
    run_or_load(parser().parse_args(), measure, "Kernel compile time", table)


if __name__ == "__main__":
    main()
