"""The race: recipes trained for the same wall-clock time on one GPU, then held out on the same bytes.

    python benchmarks/race.py --minutes 6 --seeds 1234 1235 --json benchmarks/race_h200.json    # on the GPU
    python benchmarks/race.py --seeds 1234 --recipes recipes/small.yaml --json F --append   # one run a call
    python benchmarks/race.py --from_json benchmarks/race_h200.json     # RESULTS.md section and PNG only
    python benchmarks/race.py --from_json a.json b.json --json both.json   # runs of one race from several calls
    python benchmarks/race.py --recipes --variant "small_b32=recipes/small.yaml --data.batch_size=32" ...
    python benchmarks/race.py --seq_len 8192 --seeds 1234 --json benchmarks/race_8k_h200.json    # longer sequences

Each run is a fresh ``k3lit fit`` process of a recipe as shipped, with ``trainer.max_time`` the budget and no step
limit, so its learning-rate schedule (warm-up, then the cosine) ends when the time does
(:meth:`k3lit.train.optim.OptimConfig.lr_factor`). The budget is Lightning's clock: from the start of training
(the corpus is prepared before the first run, the model built), compilation and validation included. Every
``--val_every`` seconds a validation reads the held-out split's first ``--val_batches`` batches (``val/bpb``
against ``val/elapsed_s`` gives the curve); at the end ``k3lit validate`` reads the first ``--final_batches``
batches with the last weights. Both recipes must share the data section's corpus and tokenizer, so the held-out
blocks are the same bytes; gzip and xz are measured on those bytes too (:mod:`k3lit.train.reference_bpb`). With
``--positions L1 L2 ...`` each run's last weights also go through ``k3lit positions`` at those lengths (bits per
byte by position bucket, up to and beyond the training length: extrapolation at equal training time), and once
more for each ``--positions_reading LABEL=ARGS`` with those ``k3lit positions`` arguments (e.g. ``window=--attn_window
2048``: the softmax layers read through a sliding window of the training length).

A ``--variant LABEL=RECIPE ARG...`` runs a recipe with more ``k3lit fit`` arguments (another batch, balancer or
capacity), labelled; its final pass still reads the recipe's own batches, so every run is measured on the same
bytes. ``--seq_len N`` races every recipe at sequences of ``N`` tokens instead of its own, its batch scaled so a
step reads as many tokens as the recipe's (:func:`data_overrides`), in training and in the final pass alike. For runs
with MoE layers the expert load is recorded too: train MaxVio_batch over the second half of the run, held-out
MaxVio_global of the final pass, the re-routed share.

Writes the raw runs (``--json``), a PNG of held-out bits per byte against seconds (``--png``, default beside the
JSON) and RESULTS.md's section "Race at equal wall-clock (<GPU>)" (``--results``: another file, or ``none``). Recipe
paths and ``--out`` are read from the repository's root, ``--json`` and ``--png`` from the current folder.
"""

from __future__ import annotations

import argparse
import csv
import functools
import json
import math
import re
import shlex
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.results import (  # noqa: E402
    add_fit_args_argument,
    add_results_argument,
    check_outputs,
    check_recipes,
    command,
    load_json,
    versions,
    write_result,
)

ROOT = Path(__file__).resolve().parents[1]
KEYS = ("runs", "same_bytes", "minutes", "val_batches")  # what a stored race holds (--from_json)


def k3lit(*args: str, log: Path, env: dict[str, str] | None = None) -> None:
    """Run ``python -m k3lit.cli args`` from the repository root, output to ``log``, in ``env`` (default: this
    process's environment).

    Raises:
        RuntimeError: the command failed (its log's last lines in the message).
    """
    with open(log, "w") as out:
        rc = subprocess.run([sys.executable, "-m", "k3lit.cli", *args], cwd=ROOT, stdout=out, stderr=subprocess.STDOUT,
                            env=env).returncode
    if rc:
        tail = "".join(log.read_text().splitlines(keepends=True)[-15:])
        raise RuntimeError(f"k3lit {args[0]} failed ({rc}); the end of {log}:\n{tail}")


def read_csv(path: Path) -> list[dict[str, str]]:
    with open(path) as f:
        return list(csv.DictReader(f))


def curve(rows: list[dict[str, str]]) -> list[tuple[float, int, float]]:
    """``(seconds, step, val/bpb)`` of every validation of a fit's ``metrics.csv``."""
    return [(float(r["val/elapsed_s"]), int(r["step"]), float(r["val/bpb"])) for r in rows
            if r.get("val/bpb") and r.get("val/elapsed_s")]


def clock(seconds: float) -> str:
    """``DD:HH:MM:SS``, Lightning's duration string, of whole ``seconds`` (at least 1)."""
    s = max(1, round(seconds))
    return f"00:{s // 3600:02d}:{s % 3600 // 60:02d}:{s % 60:02d}"


def first_step_seconds(log: str) -> float | None:
    """Seconds to the first step from a fit log's run summary row ("first step  77.2 s after training started")."""
    found = re.search(r"first step\W+([0-9.]+) s after training started", log)
    return float(found[1]) if found else None


def entrants(a: argparse.Namespace) -> list[tuple[str, str, list[str]]]:
    """``(label, recipe, extra fit arguments)`` of every run of a seed: each of ``--recipes`` as shipped (labelled
    by its file's stem), then each ``--variant LABEL=RECIPE ARG...``.

    Raises:
        SystemExit: no entrant, a variant without ``LABEL=RECIPE``, or two entrants with one label.
    """
    out = [(Path(r).stem, r, []) for r in a.recipes]
    for v in a.variant:
        label, _, rest = v.partition("=")
        words = shlex.split(rest)
        if not label or not words:
            raise SystemExit(f"--variant {v!r}: write LABEL=RECIPE [FIT ARGUMENT ...]")
        out.append((label, words[0], words[1:]))
    labels = [label for label, _, _ in out]
    if not out:
        raise SystemExit("--recipes / --variant: nothing to run")
    if len(set(labels)) < len(labels):
        raise SystemExit(f"--recipes / --variant: each label once, got {labels}")
    return out


def data_overrides(recipe: str, seq_len: int | None) -> dict[str, int]:
    """``recipe``'s data fields for sequences of ``seq_len`` tokens at the same tokens per step: ``seq_len`` and
    ``batch_size`` = the recipe's ``batch_size x seq_len`` over ``seq_len``; none for ``seq_len`` None.

    Raises:
        SystemExit: the recipe's tokens per step are not a multiple of ``seq_len``.
    """
    if seq_len is None:
        return {}
    data = yaml.safe_load((ROOT / recipe).read_text())["data"]
    tokens = data["batch_size"] * data["seq_len"]
    if seq_len < 1 or tokens % seq_len:
        raise SystemExit(f"--seq_len {seq_len}: {recipe} reads {tokens} tokens a step ({data['batch_size']} x "
                         f"{data['seq_len']}); choose a divisor of it, e.g. {data['seq_len'] * 4}")
    return {"seq_len": seq_len, "batch_size": tokens // seq_len}


def data_args(recipe: str, seq_len: int | None) -> list[str]:
    """:func:`data_overrides` as ``k3lit`` arguments."""
    return [f"--data.{key}={value}" for key, value in data_overrides(recipe, seq_len).items()]


def label(r: dict) -> str:
    """A run's label (runs stored before variants existed: their recipe's stem)."""
    return r.get("label") or Path(r["recipe"]).stem


def run(entrant: tuple[str, str, list[str]], seed: int, a: argparse.Namespace, out: Path,
        save: Callable[[dict], None] = lambda record: None) -> dict:
    """One entrant (:func:`entrants`) and seed: fit for ``a.minutes`` (the entrant's arguments last), then the final
    held-out pass on the recipe's own data settings (at ``a.seq_len``, if set), so every run reads the same bytes;
    what both logged. ``save`` gets the record as it grows: the fit's (``final_val_loss`` None) before the final
    pass starts, then again after the final pass and after each ``k3lit positions`` reading, so a call cut short
    keeps what had finished."""
    name, recipe, extra = entrant
    folder = out / f"{name}-{seed}"
    t0 = time.perf_counter()
    k3lit("fit", "--config", recipe, "--seed_everything", str(seed), f"--trainer.max_time={clock(60 * a.minutes)}",
          "--trainer.max_steps=-1", f"--trainer.val_check_interval={clock(a.val_every)}",
          f"--trainer.limit_val_batches={a.val_batches}", f"--trainer.default_root_dir={folder}",
          *data_args(recipe, a.seq_len), *a.fit_args, *extra, log=folder.with_suffix(".fit.log"))
    wall = time.perf_counter() - t0
    fit_rows = read_csv(folder / "metrics.csv")
    steps = max(int(r["step"]) for r in fit_rows) + 1
    tps = [float(r["train/device/items_per_sec"]) for r in fit_rows if r.get("train/device/items_per_sec")]
    record = {"recipe": recipe, "label": name, "fit_args": [*a.fit_args, *extra], "seed": seed, "steps": steps,
              "process_s": wall,
              "curve": curve(fit_rows), "expert_load": None, "final_val_loss": None,
              "median_tokens_per_s": statistics.median(tps) if tps else None,
              "first_step_s": first_step_seconds(folder.with_suffix(".fit.log").read_text()), "positions": None}
    heatmaps = sorted(folder.glob("**/expert_load/step*.png"))  # the fit's last layer x expert load, kept
    if heatmaps:
        beside = Path(a.json).parent if a.json else out
        record["expert_load_png"] = f"{Path(a.json).stem if a.json else 'race'}_{name}-{seed}_expert_load.png"
        shutil.copyfile(heatmaps[-1], beside / record["expert_load_png"])
    save(record)
    k3lit("validate", "--config", recipe, *data_args(recipe, a.seq_len), "--ckpt_path",
          str(folder / "checkpoints" / "last.ckpt"), f"--trainer.limit_val_batches={a.final_batches}",
          f"--trainer.default_root_dir={folder}-val",
          log=folder.with_suffix(".val.log"))
    val_rows = read_csv(Path(f"{folder}-val") / "metrics.csv")
    final = next(r for r in val_rows if r.get("val/loss"))
    record = {**record, "expert_load": expert_load(fit_rows, final), "final_val_loss": float(final["val/loss"])}
    save(record)
    if a.positions:  # extrapolation of the same weights: bpb by position bucket at longer lengths
        try:  # a failed pass is reported with the run, not in place of it
            for reading, extra in [("", []), *positions_readings(a)]:
                stem = f"positions-{reading}" if reading else "positions"
                k3lit("positions", "--ckpt", str(folder / "checkpoints" / "last.ckpt"), "--lengths",
                      *map(str, a.positions), "--blocks", str(a.positions_blocks), *extra, "--json",
                      str(folder / f"{stem}.json"), log=Path(f"{folder}.{stem}.log"))
                results = json.loads((folder / f"{stem}.json").read_text())["results"]
                if reading:
                    record = {**record, "positions_readings": {**record.get("positions_readings", {}),
                                                               reading: results}}
                else:
                    record = {**record, "positions": results}
                save(record)
        except RuntimeError as e:
            record = {**record, "positions_error": str(e)}
            print(record["positions_error"], file=sys.stderr, flush=True)
    return record


def positions_readings(a: argparse.Namespace) -> list[tuple[str, list[str]]]:
    """``--positions_reading LABEL=ARGS`` as ``[(label, k3lit positions arguments)]``.

    Raises:
        SystemExit: a reading without ``LABEL=`` or arguments, or two readings with one label.
    """
    out = []
    for spec in a.positions_reading:
        name, _, rest = spec.partition("=")
        if not name or not shlex.split(rest):
            raise SystemExit(f"--positions_reading {spec!r}: write LABEL=ARGS, e.g. 'window=--attn_window 2048'")
        out.append((name, shlex.split(rest)))
    if len({name for name, _ in out}) < len(out):
        raise SystemExit(f"--positions_reading: each label once, got {[name for name, _ in out]}")
    return out


def expert_load(fit_rows: list[dict[str, str]], final: dict[str, str]) -> dict | None:
    """Per MoE layer: train MaxVio_batch (mean and 95th percentile over the logged steps of the run's second half),
    held-out MaxVio_global of the final pass, and the mean re-routed share of the logged steps (0 without a
    capacity limit); None for a model without MoE layers, or a fit that logged no training step."""
    layers = sorted(int(k.rsplit("layer", 1)[1]) for k in final if k.startswith("val/max_vio/layer"))
    logged = [r for r in fit_rows if r.get("train/max_vio/layer0")]
    if not layers or not logged:
        return None
    late = logged[len(logged) // 2:]

    def series(key: str) -> list[list[float]]:
        return [[float(r[f"{key}{i}"]) for r in late if r.get(f"{key}{i}")] for i in layers]

    def p95(v: list[float]) -> float:
        return statistics.quantiles(v, n=20)[-1] if len(v) > 1 else v[0]

    vio = series("train/max_vio/layer")
    return {"train_max_vio_mean": [statistics.mean(v) for v in vio], "train_max_vio_p95": [p95(v) for v in vio],
            "val_max_vio": [float(final[f"val/max_vio/layer{i}"]) for i in layers],
            "rerouted": [statistics.mean(v) if v else 0.0 for v in series("train/reroute_rate/layer")]}


def same_bytes(recipe: str, batches: int, seq_len: int | None = None) -> dict:
    """The held-out blocks ``batches`` validation batches of ``recipe`` read (at ``seq_len``, :func:`data_overrides`):
    their count, bytes, and what gzip and xz need for them (:func:`k3lit.train.reference_bpb.reference_bpb`)."""
    from k3lit.data import K3DataModule
    from k3lit.train.reference_bpb import reference_bpb

    data = yaml.safe_load((ROOT / recipe).read_text())["data"]
    dm = K3DataModule(**{**data, **data_overrides(recipe, seq_len)})
    blocks = batches * dm.batch_size
    return {"blocks": blocks, "seq_len": dm.seq_len, **reference_bpb(dm.prepared, dm.seq_len, blocks)}


def bpb(r: dict, ref: dict) -> float | None:
    """The final pass's bits per byte of the very held-out text (nats per token x tokens / ln 2 / bytes); None for a
    run whose final pass did not finish."""
    if r.get("final_val_loss") is None:
        return None
    return r["final_val_loss"] * ref["blocks"] * ref["seq_len"] / math.log(2) / ref["bytes"]


def plot(result: dict, path: Path) -> tuple[float, float]:
    """Held-out bits per byte against seconds of training, one line per run, written to ``path``; the y-axis
    limits it chose."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    labels = sorted({label(r) for r in result["runs"]})
    for r in result["runs"]:
        seconds, _, values = zip(*r["curve"]) if r["curve"] else ((), (), ())
        ax.plot(seconds, values, marker="o", ms=3, color=f"C{labels.index(label(r))}",
                linestyle="-" if r["seed"] == result["seeds"][0] else "--", label=f"{label(r)}, seed {r['seed']}")
    ax.set_xlabel("seconds of training (compilation and validation included)")
    ax.set_ylabel(f"held-out bits per byte (first {result['val_batches']} validation batches)")
    ax.set_title(f"{result['minutes']:g} minutes each, {result['env']['device']}")
    values = [v for r in result["runs"] for _, _, v in r["curve"]]
    if values and min(values) < 3.0 < max(values):  # a long race's first validations: keep the axis on its end
        ax.set_ylim(top=3.0)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return ax.get_ylim()


def table(result: dict, png: str) -> str:
    """RESULTS.md's section: the command, one row per run, and the difference against the seed-to-seed spread."""
    ref, env = result["same_bytes"], result["env"]
    lines = [
        f"Written by `benchmarks/race.py`. {env['date']} · {env['device']} · torch {env['torch']}, triton "
        f"{env['triton']} · {result['command']}. Each run a fresh `k3lit fit` of the recipe as shipped"
        + (f" at {result['seq_len']:,}-token sequences (its batch scaled to the same tokens per step)"
           if result.get("seq_len") else "") + " with "
        f"`trainer.max_time` {result['minutes']:g} minutes and no step limit (its cosine ends with the time), one "
        "after the other on one device; the budget counts from the start of training, compilation and validation "
        "included. Final held-out pass (`k3lit validate`, last weights): the split's first "
        f"{ref['blocks']} blocks of {ref['seq_len'] + 1} tokens, {ref['bytes']:,} bytes, the same bytes for every "
        f"run: gzip -9 {ref['gzip -9']:.3f}, xz -9e {ref['xz -9e']:.3f} bits per byte. Last periodic validation: "
        f"the run's last `val/bpb` inside its budget, on the split's first {result['val_batches']} batches (the "
        "curve's last point; a model's bpb, not on the final pass's bytes). Raw runs: "
        f"`{result.get('json', '')}`; curve: `{png}`. Runs from several invocations (`--append`, or several files "
        "to `--from_json`): the date and command above are the latest's; each run's date is in the table, its "
        "command in the raw runs.",
        "",
        "| run | date | seed | steps | first step (s) | median tokens/s | last periodic validation (bpb) "
        "| held-out bpb |",
        "|---|---|---|---|---|---|---|---|",
    ]
    by_label: dict[str, dict[int, list[float]]] = {}
    unfinished = []
    for r in result["runs"]:
        value = bpb(r, ref)
        if value is None:
            unfinished.append(f"`{label(r)}` seed {r['seed']}")
        else:
            by_label.setdefault(label(r), {}).setdefault(r["seed"], []).append(value)
        tps = f"{r['median_tokens_per_s']:,.0f}" if r.get("median_tokens_per_s") else "-"
        first = f"{r['first_step_s']:.1f}" if r.get("first_step_s") is not None else "-"
        shown = "-" if value is None else f"{value:.4f}"
        last = f"{r['curve'][-1][2]:.4f}" if r.get("curve") else "-"
        lines.append(f"| `{label(r)}` | {r.get('date') or env['date']} | {r['seed']} | {r['steps']:,} | {first} "
                     f"| {tps} | {last} | {shown} |")
    if unfinished:
        lines += ["", "The final held-out pass of " + ", ".join(unfinished) + " did not finish (the call ended "
                      "first): the row keeps what the fit logged, its curve is in the plot, and it counts in no mean."]
    variants = [f"`{label(r)}` = `{Path(r['recipe']).stem}` with `{' '.join(r['fit_args'])}`"
                for r in {label(r): r for r in result["runs"] if r.get("fit_args")}.values()]
    if variants:
        lines += ["", "Variants (their `k3lit fit` arguments; the final pass reads the recipe's own batches): "
                      + "; ".join(variants) + "."]
    if len(by_label) >= 2:
        lines += ["", verdict(by_label)]
    return "\n".join(lines + per_step(result["runs"]) + expert_load_table(result) + positions_table(result))


def title(result: dict) -> str:
    """RESULTS.md's section title: one section per device and, for ``--seq_len`` races, per sequence length."""
    length = f", {result['seq_len']:,}-token sequences" if result.get("seq_len") else ""
    return f"Race at equal wall-clock{length} ({result['env']['device'].removeprefix('NVIDIA ')})"


def steps_to(points: list[tuple[float, int, float]], bpb: float) -> float | None:
    """The step at which a curve (:func:`curve`) first reaches ``bpb``, linear between its validations; None if it
    never does, or already had at its first validation (no step to interpolate from)."""
    for (_, s0, b0), (_, s1, b1) in zip(points, points[1:]):
        if b1 <= bpb < b0:
            return s0 + (s1 - s0) * (b0 - bpb) / (b0 - b1)
    return None


def per_step(runs: list[dict]) -> list[str]:
    """Lines under the race table: where another label's run of the same seed reached each run's last periodic bpb
    (:func:`steps_to`), and that step over the run's own: the step-time ratio at which the two would tie at the
    budget. Empty when no run reached another's."""
    rows = []
    for r in runs:
        if not r.get("curve"):
            continue
        _, step, target = r["curve"][-1]
        for o in runs:
            at = (None if label(o) == label(r) or o["seed"] != r["seed"] or not o.get("curve") or step < 1
                  else steps_to(o["curve"], target))
            if at is not None:
                rows.append(f"| `{label(r)}` | {r['seed']} | {target:.4f} | {step:,} | `{label(o)}` | {at:,.0f} | "
                            f"{at / step:.2f} |")
    if not rows:
        return []
    return ["", "Per step: where another run of the same seed reached a run's last periodic bpb (linear between its "
                "validations). At this budget a run needing k times fewer steps ties with a step k times the other's; "
                "the curves between their ends compare other points of two cosine schedules.", "",
            "| run | seed | last periodic bpb | at step | reached by | at step | steps / run's steps |",
            "|---|---|---|---|---|---|---|", *rows]


def verdict(by_label: dict[str, dict[int, list[float]]]) -> str:
    """Mean held-out bpb of each label over its seeds (``{label: {seed: [bpb of each run]}}``; the runs of one seed
    count as their mean, one seed), its seed count and seed-to-seed spread (largest minus smallest seed), the
    leader's margin over the runner-up, and that margin against the largest spread (labels with two or more
    seeds)."""
    per_seed = {k: [statistics.mean(v) for v in seeds.values()] for k, seeds in by_label.items()}
    means = sorted((statistics.mean(v), k) for k, v in per_seed.items())
    (best, lead), (second, runner) = means[0], means[1]

    def counted(k: str) -> str:
        v, runs = per_seed[k], sum(len(r) for r in by_label[k].values())
        seeds = f"{len(v)} seeds, spread {max(v) - min(v):.4f}" if len(v) >= 2 else "1 seed"
        return seeds + (f", {runs} runs" if runs > len(v) else "")

    text = ("Mean held-out bpb over seeds (a seed run more than once counts as its runs' mean): "
            + ", ".join(f"`{k}` {m:.4f} ({counted(k)})" for m, k in means)
            + f": `{lead}` ahead of `{runner}` by {second - best:.4f}")
    if len(per_seed[lead]) < 2 or len(per_seed[runner]) < 2:
        return text + "; one of the two has one seed so far, so their seed-to-seed spread is not measured."
    spread = max(max(v) - min(v) for v in per_seed.values() if len(v) >= 2)
    more = "more" if second - best > spread else "less"
    return text + f", {more} than the largest seed-to-seed spread ({spread:.4f})."


def expert_load_table(result: dict) -> list[str]:
    """Lines under the race table for runs with MoE layers: train MaxVio_batch (mean and 95th percentile over the
    logged steps of the second half), held-out MaxVio_global of the final pass and the re-routed share: the worst MoE
    layer's, then every layer's, and the runs' last load heatmaps (copied beside the raw JSON by :func:`run`)."""
    runs = [r for r in result["runs"] if r.get("expert_load")]
    if not runs:
        return []
    lines = ["", "Expert load of the same runs, the worst MoE layer's value:", "",
             "| run | seed | train MaxVio_batch mean | p95 | held-out MaxVio_global | re-routed |",
             "|---|---|---|---|---|---|"]
    for r in runs:
        e = r["expert_load"]
        lines.append(f"| `{label(r)}` | {r['seed']} | {max(e['train_max_vio_mean']):.3f} | "
                     f"{max(e['train_max_vio_p95']):.3f} | {max(e['val_max_vio']):.3f} | {max(e['rerouted']):.4f} |")
    n = max(len(r["expert_load"]["val_max_vio"]) for r in runs)
    lines += ["", "Per MoE layer (in depth order):", "",
              "| run | seed | measure | " + " | ".join(str(i) for i in range(n)) + " |", "|---|---|---|" + "---|" * n]
    for r in runs:
        for key, name in (("train_max_vio_mean", "train MaxVio_batch mean"), ("train_max_vio_p95", "p95"),
                          ("val_max_vio", "held-out MaxVio_global"), ("rerouted", "re-routed")):
            digits = 4 if key == "rerouted" else 3
            values = [f"{v:.{digits}f}" for v in r["expert_load"][key]] + ["-"] * (n - len(r["expert_load"][key]))
            lines.append(f"| `{label(r)}` | {r['seed']} | {name} | " + " | ".join(values) + " |")
    pngs = [f"`{label(r)}` seed {r['seed']}: `{r['expert_load_png']}`" for r in runs if r.get("expert_load_png")]
    if pngs:
        lines += ["", "Layer x expert load at each run's last plotted step (heatmaps beside the raw JSON): "
                  + "; ".join(pngs) + "."]
    return lines


def positions_table(result: dict) -> list[str]:
    """Lines under the race table for runs evaluated with ``--positions``: per run and length, held-out bpb over
    all positions, in the first position bucket and in the last, last over first, and the last bucket's bytes read
    in training-length windows (``bpb_window``; ``-`` in runs stored before it was measured) with the last bucket
    over it."""
    runs = [r for r in result["runs"] if r.get("positions")]
    if not runs:
        return []
    readings = sorted({k for r in runs for k in r.get("positions_readings", {})})
    lines = ["", "The same final weights through `k3lit positions`: held-out bits per byte by position on the "
                 "split's first blocks of each length (documents packed as in training, KDA state and attention "
                 "running across their boundaries); `in windows`: the last bucket's bytes read in windows of the "
                 "training length, each from an empty state:", "",
             "| run | seed | length | blocks | all positions | first bucket | last bucket | last / first | "
             "last bucket in windows | last / in windows |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    rows = [(f"`{label(r)}`", r, r["positions"]) for r in runs]
    rows += [(f"`{label(r)}` read with `{k}`", r, r["positions_readings"][k])
             for k in readings for r in runs if k in r.get("positions_readings", {})]
    for name, r, results in rows:
        for p in results:
            filled = [b for b in p["buckets"] if b["bpb"] is not None]
            first, last = filled[0], filled[-1]
            windowed = last.get("bpb_window")
            lines.append(f"| {name} | {r['seed']} | {p['length']:,} | {p['blocks']} | "
                         f"{p['bpb']:.4f} | {first['bpb']:.4f} ({first['start']:,}-{first['end']:,}) | "
                         f"{last['bpb']:.4f} ({last['start']:,}-{last['end']:,}) | {last['bpb'] / first['bpb']:.3f} | "
                         + (f"{windowed:.4f} | {last['bpb'] / windowed:.3f} |" if windowed else "- | - |"))
    return lines


def continued(earlier: dict, result: dict) -> dict:
    """``result`` (a race just begun) holding ``earlier``'s runs and seeds too.

    Raises:
        SystemExit: ``earlier`` is another race: another time budget, validation size or held-out text.
    """
    keys = ("minutes", "val_batches", "same_bytes")
    if any(earlier[k] != result[k] for k in keys):
        raise SystemExit("--append: the stored runs are of another race (" + ", ".join(
            f"{k} {earlier[k]} against {result[k]}" for k in keys if earlier[k] != result[k]) + ")")
    seeds = sorted(set(earlier["seeds"]) | set(result["seeds"]))
    return {**result, "runs": stamped(earlier) + stamped(result), "seeds": seeds}


def stamped(result: dict) -> list[dict]:
    """``result``'s runs, each with the date and command of the invocation that ran it (``date``, ``command``),
    kept where a run has them already (runs joined from several invocations keep their own)."""
    date, cmd = result.get("env", {}).get("date"), result.get("command")
    return [{"date": date, "command": cmd, **r} for r in result["runs"]]


def race(a: argparse.Namespace) -> dict:
    """Prepare the recipes' corpus, then run every seed of every recipe (:func:`run`), one after the other; the
    raw result (written to ``a.json`` after each run).

    Raises:
        SystemExit: the recipes' data sections differ (their held-out bytes would too).
    """
    runs = entrants(a)
    check_recipes([r for _, r, _ in runs], ROOT)
    positions_readings(a)  # a malformed reading stops the race before its first run
    for _, r, _ in runs:  # so does a sequence length that does not divide a recipe's tokens a step
        data_overrides(r, a.seq_len)
    datas = {json.dumps(yaml.safe_load((ROOT / r).read_text())["data"], sort_keys=True) for _, r, _ in runs}
    if len(datas) > 1:
        raise SystemExit("--recipes: their data sections differ, so their held-out bytes would too")
    out = ROOT / a.out
    out.mkdir(parents=True, exist_ok=True)
    first = runs[0][1]
    k3lit("prepare", "--config", first, log=out / "prepare.log")
    result = {"minutes": a.minutes, "seeds": a.seeds, "val_batches": a.val_batches, "seq_len": a.seq_len,
              "env": versions(), "command": command(), "json": a.json or "", "runs": [],
              "same_bytes": same_bytes(first, a.final_batches, a.seq_len)}
    if a.append and a.json and Path(a.json).is_file():  # runs of earlier invocations (one GPU call each)
        result = continued(json.loads(Path(a.json).read_text()), result)
    def save(record: dict) -> None:  # the run in progress is the last entry
        result["runs"][-1] = record
        if a.json:
            Path(a.json).write_text(json.dumps(result, indent=1))

    for seed in a.seeds:
        for entrant in runs:
            result["runs"].append(None)
            save(run(entrant, seed, a, out, save))
            print(json.dumps(result["runs"][-1]), flush=True)
    return result


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--recipes", nargs="*", default=["recipes/small.yaml", "recipes/small_plain.yaml"])
    p.add_argument("--variant", action="append", default=[],
                   help="LABEL=RECIPE ARG...: also run RECIPE with these `k3lit fit` arguments (quoted as one "
                        "string; e.g. 'small_b32=recipes/small.yaml --data.batch_size=32'); repeatable")
    p.add_argument("--seeds", nargs="+", type=int, default=[1234, 1235])
    p.add_argument("--minutes", type=float, default=6.0, help="training time of each run")
    p.add_argument("--val_every", type=float, default=45.0, help="seconds between validations")
    p.add_argument("--val_batches", type=int, default=25, help="validation batches of each periodic validation")
    p.add_argument("--final_batches", type=int, default=50, help="validation batches of the final held-out pass")
    p.add_argument("--seq_len", type=int, help="race at sequences of this many tokens, the batch scaled to the "
                   "recipes' tokens per step (default: each recipe's own)")
    p.add_argument("--positions", type=int, nargs="*", default=[],
                   help="after each run, `k3lit positions` of its weights at these lengths (e.g. 2048 8192 32768)")
    p.add_argument("--positions_blocks", type=int, default=4, help="held-out blocks of each --positions length")
    p.add_argument("--positions_reading", action="append", default=[],
                   help="LABEL=ARGS: also `k3lit positions` with these arguments (quoted as one string; e.g. "
                        "'window=--attn_window 2048'); repeatable")
    p.add_argument("--out", default="runs/race", help="folder of the runs (from the repository's root)")
    p.add_argument("--json", help="write the raw runs here")
    p.add_argument("--append", action="store_true", help="add to the runs --json holds, if any (same race)")
    p.add_argument("--png", help="the curve (default: the JSON's path with .png)")
    p.add_argument("--from_json", nargs="+", help="only write RESULTS.md's section and the PNG from these files, "
                   "the runs of one race (several: joined in this order and written to --json, if given)")
    add_results_argument(p)
    add_fit_args_argument(p)
    return p


def main() -> None:
    a = parser().parse_args()
    check_outputs(a)
    if a.from_json:
        result = functools.reduce(continued, (load_json(f, KEYS) for f in a.from_json))
        result["json"] = a.json or a.from_json[0]
        if a.json:
            Path(a.json).write_text(json.dumps(result, indent=1))
    else:
        result = race(a)
    png = a.png or str(Path(a.json or (a.from_json or [ROOT / a.out / "race.json"])[0]).with_suffix(".png"))
    plot(result, Path(png))
    print(table(result, png))
    write_result(a.results, title(result), table(result, png))


if __name__ == "__main__":
    main()
