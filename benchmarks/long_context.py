"""Training throughput against sequence length: a recipe's model and a plain transformer at the same tokens a step.

    python benchmarks/long_context.py --recipe recipes/small.yaml --plain_recipe recipes/small_plain.yaml \\
        --seqs 2048,8192,32768,65536 --tokens 65536 --json benchmarks/long_context_h200.json        # on the GPU
    python benchmarks/long_context.py --from_json benchmarks/long_context_h200.json   # RESULTS.md section only

Every length in one process with ``batch = tokens / T``, so each step holds the same tokens and a step's cost per
token shows what the length costs: the plain model's softmax attention grows with T in every layer, the K3
model's only in its softmax layers (KDA is linear in T). Each row is :func:`benchmarks.throughput.bench`'s step
(bf16 autocast, fused AdamW, clipping, balancer update, synthetic tokens); each sublayer compiled, as ``k3lit
fit`` does. A model that runs out of memory at a length is timed again with block activation checkpointing
(``activation_checkpointing: block``), which the table says.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.results import (  # noqa: E402
    add_results_argument,
    check_outputs,
    command,
    load_json,
    versions,
    write_result,
)
from benchmarks.throughput import bench, check_run, recipe_config  # noqa: E402
from k3lit.model import ModelConfig  # noqa: E402

SECTION = "Throughput against sequence length"


def bench_length(c: ModelConfig, seq: int, tokens: int, warmup: int, steps: int, device: str, compile_: str
                 ) -> dict:
    """:func:`bench` of ``c`` at ``seq`` with ``tokens // seq`` sequences a step; on out-of-memory again with block
    activation checkpointing (``"checkpointing"`` in the result says which ran).

    Raises:
        ValueError: ``tokens`` is not a multiple of ``seq``.
    """
    if tokens % seq:
        raise ValueError(f"--tokens {tokens} is not a multiple of the length {seq}")
    for policy in ("none", "block"):
        try:
            r = bench(dataclasses.replace(c, activation_checkpointing=policy), tokens // seq, seq, warmup, steps,
                      device, compile_)
            return {**r, "checkpointing": policy, "batch": tokens // seq}
        except torch.OutOfMemoryError:
            if device == "cuda":
                torch.cuda.empty_cache()
    return {"oom": True, "batch": tokens // seq}


def table(result: dict) -> str:
    """RESULTS.md's section: one row per length, both models side by side, and K3's tokens/s over the plain one's."""
    env = result["env"]
    names = list(result["models"])
    lines = [
        f"Written by `benchmarks/long_context.py`. {env['date']} · {env['device']} · torch {env['torch']}, triton "
        f"{env['triton']} · {result['command']}. {result['tokens']:,} tokens a step at every length (batch = "
        f"tokens / T), every row in one process, each sublayer compiled ({result['compile']}), {result['steps']} "
        f"timed steps after {result['warmup']} warm-up steps; MFU = model FLOPs (`k3lit/train/flops.py`, attention "
        "included) / dense bf16 peak; `block`: timed with block activation checkpointing (the step did not fit "
        "without).",
        "",
        "| T | batch | " + " | ".join(f"{n} tokens/s | MFU | peak GiB" for n in names) + " | K3 / plain tokens/s |",
        "|---|---|" + "---|---|---|" * len(names) + "---|",
    ]
    ratios = {}
    for seq in sorted(result["seqs"]):
        cells, tps = [], []
        for n in names:
            r = result["models"][n].get(str(seq), {})
            if not r or r.get("oom") or not r.get("correct"):
                cells.append("out of memory | - | -" if r.get("oom") else "- | - | -")
                tps.append(None)
                continue
            mark = " (block)" if r["checkpointing"] == "block" else ""
            mfu = f"{100 * r['mfu']:.1f}%" if r.get("mfu") else "-"
            mem = f"{r['peak_mem_GiB']:.1f}" if r.get("peak_mem_GiB") is not None else "-"
            cells.append(f"{r['tokens_per_s']:,.0f}{mark} | {mfu} | {mem}")
            tps.append(r["tokens_per_s"])
        if len(tps) == 2 and all(tps):
            ratios[seq] = tps[0] / tps[1]
        ratio = f"{ratios[seq]:.2f}x" if seq in ratios else "-"
        lines.append(f"| {seq:,} | {result['tokens'] // seq} | " + " | ".join(cells) + f" | {ratio} |")
    return "\n".join(lines + ["", verdict(ratios, names)])


def verdict(ratios: dict[int, float], names: list[str]) -> str:
    """The sentence under the table: the shortest measured length where the first model's step overtakes the
    second's, and the target at 32,768 tokens (at least 1.5x the plain model's tokens/s)."""
    if not ratios:
        return "No length has both models timed."
    ahead = [seq for seq, r in sorted(ratios.items()) if r >= 1]
    cross = (f"{names[0]} overtakes {names[1]} between {max(s for s in ratios if s < ahead[0]):,} and "
             f"{ahead[0]:,} tokens" if ahead and any(s < ahead[0] for s in ratios)
             else f"{names[0]} is ahead at every measured length" if ahead else f"{names[0]} is behind at every length")
    target = (f"; at 32,768 tokens it trains at {ratios[32768]:.2f}x the plain model's tokens/s: target (at least "
              f"1.5x) **{'met' if ratios[32768] >= 1.5 else 'not met'}**" if 32768 in ratios else "")
    return cross + target + "."


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--recipe", default="recipes/small.yaml")
    p.add_argument("--plain_recipe", default="recipes/small_plain.yaml")
    p.add_argument("--seqs", default="2048,8192,32768,65536", help="comma-separated sequence lengths")
    p.add_argument("--tokens", type=int, default=65536, help="tokens a step at every length")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--compile", default="sublayers", help="as benchmarks/throughput.py's --compile (one value)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--json", help="write the raw results here (after every row)")
    p.add_argument("--from_json", help="only write RESULTS.md's section from this file")
    add_results_argument(p)
    return p


def main(argv: list[str] | None = None) -> dict | None:
    a = parser().parse_args(argv)
    check_outputs(a)
    if a.from_json:
        write_result(a.results, SECTION, table(load_json(a.from_json, ("models", "seqs", "tokens"))))
        return None
    check_run(a.device, [a.compile], a.warmup, a.steps)
    seqs = [int(s) for s in a.seqs.split(",")]
    k3, _ = recipe_config(Path(a.recipe), None)
    plain, _ = recipe_config(Path(a.plain_recipe), k3.vocab_size)
    if a.device == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
    models = {f"`{Path(a.recipe).stem}`": k3, f"`{Path(a.plain_recipe).stem}`": plain}
    result = {"seqs": seqs, "tokens": a.tokens, "steps": a.steps, "warmup": a.warmup, "compile": a.compile,
              "env": versions(), "command": command(), "models": {n: {} for n in models}}
    for seq in seqs:
        for name, c in models.items():
            r = bench_length(c, seq, a.tokens, a.warmup, a.steps, a.device, a.compile)
            result["models"][name][str(seq)] = r
            print(seq, name, json.dumps(r), flush=True)
            if a.json:
                Path(a.json).write_text(json.dumps(result, indent=1))
            if a.device == "cuda":
                torch.cuda.empty_cache()
    print(table(result))
    return result


if __name__ == "__main__":
    main()
