"""Every recipe trains through `k3lit fit` on the built-in corpus, narrowed to a tiny model on one CPU process, with
epochs shorter than the validation interval: validation, last.ckpt and the load heatmap come every N optimizer steps
of the whole run, whatever an epoch's length."""

import csv
import json
from pathlib import Path

import pytest
import torch
import yaml

from k3lit.cli import main

ROOT = Path(__file__).parents[2]
RECIPES = sorted((ROOT / "recipes").glob("*.yaml"))

# Width, depth, experts, data and devices shrink; the rest of each recipe (layer pattern, balancer, residual rule,
# activation checkpointing, precision, clipping, its trainer section) stays.
NARROW = [
    "--model.dim=32", "--model.n_layers=4", "--model.n_heads=2", "--model.head_dim=16", "--model.mlp_hidden=64",
    "--data.corpus=stdlib", "--data.tokenizer=byte",
    "--data.val_fraction=0.05", "--data.seq_len=32", "--data.batch_size=2", "--data.num_workers=0",
    "--trainer.accelerator=cpu", "--trainer.devices=1", "--trainer.num_nodes=1", "--trainer.strategy=auto",
    "--trainer.limit_val_batches=2", "--trainer.log_every_n_steps=1", "--trainer.enable_model_summary=false",
]
MOE = ["--model.n_experts=4", "--model.top_k=2", "--model.expert_dim=32"]  # MoE recipes only
STEPS, EVERY, EPOCH = 5, 2, 3  # an epoch of 3 batches is shorter than the interval's multiples 4 and 6


def fit(recipe: Path, root: Path, cache: str, *extra: str) -> None:
    main(["fit", "--config", str(recipe), *NARROW, f"--data.cache_dir={cache}", f"--trainer.default_root_dir={root}",
          f"--trainer.max_steps={STEPS}", f"--trainer.val_check_interval={EVERY}",
          f"--trainer.limit_train_batches={EPOCH}", "--trainer.callbacks+=tests.train.probes.CheckpointSteps",
          f"--trainer.callbacks.dirpath={root}", *extra])


def logged_steps(root: Path, name: str) -> list[int]:
    """Optimizer steps done when ``name`` was logged (metrics.csv counts from 0: its step s is after s + 1 steps)."""
    with open(root / "metrics.csv") as f:
        return sorted(int(r["step"]) + 1 for r in csv.DictReader(f) if r.get(name))


@pytest.mark.parametrize("recipe", RECIPES, ids=[r.stem for r in RECIPES])
def test_every_recipe_validates_and_checkpoints_every_n_steps(recipe, tmp_path, stdlib_cache):
    trainer = yaml.safe_load(recipe.read_text())["trainer"]
    assert isinstance(trainer["val_check_interval"], int) and "check_val_every_n_epoch" in trainer
    assert trainer["check_val_every_n_epoch"] is None  # step-based in the recipe itself, not only through the CLI
    moe = yaml.safe_load(recipe.read_text())["model"].get("n_experts", 0) > 0
    fit(recipe, tmp_path, stdlib_cache, *(MOE if moe else []))
    assert logged_steps(tmp_path, "val/loss") == [2, 4]  # across the epoch boundary after batch 3
    assert json.loads((tmp_path / "checkpoint_steps.json").read_text()) == [2, 4]  # last.ckpt during training
    assert torch.load(tmp_path / "checkpoints" / "last.ckpt", weights_only=False)["global_step"] == STEPS
    pngs = sorted(p.name for p in (tmp_path / "expert_load").glob("*.png"))
    assert pngs == (["step0000002.png", "step0000004.png", "step0000005.png"] if moe else [])  # every MoE recipe


def test_interval_counts_optimizer_steps_under_gradient_accumulation(tmp_path, stdlib_cache):
    fit(ROOT / "recipes" / "tiny.yaml", tmp_path, stdlib_cache, *MOE, "--trainer.accumulate_grad_batches=2",
        "--trainer.limit_train_batches=4")
    assert logged_steps(tmp_path, "val/loss") == [2, 4]
    assert json.loads((tmp_path / "checkpoint_steps.json").read_text()) == [2, 4]


def test_fraction_of_an_epoch_keeps_its_per_epoch_meaning(tmp_path, stdlib_cache):
    fit(ROOT / "recipes" / "tiny.yaml", tmp_path, stdlib_cache, *MOE, "--trainer.val_check_interval=0.5",
        "--trainer.limit_train_batches=4", "--trainer.max_steps=4")
    assert logged_steps(tmp_path, "val/loss") == [2, 4]


def test_per_epoch_validation_longer_than_an_epoch_is_a_clear_error(tmp_path, stdlib_cache, capsys):
    with pytest.raises(SystemExit) as e:
        fit(ROOT / "recipes" / "tiny.yaml", tmp_path, stdlib_cache, *MOE, "--trainer.check_val_every_n_epoch=1",
            "--trainer.val_check_interval=4")
    err = capsys.readouterr().err
    assert e.value.code == 2
    assert "k3lit: error:" in err and "val_check_interval` (4)" in err and "check_val_every_n_epoch=None" in err
