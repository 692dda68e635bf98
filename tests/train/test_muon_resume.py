"""`k3lit fit --optim.name=muon` resumed from its checkpoint trains on exactly as the run without a break."""

from pathlib import Path

import pytest
import torch
from lightning.pytorch.callbacks import Callback

from k3lit.cli import K3CLI, main

SMALL = [
    "--model.dim=64", "--model.n_layers=2", "--model.layer_pattern=KA", "--model.n_heads=2", "--model.head_dim=32",
    "--model.mlp_hidden=128", "--model.n_experts=4", "--model.top_k=2", "--model.expert_dim=64",
    "--model.attnres_block_size=2", "--data.tokenizer=byte", "--data.seq_len=32", "--data.batch_size=4",
    "--trainer.limit_val_batches=1", "--trainer.log_every_n_steps=1", "--trainer.enable_progress_bar=false",
    "--optim.warmup_steps=2", "--optim.lr=3e-3", "--optim.name=muon",
]


class _CrashAt(Callback):
    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_start(self, trainer, *args) -> None:  # noqa: ANN001
        if trainer.global_step == self.step:
            raise KeyboardInterrupt


def _args(root: Path, cache: str) -> list[str]:
    return ["fit", "--config", "recipes/tiny.yaml", *SMALL, f"--data.cache_dir={cache}",
            f"--trainer.default_root_dir={root}", "--trainer.max_steps=6", "--trainer.val_check_interval=6",
            "--trainer.callbacks+=ModelCheckpoint", "--trainer.callbacks.every_n_train_steps=3",
            "--trainer.callbacks.save_last=true", "--trainer.callbacks.save_top_k=0",
            f"--trainer.callbacks.dirpath={root / 'checkpoints'}"]


def test_muon_run_resumes_exactly(tmp_path, stdlib_cache, monkeypatch):
    monkeypatch.chdir(Path(__file__).parents[2])
    whole, parts = tmp_path / "whole", tmp_path / "parts"
    main(_args(whole, stdlib_cache))
    cli = K3CLI(args=_args(parts, stdlib_cache)[1:], run=False)
    cli.trainer.callbacks.append(_CrashAt(4))
    with pytest.raises(SystemExit):
        cli.trainer.fit(cli.model, cli.datamodule)
    at3 = torch.load(parts / "checkpoints" / "last.ckpt", weights_only=False)
    assert at3["global_step"] == 3
    assert any("momentum_buffer" in s for s in at3["optimizer_states"][0]["state"].values())  # Muon's state saved
    main(_args(parts, stdlib_cache) + ["--ckpt_path", "last"])
    a = torch.load(whole / "checkpoints" / "last.ckpt", weights_only=False)
    b = torch.load(parts / "checkpoints" / "last.ckpt", weights_only=False)
    assert a["global_step"] == b["global_step"] == 6
    for name, tensor in a["state_dict"].items():
        assert torch.equal(tensor, b["state_dict"][name]), name
    opt_a, opt_b = a["optimizer_states"][0]["state"], b["optimizer_states"][0]["state"]
    assert opt_a.keys() == opt_b.keys()
    for i, state in opt_a.items():
        for key, value in state.items():
            assert torch.equal(value, opt_b[i][key]), (i, key)
