"""``k3lit slurm``: render (and optionally submit) an sbatch script that trains a recipe under SLURM.

    k3lit slurm --config recipes/medium.yaml --nodes 1 --gpus_per_node 8 --time 48:00:00 \\
        --partition gpu --account my-project -- --trainer.max_steps=20000 > medium.sbatch
    sbatch medium.sbatch

The template is ``recipes/slurm/train.sbatch``: ``srun`` with one task per device, ``--signal=SIGUSR1@90``
and ``--requeue``; the training command ends in ``--ckpt_path last``, so a requeued job resumes from the
checkpoint that :class:`k3lit.train.callbacks.SlurmRequeue` wrote when the signal came.

The layout is checked against the recipe (with the ``--`` overrides applied) before anything is written:
``trainer.num_nodes`` must equal ``--nodes``, ``trainer.devices`` the tasks per node, a
``ModelParallelStrategy``'s ``data_parallel_size * tensor_parallel_size`` the number of tasks, and an
``ExpertParallelStrategy``'s mesh (replicas x data parallel x expert parallel, :func:`k3lit.parallel.mesh_shape`)
the number of tasks and ``model.n_experts``. Where the recipe leaves them open (``devices: auto``), the
rendered command sets them. ``k3lit slurm`` also parses the recipe with the ``--`` arguments as ``k3lit fit`` will
(:func:`check_fit_args`), so a misspelt argument fails here, not after the job's wait in the queue.
"""

from __future__ import annotations

import argparse
import os
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

import yaml

TEMPLATE = Path(__file__).resolve().parents[1] / "recipes" / "slurm" / "train.sbatch"
# Exported into the job when set where the script is rendered (NCCL knobs a cluster's admins often ask for).
PASSED_ENV = ("NCCL_SOCKET_IFNAME", "NCCL_IB_HCA", "NCCL_DEBUG", "NCCL_NVLS_ENABLE", "HF_HOME", "K3LIT_DEBUG")


class LayoutError(ValueError):
    """The job layout (nodes, tasks per node) disagrees with the recipe's trainer or strategy."""


def _overrides(fit_args: list[str]) -> dict[str, Any]:
    """``--a.b=v`` / ``--a.b v`` pairs of the fit command line, values parsed as YAML."""
    out: dict[str, Any] = {}
    i = 0
    while i < len(fit_args):
        arg = fit_args[i]
        if arg.startswith("--") and "." in arg.split("=", 1)[0]:
            if "=" in arg:
                key, value = arg[2:].split("=", 1)
            elif i + 1 < len(fit_args) and not fit_args[i + 1].startswith("--"):
                key, value = arg[2:], fit_args[i + 1]
                i += 1
            else:
                key, value = arg[2:], "true"
            out[key] = yaml.safe_load(value)
        i += 1
    return out


def _strategy_sizes(strategy: Any) -> tuple[str, Any, Any] | None:
    """(class name, data_parallel_size, tensor_parallel_size) of a ModelParallelStrategy entry."""
    if isinstance(strategy, dict):
        name = str(strategy.get("class_path", ""))
        init = strategy.get("init_args") or {}
        if "data_parallel_size" in init or "tensor_parallel_size" in init or name.endswith("ParallelStrategy"):
            return name, init.get("data_parallel_size", "auto"), init.get("tensor_parallel_size", "auto")
    return None


def _check_expert_mesh(init: dict[str, Any], world: int, n_experts: int | None, layout: str) -> None:
    """An ExpertParallelStrategy's mesh against the job's process count and the model's expert count."""
    from k3lit.parallel.strategy import mesh_shape

    try:
        mesh_shape(world, int(init.get("data_parallel_replicate_size", 1)), int(init.get("data_parallel_size", -1)),
                   int(init.get("expert_parallel_size", 1)), n_experts=n_experts)
    except ValueError as e:
        raise LayoutError(f"{e} -- the job has {layout}") from None


def check_layout(
    trainer: dict[str, Any], nodes: int, tasks_per_node: int, n_experts: int | None = None
) -> list[str]:
    """Check the layout against the resolved ``trainer`` section; return the fit arguments that pin it.

    ``n_experts``: the recipe's ``model.n_experts``, checked against an ``ExpertParallelStrategy``'s
    ``expert_parallel_size`` (None: not checked).

    Raises:
        LayoutError: naming every factor when nodes, tasks per node, devices or mesh sizes disagree.
    """
    if nodes < 1 or tasks_per_node < 1:
        raise LayoutError(f"--nodes={nodes} and tasks per node={tasks_per_node} must both be >= 1")
    pins = []
    num_nodes = trainer.get("num_nodes")
    if num_nodes is not None and int(num_nodes) != nodes:
        raise LayoutError(f"the recipe trains on trainer.num_nodes={num_nodes} but the job asks for --nodes={nodes}: "
                          f"pass --nodes {num_nodes}, or override -- --trainer.num_nodes={nodes}")
    pins.append(f"--trainer.num_nodes={nodes}")
    devices = trainer.get("devices", "auto")
    if isinstance(devices, list):
        devices = len(devices)
    if isinstance(devices, str) and devices.lstrip("-").isdigit():
        devices = int(devices)
    if isinstance(devices, int) and devices != -1:
        if devices != tasks_per_node:
            raise LayoutError(f"the recipe uses trainer.devices={devices} per node but the job starts "
                              f"{tasks_per_node} tasks per node (srun runs one task per device): make them equal "
                              f"(--gpus_per_node/--tasks_per_node {devices}, or -- --trainer.devices={tasks_per_node})")
    pins.append(f"--trainer.devices={tasks_per_node}")
    strategy = trainer.get("strategy")
    if isinstance(strategy, str):  # --trainer.strategy=<class path or name>, default sizes
        strategy = {"class_path": strategy}
    if isinstance(strategy, dict) and str(strategy.get("class_path", "")).endswith("ExpertParallelStrategy"):
        layout = f"{nodes} nodes x {tasks_per_node} tasks = {nodes * tasks_per_node} processes"
        _check_expert_mesh(strategy.get("init_args") or {}, nodes * tasks_per_node, n_experts, layout)
        return pins
    sizes = _strategy_sizes(strategy)
    if sizes:
        name, dp, tp = sizes
        world = nodes * tasks_per_node
        if isinstance(dp, int) and isinstance(tp, int) and dp * tp != world:
            raise LayoutError(f"{name}: data_parallel_size={dp} x tensor_parallel_size={tp} = {dp * tp}, but the job "
                              f"has {nodes} nodes x {tasks_per_node} tasks = {world} processes")
        if isinstance(dp, int) != isinstance(tp, int):
            fixed = dp if isinstance(dp, int) else tp
            if world % fixed:
                raise LayoutError(f"{name}: {'data' if isinstance(dp, int) else 'tensor'}_parallel_size={fixed} does "
                                  f"not divide {nodes} nodes x {tasks_per_node} tasks = {world} processes")
    return pins


def render(
    config: str | Path,
    nodes: int | None = None,
    tasks_per_node: int | None = None,
    gpus: bool | None = None,
    cpus_per_task: int = 8,
    time: str = "24:00:00",
    partition: str | None = None,
    account: str | None = None,
    job_name: str | None = None,
    mem: str | None = None,
    output: str | None = None,
    sbatch: list[str] | None = None,
    fit_args: list[str] | None = None,
    python: str = sys.executable,
    workdir: str | Path | None = None,
    template: str | Path = TEMPLATE,
) -> str:
    """The sbatch script for ``config`` (see the module docstring); raises :class:`LayoutError` on a mismatch.

    ``gpus`` None: request one GPU per task unless the recipe's ``trainer.accelerator`` is ``cpu``.
    ``tasks_per_node`` None: the recipe's ``trainer.devices``. ``nodes`` None: ``trainer.num_nodes`` or 1.
    """
    config = Path(config).resolve()
    if not config.is_file():
        raise FileNotFoundError(f"recipe {config} not found")
    fit_args = list(fit_args or [])
    recipe = yaml.safe_load(config.read_text()) or {}
    trainer = dict(recipe.get("trainer") or {})
    n_experts = (recipe.get("model") or {}).get("n_experts")
    for key, value in _overrides(fit_args).items():
        if key.startswith("trainer.") and key.count(".") == 1:
            trainer[key.split(".", 1)[1]] = value
        elif key.startswith("trainer.strategy."):  # --trainer.strategy[.init_args].<size>=...
            strategy = trainer.get("strategy")
            strategy = dict(strategy) if isinstance(strategy, dict) else {"class_path": str(strategy)}
            strategy["init_args"] = {**(strategy.get("init_args") or {}), key.rsplit(".", 1)[1]: value}
            trainer["strategy"] = strategy
        elif key == "model.n_experts":
            n_experts = value
    nodes = int(trainer.get("num_nodes") or 1) if nodes is None else nodes
    if tasks_per_node is None:
        devices = trainer.get("devices")
        if not isinstance(devices, int) or devices < 1:
            raise LayoutError(f"the recipe has trainer.devices={devices!r}: pass --gpus_per_node or --tasks_per_node")
        tasks_per_node = devices
    pins = check_layout(trainer, nodes, tasks_per_node, n_experts if isinstance(n_experts, int) else None)
    if gpus is None:
        gpus = str(trainer.get("accelerator", "auto")) != "cpu"
    options = []
    if gpus:
        options.append(f"--gpus-per-node={tasks_per_node}")
    for flag, value in (("partition", partition), ("account", account), ("mem", mem)):
        if value:
            options.append(f"--{flag}={value}")
    options += list(sbatch or [])
    workdir = Path(workdir or Path.cwd()).resolve()
    env = [f"export {k}={shlex.quote(v)}" for k in PASSED_ENV if (v := os.environ.get(k))]
    given = {a.split("=", 1)[0] for a in fit_args}
    pins = [p for p in pins if p.split("=", 1)[0] not in given]  # the same value, already on the line
    command = [python, "-m", "k3lit.cli", "fit", "--config", str(config), *pins, *fit_args]
    values = {
        "recipe": str(config),
        "job_name": job_name or f"k3lit-{config.stem}",
        "nodes": str(nodes),
        "tasks_per_node": str(tasks_per_node),
        "cpus_per_task": str(cpus_per_task),
        "time": time,
        "workdir": str(workdir),
        "output": output or str(workdir / "slurm-%x-%j.out"),
        "sbatch_options": "\n".join(f"#SBATCH {o}" for o in options),
        "environment": "\n".join(env),
        "command": shlex.join(command),
    }
    text = Path(template).read_text()
    for key, value in values.items():
        text = text.replace("{{" + key + "}}", value)
    if "{{" in text:
        raise ValueError(f"template {template} has unknown placeholders: {text[text.index('{{'):][:40]!r}")
    return text


def check_fit_args(config: str | Path, fit_args: list[str]) -> None:
    """Parse ``k3lit fit --config config *fit_args`` here, as the job would on its nodes (``--print_config``: the
    arguments and the recipe are read, nothing is built), so that a misspelt argument fails now, not once the job
    has waited in the queue.

    Raises:
        ValueError: what ``k3lit fit`` says of the arguments (its last line).
    """
    out = subprocess.run([sys.executable, "-m", "k3lit.cli", "fit", "--config", str(config), *fit_args,
                          "--print_config"], capture_output=True, text=True)
    if out.returncode:
        said = [line.strip() for line in out.stderr.splitlines() if line.strip()]
        raise ValueError(f"`k3lit fit --config {config} {shlex.join(fit_args)}`, which the job would run, does not "
                         f"parse: {said[-1] if said else f'exit status {out.returncode}'}")


def slurm_main(argv: list[str]) -> None:
    """``k3lit slurm``: render an sbatch script from a recipe (and optionally submit it)."""
    fit_args: list[str] = []
    if "--" in argv:
        at = argv.index("--")
        argv, fit_args = argv[:at], argv[at + 1 :]
    p = argparse.ArgumentParser(prog="k3lit slurm", description=__doc__.split("\n\n")[0], allow_abbrev=False,
                                epilog="Arguments after -- go to `k3lit fit` (e.g. -- --trainer.max_steps=1000).")
    p.add_argument("--config", required=True, help="recipe YAML")
    p.add_argument("--nodes", type=int, help="nodes (default: the recipe's trainer.num_nodes, else 1)")
    layout = p.add_mutually_exclusive_group()
    layout.add_argument("--gpus_per_node", type=int, help="GPUs per node = tasks per node (requests the GPUs)")
    layout.add_argument("--tasks_per_node", type=int, help="tasks per node without requesting GPUs (CPU runs)")
    p.add_argument("--cpus_per_task", type=int, default=8)
    p.add_argument("--time", default="24:00:00", help="time limit, e.g. 2-00:00:00")
    p.add_argument("--partition")
    p.add_argument("--account")
    p.add_argument("--job_name")
    p.add_argument("--mem", help="memory per node, e.g. 0 (all) or 200G")
    p.add_argument("--output", help="job log; default <cwd>/slurm-<job name>-<job id>.out")
    p.add_argument("--sbatch", action="append", default=[], help="extra #SBATCH option, e.g. --sbatch=--qos=high")
    p.add_argument("--python", default=sys.executable, help="interpreter that runs k3lit on the nodes")
    p.add_argument("--template", default=str(TEMPLATE))
    p.add_argument("--out", help="write the script here instead of stdout")
    p.add_argument("--submit", action="store_true", help="write it (to --out or a temporary file) and sbatch it")
    a, unknown = p.parse_known_args(argv)
    if unknown:  # most often `k3lit fit` arguments written without the -- before them
        fit_like = any(x.startswith("--") and "." in x.split("=")[0] for x in unknown)  # --trainer.max_steps=...
        p.error(f"unrecognized arguments: {' '.join(unknown)}"
                + (f"; arguments for `k3lit fit` go after --: k3lit slurm ... -- {' '.join(unknown)}" if fit_like
                   else ""))
    if a.gpus_per_node is not None:
        tasks, gpus = a.gpus_per_node, True
    elif a.tasks_per_node is not None:
        tasks, gpus = a.tasks_per_node, False
    else:
        tasks, gpus = None, None
    try:
        text = render(a.config, a.nodes, tasks, gpus, a.cpus_per_task, a.time, a.partition, a.account,
                      a.job_name, a.mem, a.output, a.sbatch, fit_args, a.python, template=a.template)
    except LayoutError as e:
        raise ValueError(f"job layout: {e}") from None
    check_fit_args(a.config, fit_args)
    if not a.submit:
        if a.out:
            Path(a.out).write_text(text)
        else:
            sys.stdout.write(text)
        return
    import tempfile

    path = Path(a.out) if a.out else Path(tempfile.mkstemp(prefix="k3lit-", suffix=".sbatch")[1])
    path.write_text(text)
    out = subprocess.run(["sbatch", "--parsable", str(path)], capture_output=True, text=True)
    if out.returncode:
        raise ValueError(f"sbatch {path} failed: {out.stderr.strip()}")
    print(out.stdout.strip())
