"""Balancing experiment (CPU-sized, seeded): Quantile Balancing vs sign bias vs auxiliary loss vs none.

    python benchmarks/balance.py [--steps 1000] [--json out.json] [--only train|router]
    python benchmarks/balance.py --from-json benchmarks/balance_cpu.json    # the stored run
    python benchmarks/balance.py --only compare --steps 600 --seeds 1234 1235 --json benchmarks/balance_compare_cpu.json

A. ``train``: the same tiny MoE recipe (softmax-attention layers, 16 experts top-2 in every layer, byte
   tokenizer on the built-in stdlib corpus, seed 1234) trained for ``--steps`` optimizer steps with each
   balancer (quantile, quantile_hist, aux_free = sign bias u = 1e-3, aux_loss α = 1e-2, none); batch 8 x 128
   tokens, AdamW lr 3e-3; reports validation loss and MaxVio_global (over a 20-batch validation pass) per MoE
   layer. One thread (``torch.set_num_threads(1)``): about 40 s per run on a 2-core machine.
B. ``router``: a fixed skewed synthetic router (per-expert logit offsets ~ N(0, 0.5^2) plus per-token noise
   N(0, 1), sigmoid scores) with m = 16384 tokens per batch, k = 8, n = 64 / 256 / 1024: the number of bias
   updates until MaxVio_batch is within 1.5x of the sampling-noise floor (the mean MaxVio of a uniformly
   random router, k distinct experts per token, at the same m, n, k), for quantile (exact pooled quantile),
   quantile_hist (1000-bin histogram estimator) and the sign bias (u = 1e-3). Batches are drawn fresh from
   the same router each update; the bias from batch t routes batch t+1. ``settled`` is the mean MaxVio_batch
   over the ``settle`` = 30 updates after the target is first reached (does the balancer stay there?).

C. ``compare`` (run only with ``--only compare``): the one-step quantile against the sliding-average quantile
   (rates in ``RATES``), the sliding quantile with the quantile capacity mode (cf = 1.25), with the forward
   capacity mode (cf = 1.15, a count per forward in token order: not causal) and with the causal one (the same
   count, tokens admitted in position order; cf = 1.15 and 1.1), the sign bias, the auxiliary loss and none,
   all on the same data, seed and steps (batch 16 x 128 tokens), for each of ``--seeds``. Per balancer: train
   MaxVio_batch (every step; mean and 95th percentile over the second half, worst MoE layer), held-out
   MaxVio_global and bits per byte (50 validation batches at the end), dropped and re-routed fractions of the
   (token, expert) slots over the second half, and the mean wall time of a training step.

The tables of A and B go to ``benchmarks/RESULTS.md``, section "Balancing (CPU)"; C's to "Balancing on real text
(CPU)".
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from benchmarks.results import command, load_json, write_section  # noqa: E402
from k3lit.ops.routing import (  # noqa: E402
    expert_load,
    max_violation,
    quantile_bias,
    quantile_bias_from_histogram,
    required_bias_histogram,
    route,
    sign_bias_update,
)

TITLE = "Balancing (CPU)"
COMPARE_TITLE = "Balancing on real text (CPU)"
RATES = (0.3, 0.1, 0.03)
# name -> ModelConfig balancer fields of part C
VARIANTS = {
    "quantile (one step)": {"balancer": "quantile"},
    **{f"sliding quantile ρ = {r}": {"balancer": "quantile", "quantile_rate": r} for r in RATES},
    "sliding ρ = 0.1 + quantile capacity 1.25": {"balancer": "quantile", "quantile_rate": 0.1,
                                                 "capacity_factor": 1.25, "capacity_mode": "quantile"},
    "sliding ρ = 0.1 + forward capacity 1.15 (not causal)": {"balancer": "quantile", "quantile_rate": 0.1,
                                                             "capacity_factor": 1.15, "capacity_mode": "forward"},
    **{f"sliding ρ = 0.1 + causal capacity {cf}": {"balancer": "quantile", "quantile_rate": 0.1,
                                                    "capacity_factor": cf, "capacity_mode": "causal"}
       for cf in (1.15, 1.1)},
    "sign bias (u = 1e-3)": {"balancer": "aux_free", "bias_update_rate": 1e-3},
    "aux loss (α = 1e-2)": {"balancer": "aux_loss", "aux_loss_coef": 1e-2},
    "none": {"balancer": "none"},
}
BALANCERS = ("quantile", "quantile_hist", "aux_free", "aux_loss", "none")
NAMES = {"quantile": "quantile (exact pooled)", "quantile_hist": "quantile_hist (1000-bin histogram)",
         "aux_free": "sign bias (u = 1e-3)", "aux_loss": "aux loss (α = 1e-2)", "none": "none"}


# ------------------------------------------------------------------------------------------- A. training
class _Progress:
    """Prints the step and elapsed seconds every 50 optimizer steps (a Lightning callback, built lazily)."""

    def __new__(cls, t0: float, name: str):  # noqa: ANN204
        import lightning as L

        class P(L.Callback):
            def on_train_batch_end(self, trainer, *args) -> None:  # noqa: ANN001, ANN002
                if trainer.global_step % 50 == 0:
                    print(f"  {name}: step {trainer.global_step}, {time.time() - t0:.0f} s", flush=True)

        return P()


def train_runs(steps: int, cache: str) -> dict:
    import lightning as L

    from k3lit.data import K3DataModule
    from k3lit.model import ModelConfig
    from k3lit.train.module import K3LitModule
    from k3lit.train.optim import OptimConfig

    out = {}
    for bal in BALANCERS:
        L.seed_everything(1234, verbose=False)
        dm = K3DataModule(corpus="stdlib", tokenizer="byte", cache_dir=cache, seq_len=128, batch_size=8)
        cfg = ModelConfig(vocab_size=dm.vocab_size, dim=96, n_layers=2, layer_pattern="A", n_heads=2, head_dim=48,
                          mlp_hidden=256, n_experts=16, top_k=2, expert_dim=64, first_dense_layers=0,
                          balancer=bal, residual="plain", aux_loss_coef=1e-2, bias_update_rate=1e-3)
        module = K3LitModule(cfg, OptimConfig(lr=3e-3, warmup_steps=20))
        trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=steps, val_check_interval=steps,
                            limit_val_batches=20, num_sanity_val_steps=0, logger=False, enable_checkpointing=False,
                            enable_progress_bar=False, enable_model_summary=False, gradient_clip_val=1.0)
        t0 = time.time()
        trainer.callbacks.append(_Progress(t0, bal))
        trainer.fit(module, dm)
        m = trainer.callback_metrics
        out[bal] = {
            "val_loss": float(m["val/loss"]),
            "max_vio_global": [float(m[f"val/max_vio/layer{i}"]) for i in range(cfg.n_layers)],
            "seconds": time.time() - t0,
        }
        print(bal, out[bal], flush=True)
    return out


# ---------------------------------------------------------------------------------- C. balancers compared
class _StepStats:
    """Per optimizer step: MaxVio_batch of every MoE layer, dropped / re-routed slots and wall time (a Lightning
    callback, built lazily; one micro-batch per step, so the latest forward is the step's batch)."""

    def __new__(cls, record: dict):  # noqa: ANN204
        import lightning as L

        class S(L.Callback):
            def on_train_batch_start(self, *args) -> None:  # noqa: ANN002
                self.t0 = time.perf_counter()

            def on_train_batch_end(self, trainer, module, *args) -> None:  # noqa: ANN001, ANN002
                moes = module.model.moe_layers()
                m = float(moes[0].last_stats["tokens"])
                record["max_vio"].append([float(max_violation(x.last_load, x.top_k, m)) for x in moes])
                slots = m * moes[0].top_k * len(moes)
                record["dropped"].append(sum(float(x.last_stats["dropped"]) for x in moes) / slots)
                record["rerouted"].append(sum(float(x.last_stats["rerouted"]) for x in moes) / slots)
                record["step_s"].append(time.perf_counter() - self.t0)

        return S()


def compare_runs(steps: int, cache: str, seed: int) -> dict:
    import lightning as L

    from k3lit.data import K3DataModule
    from k3lit.model import ModelConfig
    from k3lit.train.module import K3LitModule
    from k3lit.train.optim import OptimConfig

    out = {}
    for name, fields in VARIANTS.items():
        L.seed_everything(seed, verbose=False)
        dm = K3DataModule(corpus="stdlib", tokenizer="byte", cache_dir=cache, seq_len=128, batch_size=16)
        cfg = ModelConfig(vocab_size=dm.vocab_size, dim=64, n_layers=2, layer_pattern="A", n_heads=2, head_dim=32,
                          mlp_hidden=128, n_experts=16, top_k=2, expert_dim=32, first_dense_layers=0,
                          residual="plain", **fields)
        module = K3LitModule(cfg, OptimConfig(lr=3e-3, warmup_steps=20))
        record = {"max_vio": [], "dropped": [], "rerouted": [], "step_s": []}
        trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=steps, val_check_interval=steps,
                            limit_val_batches=50, num_sanity_val_steps=0, logger=False, enable_checkpointing=False,
                            enable_progress_bar=False, enable_model_summary=False, gradient_clip_val=1.0,
                            callbacks=[_StepStats(record)])
        t0 = time.time()
        trainer.fit(module, dm)
        m = trainer.callback_metrics
        record.update(fields=fields, seconds=time.time() - t0, val_bpb=float(m["val/bpb"]),
                      max_vio_global=[float(m[f"val/max_vio/layer{i}"]) for i in range(cfg.n_layers)])
        if fields.get("capacity_factor") is None:  # a fitted bias routes by top-k alone, as these runs do
            train, held_out = (_router_scores(module, loader, 50) for loader in (dm.train_dataloader(),
                                                                               dm.val_dataloader()))
            fitted = [fitted_bias(t, torch.cat(h), moe.expert_bias, moe.top_k)
                      for t, h, moe in zip(train, held_out, module.model.moe_layers(), strict=True)]
            record["fitted"] = [{key: v for key, v in f.items() if key != "bias"} for f in fitted]
        out[name] = record
        print(seed, name, {k: v for k, v in record.items() if not isinstance(v, list) or k == "max_vio_global"},
              flush=True)
    return out


def fitted_bias(train: list[torch.Tensor], held_out: torch.Tensor, bias: torch.Tensor, k: int,
                 steps: int = 50) -> dict:
    """What one fixed bias can reach on these tokens: the bias that balances the pooled training sample exactly
    (``steps`` Quantile-Balancing coordinate steps on it, from ``bias``), applied to each training batch and to
    the held-out tokens.

    Args:
        train: router scores ``[m_b, n]`` of training batches, one tensor per batch.
        held_out: ``[m_h, n]`` router scores of the held-out tokens.
        bias: ``[n]`` float32 start of the coordinate ascent (the run's final bias).
        k: experts per token.
        steps: coordinate steps; 50 bring the pooled MaxVio of these runs below 0.05.

    Returns:
        ``{"bias": that [n] bias, "pooled": MaxVio of the pooled sample under it (the residual of the ascent),
        "train": mean MaxVio_batch over the batches, "held_out": MaxVio_global of the held-out tokens}``.
    """
    pooled = torch.cat(train)
    for _ in range(steps):
        bias = quantile_bias(pooled, bias, k)
    n = pooled.shape[1]

    def vio(s: torch.Tensor) -> float:
        return max_violation(expert_load(route(s, bias, k)[0], n), k, s.shape[0]).item()

    return {"bias": bias, "pooled": vio(pooled), "train": sum(vio(s) for s in train) / len(train),
            "held_out": vio(held_out)}


def _router_scores(module, loader, batches: int) -> list[list[torch.Tensor]]:  # noqa: ANN001
    """Router scores ``[B T, n]`` of every MoE layer for the first ``batches`` batches of ``loader`` (eval mode,
    the final weights and biases): ``out[layer][batch]``."""
    moes = module.model.moe_layers()
    out: list[list[torch.Tensor]] = [[] for _ in moes]
    hooks = [moe.register_forward_hook(lambda mod, args, _, i=i: out[i].append(
        mod.router_scores(args[0].reshape(-1, args[0].shape[-1])))) for i, moe in enumerate(moes)]
    module.eval()
    try:
        with torch.no_grad():
            for j, batch in enumerate(loader):
                if j == batches:
                    break
                module.model(batch[:, :-1])
    finally:
        for h in hooks:
            h.remove()
    return out


def compare_summary(record: dict) -> dict:
    """Second-half statistics of one run of :func:`compare_runs`: MaxVio_batch of the worst layer (mean, p95)."""
    half = len(record["max_vio"]) // 2
    worst = torch.tensor(record["max_vio"][half:]).amax(dim=1)
    return {"vio_mean": worst.mean().item(), "vio_p95": worst.quantile(0.95).item(),
            "dropped": sum(record["dropped"][half:]) / (len(record["dropped"]) - half),
            "rerouted": sum(record["rerouted"][half:]) / (len(record["rerouted"]) - half),
            "step_ms": 1e3 * sum(record["step_s"][half:]) / (len(record["step_s"]) - half)}


def compare_section(run: dict) -> str:
    """The RESULTS.md section of part C from :func:`main`'s JSON record ``run``."""
    threads = run["cpu_threads"]
    lines = [f"Written by `benchmarks/balance.py --only compare`. {run['date']} · CPU, {threads} thread"
             f"{'s' * (threads != 1)} · torch {run['torch']} · Python {run['python']}. Command: {run['command']} "
             f"({run['seconds'] / 60:.1f} min). Raw per-step record: `benchmarks/balance_compare_cpu.json`.", "",
             f"Each balancer trains the same model for {run['steps']} steps on the same batches, once per seed "
             f"({', '.join(run['compare'])}): 2 layers "
             "of softmax attention + MoE (d = 64, 16 experts of width 32, top-2, no shared expert), byte tokenizer "
             "on the built-in stdlib corpus, batch 16 x 128 = 2,048 tokens a step, AdamW lr 3e-3. Train "
             "MaxVio_batch: every step's batch, the worse of the two layers, mean and 95th percentile over the "
             "second half of training; its sampling floor at this batch (a uniformly random router, m = 2,048, "
             "n = 16, k = 2) is about 0.12. Held-out: 50 validation batches (102,400 tokens) after the last step, "
             "bias frozen. Dropped / re-routed: fraction of (token, expert) slots over the second half. The two "
             "seeds' rows show the seed noise.", "",
             "*Fitted bias* (`fitted_bias`): with the run's final weights, the one bias that balances 50 fresh "
             "training batches pooled (50 Quantile-Balancing coordinate steps on them), applied to each of those "
             "batches (mean MaxVio_batch, worse layer) and to the held-out tokens (layer 0 / 1). On the training "
             "batches it is the floor of routing by a bias alone, short of a capacity limit: 16 sequences of 128 "
             "bytes are a small, uneven sample of the corpus. On the held-out pass it is a reference, not a bound: "
             "those few files ask for other experts than the training sample does.", "",
             "| balancer | seed | train MaxVio_batch mean | p95 | held-out MaxVio_global (layer 0 / 1) | held-out bpb "
             "| dropped | re-routed | ms / step | fitted bias: train | fitted bias: held-out |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    seeds = list(run["compare"])
    summary = {(seed, name): compare_summary(r) for seed, by_name in run["compare"].items()
               for name, r in by_name.items()}
    for name in run["compare"][seeds[0]]:
        for seed in seeds:
            r, s = run["compare"][seed][name], summary[seed, name]
            lines.append(f"| {name} | {seed} | {s['vio_mean']:.3f} | {s['vio_p95']:.3f} | "
                         + " / ".join(f"{v:.3f}" for v in r["max_vio_global"])
                         + f" | {r['val_bpb']:.4f} | {s['dropped']:.4f} | {s['rerouted']:.4f} | {s['step_ms']:.0f} | "
                         + ("– | – |" if "fitted" not in r else f"{max(f['train'] for f in r['fitted']):.3f} | "
                            + " / ".join(f"{f['held_out']:.3f}" for f in r["fitted"]) + " |"))
    rows = [(name, summary[seed, name], r) for seed, by_name in run["compare"].items() for name, r in by_name.items()]
    bias_only = [(name, s) for name, s, r in rows if not r["fields"].get("capacity_factor")]
    if bias_only and any("fitted" in r for _, _, r in rows):
        best = min(bias_only, key=lambda x: x[1]["vio_mean"])
        fitted = [max(f["train"] for f in r["fitted"]) for _, _, r in rows if "fitted" in r]
        lines += ["", f"Without a capacity limit the lowest train MaxVio_batch mean is {best[1]['vio_mean']:.3f} "
                  f"({best[0]}), against {min(fitted):.3f}-{max(fitted):.3f} for a bias fitted to the very batches it "
                  "is measured on: at this batch size a bias alone leaves about that much. Only a count limit "
                  "over the forward's tokens holds every batch near its capacity factor; admitted in position "
                  "order (`causal`) it depends on no later position, at the price of re-routing the late ones."]
    return "\n".join(lines)


# ------------------------------------------------------------------------------------ B. synthetic router
def noise_floor(m: int, n: int, k: int, gen: torch.Generator, draws: int = 8) -> float:
    """Mean MaxVio of a uniformly random router: every token takes k distinct experts uniformly."""
    vios = []
    for _ in range(draws):
        idx = torch.rand(m, n, generator=gen).topk(k, dim=-1).indices
        vios.append(max_violation(expert_load(idx, n), k, m).item())
    return sum(vios) / len(vios)


def router_runs(
    m: int = 16384, k: int = 8, ns: tuple[int, ...] = (64, 256, 1024), max_updates: int = 1500, settle: int = 30
) -> dict:
    out = {}
    for n in ns:
        gen = torch.Generator().manual_seed(n)
        offsets = torch.randn(n, generator=gen) * 0.5  # the skew: some experts are preferred by everyone

        def batch(offsets: torch.Tensor = offsets, gen: torch.Generator = gen, n: int = n) -> torch.Tensor:
            return torch.sigmoid(offsets + torch.randn(m, n, generator=gen))

        floor = noise_floor(m, n, k, gen)
        res = {"noise_floor": floor, "target": 1.5 * floor}
        for method in ("quantile", "quantile_hist", "sign"):
            bias = torch.zeros(n)
            reached, vios = None, []
            for update in range(max_updates + 1):
                s = batch()
                idx = (s + bias).topk(k, dim=-1).indices
                vios.append(max_violation(expert_load(idx, n), k, m).item())
                if reached is None and vios[-1] <= 1.5 * floor:
                    reached = update
                if reached is not None and update >= reached + settle or update == max_updates:
                    break
                if method == "quantile":
                    bias = quantile_bias(s, bias, k)
                elif method == "quantile_hist":
                    lo, hi = bias.min() - 1, bias.max() + 1
                    bias = quantile_bias_from_histogram(required_bias_histogram(s, bias, k, lo, hi, 1000), lo, hi, k)
                else:
                    bias = sign_bias_update(bias, expert_load(idx, n), 1e-3)
            res[method] = {"updates": reached, "max_vio_at_start": vios[0],
                           "settled_max_vio": sum(vios[-settle:]) / len(vios[-settle:])}
            print(n, method, res[method], f"floor={floor:.4f}", flush=True)
        out[n] = res
    return out


def section(run: dict) -> str:
    """The RESULTS.md section from :func:`main`'s JSON record ``run`` (either part, ``"train"`` or ``"router"``, may
    be missing: ``--only``)."""
    threads = run["cpu_threads"]
    lines = [f"Written by `benchmarks/balance.py`. {run['date']} · CPU, {threads} thread{'s' * (threads != 1)} · "
             f"torch {run['torch']} · Python {run['python']}. Command: {run['command']} "
             f"({run['seconds'] / 60:.1f} min)."]
    if "train" in run:
        n_layers = len(next(iter(run["train"].values()))["max_vio_global"])
        lines += ["", f"**A. The same tiny MoE recipe, {run['steps']} steps, each balancer** (2 layers of softmax "
                  "attention + MoE, 16 experts top-2 in both layers, byte tokenizer on the stdlib corpus, batch 8 x "
                  "128, AdamW lr 3e-3, seed 1234). Validation loss and MaxVio_global over a 20-batch validation pass "
                  "(20,480 tokens; the bias is frozen at evaluation). One seed: loss differences of a few hundredths "
                  "of a nat are noise, not a ranking.", "",
                  "| balancer | val loss (nats/token) | "
                  + " | ".join(f"MaxVio_global layer {i}" for i in range(n_layers)) + " | run s |",
                  "|---|---|" + "---|" * (n_layers + 1)]
        for bal, r in run["train"].items():
            lines.append(f"| {NAMES[bal]} | {r['val_loss']:.3f} | "
                         + " | ".join(f"{v:.2f}" for v in r["max_vio_global"]) + f" | {r['seconds']:.0f} |")
    if "router" in run:
        lines += ["", "**B. Skewed synthetic router, updates until MaxVio_batch <= 1.5x the noise floor.** m = 16,384 "
                  "tokens per batch, k = 8; scores = sigmoid(per-expert offset ~ N(0, 0.5²) + per-token N(0, 1)), a "
                  "fresh batch every update, the bias of batch t routes batch t+1. Noise floor = mean MaxVio of a "
                  "uniformly random router (k distinct experts per token) at the same m, n, k. *settled* = mean "
                  "MaxVio_batch over the 30 updates after the target is first reached.", "",
                  "| n | noise floor | MaxVio at start | quantile: updates | quantile_hist: updates "
                  "| sign bias: updates | settled quantile / hist / sign |", "|---|---|---|---|---|---|---|"]
        for n, r in run["router"].items():
            methods = ("quantile", "quantile_hist", "sign")
            lines.append(f"| {n} | {r['noise_floor']:.3f} | {r['quantile']['max_vio_at_start']:.1f} | "
                         + " | ".join(str(r[m]["updates"]) for m in methods) + " | "
                         + " / ".join(f"{r[m]['settled_max_vio']:.3f}" for m in methods) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=1000)
    ap.add_argument("--max-updates", type=int, default=1500)
    ap.add_argument("--only", choices=("train", "router", "compare"), default=None)
    ap.add_argument("--json", type=str, default=None)
    ap.add_argument("--seeds", type=int, nargs="+", default=[1234], help="seeds of the compare runs")
    ap.add_argument("--from-json", "--from_json",
                    help="write the section from the record of an earlier run (no training)")
    ap.add_argument("--results", default=os.path.join(ROOT, "benchmarks", "RESULTS.md"))
    a = ap.parse_args(argv)
    if a.from_json:
        run = load_json(a.from_json, ())
        title, body = (COMPARE_TITLE, compare_section(run)) if "compare" in run else (TITLE, section(run))
        write_section(title, body, a.results)
        print(body)
        return
    torch.manual_seed(0)
    torch.set_num_threads(1)  # 2-core CI box: one thread is faster than two under any other load
    out = {"date": time.strftime("%Y-%m-%d"), "torch": torch.__version__, "python": platform.python_version(),
           "cpu_threads": torch.get_num_threads(), "steps": a.steps,
           "command": command(None if argv is None else [sys.argv[0], *argv])}
    t0 = time.time()
    if a.only in (None, "router"):
        out["router"] = router_runs(max_updates=a.max_updates)
    if a.only in (None, "train"):
        with tempfile.TemporaryDirectory() as cache:
            out["train"] = train_runs(a.steps, cache)
    if a.only == "compare":
        with tempfile.TemporaryDirectory() as cache:
            out["compare"] = {str(seed): compare_runs(a.steps, cache, seed) for seed in a.seeds}
    out["seconds"] = time.time() - t0
    if a.json:
        with open(a.json, "w") as fh:
            json.dump(out, fh)
    if a.only == "compare":
        body = compare_section(out)
        write_section(COMPARE_TITLE, body, a.results)
        print(body)
        return
    print(json.dumps(out, indent=1))
    write_section(TITLE, section(out), a.results)


if __name__ == "__main__":
    main()
