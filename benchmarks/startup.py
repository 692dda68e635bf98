"""Start-up of ``k3lit fit``: the first optimizer step on empty compile caches, with and without the background kernel
compilation, and on the caches a first run left.

    python benchmarks/startup.py --json benchmarks/startup_h200.json          # on the GPU: small and small_plain
    python benchmarks/startup.py --from_json benchmarks/startup_h200.json     # RESULTS.md section only
    python benchmarks/startup.py --recipes recipes/small.yaml --modes cold,warm   # some of the modes
    python benchmarks/startup.py --recipes recipes/tiny.yaml --modes cold-no-precompile --fit_args --optim.name=adamw

Per recipe, fresh ``k3lit fit --trainer.max_steps=N`` processes of the recipe as shipped (no validation), in this
order: ``cold, no precompile`` (empty Triton and inductor cache folders, ``TRITON_CACHE_DIR`` and
``TORCHINDUCTOR_CACHE_DIR``; ``KernelPrecompile`` off), ``cold`` (new empty folders, ``KernelPrecompile`` on, the
default) and ``warm`` (the folders the ``cold`` run filled). Each row holds the run summary's first step (seconds
from the start of training to the end of the first optimizer step, compilation included, the device synchronised)
and the process's wall time (interpreter start, imports, model build and data loaders included). The corpus is
prepared first (``k3lit prepare``), outside the timings. Writes the raw rows (``--json``) and RESULTS.md's section
"Start-up (<GPU>)".
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.race import first_step_seconds, k3lit  # noqa: E402
from benchmarks.results import (  # noqa: E402
    add_fit_args_argument,
    add_output_arguments,
    check_recipes,
    command,
    run_or_load,
    versions,
)

OFF = ["--trainer.callbacks+=k3lit.train.kernel_precompile.KernelPrecompile", "--trainer.callbacks.workers=0"]
MODES = ("cold, no precompile", "cold", "warm")
NAMES = {mode.replace(", ", "-").replace(" ", "-"): mode for mode in MODES}  # --modes spelling: cold-no-precompile


def run(recipe: str, mode: str, caches: Path, a: argparse.Namespace, out: Path) -> dict:
    """One ``k3lit fit`` of ``recipe`` with its compile caches in ``caches``; the first step and the wall time."""
    name = f"{Path(recipe).stem}-{mode.replace(', ', '-').replace(' ', '-')}"
    env = {**os.environ, "TRITON_CACHE_DIR": str(caches / "triton"),
           "TORCHINDUCTOR_CACHE_DIR": str(caches / "inductor")}
    t0 = time.perf_counter()
    k3lit("fit", "--config", recipe, f"--trainer.max_steps={a.steps}", "--trainer.max_time=null",
          "--trainer.limit_val_batches=0", f"--trainer.default_root_dir={out / name}", *a.fit_args,
          *(OFF if mode == "cold, no precompile" else []), log=out / f"{name}.log", env=env)
    wall = time.perf_counter() - t0
    log = (out / f"{name}.log").read_text()
    first = first_step_seconds(log)
    if first is None:
        raise RuntimeError(f"no first-step time in {out / name}.log")
    setup = re.search(r"set-up\W+([0-9.]+) s from the process's start", log)
    parts = re.search(r"set-up\W+[0-9.]+ s from the process's start to training's: (.*) s$", log, re.M)
    h, m, sec = map(int, re.search(r"wall time\W+(\d+):(\d\d):(\d\d)", log).groups())
    return {"recipe": recipe, "mode": mode, "setup_s": float(setup[1]) if setup else None, "first_step_s": first,
            "setup_parts_s": {name: float(v) for name, v in (p.rsplit(" ", 1) for p in parts[1].split("; "))}
            if parts else None,
            "training_s": 3600 * h + 60 * m + sec, "process_s": wall}


def startup(a: argparse.Namespace) -> dict:
    """Every recipe in every mode (module docstring); the rows and this process's versions."""
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    result = {"steps": a.steps, "modes": a.modes, "env": versions(), "command": command(), "rows": rows}
    for recipe in a.recipes:
        k3lit("prepare", "--config", recipe, *[x for x in a.fit_args if x.startswith("--data.")],
              log=out / f"{Path(recipe).stem}-prepare.log")
        with tempfile.TemporaryDirectory(prefix="k3lit-startup-") as tmp:
            for mode in a.modes:
                caches = Path(tmp) / ("none" if mode == "cold, no precompile" else "shared")
                rows.append(run(recipe, mode, caches, a, out))
                if a.json:  # after every row: a call that runs out of time keeps the rows it finished
                    Path(a.json).write_text(json.dumps(result, indent=1))
                print(f"{recipe}  {mode:20s}  first step {rows[-1]['first_step_s']:6.1f} s  "
                      f"process {rows[-1]['process_s']:6.1f} s", flush=True)
    return result


def table(result: dict) -> str:
    """RESULTS.md's section body: one row per recipe and mode."""
    env = result["env"]
    lines = [f"{env['date']}, {env['device']}, torch {env['torch']}, triton {env['triton']}; {result['command']}. "
             f"Each row a fresh `k3lit fit` process of the recipe as shipped, {result['steps']} steps, no validation. "
             "Set-up: from the process's start to the start of training, and its parts as the run summary's row "
             "names them; first step: from the start of training to the end of the first optimizer step "
             "(compilation included); after training: the process less its set-up and its training wall time (the "
             "summary's, to the second: last checkpoint, plots, teardown); process: the whole command, interpreter "
             "start to exit. `cold`: empty "
             "Triton and inductor caches; `warm`: the caches the `cold` run left; `no precompile`: "
             "`KernelPrecompile` off (the Triton kernels compile at their first launches).", "",
             "| recipe | caches | set-up (s) | first step (s) | after training (s) | process (s) |",
             "|---|---|---|---|---|---|"]
    for r in result["rows"]:
        setup = "-" if r.get("setup_s") is None else f"{r['setup_s']:.1f}"
        if r.get("setup_parts_s"):
            setup += " (" + "; ".join(f"{name} {x:.1f}" for name, x in r["setup_parts_s"].items()) + ")"
        after = "-" if r.get("setup_s") is None or r.get("training_s") is None else \
            f"{max(0.0, r['process_s'] - r['setup_s'] - r['training_s']):.0f}"  # training_s is whole seconds
        lines.append(f"| `{Path(r['recipe']).stem}` | {r['mode']} | {setup} | {r['first_step_s']:.1f} | {after} | "
                     f"{r['process_s']:.1f} |")
    done = {(r["recipe"], r["mode"]) for r in result["rows"]}
    missing = [f"`{Path(recipe).stem}` {mode}" for recipe in dict.fromkeys(r["recipe"] for r in result["rows"])
               for mode in result.get("modes", MODES) if (recipe, mode) not in done]
    return "\n".join(lines + ([f"\nNot measured (the run ended first): {', '.join(missing)}."] if missing else []))


def modes(text: str) -> list[str]:
    """``--modes``: comma-separated names of :data:`NAMES` (``cold-no-precompile``, ``cold``, ``warm``), run in the
    order of :data:`MODES`.

    Raises:
        argparse.ArgumentTypeError: an unknown mode, or ``warm`` without the ``cold`` run that fills its caches.
    """
    words = [m.strip() for m in text.split(",")]
    unknown = [m for m in words if m not in NAMES]
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown mode(s) {unknown}; choose from {', '.join(NAMES)}")
    chosen = [NAMES[m] for m in words]
    if "warm" in chosen and "cold" not in chosen:
        raise argparse.ArgumentTypeError("warm reads the caches the cold run fills: add cold")
    return [m for m in MODES if m in chosen]


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--recipes", nargs="+", default=["recipes/small.yaml", "recipes/small_plain.yaml"])
    p.add_argument("--steps", type=int, default=5, help="optimizer steps of each run")
    p.add_argument("--out", default="runs/startup", help="folder of the runs and their logs")
    p.add_argument("--modes", type=modes, default=list(MODES), help=f"comma-separated, of: {', '.join(NAMES)}")
    add_output_arguments(p, "raw rows")
    add_fit_args_argument(p)
    return p


def main() -> None:
    a = parser().parse_args()
    if not a.from_json:
        check_recipes(a.recipes)
    run_or_load(a, startup, "Start-up", table, keys=("rows", "steps"))


if __name__ == "__main__":
    main()
