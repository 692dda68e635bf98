"""Training throughput of a recipe's model beside its ablations, a plain transformer and litgpt, in one process.

    python benchmarks/throughput.py --recipe recipes/small.yaml \\
        --rows recipe,plain,litgpt,dense,attention,plain_residual,no_balancer \\
        --extra_recipe recipes/medium_1gpu.yaml --compile none,sublayers,model \\
        --json benchmarks/throughput_h200.json                                      # on the GPU
    python benchmarks/throughput.py --from_json benchmarks/throughput_h200.json    # write RESULTS.md "Throughput"

Rows (``--rows``): the recipe; four one-change ablations of it (dense SwiGLU of the same active size instead of
the MoE, softmax attention in every layer, the plain residual, no balancer); the plain transformer (softmax
attention everywhere, dense SwiGLU, plain residual, ``mlp_hidden`` chosen so that its active matmul weights match
the recipe's); litgpt's ``GPT`` (SmolLM2-135M config) as the peer; each ``--variant`` (the recipe's model with
other fields: a balancer, a capacity); and ``--extra_recipe`` models at their own batch. Each row runs once per
``--compile`` setting. Each step is what ``trainer.precision=bf16-mixed`` runs: float32 weights, bf16 autocast,
float32 cross-entropy, fused AdamW, clipping, plus the MoE balancer update.
Tokens are synthetic (uniform random ids), so no data pipeline is timed.

Correctness first: before timing, each model's loss must be finite and fall over the warm-up steps on a fixed
batch, else no number is reported. MFU = model FLOPs (k3lit.train.flops) / dense bf16 peak of the device.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.results import add_results_argument, check_outputs, load_json, versions, write_result  # noqa: E402
from k3lit.model import K3LM, ModelConfig  # noqa: E402
from k3lit.nn.moe import update_balancers  # noqa: E402
from k3lit.train.flops import active_matmul_params, peak_flops, training_flops  # noqa: E402
from k3lit.train.loss import compiled_next_token_loss, next_token_loss  # noqa: E402
from k3lit.train.optim import OptimConfig  # noqa: E402


def recipe_config(recipe: Path, vocab: int | None) -> tuple[ModelConfig, dict]:
    """The recipe's :class:`ModelConfig` (vocabulary from its tokenizer unless ``vocab``) and its ``data`` section.
    ``recipe`` is a YAML file or, as ``make RECIPE=`` takes it, the name of one in ``recipes/`` (``small``).

    Raises:
        SystemExit: neither a file nor a recipe's name (the message lists the recipes).
    """
    if not recipe.is_file():
        named = ROOT / "recipes" / f"{recipe}.yaml"
        if not named.is_file():
            names = sorted(p.stem for p in (ROOT / "recipes").glob("*.yaml"))
            raise SystemExit(f"no recipe {str(recipe)!r}: give a YAML file or one of {', '.join(names)}")
        recipe = named
    r = yaml.safe_load(recipe.read_text())
    data = r.get("data", {})
    tok = str(data.get("tokenizer", "byte"))
    if vocab is None:
        vocab = int(tok.split(":")[1]) if tok.startswith("bpe:") else 256 if tok == "byte" else 32768
    return ModelConfig(vocab_size=vocab, **r["model"]), data


def plain_baseline(c: ModelConfig) -> ModelConfig:
    """Softmax attention everywhere (no positional encoding, as ``c``'s), dense SwiGLU, plain residual;
    mlp_hidden matched on active weights."""
    base = dataclasses.replace(c, layer_pattern="A", n_experts=0, residual="plain", first_dense_layers=0)
    target = active_matmul_params(c)
    without_mlp = active_matmul_params(dataclasses.replace(base, mlp_hidden=1)) - 3 * c.dim * c.n_layers
    hidden = max(64, round((target - without_mlp) / (3 * c.dim * c.n_layers) / 64) * 64)
    return dataclasses.replace(base, mlp_hidden=hidden)


ROWS = ("recipe", "dense", "attention", "plain_residual", "no_balancer", "plain", "litgpt")


def rows(c: ModelConfig, stem: str, names: list[str], plain: ModelConfig | None = None
         ) -> dict[str, ModelConfig | str]:
    """The models to time, by row name: the recipe, four one-change ablations of it (dense SwiGLU of the same
    active width instead of the MoE; softmax attention in every layer; the plain residual; no balancer), the
    plain transformer (``plain``, e.g. a recipe's; default :func:`plain_baseline`), and litgpt's ``GPT`` with the
    SmolLM2-135M config (the string ``"litgpt"``: built by :func:`build_litgpt`)."""
    dense = dataclasses.replace(c, n_experts=0, first_dense_layers=0,
                                mlp_hidden=plain_baseline(dataclasses.replace(c, layer_pattern="K")).mlp_hidden)
    table = {
        "recipe": (f"k3lit `{stem}` ({c.layer_pattern}, MoE {c.n_experts}x top-{c.top_k}, {c.residual})", c),
        "dense": ("same, dense SwiGLU of the same active size instead of MoE", dense),
        "attention": ("same, softmax attention in every layer", dataclasses.replace(c, layer_pattern="A")),
        "plain_residual": ("same, plain residual", dataclasses.replace(c, residual="plain")),
        "no_balancer": ("same, balancer none", dataclasses.replace(c, balancer="none")),
        "plain": ("plain transformer of the same active size (A, dense SwiGLU, plain residual"
                  + (", rotary embeddings)" if plain is not None and plain.rope_theta else ")"),
                  plain or plain_baseline(c)),
        "litgpt": ("litgpt `GPT`, SmolLM2-135M config", "litgpt"),
    }
    unknown = set(names) - set(table)
    if unknown:
        raise SystemExit(f"--rows: unknown {sorted(unknown)}; choose from {ROWS}")
    return dict(table[n] for n in names)


COMPILE = ("none", "sublayers", "sublayer_graphs", "model", "cudagraphs")
GRAPHS = ("sublayer_graphs", "cudagraphs")  # the compile settings that replay CUDA graphs


def check_run(device: str, compiles: list[str], warmup: int, steps: int, kda_backend: str | None = None,
              rows: tuple[str, ...] | list[str] = ()) -> None:
    """Refuse, in one line and before any model is built, what :func:`bench` cannot time here.

    Raises:
        SystemExit: an unknown compile setting; fewer than 2 warm-up steps (the loss check compares the first and the
            last) or no timed step; ``--device cuda``, CUDA graphs or Triton KDA without a CUDA device; a ``litgpt``
            row without litgpt installed.
    """
    unknown = sorted(set(compiles) - set(COMPILE))
    if unknown:
        raise SystemExit(f"--compile: unknown {unknown}; choose from {COMPILE}")
    if warmup < 2 or steps < 1:
        raise SystemExit(f"--warmup {warmup} --steps {steps}: at least 2 warm-up steps (the loss on the fixed batch "
                         "must fall from the first to the last) and 1 timed step")
    cuda = torch.cuda.is_available()
    if device.startswith("cuda") and not cuda:
        raise SystemExit(f"--device {device}: this machine has no CUDA device; use --device cpu")
    graphs = sorted(set(compiles) & set(GRAPHS))
    if graphs and not device.startswith("cuda"):
        raise SystemExit(f"--compile {','.join(graphs)} replays CUDA graphs: it needs --device cuda on a GPU")
    if kda_backend == "triton" and not device.startswith("cuda") and os.environ.get("TRITON_INTERPRET") != "1":
        raise SystemExit("--kda_backend triton needs a CUDA device (or TRITON_INTERPRET=1, slow); on a CPU use "
                         "--kda_backend auto or torch")
    if "litgpt" in rows and importlib.util.find_spec("litgpt") is None:
        raise SystemExit("--rows litgpt times litgpt's GPT, which is not installed: `pip install litgpt`, or leave "
                         "the row out")


def variant(c: ModelConfig, spec: str) -> tuple[str, ModelConfig]:
    """``LABEL:field=value,field=value`` -> (row name, ``c`` with those model fields; values read as YAML, so
    ``capacity_factor=1.1``, ``capacity_mode=causal``, ``capacity_factor=null``).

    Raises:
        SystemExit: no ``LABEL:``, a pair without ``=``, or a field ModelConfig lacks or rejects.
    """
    label, _, pairs = spec.partition(":")
    fields = {}
    for pair in filter(None, pairs.split(",")):
        key, eq, value = pair.partition("=")
        if not eq:
            raise SystemExit(f"--variant {spec!r}: {pair!r} is not field=value")
        fields[key.strip()] = yaml.safe_load(value)
    if not label or not fields:
        raise SystemExit(f"--variant {spec!r}: write LABEL:field=value[,field=value]")
    try:
        return f"same, {label} (" + ", ".join(f"{k}={v}" for k, v in fields.items()) + ")", dataclasses.replace(
            c, **fields)
    except (TypeError, ValueError) as e:
        raise SystemExit(f"--variant {spec!r}: {e}") from e


def build_model(c: ModelConfig, device: str, compile_: str | bool) -> K3LM:
    """``K3LM(c)`` from seed 0 on ``device``; ``compile_``: ``none`` (or False), ``sublayers`` (or True: every
    sublayer ``torch.compile``'d, :meth:`K3LM.compile_sublayers`), ``sublayer_graphs`` (the same with
    ``mode="reduce-overhead"``: each sublayer's forward and backward replayed as CUDA graphs), ``model`` (the whole
    model as one ``torch.compile`` region) or ``cudagraphs`` (the whole model with ``mode="reduce-overhead"``)."""
    torch.manual_seed(0)
    model = K3LM(c).to(device)
    mode = {False: "none", True: "sublayers"}.get(compile_, compile_)
    if mode in ("sublayers", "sublayer_graphs"):
        model.compile_sublayers(mode="reduce-overhead" if mode == "sublayer_graphs" else None)
    elif mode in ("model", "cudagraphs"):
        model.compile(mode="reduce-overhead" if mode == "cudagraphs" else None)
    return model


def build_litgpt(device: str, compile_: str, seq: int) -> tuple[torch.nn.Module, int, float]:
    """litgpt's ``GPT`` with the SmolLM2-135M config (seed 0) -> ``(model, vocab, training FLOPs per token)``,
    the FLOPs counted as :mod:`k3lit.train.flops` counts them: 6 x the matmul weights (grouped-query q|k|v,
    output, SwiGLU, LM head) + causal attention ``3 * 4 * heads * head_size * (T + 1) / 2`` per layer."""
    from litgpt import GPT, Config

    cfg = Config.from_name("SmolLM2-135M", block_size=seq)
    torch.manual_seed(0)
    model = GPT(cfg).to(device)
    if compile_ in ("model", "cudagraphs"):
        model.compile(mode="reduce-overhead" if compile_ == "cudagraphs" else None)
    elif compile_ in ("sublayers", "sublayer_graphs"):
        for block in model.transformer.h:
            block.compile(mode="reduce-overhead" if compile_ == "sublayer_graphs" else None)
    d, hs = cfg.n_embd, cfg.head_size
    per_layer = d * hs * (cfg.n_head + 2 * cfg.n_query_groups) + cfg.n_head * hs * d + 3 * d * cfg.intermediate_size
    matmul = cfg.n_layer * per_layer + cfg.padded_vocab_size * d
    attention = cfg.n_layer * 3.0 * 4 * cfg.n_head * hs * (seq + 1) / 2
    return model, cfg.padded_vocab_size, 6.0 * matmul + attention


def make_step(model: torch.nn.Module, device: str, optim: str = "adamw", compile_loss: bool = False):
    """One optimizer step as ``trainer.precision=bf16-mixed`` runs it: ``step(tokens [B, T+1]) -> loss``.
    ``optim``: ``adamw`` (torch's fused AdamW on every parameter) or ``muon`` (``k3lit fit``'s ``optim.name=muon``
    optimizer: Muon on the hidden matrices, the fused AdamW on the rest). ``compile_loss``: the loss compiled on
    its own, as ``k3lit fit`` runs it beside a compiled model (:func:`k3lit.train.loss.compiled_next_token_loss`)."""
    if optim == "muon":
        opt = OptimConfig(name="muon", lr=3e-4).build(model, math.inf)[0]
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=3e-4, fused=device == "cuda")
    amp = torch.autocast(device_type=device, dtype=torch.bfloat16)
    loss_fn = compiled_next_token_loss() if compile_loss else next_token_loss

    def step(tokens: torch.Tensor) -> torch.Tensor:
        with amp:
            logits = model(tokens[:, :-1])
        if isinstance(logits, tuple):  # K3LM returns (logits, states)
            logits = logits[0]
        loss = loss_fn(logits, tokens[:, 1:])
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        update_balancers(model)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    return step


def host_ms_per_step(step, batches: list[torch.Tensor], n: int, device: str) -> float:
    """Median host milliseconds to issue one step with the device idle at its start (synchronised before each):
    the host's own cost of a step (Python, dispatch, kernel launches), which it must stay under the device's step
    time to keep the device busy. Equal to the device time when the step waits on the device inside (a host
    sync)."""
    times = []
    for i in range(n):
        if device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        step(batches[i % len(batches)])
        times.append(1e3 * (time.perf_counter() - t0))
    if device == "cuda":
        torch.cuda.synchronize()
    return statistics.median(times)


def step_times_ms(step, batches: list[torch.Tensor], n: int, device: str) -> list[float]:
    """Milliseconds of each of ``n`` back-to-back steps (on ``batches`` in turn) as the device runs them: on CUDA the
    time between events recorded on the current stream before each step and after the last (the device's timeline,
    its waits for the host included), elsewhere the host clock around each step."""
    if device == "cuda":
        marks = [torch.cuda.Event(enable_timing=True) for _ in range(n + 1)]
        for i in range(n):
            marks[i].record()
            step(batches[i % len(batches)])
        marks[n].record()
        torch.cuda.synchronize()
        return [a.elapsed_time(b) for a, b in zip(marks, marks[1:])]
    clock = [time.perf_counter()]
    for i in range(n):
        step(batches[i % len(batches)])
        clock.append(time.perf_counter())
    return [1e3 * (b - a) for a, b in zip(clock, clock[1:])]


def bench(c: ModelConfig | str, batch: int, seq: int, warmup: int, steps: int, device: str, compile_: str,
          optim: str = "adamw") -> dict:
    """Time ``steps`` optimizer steps of model ``c`` (a ModelConfig, or ``"litgpt"``) after ``warmup`` steps on one
    fixed batch (whose loss must fall): the median step of :func:`step_times_ms` (every step's time in
    ``step_ms``), so that a slow step (a clock dip, a collection) moves no row."""
    torch._dynamo.reset()  # compiled code of earlier rows shares code objects (and recompile limits) with this one
    if c == "litgpt":
        model, vocab, flops_per_token = build_litgpt(device, compile_, seq)
        active = None
    else:
        model, vocab = build_model(c, device, compile_), c.vocab_size
        flops_per_token, active = training_flops(c, batch, seq) / (batch * seq), active_matmul_params(c) / 1e6
    n_params = sum(p.numel() for p in model.parameters())
    step = make_step(model, device, optim, compile_loss=compile_ != "none")
    x = torch.randint(0, vocab, (batch, seq + 1), device=device)

    t0 = time.perf_counter()
    losses = [step(x).item() for _ in range(warmup)]  # the same batch: the loss must fall
    first_call_s = time.perf_counter() - t0
    ok = all(math.isfinite(v) for v in losses) and losses[-1] < losses[0]
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
        torch.cuda.synchronize()
    batches = [torch.randint(0, vocab, (batch, seq + 1), device=device) for _ in range(4)]
    times = step_times_ms(step, batches, steps, device)
    seconds = statistics.median(times) / 1e3
    host_ms = host_ms_per_step(step, batches, min(steps, 5), device)
    flops = flops_per_token * batch * seq
    peak = peak_flops(torch.device(device), torch.bfloat16) if device == "cuda" else None
    return {
        "params_M": n_params / 1e6,
        "active_M": active,
        "gflop_per_token": flops_per_token / 1e9,
        "ms_per_step": 1e3 * seconds,
        "step_ms": times,
        "host_ms_per_step": host_ms,
        "tokens_per_s": batch * seq / seconds,
        "tflops": flops / seconds / 1e12,
        "mfu": flops / seconds / peak if peak else None,
        "peak_mem_GiB": torch.cuda.max_memory_allocated() / 2**30 if device == "cuda" else None,
        "warmup_s": first_call_s,
        "loss_first_last": [losses[0], losses[-1]],
        "correct": ok,
    }


LIGHTNING_COMPILE = {  # a bare row's compile setting as K3LitModule's (compile, compile_mode, compile_scope)
    "none": (False, None, "sublayers"), "sublayers": (True, None, "sublayers"),
    "sublayer_graphs": (True, "reduce-overhead", "sublayers"), "model": (True, None, "model"),
    "cudagraphs": (True, "reduce-overhead", "model")}


def lightning_module(c: ModelConfig, compile_: str, optim: str):
    """K3LitModule of ``c`` as ``k3lit fit`` builds it for a bare row's compile setting and optimizer."""
    from k3lit.train.module import K3LitModule

    compile_model, mode, scope = LIGHTNING_COMPILE[compile_]
    return K3LitModule(c, OptimConfig(name=optim, lr=3e-4), compile=compile_model, compile_mode=mode,
                       compile_scope=scope)


def bench_lightning(c: ModelConfig, batch: int, seq: int, warmup: int, steps: int, out_dir: str,
                    compile_: str = "none", optim: str = "adamw") -> dict:
    """The same model through ``lightning.Trainer`` + K3LitModule (bf16-mixed, clipping at 1.0) as ``k3lit fit``
    runs it, with the bare rows' compile setting ``compile_`` and optimizer ``optim``, and K3ThroughputMonitor: the
    tokens/s and MFU that training runs log over the last ``steps`` steps, read back from the CSV log."""
    import csv

    import lightning as L
    from lightning.pytorch.loggers import CSVLogger

    from k3lit.train.callbacks import K3ThroughputMonitor

    data = torch.randint(0, c.vocab_size, ((warmup + steps) * batch, seq + 1))
    loader = torch.utils.data.DataLoader(data, batch_size=batch)
    cuda = torch.cuda.is_available()
    trainer = L.Trainer(accelerator="gpu" if cuda else "cpu", devices=1, precision="bf16-mixed",
                        max_steps=warmup + steps,
                        logger=CSVLogger(out_dir, name="", version=""), log_every_n_steps=1,
                        callbacks=[K3ThroughputMonitor(window_size=steps)], enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, gradient_clip_val=1.0)
    torch._dynamo.reset()  # as bench(): no compiled code of the bare rows
    trainer.fit(lightning_module(c, compile_, optim), loader)
    with open(Path(out_dir) / "metrics.csv") as f:
        last = [r for r in csv.DictReader(f) if r.get("train/device/items_per_sec")][-1]
    return {"compile": compile_, "optim": optim, "tokens_per_s": float(last["train/device/items_per_sec"]),
            "mfu": float(last["train/device/mfu"]) if last.get("train/device/mfu") else None,
            "peak_mem_GiB": torch.cuda.max_memory_allocated() / 2**30 if cuda else None}


def _cells(r: dict | None) -> str:
    if not r:
        return "- | -"
    if r.get("oom"):
        return "out of memory | -"
    if not r["correct"]:
        return f"loss {r['loss_first_last']} did not fall | -"
    mfu = f"{100 * r['mfu']:.1f}%" if r.get("mfu") else "-"
    return f"{r['ms_per_step']:.1f} | {mfu}"


def table(result: dict) -> str:
    """RESULTS.md's Throughput section: one row per model, ms/step and MFU per compile setting."""
    env, modes = result["env"], result["compile"]
    median = any("step_ms" in r for by_mode in result["rows"].values() for r in by_mode.values())
    timing = (f"the median of {result['steps']} timed steps (CUDA events between steps)" if median  # since 2026-12-05
              else f"{result['steps']} timed steps (their mean)")
    lines = [
        f"Written by `benchmarks/throughput.py`. Date {env['date']}, {env['device']}, torch {env['torch']}, "
        f"triton {env['triton']}; `{result.get('command', '')}`. Every row in one process: batch {result['batch']} x "
        f"{result['seq']} tokens of the recipe `{result['recipe']}` (other recipes: their own batch), bf16 autocast "
        "with float32 weights (= `precision: bf16-mixed`), "
        f"{'Muon with the fused AdamW' if result.get('optim') == 'muon' else 'fused AdamW'}, clipping, balancer "
        "update, synthetic tokens, "
        f"{timing} after {result['warmup']} warm-up steps. compile: `none` eager, `sublayers` "
        "`torch.compile` per sublayer (`k3lit fit`'s default on one GPU), `sublayer_graphs` the same with CUDA "
        "graphs (`--compile_mode=reduce-overhead`), `model` the whole model as one region (`--compile_scope=model`), "
        "`cudagraphs` the whole model with CUDA graphs. MFU = "
        "model FLOPs (`k3lit/train/flops.py`) / dense bf16 peak (989.4 TFLOP/s).",
        "",
        "| model | params (M) | active (M) | GFLOP/token | " + " | ".join(f"ms/step {m} | MFU {m}" for m in modes)
        + " | peak memory (GiB) |",
        "|---|---|---|---|" + "---|---|" * len(modes) + "---|",
    ]
    for name, by_mode in result["rows"].items():
        any_r = next((r for r in by_mode.values() if r.get("params_M")), {})
        active = f"{any_r['active_M']:.1f}" if any_r.get("active_M") else "-"
        mem = max((r.get("peak_mem_GiB") or 0 for r in by_mode.values()), default=0)
        lines.append(f"| {name} | {any_r.get('params_M', 0):.1f} | {active} | {any_r.get('gflop_per_token', 0):.3f} | "
                     + " | ".join(_cells(by_mode.get(m)) for m in modes) + f" | {mem:.1f} |")
    if result.get("lightning"):
        r = result["lightning"]
        mfu = f"{100 * r['mfu']:.1f}%" if r.get("mfu") else "-"
        mode = r.get("compile", "none")
        bare = result["rows"].get(r.get("bare_row"), {}).get(mode)
        against = (f"; the bare row ({mode}) {bare['tokens_per_s']:,.0f} tokens/s, so the Trainer runs at "
                   f"{r['tokens_per_s'] / bare['tokens_per_s']:.2f} of it" if bare and bare.get("tokens_per_s")
                   else "")
        lines += ["", f"The recipe's model trained through `lightning.Trainer` (K3LitModule as `k3lit fit` builds it, "
                      f"`precision=bf16-mixed`, compile `{mode}`, {r.get('optim', 'adamw')}, same batch, random "
                      f"tokens), as logged by `K3ThroughputMonitor` over the last {result['steps']} steps: "
                      f"{r['tokens_per_s']:,.0f} tokens/s, MFU {mfu}{against}."]
    host = [f"{name.split(' (')[0]} {m}: {r['host_ms_per_step']:.1f} of {r['ms_per_step']:.1f} ms"
            for name, by_mode in result["rows"].items() for m, r in by_mode.items()
            if r.get("host_ms_per_step") is not None and r.get("correct")]
    if host:
        lines += ["", "Host time to issue one step with the device idle at its start (median of up to 5 steps, "
                      "against the timed step): " + "; ".join(host) + ". Where it nears the step time, the device "
                      "waits for the host whenever the host is slowed (data loading, logging, garbage collection)."]
    if result.get("note"):
        lines += ["", result["note"]]
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--recipe", default="recipes/small.yaml")
    p.add_argument("--vocab", type=int, help="default: the recipe tokenizer's (bpe:N -> N)")
    p.add_argument("--batch", type=int, help="default: the recipe's data.batch_size")
    p.add_argument("--seq", type=int, help="default: the recipe's data.seq_len")
    p.add_argument("--warmup", type=int, default=8)
    p.add_argument("--optim", choices=["adamw", "muon"], default="adamw", help="every row's optimizer (make_step)")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--kda_backend", help="override model.kda_backend (auto = Triton on CUDA)")
    p.add_argument("--compile", default="none", help=f"comma-separated, each of {COMPILE}: every row with each")
    p.add_argument("--rows", default="recipe,plain", help=f"comma-separated, each of {ROWS}")
    p.add_argument("--plain_recipe", help="the plain row's model from this recipe (default: plain_baseline)")
    p.add_argument("--extra_recipe", nargs="*", default=[], help="more recipes, each timed at its own batch")
    p.add_argument("--variant", action="append", default=[],
                   help="LABEL:field=value,...: also time the recipe's model with these ModelConfig fields (e.g. "
                        "'causal 1.1:capacity_factor=1.1,capacity_mode=causal,quantile_rate=0.1'); repeatable")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--json", help="write the raw results here")
    p.add_argument("--from_json", help="only write RESULTS.md's Throughput section from this file")
    p.add_argument("--note", default="", help="a sentence to print under the table")
    p.add_argument("--lightning", help="also train the recipe model through lightning.Trainer (the first --compile "
                   "setting, --optim), logs in this folder")
    add_results_argument(p)
    a = p.parse_args()
    check_outputs(a)
    if a.from_json:
        write_result(a.results, "Throughput", table(load_json(a.from_json, ("rows", "batch", "seq"))))
        return
    check_run(a.device, a.compile.split(","), a.warmup, a.steps, a.kda_backend, a.rows.split(","))
    cfg, data = recipe_config(Path(a.recipe), a.vocab)
    if a.kda_backend:
        cfg = dataclasses.replace(cfg, kda_backend=a.kda_backend)
    batch, seq = a.batch or int(data.get("batch_size", 16)), a.seq or int(data.get("seq_len", 2048))
    if a.device == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
    result = {"recipe": a.recipe, "batch": batch, "seq": seq, "steps": a.steps, "warmup": a.warmup,
              "kda_backend": cfg.kda_backend, "env": versions(), "command": " ".join(["python", *sys.argv]),
              "rows": {}, "note": a.note, "optim": a.optim}
    plain = recipe_config(Path(a.plain_recipe), cfg.vocab_size)[0] if a.plain_recipe else None
    named = rows(cfg, Path(a.recipe).stem, a.rows.split(","), plain)
    jobs = [(name, c, batch, seq) for name, c in named.items()]
    jobs += [(*variant(cfg, spec), batch, seq) for spec in a.variant]
    for extra in a.extra_recipe:
        c, d = recipe_config(Path(extra), None)
        jobs.append((f"k3lit `{Path(extra).stem}` ({c.layer_pattern}, MoE {c.n_experts}x top-{c.top_k}, {c.residual}; "
                     f"batch {d['batch_size']} x {d['seq_len']})", c, int(d["batch_size"]), int(d["seq_len"])))
    result["compile"] = a.compile.split(",")
    for compile_ in result["compile"]:
        for name, c, b, t in jobs:
            try:
                r = bench(c, b, t, a.warmup, a.steps, a.device, compile_, a.optim)
            except torch.OutOfMemoryError:
                r = {"oom": True}
            result["rows"].setdefault(name, {})[compile_] = r
            print(name, compile_, json.dumps(r), flush=True)
            if a.json:
                Path(a.json).write_text(json.dumps(result, indent=1))
            if a.device == "cuda":
                torch.cuda.empty_cache()
    if a.lightning:
        result["lightning"] = bench_lightning(cfg, batch, seq, a.warmup, a.steps, a.lightning,
                                              result["compile"][0], a.optim)
        # the bare row of the same model, the ratio's denominator (none unless --rows has "recipe")
        result["lightning"]["bare_row"] = next((name for name, c in named.items() if c is cfg), None)
        print("lightning.Trainer + K3ThroughputMonitor:", json.dumps(result["lightning"]), flush=True)
    print(table(result))
    if a.json:
        Path(a.json).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
