"""`k3lit slurm` on a real SLURM controller: a 2-task CPU job (gloo) trains; a requeued job resumes exactly.

The job tests need munged, slurmctld and slurmd (`recipes/slurm/localhost.sh up`, which `.ci/run` does);
they skip, saying so, only when no controller answers. The layout checks need nothing.
"""

import csv
import os
import random
import re
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from k3lit.cli import main
from k3lit.slurm import LayoutError, render

ROOT = Path(__file__).parents[1]
TINY = ROOT / "recipes" / "tiny.yaml"


def _controller_up() -> bool:
    if not shutil.which("sbatch"):
        return False
    return subprocess.run(["scontrol", "ping"], capture_output=True, timeout=20).returncode == 0


needs_slurm = pytest.mark.skipif(
    not _controller_up(), reason="no slurmctld answers `scontrol ping` (start one: recipes/slurm/localhost.sh up)")


# --- layout checks: before anything is written or submitted -------------------------------------------------------

@pytest.mark.parametrize("kwargs,fit_args,message", [
    ({"nodes": 2, "tasks_per_node": 1}, ["--trainer.num_nodes=4"],
     "trainer.num_nodes=4 but the job asks for --nodes=2"),
    ({"tasks_per_node": 2}, [], "trainer.devices=1 per node but the job starts 2 tasks per node"),
    ({"nodes": 1, "tasks_per_node": 4}, ["--trainer.devices=8"], "trainer.devices=8 per node"),
    ({"tasks_per_node": 0}, [], "must both be >= 1"),
])
def test_mismatched_layout_is_refused_with_every_factor(kwargs, fit_args, message):
    with pytest.raises(LayoutError, match=re.escape(message)):
        render(TINY, fit_args=fit_args, **kwargs)


def test_mismatched_mesh_is_refused(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text(TINY.read_text().replace(
        "  devices: 1\n",
        "  devices: 4\n  strategy:\n    class_path: lightning.pytorch.strategies.ModelParallelStrategy\n"
        "    init_args: {data_parallel_size: 3, tensor_parallel_size: 1}\n"))
    message = r"data_parallel_size=3 x tensor_parallel_size=1 = 3, .* 2 nodes x 4 tasks = 8"
    with pytest.raises(LayoutError, match=message):
        render(recipe, nodes=2, fit_args=["--trainer.num_nodes=2"])


def test_cli_reports_layout_error_before_anything_starts(capsys):
    with pytest.raises(SystemExit) as e:
        main(["slurm", "--config", str(TINY), "--tasks_per_node", "2", "--submit"])
    assert e.value.code == 2
    assert "job layout" in capsys.readouterr().err


def test_fit_arguments_without_the_separator_are_named_with_where_they_go(capsys):
    with pytest.raises(SystemExit) as e:
        main(["slurm", "--config", str(TINY), "--trainer.max_steps=100"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and ("unrecognized arguments: --trainer.max_steps=100; arguments for `k3lit fit` go "
                                  "after --: k3lit slurm ... -- --trainer.max_steps=100") in err, err


def test_a_misspelt_fit_argument_fails_before_the_job_is_written(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        main(["slurm", "--config", str(TINY), "--out", str(tmp_path / "job.sbatch"), "--", "--trainer.max_stepz=5"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and (f"`k3lit fit --config {TINY} --trainer.max_stepz=5`, which the job would run, does "
                                  "not parse: --trainer.max_stepz: did you mean --trainer.max_steps") in err, err
    assert not (tmp_path / "job.sbatch").exists()


def test_rendered_script_has_the_launch_contract():
    text = render(TINY, nodes=2, tasks_per_node=4, gpus=True, partition="gpu", account="proj", time="1:00:00",
                  fit_args=["--trainer.devices=4", "--trainer.num_nodes=2", "--trainer.accelerator=gpu"])
    for line in ["#SBATCH --nodes=2", "#SBATCH --ntasks-per-node=4", "#SBATCH --gpus-per-node=4",
                 "#SBATCH --signal=SIGUSR1@90", "#SBATCH --requeue", "#SBATCH --partition=gpu",
                 "#SBATCH --account=proj", "#SBATCH --time=1:00:00"]:
        assert line in text.splitlines(), line
    srun = next(line for line in text.splitlines() if line.startswith("srun "))
    assert srun.endswith("--ckpt_path last") and "--trainer.devices=4" in srun and "--trainer.num_nodes=2" in srun
    assert subprocess.run(["bash", "-n"], input=text, text=True).returncode == 0


def test_multinode_recipe_renders_hsdp_expert_parallel_job():
    """4 nodes x 8 tasks = the 32 ranks of the recipe's replicate 4 x data parallel 1 x expert parallel 8 mesh."""
    multinode = ROOT / "recipes" / "multinode.yaml"
    text = render(multinode, gpus=True, partition="gpu", time="72:00:00")  # nodes and tasks from the recipe
    lines = text.splitlines()
    for line in ["#SBATCH --nodes=4", "#SBATCH --ntasks-per-node=8", "#SBATCH --gpus-per-node=8"]:
        assert line in lines, line
    srun = next(line for line in lines if line.startswith("srun "))
    assert "--trainer.num_nodes=4" in srun and "--trainer.devices=8" in srun
    assert subprocess.run(["bash", "-n"], input=text, text=True).returncode == 0
    # pairs of nodes share a replica: data_parallel fills to 2
    render(multinode, fit_args=["--trainer.strategy.data_parallel_replicate_size=2"])
    with pytest.raises(LayoutError, match=r"data_parallel_replicate_size=4 x expert_parallel_size=8 = 32 does not "
                                          r"divide world_size=16 .* 2 nodes x 8 tasks = 16 processes"):
        render(multinode, nodes=2, fit_args=["--trainer.num_nodes=2"])
    with pytest.raises(LayoutError, match=r"expert_parallel_size=8 does not divide n_experts=12"):
        render(multinode, fit_args=["--model.n_experts=12"])
    with pytest.raises(LayoutError, match=r"expert_parallel_size=3 = 12 does not divide world_size=32"):
        render(multinode, fit_args=["--trainer.strategy.init_args.expert_parallel_size=3"])


# --- real jobs --------------------------------------------------------------------------------------------------------

def _corpus(path: Path) -> Path:
    rng = random.Random(0)
    words = "the model trains on tokens and the loss falls as the steps go by while experts share the load".split()
    path.mkdir()
    for i in range(40):
        (path / f"doc{i:02d}.txt").write_text("\n".join(" ".join(rng.choice(words) for _ in range(12))
                                                        for _ in range(60)))
    return path


def _fit_args(tmp: Path, run: str, steps: int) -> list[str]:
    return [
        "--trainer.accelerator=cpu", "--trainer.devices=2", "--trainer.strategy=ddp",
        "--model.dim=64", "--model.n_layers=2", "--model.layer_pattern=KA", "--model.n_heads=2",
        "--model.head_dim=32", "--model.mlp_hidden=128", "--model.n_experts=4", "--model.top_k=2",
        "--model.expert_dim=64", "--model.attnres_block_size=2", "--optim.warmup_steps=2",
        f"--data.corpus={tmp / 'corpus'}", "--data.tokenizer=byte", "--data.seq_len=64", "--data.batch_size=4",
        f"--data.cache_dir={tmp / 'cache'}", f"--trainer.max_steps={steps}", "--trainer.limit_val_batches=0",
        "--trainer.enable_progress_bar=false", "--trainer.log_every_n_steps=1",
        f"--trainer.default_root_dir={tmp / run}",
    ]


def _submit(tmp: Path, run: str, steps: int) -> str:
    script = tmp / f"{run}.sbatch"
    script.write_text(render(TINY, tasks_per_node=2, gpus=False, cpus_per_task=1, time="10:00",
                             job_name=f"k3lit-test-{run}", output=str(tmp / f"{run}.out"),
                             fit_args=_fit_args(tmp, run, steps), workdir=ROOT))
    out = subprocess.run(["sbatch", "--parsable", str(script)], capture_output=True, text=True, check=True)
    return out.stdout.strip().split(";")[0]


def _job(job: str) -> dict[str, str]:
    out = subprocess.run(["scontrol", "show", "job", job], capture_output=True, text=True).stdout
    return dict(re.findall(r"(\w+)=(\S+)", out))


def _wait(what, predicate, timeout: float, log: Path) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if predicate():
            return
        time.sleep(0.25)
    tail = log.read_text()[-3000:] if log.exists() else "(no job output)"
    pytest.fail(f"timed out after {timeout:.0f} s waiting for {what}; job output:\n{tail}")


def _finished(job: str, log: Path) -> dict[str, str]:
    _wait(f"job {job} to finish", lambda: _job(job).get("JobState") in ("COMPLETED", "FAILED", "CANCELLED",
                                                                         "TIMEOUT", "NODE_FAIL"), 240, log)
    info = _job(job)
    assert (info["JobState"], info["ExitCode"]) == ("COMPLETED", "0:0"), log.read_text()[-3000:]
    return info


def _requeued_and_gone(job: str) -> bool:
    """The job is requeued (pending, restart 1, held to its BeginTime) and no process of its first run is left on
    the node (`scontrol listpids` fails once the job has none there)."""
    info = _job(job)
    if (info.get("JobState"), info.get("Restarts"), info.get("Reason")) != ("PENDING", "1", "BeginTime"):
        return False
    return subprocess.run(["scontrol", "listpids", job], capture_output=True).returncode != 0


def _losses(metrics: Path) -> dict[int, float]:
    with open(metrics) as f:
        return {int(r["step"]): float(r["train/loss"]) for r in csv.DictReader(f) if r.get("train/loss")}


@pytest.fixture
def jobs():
    submitted: list[str] = []
    yield submitted
    for job in submitted:  # leave nothing queued if a test fails half-way
        subprocess.run(["scancel", job], capture_output=True)


@needs_slurm
def test_two_task_cpu_job_trains(tmp_path, jobs):
    _corpus(tmp_path / "corpus")
    script = tmp_path / "job.sbatch"
    # The submitting shell carries a MASTER_PORT that is in use (as after another torch.distributed job in
    # it): sbatch exports the environment, and the job must still take its rendezvous from SLURM.
    busy = socket.socket()
    busy.bind(("", 0))
    busy.listen()
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(busy.getsockname()[1])}
    out = subprocess.run(
        [sys.executable, "-m", "k3lit.cli", "slurm", "--config", str(TINY), "--tasks_per_node", "2",
         "--cpus_per_task", "1", "--time", "10:00", "--job_name", "k3lit-test-fit", "--output",
         str(tmp_path / "job.out"), "--out", str(script), "--submit", "--", *_fit_args(tmp_path, "run", 20)],
        capture_output=True, text=True, cwd=ROOT, env=env)
    assert out.returncode == 0, out.stderr
    job = out.stdout.strip()
    jobs.append(job)
    info = _finished(job, tmp_path / "job.out")
    assert info["NumTasks"] == "2"
    log = (tmp_path / "job.out").read_text()
    assert "MEMBER: 1/2" in log and "MEMBER: 2/2" in log and "distributed_backend=gloo" in log
    ckpt = torch.load(tmp_path / "run" / "checkpoints" / "last.ckpt", weights_only=False, map_location="cpu")
    assert ckpt["global_step"] == 20
    loss = _losses(tmp_path / "run" / "metrics.csv")
    assert sorted(loss) == list(range(20))
    assert loss[19] < loss[0] - 0.5


@needs_slurm
def test_requeue_signal_resumes_to_the_same_losses(tmp_path, jobs):
    """USR1 mid-run (what `--signal=SIGUSR1@90` sends) -> checkpoint at a step boundary, `scontrol requeue`,
    the job restarts under the same id, resumes from last.ckpt and ends at max_steps with the losses of an
    uninterrupted job."""
    steps = 150
    _corpus(tmp_path / "corpus")
    ref = _submit(tmp_path, "ref", steps)
    jobs.append(ref)
    _finished(ref, tmp_path / "ref.out")  # the two-task jobs fill the node, so run them one after another

    job = _submit(tmp_path, "cut", steps)
    jobs.append(job)
    log = tmp_path / "cut.out"
    _wait("training to start", lambda: log.exists() and "will checkpoint at the next step" in log.read_text(), 180, log)
    time.sleep(2)  # a few steps in
    subprocess.run(["scancel", "--signal=USR1", job], check=True)
    _wait("the requeue", lambda: _requeued_and_gone(job), 120, log)
    first_run = _losses(tmp_path / "cut" / "metrics.csv")  # the resumed run appends to this file
    # SLURM holds a requeued job back for about two minutes (BeginTime); release it now. Not within the second
    # of the requeue: slurmd revoked the first run's credential at a one-second resolution and refuses to launch
    # the job again in that second ("Job credential revoked"), which fails the job.
    time.sleep(2)
    subprocess.run(["scontrol", "update", f"JobId={job}", "StartTime=now"], check=True)
    _finished(job, log)

    text = log.read_text()
    cut = int(re.search(r"saved \S+ at step (\d+); requeueing job", text).group(1))
    assert 0 < cut < steps, text[-3000:]
    assert f"job {job} restart 1" in text
    assert f"Restoring states from the checkpoint path at {tmp_path / 'cut' / 'checkpoints' / 'last.ckpt'}" in text
    assert [p.name for p in (tmp_path / "cut" / "checkpoints").iterdir()] == ["last.ckpt"]
    resumed = _losses(tmp_path / "cut" / "metrics.csv")
    reference = _losses(tmp_path / "ref" / "metrics.csv")
    assert sorted(reference) == list(range(steps))
    assert set(first_run) >= set(range(cut)) and sorted(resumed) == list(range(steps))
    assert [first_run[s] for s in range(cut)] == [reference[s] for s in range(cut)]
    assert [resumed[s] for s in range(cut, steps)] == [reference[s] for s in range(cut, steps)]
    a = torch.load(tmp_path / "ref" / "checkpoints" / "last.ckpt", weights_only=False, map_location="cpu")
    b = torch.load(tmp_path / "cut" / "checkpoints" / "last.ckpt", weights_only=False, map_location="cpu")
    assert a["global_step"] == b["global_step"] == steps
    for name, tensor in a["state_dict"].items():
        assert torch.equal(tensor, b["state_dict"][name]), name
