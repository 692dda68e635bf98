"""FSDP2 (Lightning's ModelParallelStrategy, gloo on CPU) saves sharded checkpoints through torch distributed
checkpoint and resumes them on the same number of processes (exactly) and on a different one (2 -> 1).

ModelParallelStrategy needs no change for CPUs: Lightning picks gloo for CPU devices, ``configure_model`` shards
with FSDP2 on the ``data_parallel`` mesh axis, and a checkpoint is a folder (one ``.distcp`` shard per rank,
``.metadata``, and ``meta.pt`` with the loops, callbacks, data position and schedulers).
"""

import csv
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict

from k3lit.cli import K3CLI, main
from k3lit.data.tokenizer import ByteTokenizer
from k3lit.train.module import K3LitModule
from tests.parallel._dist import one_process_env

ROOT = Path(__file__).parents[1]
MODEL = [
    "--model.dim=64", "--model.n_layers=2", "--model.layer_pattern=KA", "--model.n_heads=2", "--model.head_dim=32",
    "--model.mlp_hidden=128", "--model.n_experts=4", "--model.top_k=2", "--model.expert_dim=64",
    "--model.attnres_block_size=2", "--optim.warmup_steps=2", "--optim.name=adamw",  # Adam moments checked below
]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("corpus")
    for i in range(20):
        (path / f"doc{i:02d}.txt").write_text(
            "\n".join(f"line {j} of document {i}: the sharded state must come back whole" for j in range(80)))
    return path


def _args(root: Path, corpus: Path, devices: int, steps: int) -> list[str]:
    return [
        "--config", str(ROOT / "recipes" / "tiny.yaml"), *MODEL, f"--data.corpus={corpus}",
        "--data.tokenizer=byte", "--data.seq_len=64", "--data.batch_size=4", f"--data.cache_dir={corpus}.cache",
        "--trainer.accelerator=cpu", f"--trainer.devices={devices}", "--trainer.strategy=ModelParallelStrategy",
        f"--trainer.strategy.data_parallel_size={devices}", "--trainer.strategy.tensor_parallel_size=1",
        f"--trainer.max_steps={steps}", "--trainer.limit_val_batches=0", "--trainer.enable_progress_bar=false",
        "--trainer.log_every_n_steps=1", f"--trainer.default_root_dir={root}",
        "--trainer.callbacks+=ModelCheckpoint", f"--trainer.callbacks.dirpath={root / 'checkpoints'}",
        "--trainer.callbacks.filename={step}", "--trainer.callbacks.every_n_train_steps=4",
        "--trainer.callbacks.save_top_k=-1", "--trainer.callbacks.save_last=true",
    ]


def _fit_two_processes(root: Path, corpus: Path, steps: int, *extra: str) -> None:
    """`k3lit fit` with 2 CPU devices: Lightning launches the second process itself."""
    out = subprocess.run([sys.executable, "-m", "k3lit.cli", "fit", *_args(root, corpus, 2, steps), *extra],
                         capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert out.returncode == 0, out.stderr[-4000:]


def _losses(root: Path) -> dict[int, float]:
    with open(root / "metrics.csv") as f:
        return {int(r["step"]): float(r["train/loss"]) for r in csv.DictReader(f) if r.get("train/loss")}


def _full(ckpt: Path, tmp: Path) -> dict:
    """A sharded checkpoint folder gathered into one plain dict (torch's own converter)."""
    assert ckpt.is_dir() and {p.name for p in ckpt.iterdir()} >= {".metadata", "__0_0.distcp", "__1_0.distcp",
                                                                    "meta.pt"}
    dcp_to_torch_save(ckpt, tmp / f"{ckpt.parent.parent.name}-{ckpt.name}.pt")
    return torch.load(tmp / f"{ckpt.parent.parent.name}-{ckpt.name}.pt", weights_only=False)


class Capture(Callback):
    """Keeps the full (unsharded) model and optimizer state as training starts, i.e. right after the restore."""

    def on_train_start(self, trainer, pl_module) -> None:
        opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
        # Copies: on one process the "full" tensors can alias the live parameters that training then updates.
        clone = lambda tree: torch.utils._pytree.tree_map_only(torch.Tensor, torch.clone, tree)
        self.model = clone(get_model_state_dict(pl_module, options=opts))
        self.optim = clone(get_optimizer_state_dict(pl_module, trainer.optimizers[0], options=opts))
        self.step = trainer.global_step


def _generate_matches_gathered_weights(folder: Path, saved: dict, capsys) -> None:
    """`k3lit generate --ckpt <sharded folder>` decodes what the gathered weights decode (greedy)."""
    main(["generate", "--ckpt", str(folder), "--prompt", "line 3 of", "--max_new_tokens", "12", "--temperature", "0"])
    text = capsys.readouterr().out.removesuffix("\n")
    hparams = torch.load(folder / "meta.pt", weights_only=False)["hyper_parameters"]
    module = K3LitModule(**{k: v for k, v in hparams.items() if not k.startswith("_")})
    module.load_state_dict(saved["state_dict"])
    ids = torch.tensor([list(b"line 3 of")])
    want = module.model.eval().generate(ids, 12, temperature=0)[0].tolist()
    assert text == ByteTokenizer().decode(want)


def _export_reads_the_gathered_weights_only(folder: Path, saved: dict, out: Path) -> None:
    """`k3lit export --ckpt <sharded folder>`: exactly the gathered weights (a tied LM head stored once), read
    without the optimizer states."""
    from safetensors.torch import load_file

    from k3lit.train.checkpoint import load_model_checkpoint

    loaded = load_model_checkpoint(folder)
    assert "optimizer_0" not in loaded and "optimizer_states" not in loaded
    assert loaded["state_dict"].keys() == saved["state_dict"].keys()
    main(["export", "--ckpt", str(folder), "--out", str(out)])
    exported = load_file(out / "model.safetensors")
    want = {k: v for k, v in saved["state_dict"].items() if k != "model.lm_head.weight"}  # tied: the embedding
    assert exported.keys() == want.keys()
    for name, t in want.items():
        assert torch.equal(exported[name], t), name


@pytest.mark.slow
def test_sharded_checkpoint_resumes_on_two_and_on_one_process(tmp_path, corpus, capsys, monkeypatch):
    whole, resumed = tmp_path / "whole", tmp_path / "resumed"
    _fit_two_processes(whole, corpus, 8)
    at4 = whole / "checkpoints" / "step=4.ckpt"
    saved = _full(at4, tmp_path)
    assert torch.load(at4 / "meta.pt", weights_only=False)["global_step"] == 4
    _generate_matches_gathered_weights(at4, saved, capsys)
    _export_reads_the_gathered_weights_only(at4, saved, tmp_path / "hf")

    # 2 -> 2: the same losses and the same final weights as the uninterrupted run.
    _fit_two_processes(resumed, corpus, 8, "--ckpt_path", str(at4))
    a, b = _losses(whole), _losses(resumed)
    assert sorted(b) == [4, 5, 6, 7]
    assert [a[s] for s in range(4, 8)] == [b[s] for s in range(4, 8)]
    end_a, end_b = _full(whole / "checkpoints" / "last.ckpt", tmp_path), _full(resumed / "checkpoints" / "last.ckpt",
                                                                               tmp_path)
    assert end_a["state_dict"].keys() == end_b["state_dict"].keys()
    for name, t in end_a["state_dict"].items():
        assert torch.equal(t, end_b["state_dict"][name]), name

    # 2 -> 1: one process gathers both shards; weights and Adam moments are exactly the saved ones.
    one_process_env(monkeypatch)
    cli = K3CLI(args=_args(tmp_path / "one", corpus, 1, 6), run=False)
    capture = Capture()
    cli.trainer.callbacks.append(capture)
    try:
        cli.trainer.fit(cli.model, cli.datamodule, ckpt_path=str(at4))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    assert capture.step == 4 and cli.trainer.global_step == 6
    assert capture.model.keys() == saved["state_dict"].keys()
    for name, t in saved["state_dict"].items():
        assert torch.equal(capture.model[name], t), name
    moments = saved["optimizer_0"]["state"]
    assert moments and moments.keys() == capture.optim["state"].keys()
    for name, state in moments.items():
        assert torch.equal(capture.optim["state"][name]["exp_avg"], state["exp_avg"]), name
        assert torch.equal(capture.optim["state"][name]["exp_avg_sq"], state["exp_avg_sq"]), name
    losses = _losses(tmp_path / "one")
    assert sorted(losses) == [4, 5] and all(torch.isfinite(torch.tensor(v)) for v in losses.values())


@pytest.mark.slow
def test_init_weights_from_a_sharded_checkpoint_on_two_processes_and_on_one(tmp_path, corpus, monkeypatch):
    """`fit --init_weights <sharded folder>`: under FSDP2 on 2 processes each rank keeps its shards of the saved
    weights, on one process the model holds them whole; both at step 0 (on 2 processes with no optimizer state yet),
    at twice the source's sequence length."""
    source = tmp_path / "source"
    _fit_two_processes(source, corpus, 2)
    folder = source / "checkpoints" / "last.ckpt"
    saved = _full(folder, tmp_path)["state_dict"]
    longer = ["--init_weights", str(folder), "--data.seq_len=128", "--data.batch_size=2"]

    two = tmp_path / "two"
    two.mkdir()
    _fit_two_processes(two, corpus, 2, *longer, "--trainer.callbacks+=tests.train.probes.StartWeights",
                       f"--trainer.callbacks.dirpath={two}")
    start = torch.load(two / "start.pt", weights_only=False)
    assert start["step"] == 0 and start["optimizer_entries"] == 0 and start["state_dict"].keys() == saved.keys()
    for name, t in saved.items():
        assert torch.equal(start["state_dict"][name], t), name
    assert sorted(_losses(two)) == [0, 1]

    one_process_env(monkeypatch)
    cli = K3CLI(args=[*_args(tmp_path / "one", corpus, 1, 1), *longer], run=False)
    capture = Capture()
    cli.trainer.callbacks.append(capture)
    try:
        cli.trainer.fit(cli.model, cli.datamodule)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    assert capture.step == 0 and capture.model.keys() == saved.keys()
    for name, t in saved.items():
        assert torch.equal(capture.model[name], t), name
