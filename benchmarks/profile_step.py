"""Where a training step's time goes: torch.profiler over a few optimizer steps of a recipe's or a size's model.

    python benchmarks/profile_step.py --recipe recipes/small.yaml                      # the recipe as written
    python benchmarks/profile_step.py --recipe recipes/small.yaml --set residual=plain n_experts=0
    python benchmarks/profile_step.py --size 300m --grid residual=plain,block_attnres \\
        activation_checkpointing=none,block --out prof/                              # 4 configurations
    python benchmarks/profile_step.py --recipe recipes/small.yaml --trace trace.json  # Chrome/Perfetto trace
    python benchmarks/profile_step.py --recipe recipes/small.yaml recipes/small_plain.yaml --compile sublayers \\
        --write                                        # device time by kernel group, side by side, in RESULTS.md

``--size`` takes the model, batch and sequence length of ``benchmarks/attnres.py``'s SIZES (``300m``: a 299M
model); ``--set`` overrides ModelConfig fields for every configuration, ``--grid`` runs every combination of the
listed values. Per configuration it prints:

* the activation peak on GPUs (peak allocated memory over the timed steps minus weights and optimizer state,
  as ``benchmarks/attnres.py`` measures it, gradients included);
* wall time per step without the profiler (synchronised, median of ``--steps``), the summed device-kernel time
  per step (the gap is time the GPU waits for the host), and under the profiler the wall time and the host
  time spent inside top-level torch operators and CUDA API calls (every thread; the rest is Python);
* what the host dispatches per step: operators that reach the dispatcher (aten and custom ops, counted by a
  TorchDispatchMode over one extra step; views counted apart), device kernels, kernel-launch API calls, and
  those per sublayer; copies, pinned allocations and synchronisations per step (the profiled loop ends with
  one ``torch.cuda.synchronize``);
* the operators with the most self CPU time and, on GPUs, the most self device time (``--rows`` each);
* on GPUs, after the last configuration, every run's device time per step by kernel group (:data:`KERNEL_GROUPS`:
  KDA, short convolution, AttnRes, GEMMs, grouped GEMMs, attention, cross-entropy, routing, optimizer, inductor's
  kernels, the rest) side by side; ``--write`` puts that table in RESULTS.md (section "Device time by kernel group
  (<GPU>)").

With ``--out DIR`` each configuration's full tables (60 rows) go to ``DIR/<recipe or size>[_<grid values>].txt``,
and ``DIR/summary.json`` collects the summaries (with each kernel group's ten largest kernels, ``group_kernels``).
The step is ``benchmarks/throughput.py``'s (bf16 autocast, float32 weights, fused AdamW, clipping, balancer
update; the loss compiled when the model is).
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import itertools
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import yaml
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parent))
from attnres import SIZES  # noqa: E402
from results import command, environment, write_section  # noqa: E402
from throughput import COMPILE, GRAPHS, build_model, make_step, recipe_config  # noqa: E402

from k3lit.kernels.launches import (  # noqa: E402
    ATTN_RES_MIX_KERNELS,
    ATTN_RES_TWO_PHASE_KERNELS,
    KDA_BWD_KERNELS,
    KDA_FWD_KERNELS,
    ROUTING_CAPACITY_KERNELS,
    SHORT_CONV_KERNELS,
)
from k3lit.model import ModelConfig  # noqa: E402

LAUNCH = "LaunchKernel"  # in cudaLaunchKernel, cuLaunchKernel, cuLaunchKernelEx, cudaLaunchKernelExC
# host-side CUDA API calls worth counting: copies, pinned allocations, and anything that waits for the device
API_CALLS = ("Memcpy", "HostAlloc", "Synchronize")


KERNEL_GROUPS: tuple[tuple[str, tuple[str, ...], tuple[str, ...]], ...] = (
    # (group, exact kernel names, substrings), the first match wins
    ("KDA", (*KDA_FWD_KERNELS, *KDA_BWD_KERNELS, "_fused_recurrent_fwd"), ()),
    ("short convolution", SHORT_CONV_KERNELS, ()),
    ("AttnRes", (*ATTN_RES_TWO_PHASE_KERNELS, *ATTN_RES_MIX_KERNELS), ()),
    ("cross-entropy", (), ("log_softmax", "nll_loss", "SoftMax")),
    # cuDNN's SDPA backward runs its dO·O and dQ-conversion kernels (cudnn::fusion::) beside the main one
    ("softmax attention", (), ("sdpa", "flash", "fmha", "attention", "cudnn::fusion::")),
    ("grouped GEMM (MoE experts)", (), ("cutlass13device_kernel", "GroupedGemm", "grouped_gemm")),
    ("GEMM (projections, LM head)", (), ("nvjet", "gemm", "xmma", "cutlass")),
    ("routing: top-k and sort", ROUTING_CAPACITY_KERNELS, ("topk", "TopK", "sort", "Sort", "radix")),
    ("optimizer", (), ("multi_tensor_apply", "adam", "Adam")),
    ("inductor's fused kernels (norms, gates, casts)", (), ("triton_",)),
)
OTHER_KERNELS = "other aten kernels (copies, reductions, scatters)"


def kernel_group(name: str) -> str:
    """The :data:`KERNEL_GROUPS` group of a device kernel, by its name in the profiler (a Triton kernel's JIT
    function name, inductor's ``triton_*`` names, cuBLAS's ``nvjet_*``, ...); :data:`OTHER_KERNELS` for the rest."""
    for group, names, parts in KERNEL_GROUPS:
        if name in names or any(p in name for p in parts):
            return group
    return OTHER_KERNELS


def overrides(pairs: list[str]) -> dict:
    """``["residual=plain", "n_experts=0"]`` -> ``{"residual": "plain", "n_experts": 0}`` (YAML values)."""
    out = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep:
            raise SystemExit(f"--set / --grid take field=value pairs of ModelConfig, got {pair!r}")
        out[key] = yaml.safe_load(value)
    return out


def grid(pairs: list[str]) -> list[dict]:
    """``["residual=plain,block_attnres", "activation_checkpointing=none,block"]`` -> the 4 override dicts."""
    axes = [[f"{key}={v}" for v in values.split(",")] for key, _, values in (p.partition("=") for p in pairs)]
    return [overrides(list(combo)) for combo in itertools.product(*axes)] or [{}]


class OpCounter(TorchDispatchMode):
    """Counts every operator that reaches the dispatcher below autograd (forward, backward, recomputation and
    optimizer): ``counts[name]``; ``views`` of them only alias (no kernel)."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: collections.Counter[str] = collections.Counter()
        self.views = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counts[str(func.overloadpacket)] += 1
        self.views += bool(getattr(func, "is_view", False))
        return func(*args, **(kwargs or {}))


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _table(events: list, key: str, steps: int, rows: int, device_col: bool) -> str:
    """Compact rows ``name | calls/step | self CPU ms/step [| self device ms/step]`` sorted by ``key``."""
    events = sorted(events, key=lambda e: getattr(e, key), reverse=True)[:rows]
    head = f"  {'operator':<58} {'calls':>7} {'self CPU ms':>11}" + (f" {'self dev ms':>11}" if device_col else "")
    lines = [head]
    for e in events:
        line = f"  {e.key[:58]:<58} {e.count / steps:>7.1f} {e.self_cpu_time_total / steps / 1e3:>11.2f}"
        if device_col:
            line += f" {e.self_device_time_total / steps / 1e3:>11.2f}"
        lines.append(line)
    return "\n".join(lines)


def profile_config(cfg: ModelConfig, batch: int, seq: int, steps: int, rows: int, trace: str | None,
                   compile_: str = "none", optim: str = "adamw") -> dict:
    """Time, count and profile ``steps`` optimizer steps of ``cfg`` (``compile_`` and ``optim`` as
    ``benchmarks/throughput.py`` takes them; compiled steps are not op-counted: a dispatch mode would change what
    dynamo traces); returns the summary and the text tables."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = build_model(cfg, device, compile_)
    step = make_step(model, device, optim, compile_loss=compile_ != "none")
    x = torch.randint(0, cfg.vocab_size, (batch, seq + 1), device=device)
    for _ in range(3):  # compile kernels, prime the allocator
        step(x)
    _sync(device)
    base = torch.cuda.memory_allocated() if device == "cuda" else 0  # weights and optimizer state
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(steps):
        _sync(device)
        t0 = time.perf_counter()
        step(x)
        _sync(device)
        times.append(time.perf_counter() - t0)
    act_mib = (torch.cuda.max_memory_allocated() - base) / 2**20 if device == "cuda" else None
    counter = OpCounter()
    if compile_ == "none":
        with counter:
            step(x)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    with profile(activities=activities) as prof:
        t0 = time.perf_counter()
        for _ in range(steps):
            step(x)
        _sync(device)
        prof_wall = (time.perf_counter() - t0) / steps
    averages = prof.key_averages()
    # kernel rows, not the ops launching them, nor the device-side spans of record_function regions (the
    # optimizer's step is one: it spans every kernel of the step and the gaps between them)
    kernels = [e for e in averages if e.device_type == DeviceType.CUDA and not e.is_user_annotation]
    cpu_ops = [e for e in averages if e.device_type == DeviceType.CPU]
    top_level_us = sum(e.cpu_time_total for e in prof.events()
                       if e.cpu_parent is None and e.device_type == DeviceType.CPU)
    n_sub = len(model.sublayers)
    summary = {
        "config": {k: getattr(cfg, k) for k in ("residual", "activation_checkpointing", "attnres_block_size")},
        "compile": compile_,
        "params_m": sum(p.numel() for p in model.parameters()) / 1e6,
        "wall_ms": 1e3 * statistics.median(times),
        "act_mib": act_mib,
        "wall_profiled_ms": 1e3 * prof_wall,
        "device_ms": sum(e.self_device_time_total for e in kernels) / steps / 1e3 if kernels else None,
        "host_in_ops_ms": top_level_us / steps / 1e3,
        "ops": sum(counter.counts.values()) if compile_ == "none" else None,
        "views": counter.views,
        "kernels": sum(e.count for e in kernels) / steps if kernels else None,
        "launches": sum(e.count for e in cpu_ops if LAUNCH in e.key) / steps,
        "api_calls": {e.key: e.count / steps for e in cpu_ops if any(c in e.key for c in API_CALLS)},
        "sublayers": n_sub,
        "top_dispatched": counter.counts.most_common(12),
        "kernel_groups": _grouped_ms(kernels, steps) if kernels else None,
        "group_kernels": _group_kernels(kernels, steps) if kernels else None,
        "batch": batch,
        "seq": seq,
    }
    if trace:
        prof.export_chrome_trace(trace)
    full = [f"by self CPU time:\n{_table(cpu_ops, 'self_cpu_time_total', steps, 60, bool(kernels))}"]
    short = [f"top self CPU (ms and calls per step):\n{_table(cpu_ops, 'self_cpu_time_total', steps, rows, False)}"]
    if kernels:
        full.append(f"by self device time:\n{_table(averages, 'self_device_time_total', steps, 60, True)}")
        short.append(f"top self device (ms and calls per step):\n"
                     f"{_table(kernels, 'self_device_time_total', steps, rows, True)}")
    if compile_ == "none":
        full.append("dispatched operators per step:\n" + "\n".join(f"  {n:<40} {c:>7}" for n, c in
                                                                    counter.counts.most_common()))
    del model, step
    if device == "cuda":
        torch.cuda.empty_cache()
    return {"summary": summary, "short": "\n".join(short), "full": "\n\n".join(full)}


def _grouped_ms(kernels: list, steps: int) -> dict[str, float]:
    """Device milliseconds per step of each kernel group (:func:`kernel_group`), largest first."""
    ms: dict[str, float] = collections.Counter()
    for e in kernels:
        ms[kernel_group(e.key)] += e.self_device_time_total / steps / 1e3
    return dict(sorted(ms.items(), key=lambda kv: -kv[1]))


def _group_kernels(kernels: list, steps: int, top: int = 10) -> dict[str, list[tuple[str, float, float]]]:
    """Each kernel group's ``top`` kernels by device time: ``[(name, ms per step, calls per step)]``, largest
    first, so a stored summary says what a group's milliseconds are made of."""
    rows: dict[str, list] = collections.defaultdict(list)
    for e in kernels:
        rows[kernel_group(e.key)].append((e.key, e.self_device_time_total / steps / 1e3, e.count / steps))
    return {g: sorted(r, key=lambda x: -x[1])[:top] for g, r in rows.items()}


def side_by_side(runs: list[tuple[str, dict]]) -> str:
    """Device ms per step by kernel group, one column per profiled run (``(name, summary)``), the groups in the first
    run's order; the last rows: all kernels and the step's wall time."""
    groups = list(runs[0][1]["kernel_groups"])
    groups += [g for _, s in runs[1:] for g in s["kernel_groups"] if g not in groups]
    lines = ["| kernels | " + " | ".join(f"`{name}` ms" for name, _ in runs) + " |", "|---" * (len(runs) + 1) + "|"]
    for g in groups:
        lines.append(f"| {g} | " + " | ".join(f"{s['kernel_groups'].get(g, 0.0):.2f}" for _, s in runs) + " |")
    lines.append("| all device kernels (kernels a step) | " + " | ".join(
        f"{s['device_ms']:.1f} ({s['kernels']:.0f})" for _, s in runs) + " |")
    lines.append("| step wall time | " + " | ".join(f"{s['wall_ms']:.1f}" for _, s in runs) + " |")
    return "\n".join(lines)


SECTION = "Device time by kernel group"


def section(runs: list[tuple[str, dict]], compile_: str, optim: str) -> str:
    """RESULTS.md's section: how the runs were made, then :func:`side_by_side`."""
    shapes = ", ".join(f"`{name}` {s['batch']} x {s['seq']}" for name, s in runs)
    optimizer = "fused AdamW" if optim == "adamw" else "Muon on the hidden matrices, fused AdamW on the rest"
    return (f"Written by `benchmarks/profile_step.py`. {environment()}. Command: {command()}. Device milliseconds per "
            f"optimizer step by kernel group (the profiler's self device time of every kernel, grouped by name: "
            f"`profile_step.kernel_group`), each run's own batch x tokens ({shapes}), compile `{compile_}`, the "
            f"step of `benchmarks/throughput.py` (bf16 autocast, float32 weights, {optimizer}, clipping, balancer "
            "update; the loss compiled with a compiled model). Step wall time without the profiler, median.\n\n"
            + side_by_side(runs))


def headline(s: dict, batch: int, seq: int) -> str:
    """The summary of one configuration in four or five lines."""
    c, per = s["config"], s["sublayers"]
    dev = "" if s["device_ms"] is None else f" · device kernels {s['device_ms']:.1f} ms ({s['kernels']:.0f} kernels)"
    mem = "" if s["act_mib"] is None else f" · activation peak {s['act_mib']:.0f} MiB"
    compiled = "" if s.get("compile", "none") == "none" else f" · compiled: {s['compile']}"
    ops = "" if s["ops"] is None else f"{s['ops']} dispatched ops ({s['views']} views), "
    per_ops = "" if s["ops"] is None else f"{s['ops'] / per:.0f} ops, "
    lines = [
        f"== {c['residual']} / {c['activation_checkpointing']} (S={c['attnres_block_size']}) · "
        f"{s['params_m']:.0f}M params · batch {batch} x {seq}{mem}{compiled}",
        f"wall {s['wall_ms']:.1f} ms/step{dev}; profiled: wall {s['wall_profiled_ms']:.1f} ms, inside torch ops "
        f"and CUDA calls {s['host_in_ops_ms']:.1f} ms",
        f"per step: {ops}{s['launches']:.0f} kernel launches; per sublayer ({per}): {per_ops}"
        f"{s['launches'] / per:.0f} launches",
    ]
    if s["api_calls"]:
        lines.append("CUDA calls per step: " + ", ".join(f"{k} {v:.1f}" for k, v in s["api_calls"].items()))
    if s["ops"] is not None:
        lines.append("most dispatched: " + ", ".join(f"{n.removeprefix('aten.')} {k}"
                                                     for n, k in s["top_dispatched"][:8]))
    return "\n".join(lines)


def comparison(summaries: list[dict]) -> str:
    """One row per configuration, with ratios to ``none`` of the same residual and to ``plain`` of the same
    policy where those ran."""
    def key(s, **kw):
        c = dict(s["config"], **kw)
        return c["residual"], c["activation_checkpointing"]

    by = {key(s): s for s in summaries}
    lines = ["| residual | policy | wall ms | device ms | act. MiB | ops | launches | vs none | vs plain |",
             "|---|---|---|---|---|---|---|---|---|"]
    for s in summaries:
        none, plain = by.get(key(s, activation_checkpointing="none")), by.get(key(s, residual="plain"))
        dev = "-" if s["device_ms"] is None else f"{s['device_ms']:.1f}"
        mem = "-" if s["act_mib"] is None else f"{s['act_mib']:.0f}"
        lines.append(f"| {s['config']['residual']} | {s['config']['activation_checkpointing']} | {s['wall_ms']:.1f} | "
                     f"{dev} | {mem} | {s['ops']} | {s['launches']:.0f} | "
                     f"{'-' if none is None else format(s['wall_ms'] / none['wall_ms'], '.2f') + 'x'} | "
                     f"{'-' if plain is None else format(s['wall_ms'] / plain['wall_ms'], '.3f') + 'x'} |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--recipe", nargs="+", default=["recipes/small.yaml"],
                   help="one or more recipes (each with its own batch and length), profiled one after another")
    p.add_argument("--size", choices=list(SIZES), help="model, batch and length of benchmarks/attnres.py instead")
    p.add_argument("--set", nargs="*", default=[], help="ModelConfig overrides, field=value")
    p.add_argument("--grid", nargs="*", default=[], help="field=v1,v2 ...: every combination, one after another")
    p.add_argument("--batch", type=int)
    p.add_argument("--seq", type=int)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--rows", type=int, default=12)
    p.add_argument("--out", help="folder for the full tables and summary.json")
    p.add_argument("--trace", help="also write a Chrome trace here (the last configuration's)")
    p.add_argument("--compile", choices=COMPILE, default="none", help="as benchmarks/throughput.py's --compile")
    p.add_argument("--optim", choices=["adamw", "muon"], default="adamw", help="as benchmarks/throughput.py's --optim")
    p.add_argument("--write", action="store_true",
                   help="write the device time by kernel group, the runs side by side, to RESULTS.md's section "
                        f"{SECTION!r} (GPU runs only)")
    a = p.parse_args()
    if not torch.cuda.is_available():  # what only a GPU run gives, refused before the profile runs
        if a.compile in GRAPHS:
            p.error(f"--compile {a.compile} replays CUDA graphs: run it on a GPU")
        if a.write:
            p.error("--write tabulates device kernels: run it on a GPU")
    bases = []  # (name, config, batch, seq)
    if a.size:
        spec = SIZES[a.size]
        bases.append((a.size, spec["cfg"], a.batch or spec["batch"], a.seq or spec["seq"]))
    else:
        for recipe in a.recipe:
            cfg, data = recipe_config(Path(recipe), None)
            bases.append((Path(recipe).stem, cfg, a.batch or int(data.get("batch_size", 16)),
                          a.seq or int(data.get("seq_len", 2048))))
    out = Path(a.out) if a.out else None
    if out:
        out.mkdir(parents=True, exist_ok=True)
    summaries, runs = [], []
    for (stem, base, batch, seq), over in itertools.product(bases, grid(a.grid)):
        cfg = dataclasses.replace(base, **{**overrides(a.set), **over})  # the grid's value wins
        r = profile_config(cfg, batch, seq, a.steps, a.rows, a.trace, a.compile, a.optim)
        print(headline(r["summary"], batch, seq), r["short"], "", sep="\n", flush=True)
        name = "_".join([stem, *(f"{k}-{v}" for k, v in over.items())])
        if out:
            (out / f"{name}.txt").write_text(headline(r["summary"], batch, seq) + "\n\n" + r["full"] + "\n")
        summaries.append(r["summary"])
        runs.append((name, r["summary"]))
    print(comparison(summaries))
    if out:
        (out / "summary.json").write_text(json.dumps(summaries, indent=1))
    if all(s["kernel_groups"] for s in summaries):
        print(side_by_side(runs))
        if a.write:
            write_section(f"{SECTION} ({torch.cuda.get_device_name()})", section(runs, a.compile, a.optim))
    elif a.write:
        raise SystemExit("--write: no device kernels were profiled (run it on a GPU)")


if __name__ == "__main__":
    main()
