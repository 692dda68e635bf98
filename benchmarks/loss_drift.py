"""Does a change alter what the model computes? The per-step training loss of one recipe, seed and data at a base
revision and in this tree, against the run-to-run noise of this tree.

    python benchmarks/loss_drift.py --base ea83029 --recipe recipes/small.yaml --steps 200 \\
        --json benchmarks/loss_drift_h200.json                          # on the GPU
    python benchmarks/loss_drift.py --from_json benchmarks/loss_drift_h200.json    # RESULTS.md section only

Three ``k3lit fit`` processes of ``--steps`` optimizer steps each (no validation, ``train/loss`` logged every step,
the recipe's seed unless ``--fit_args`` sets one): the base (``--base``, a revision checked out in a temporary git
worktree, or ``--base_tree``, a folder holding another source tree), this tree, and this tree again. Drift is the
largest and the mean ``|loss_base - loss_this|`` over the steps; noise the same between the two runs of this tree
(kernels whose sums are not ordered: atomics, split reductions). A change that computes the same model in another
order drifts like the noise; one that changes the model drifts beyond it. With deterministic kernels (a CPU) the
noise is 0 and an unchanged model drifts by exactly 0. Each tree reads the corpus it prepares itself (``k3lit
prepare`` of that tree into ``<out>/data-<name>``, outside the runs). Writes the raw losses (``--json``) and
RESULTS.md's section "Loss drift (<device>)".
"""

from __future__ import annotations

import argparse
import contextlib
import os
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.race import read_csv  # noqa: E402
from benchmarks.results import add_fit_args_argument, add_output_arguments, command, run_or_load, versions  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


@contextlib.contextmanager
def worktree(revision: str) -> Iterator[Path]:
    """A temporary detached git worktree of ``revision`` of this repository, removed on exit.

    Raises:
        subprocess.CalledProcessError: ``revision`` is not a commit of this repository.
    """
    with tempfile.TemporaryDirectory(prefix="k3lit-base-") as tmp:
        path = Path(tmp) / "tree"
        subprocess.run(["git", "worktree", "add", "--detach", str(path), revision], cwd=ROOT, check=True,
                       capture_output=True)
        try:
            yield path
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(path)], cwd=ROOT, capture_output=True)


def fit_losses(tree: Path, name: str, a: argparse.Namespace, out: Path) -> dict[int, float]:
    """``{step: train/loss}`` of ``a.steps`` steps of ``a.recipe`` trained by the k3lit in ``tree``.

    Raises:
        RuntimeError: a command failed (the end of its log in the message).
    """
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(tree), os.environ.get("PYTHONPATH")) if p)}
    data = f"--data.cache_dir={out / ('data-' + name.split('-')[0])}"
    recipe = str((ROOT / a.recipe).resolve())
    for args, log in (
        (["prepare", "--config", recipe, data], out / f"{name}-prepare.log"),
        (["fit", "--config", recipe, f"--trainer.max_steps={a.steps}", "--trainer.max_time=null",
          "--trainer.limit_val_batches=0", "--trainer.log_every_n_steps=1", data,
          f"--trainer.default_root_dir={out / name}", *a.fit_args], out / f"{name}.log"),
    ):
        with open(log, "w") as f:
            rc = subprocess.run([sys.executable, "-m", "k3lit.cli", *args], cwd=tree, env=env, stdout=f,
                                stderr=subprocess.STDOUT).returncode
        if rc:
            tail = "".join(log.read_text().splitlines(keepends=True)[-15:])
            raise RuntimeError(f"k3lit {args[0]} in {tree} failed ({rc}); the end of {log}:\n{tail}")
    return {int(r["step"]): float(r["train/loss"]) for r in read_csv(out / name / "metrics.csv")
            if r.get("train/loss")}


def gap(a: dict[int, float], b: dict[int, float]) -> dict[str, float]:
    """Largest and mean ``|a - b|`` over the steps both hold.

    Raises:
        ValueError: no step in common.
    """
    steps = sorted(set(a) & set(b))
    if not steps:
        raise ValueError("the two runs logged no step in common")
    d = [abs(a[s] - b[s]) for s in steps]
    return {"steps": len(steps), "max": max(d), "mean": sum(d) / len(d)}


def drift(a: argparse.Namespace) -> dict:
    """The three runs (module docstring) and their gaps."""
    out = Path(a.out).resolve()  # the runs start in their own tree's folder
    out.mkdir(parents=True, exist_ok=True)
    with (contextlib.nullcontext(Path(a.base_tree)) if a.base_tree else worktree(a.base)) as base_tree:
        base = fit_losses(base_tree, "base", a, out)
    this = fit_losses(ROOT, "this-1", a, out)
    again = fit_losses(ROOT, "this-2", a, out)
    return {"base": a.base or str(a.base_tree), "recipe": a.recipe, "steps": a.steps, "env": versions(),
            "command": command(), "losses": {"base": base, "this": this, "this again": again},
            "drift": gap(base, this), "noise": gap(this, again)}


def table(result: dict) -> str:
    """RESULTS.md's section body."""
    env, d, n = result["env"], result["drift"], result["noise"]
    verdict = ("none, every step's loss is the same" if d["max"] == 0 else
               "within the run-to-run noise" if d["max"] <= n["max"] else
               f"{d['max'] / n['max']:.1f}x the run-to-run noise at most" if n["max"] > 0 else
               "beyond the noise (the runs of this tree agree exactly)")
    return "\n".join([
        f"{env['date']}, {env['device']}, torch {env['torch']}, triton {env['triton']}; {result['command']}. "
        f"`{result['recipe']}`, {result['steps']} optimizer steps, `train/loss` of every step: the base "
        f"`{result['base']}` against this tree, and this tree against a second run of itself.", "",
        "| runs | steps compared | largest \\|Δ loss\\| | mean \\|Δ loss\\| |", "|---|---|---|---|",
        f"| base against this tree (drift) | {d['steps']} | {d['max']:.3g} | {d['mean']:.3g} |",
        f"| this tree twice (noise) | {n['steps']} | {n['max']:.3g} | {n['mean']:.3g} |", "",
        f"Drift: {verdict}."])


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    base = p.add_mutually_exclusive_group()
    base.add_argument("--base", help="the base revision (a git worktree of it)")
    base.add_argument("--base_tree", help="or a folder holding the base source tree")
    p.add_argument("--recipe", default="recipes/small.yaml")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--out", default="runs/loss_drift", help="folder of the runs, their logs and corpora")
    add_output_arguments(p, "raw losses")
    add_fit_args_argument(p)
    return p


def main() -> None:
    p = parser()
    a = p.parse_args()
    if not (a.from_json or a.base or a.base_tree):
        p.error("give --base REVISION, --base_tree FOLDER or --from_json FILE")
    run_or_load(a, drift, "Loss drift", table)


if __name__ == "__main__":
    main()
