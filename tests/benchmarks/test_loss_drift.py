"""benchmarks/loss_drift.py on CPU: an unchanged model drifts by exactly nothing; a changed one drifts."""

from __future__ import annotations

import subprocess

import yaml

from benchmarks.loss_drift import ROOT, drift, fit_losses, gap, parser, table, worktree


def _recipe(path) -> str:
    model = dict(dim=32, n_layers=2, layer_pattern="KA", n_heads=2, head_dim=16, mlp_hidden=64, n_experts=4,
                 top_k=2, expert_dim=16)
    data = dict(corpus="stdlib", tokenizer="byte", seq_len=32, batch_size=2, val_fraction=0.05)
    trainer = dict(accelerator="cpu", devices=1, enable_model_summary=False)
    path.write_text(yaml.safe_dump({"model": model, "optim": {"warmup_steps": 2}, "data": data, "trainer": trainer,
                                    "compile": False}))
    return str(path)


def test_the_same_tree_drifts_by_nothing_and_a_changed_model_drifts(tmp_path):
    recipe = _recipe(tmp_path / "r.yaml")
    a = parser().parse_args(["--base_tree", str(ROOT), "--recipe", recipe, "--steps", "4", "--out",
                             str(tmp_path / "runs")])
    result = drift(a)
    assert result["drift"] == {"steps": 4, "max": 0.0, "mean": 0.0}
    assert result["noise"] == {"steps": 4, "max": 0.0, "mean": 0.0}
    assert "Drift: none, every step's loss is the same." in table(result)
    # a changed model (another learning rate) against this tree's run drifts
    a.fit_args = ["--optim.lr=0.05"]
    changed = fit_losses(ROOT, "this-lr", a, tmp_path / "runs")
    moved = gap(result["losses"]["this"], changed)
    assert moved["steps"] == 4 and moved["max"] > 0


def test_a_worktree_of_head_holds_the_package_and_is_removed():
    with worktree("HEAD") as tree:
        assert (tree / "k3lit" / "__init__.py").exists()
        listed = subprocess.run(["git", "worktree", "list"], cwd=ROOT, capture_output=True, text=True).stdout
        assert str(tree) in listed
    assert not tree.exists()
    assert str(tree) not in subprocess.run(["git", "worktree", "list"], cwd=ROOT, capture_output=True,
                                           text=True).stdout
