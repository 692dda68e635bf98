"""What a `k3lit fit` run shows a person: progress in optimizer steps against what ends the run, a summary at the end,
the expert-load heatmap, and no third-party messages nobody can act on."""

import os
import re
import shlex
import subprocess
import sys
import time
from io import StringIO
from pathlib import Path

import pytest
from rich.console import Console

from k3lit.cli import K3CLI
from k3lit.train.flops import training_flops_per_token
from k3lit.train.progress import StepProgressBar
from k3lit.train.summary import SETUP_MARKS, RunSummary

ROOT = Path(__file__).parents[2]
TINY = [
    "--model.dim=32", "--model.n_layers=3", "--model.n_heads=2", "--model.head_dim=16", "--model.mlp_hidden=64",
    "--model.n_experts=4", "--model.top_k=2", "--model.expert_dim=32", "--data.tokenizer=byte", "--data.seq_len=32",
    "--data.batch_size=2", "--trainer.limit_val_batches=2", "--trainer.log_every_n_steps=2",
    "--trainer.enable_model_summary=false",
]
SUMMARY_FIELDS = ("steps", "tokens", "wall time", "set-up", "first step", "tokens/s", "MFU", "held-out bpb",
                  "same bytes", "MaxVio_global", "checkpoint", "plots", "metrics", "sample")


def fit_args(root: Path, cache: str, steps: int, every: int) -> list[str]:
    return ["fit", "--config", str(ROOT / "recipes" / "tiny.yaml"), *TINY, f"--data.cache_dir={cache}",
            f"--trainer.default_root_dir={root}", f"--trainer.max_steps={steps}",
            f"--trainer.val_check_interval={every}"]


def test_a_run_in_a_log_shows_steps_a_summary_and_no_third_party_noise(tmp_path, stdlib_cache):
    """The real command, stdout and stderr to a file (as a SLURM job's log)."""
    bin_dir = Path(sys.executable).parent  # the virtual environment's scripts, off PATH as after `make install`
    path = os.pathsep.join(p for p in os.environ.get("PATH", "").split(os.pathsep) if p and Path(p) != bin_dir)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "PATH": path}
    t0 = time.monotonic()
    out = subprocess.run([sys.executable, "-m", "k3lit.cli", *fit_args(tmp_path, stdlib_cache, 6, 3)], cwd=ROOT,
                         env=env, capture_output=True, text=True, timeout=300)
    process_s = time.monotonic() - t0
    log = out.stdout + out.stderr
    assert out.returncode == 0, log[-4000:]
    # progress: one line per log_every_n_steps optimizer steps, against max_steps (tiny's max_time is further off)
    steps = re.findall(r"^step (\d+)/6 · train/loss [\d.]+ .*· (\d+:\d\d:\d\d) left$", log, re.M)
    assert [s for s, _ in steps] == ["2", "4", "6"] and steps[-1][1] == "0:00:00"
    # the summary, with where the outputs are and how to sample
    block = log[log.index("k3lit fit: max_steps reached at step 6"):]
    fields = dict(re.findall(r"^  (\S[\w/ -]*?)\s{2,}(.+)$", block, re.M))
    assert all(f in fields for f in SUMMARY_FIELDS), fields
    assert fields["steps"] == "6" and fields["tokens"] == f"{6 * 2 * 32:,} (this run)"
    assert re.fullmatch(r"[\d.]+ s after training started \(compilation included\)", fields["first step"])
    setup = re.fullmatch(r"([\d.]+) s from the process's start to training's: (.+) s", fields["set-up"])
    assert setup and 0.5 < float(setup[1]) < process_s, (fields["set-up"], process_s)  # imports alone take > 0.5 s
    parts = [p.rsplit(" ", 1) for p in setup[2].split("; ")]
    assert [name for name, _ in parts] == list(SETUP_MARKS.values()), parts  # every mark, in the order they happen
    seconds = [float(x) for _, x in parts]
    assert seconds[0] > 0.5 and abs(sum(seconds) - float(setup[1])) <= 0.4, parts  # imports first; each to 0.1 s
    held = re.fullmatch(r"[\d.]+ \(val/bpb at step 6, over the ([\d,]+) bytes its targets encode\)",
                        fields["held-out bpb"])
    same = re.fullmatch(r"gzip -9 [\d.]+ · xz -9e [\d.]+ bits/byte on the text of the 4 validation blocks "
                        r"\(([\d,]+) bytes, each block's first token included\)", fields["same bytes"])
    # byte tokenizer: the 4 blocks of 33 tokens hold 4 x 33 bytes, of which the targets encode all but 4
    assert held and same and int(held[1].replace(",", "")) == int(same[1].replace(",", "")) - 4 == 4 * 32
    assert re.fullmatch(r"layer0 [\d.]+ · layer1 [\d.]+", fields["MaxVio_global"])  # tiny: 3 layers, 1 dense
    ckpt = tmp_path / "checkpoints" / "last.ckpt"
    # the commands name scripts a shell in the run's folder can start: beside the interpreter when not on PATH
    scripts = [bin_dir / name for name in ("k3lit", "tensorboard")]
    k3lit, tensorboard = (str(s.relative_to(ROOT) if s.is_relative_to(ROOT) else s) if s.is_file() else s.name
                          for s in scripts)
    assert fields["checkpoint"] == str(ckpt) and fields["sample"] == f"{k3lit} generate --ckpt {ckpt}"
    # the heatmap is on by default: a PNG per interval and at the end, the last one named in the summary
    pngs = sorted((tmp_path / "expert_load").glob("*.png"))
    assert [p.name for p in pngs] == ["step0000003.png", "step0000006.png"]
    assert fields["plots"].startswith(f"{pngs[-1]} · TensorBoard: {tensorboard} --logdir {tmp_path}")
    # nothing from Lightning or litdata that a user cannot act on
    for noise in ("litlogger", "Tip:", "IterableDataset` has `__len__`", "is deprecated", "DeprecationWarning",
                  "FutureWarning"):
        assert noise not in log, noise


def test_the_terminal_bar_counts_optimizer_steps_and_the_summary_is_a_table(tmp_path, stdlib_cache, monkeypatch):
    monkeypatch.chdir(ROOT)
    args = fit_args(tmp_path, stdlib_cache, 4, 2)[1:] + [
        "--trainer.accumulate_grad_batches=2", "--trainer.callbacks+=k3lit.train.progress.StepProgressBar",
        "--trainer.callbacks+=k3lit.train.callbacks.K3ThroughputMonitor", "--trainer.callbacks.available_flops=1e9",
        "--trainer.callbacks.window_size=2"]
    cli = K3CLI(args=args, run=False)
    bar = next(c for c in cli.trainer.callbacks if isinstance(c, StepProgressBar))
    summary = next(c for c in cli.trainer.callbacks if isinstance(c, RunSummary))
    screen = StringIO()
    bar.console = summary.console = Console(file=screen, force_terminal=True, width=220, color_system=None)
    summary.rich = True
    cli.trainer.fit(cli.model, cli.datamodule)
    text = screen.getvalue()
    frames = re.findall(r"train ━+\s+step (\d)/4 · (?:(\d+:\d\d:\d\d) left · )?loss", text)
    assert frames and frames[-1] == ("4", "0:00:00")  # optimizer steps (8 micro-batches), none left at the end
    assert {s for s, _ in frames} <= {"1", "2", "3", "4"}
    assert "k3lit fit: max_steps reached at step 4" in text
    assert all(f"{label} " in text for label, _ in summary.rows)
    assert [label for label, _ in summary.rows] == [*SUMMARY_FIELDS[:7], "recent rate", *SUMMARY_FIELDS[7:]]
    rows = dict(summary.rows)
    assert rows["tokens"] == f"{4 * 2 * 2 * 32:,} (this run)"  # 4 steps of 2 micro-batches of [2, 32]
    tokens_per_s = float(rows["tokens/s"].split()[0].replace(",", ""))
    mfu = re.fullmatch(r"([\d.]+)% \(of 0.001 TFLOP/s per device\)", rows["MFU"])  # the monitor's 1e9 FLOP/s
    flops_per_token = training_flops_per_token(cli.model.model_config, 32)
    assert mfu and float(mfu.group(1)) == pytest.approx(100 * tokens_per_s * flops_per_token / 1e9, rel=0.02, abs=0.06)
    recent = re.fullmatch(r"([\d,]+) tokens/s per device, MFU ([\d.]+)% \(the last 2 steps\)",
                          rows["recent rate"])
    assert recent, rows["recent rate"]
    recent_tps = float(recent.group(1).replace(",", ""))
    assert float(recent.group(2)) == pytest.approx(100 * recent_tps * flops_per_token / 1e9, rel=0.02, abs=0.06)


def test_process_age_counts_from_the_interpreter_start():
    """A child that sleeps 1 s before asking is at least 1 s old, and younger than its parent measured it."""
    code = "import time; time.sleep(1.0); from k3lit.train.summary import process_age_s; print(process_age_s())"
    t0 = time.monotonic()
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
                         capture_output=True, text=True, timeout=120, check=True)
    wall = time.monotonic() - t0
    assert 1.0 <= float(out.stdout) <= wall + 0.02, (out.stdout, wall)  # /proc's clock ticks: 10 ms


def test_a_run_without_validation_says_how_to_validate_its_checkpoint(tmp_path, stdlib_cache, monkeypatch):
    """The summary's command, run in the working folder (on one batch here, for time), validates the run's last
    checkpoint."""
    monkeypatch.chdir(ROOT)
    cli = K3CLI(args=fit_args(tmp_path, stdlib_cache, 2, 1) + ["--trainer.limit_val_batches=0"])
    row = dict(next(c for c in cli.trainer.callbacks if isinstance(c, RunSummary)).rows)["held-out bpb"]
    how = re.fullmatch(r"no validation ran: (\S+) (validate .*)", row)
    ckpt = tmp_path / "checkpoints" / "last.ckpt"
    # the run validated no batch (limit 0, saved in its config.yaml): the command reads the whole held-out split
    assert how and how[2] == (f"validate --config {tmp_path / 'config.yaml'} --ckpt_path {ckpt} "
                              "--trainer.limit_val_batches=1.0")
    out = subprocess.run([sys.executable, "-m", "k3lit.cli", *shlex.split(how[2]), "--trainer.limit_val_batches=1"],
                         cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"},
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and re.search(r"val/bpb\s.*\d", out.stdout + out.stderr), out.stderr[-3000:]


def test_set_up_parts_name_what_ran_between_the_recorded_marks():
    summary = RunSummary()  # used without the CLI: only Lightning's hooks record marks
    for mark, age in (("setup", 4.0), ("fit_start", 4.5), ("train_start", 6.25)):
        summary.record_age(mark, age)
    assert summary._setup_row() == (
        "6.2 s from the process's start to training's: interpreter start and imports, arguments and recipe, data "
        "module, trainer, model, the device and data preparation 4.0; the model onto its devices and the optimizer "
        "0.5; model summary and data loaders 1.8 s")
    with pytest.raises(ValueError, match="mark 'imports' is not one of imported, parsed, data"):
        summary.record_age("imports")
