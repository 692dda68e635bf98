"""The screen: a recipe and variants of it trained for the same few hundred steps, compared per step and per second.

    python benchmarks/screen.py --recipe recipes/small.yaml --steps 500 --json benchmarks/screen_h100.json \\
        --variant "lr3e-3=--optim.lr=3e-3" --variant "e64=--model.n_experts=64"        # on the GPU
    python benchmarks/screen.py --from_json benchmarks/screen_h100.json                # RESULTS.md section only

Each run is a fresh ``k3lit fit --config RECIPE --trainer.max_steps=N --trainer.max_time=null`` (seed and
everything else from the recipe, the variant's arguments last), so each run's learning-rate schedule (warm-up, then
the cosine) ends at step N; validations at steps N/2 and N read the held-out split's first ``--val_batches`` batches,
the same bytes for every run. From each run's ``metrics.csv``: ``val/bpb`` at both validations; the median of the
logged tokens/s windows from step ``--steady`` on (the step's cost as ``k3lit fit`` runs it) and MFU; the mean of
``train/grad_norm``; for MoE layers, train MaxVio_batch over the logged steps of the run's second half, its mean and
its 95th percentile (``statistics.quantiles``, inclusive: between two logged values, never beyond them), the share
of routed slots a capacity limit re-routed (mean over the same steps; 0 without a limit) and the held-out
MaxVio_global of the last validation. A screen ranks variants before a race (``benchmarks/race.py``) spends minutes
on each: bits per byte after N steps are not bits per byte at equal wall-clock, where a variant's step cost and a
longer schedule weigh in.

Writes the raw runs (``--json``, after every run) and RESULTS.md's section "Recipe variants (<GPU>, N steps)"
(``--results``: another file, or ``none``).
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.race import first_step_seconds, k3lit, read_csv  # noqa: E402
from benchmarks.results import (  # noqa: E402
    add_results_argument,
    check_outputs,
    check_recipes,
    command,
    load_json,
    versions,
    write_result,
)

ROOT = Path(__file__).resolve().parents[1]


def variants(specs: list[str]) -> list[tuple[str, list[str]]]:
    """``(label, fit arguments)`` of every run: the recipe as shipped (``"recipe"``, no arguments), then each
    ``LABEL=ARG ...`` of ``specs``.

    Raises:
        SystemExit: a spec without ``LABEL=`` and an argument, or a label used twice.
    """
    out = [("recipe", [])]
    for spec in specs:
        name, _, rest = spec.partition("=")
        words = shlex.split(rest)
        if not name or name.startswith("-") or not words:
            raise SystemExit(f"--variant {spec!r}: write LABEL=ARG [ARG ...], e.g. 'lr3e-3=--optim.lr=3e-3'")
        out.append((name, words))
    labels = [name for name, _ in out]
    if len(set(labels)) < len(labels):
        raise SystemExit(f"--variant: each label once (and not 'recipe'), got {labels}")
    return out


def summarize(rows: list[dict[str, str]], steps: int, steady: int) -> dict:
    """One fit's figures from its ``metrics.csv`` rows (0-based ``step`` column), as described in the module's
    docstring: ``val`` ([[step, bpb], ...], steps counted from 1), ``tokens_per_s`` and ``mfu`` (medians from step
    ``steady`` on; None when nothing was logged there), ``grad_norm`` (mean; None if unlogged) and, per MoE layer,
    ``max_vio_mean``, ``max_vio_p95`` and ``rerouted`` over the steps from ``steps // 2`` on and ``val_max_vio`` of
    the last validation (empty lists without MoE layers)."""
    def logged(key: str, first: int = 0) -> list[float]:
        return [float(r[key]) for r in rows if r.get(key) and int(r["step"]) >= first]

    def median(v: list[float]) -> float | None:
        return statistics.median(v) if v else None

    half = steps // 2
    layers = sorted({int(k.rsplit("layer", 1)[1]) for r in rows if int(r["step"]) >= half for k, v in r.items()
                     if v and k.startswith("train/max_vio/layer")})  # the MoE layers logged in the second half
    vio = [logged(f"train/max_vio/layer{i}", half) for i in layers]

    def p95(v: list[float]) -> float:
        return statistics.quantiles(v, n=20, method="inclusive")[-1] if len(v) > 1 else v[0]

    norms = logged("train/grad_norm")
    last_val = next((r for r in reversed(rows) if r.get("val/bpb")), {})
    return {"val": [[int(r["step"]) + 1, float(r["val/bpb"])] for r in rows if r.get("val/bpb")],
            "tokens_per_s": median(logged("train/device/items_per_sec", steady)),
            "mfu": median(logged("train/device/mfu", steady)),
            "grad_norm": statistics.mean(norms) if norms else None,
            "max_vio_mean": [statistics.mean(v) for v in vio],
            "max_vio_p95": [p95(v) for v in vio],
            "val_max_vio": [float(last_val[f"val/max_vio/layer{i}"]) for i in layers
                            if last_val.get(f"val/max_vio/layer{i}")],
            "rerouted": [statistics.mean(logged(f"train/reroute_rate/layer{i}", half) or [0.0]) for i in layers]}


def run(label: str, extra: list[str], a: argparse.Namespace, out: Path) -> dict:
    """One fit of ``a.recipe`` for ``a.steps`` steps with ``extra`` arguments; its :func:`summarize` record.

    Raises:
        RuntimeError: the fit failed (the end of its log in the message).
    """
    folder = out / label
    log = folder.with_suffix(".fit.log")
    t0 = time.perf_counter()
    k3lit("fit", "--config", a.recipe, f"--trainer.max_steps={a.steps}", "--trainer.max_time=null",
          f"--trainer.val_check_interval={a.steps // 2}", f"--trainer.limit_val_batches={a.val_batches}",
          f"--trainer.default_root_dir={folder}", *extra, log=log)
    return {"label": label, "fit_args": extra, "process_s": time.perf_counter() - t0,
            "first_step_s": first_step_seconds(log.read_text()),
            **summarize(read_csv(folder / "metrics.csv"), a.steps, a.steady)}


def screen(a: argparse.Namespace) -> dict:
    """Prepare the recipe's corpus, then :func:`run` the recipe and every variant, one after the other; the raw
    result (written to ``a.json`` after each run)."""
    out = ROOT / a.out
    out.mkdir(parents=True, exist_ok=True)
    k3lit("prepare", "--config", a.recipe, log=out / "prepare.log")
    result = {"recipe": a.recipe, "steps": a.steps, "steady": a.steady, "val_batches": a.val_batches,
              "env": versions(), "command": command(), "json": a.json or "", "runs": []}
    for label, extra in variants(a.variant):
        result["runs"].append(run(label, extra, a, out))
        if a.json:
            Path(a.json).write_text(json.dumps(result, indent=1))
        print(json.dumps(result["runs"][-1]), flush=True)
    return result


def title(result: dict) -> str:
    """RESULTS.md's section title: one section per device and run length."""
    return f"Recipe variants ({result['env']['device'].removeprefix('NVIDIA ')}, {result['steps']} steps)"


def table(result: dict) -> str:
    """RESULTS.md's section: the command, then one row per run against the recipe as shipped."""
    env, steps = result["env"], result["steps"]
    base = next((r for r in result["runs"] if r["label"] == "recipe"), None)

    def num(value: float | None, spec: str) -> str:
        return "-" if value is None else format(value, spec)

    def ratio(value: float | None, ref: float | None) -> str:
        return "" if value is None or not ref or value == ref else f" ({value / ref:.3f}x)"

    lines = [
        f"Written by `benchmarks/screen.py`. {env['date']} · {env['device']} · torch {env['torch']}, triton "
        f"{env['triton']} · {result['command']}. Each run a fresh `k3lit fit --config {result['recipe']} "
        f"--trainer.max_steps={steps} --trainer.max_time=null` with the row's arguments (warm-up, then the cosine "
        f"over the {steps} steps), one after the other on one device; `val/bpb` on the split's first "
        f"{result['val_batches']} batches, the same bytes for every run. tokens/s and MFU: medians of the logged "
        f"windows from step {result['steady']} on (the ratio against the recipe's); grad norm: the mean of "
        f"`train/grad_norm`; MaxVio: train MaxVio_batch over the logged steps of the second half, the largest MoE "
        f"layer's mean and 95th percentile, and the mean over layers; held-out: MaxVio_global of the step-{steps} "
        "validation, the largest layer's; re-routed: the share of routed slots a capacity limit sent to another "
        f"expert, the mean over layers and the second half's steps. Raw runs: `{result.get('json', '')}`.", "",
        f"| run | arguments | bpb at step {steps // 2} | at {steps} | against the recipe | tokens/s | MFU | grad norm "
        "| MaxVio mean: largest layer / all layers | MaxVio p95: largest layer | held-out MaxVio | re-routed |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in result["runs"]:
        bpb = dict(map(tuple, r["val"]))
        final, ref = bpb.get(steps), base and dict(map(tuple, base["val"])).get(steps)
        delta = "-" if r is base or final is None or ref is None else f"{final - ref:+.4f}"
        vio, p95 = r["max_vio_mean"], r["max_vio_p95"]
        args = " ".join(f"`{w}`" for w in r["fit_args"]) or "(as shipped)"
        mfu = "-" if r["mfu"] is None else f"{100 * r['mfu']:.1f}%"
        tps = num(r["tokens_per_s"], ",.0f") + ratio(r["tokens_per_s"], base and base["tokens_per_s"])
        lines.append(
            f"| `{r['label']}` | {args} | {num(bpb.get(steps // 2), '.4f')} | **{num(final, '.4f')}** | {delta} | "
            f"{tps} | {mfu} | {num(r['grad_norm'], '.2f')} | "
            + (f"{max(vio):.3f} / {statistics.mean(vio):.3f} | " if vio else "- | ")
            + (f"{max(p95):.3f} |" if p95 else "- |")
            + (f" {max(r['val_max_vio']):.3f} |" if r.get("val_max_vio") else " - |")
            + (f" {statistics.mean(r['rerouted']):.4f} |" if r.get("rerouted") else " - |"))
    return "\n".join(lines)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--recipe", default="recipes/small.yaml")
    p.add_argument("--variant", action="append", default=[],
                   help="LABEL=ARG...: also run the recipe with these `k3lit fit` arguments (quoted as one string; "
                        "e.g. 'lr3e-3=--optim.lr=3e-3'); repeatable")
    p.add_argument("--steps", type=int, default=500, help="optimizer steps of every run (its whole schedule)")
    p.add_argument("--steady", type=int, default=200, help="tokens/s and MFU from this step on")
    p.add_argument("--val_batches", type=int, default=25, help="validation batches of each validation")
    p.add_argument("--out", default="runs/screen", help="folder of the runs")
    p.add_argument("--json", help="write the raw runs here")
    p.add_argument("--from_json", help="only write RESULTS.md's section from this file")
    add_results_argument(p)
    return p


def main() -> None:
    a = parser().parse_args()
    if a.steps < 2 or a.steps % 2:
        raise SystemExit(f"--steps {a.steps}: an even number of at least 2 (validations at steps/2 and steps)")
    check_outputs(a)
    if not a.from_json:
        check_recipes([a.recipe], ROOT)
    result = load_json(a.from_json, ("runs", "steps", "steady", "recipe")) if a.from_json else screen(a)
    print(table(result))
    write_result(a.results, title(result), table(result))


if __name__ == "__main__":
    main()
