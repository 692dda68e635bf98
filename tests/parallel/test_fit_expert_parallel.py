"""`k3lit fit` with ExpertParallelStrategy on 4 CPU processes (gloo), hybrid sharding (2 replicas) x expert
parallelism 2: builds the model on the meta device and materialises each rank's shards, trains, writes a
torch-distributed checkpoint and heatmaps, feeds each rank (replicas too) its own samples, resumes on 1
process (DTensor resharding) and starts a new expert-parallel run from its weights (``--init_weights``)."""

from __future__ import annotations

import csv
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from k3lit.parallel import ExpertParallelStrategy, mesh_shape

ROOT = Path(__file__).parents[2]
SMALL = [
    "--model.dim=64", "--model.n_layers=3", "--model.layer_pattern=KKA", "--model.n_heads=2", "--model.head_dim=32",
    "--model.mlp_hidden=128", "--model.n_experts=4", "--model.top_k=2", "--model.expert_dim=64",
    "--model.attnres_block_size=2", "--model.balancer=quantile_hist", "--data.tokenizer=byte", "--data.seq_len=64",
    "--data.batch_size=4", "--trainer.limit_val_batches=2", "--trainer.log_every_n_steps=1",
    "--trainer.enable_progress_bar=false", "--trainer.enable_model_summary=false", "--optim.warmup_steps=2",
    # AdamW: the loss thresholds below are AdamW's first steps (Muon under EP: tests/parallel/test_muon_parallel.py)
    "--optim.lr=3e-3", "--optim.name=adamw", "--trainer.strategy=k3lit.parallel.ExpertParallelStrategy",
]


def fit(root: Path, cache: Path, steps: int, devices: int, ep: int, *extra: str) -> str:
    """Run `k3lit fit` in a subprocess (Lightning starts the other ranks); return its stdout and stderr."""
    cmd = [sys.executable, "-m", "k3lit.cli", "fit", "--config", "recipes/tiny.yaml", *SMALL,
           f"--data.cache_dir={cache}", f"--trainer.default_root_dir={root}", f"--trainer.max_steps={steps}",
           f"--trainer.val_check_interval={steps}", f"--trainer.devices={devices}",
           f"--trainer.strategy.expert_parallel_size={ep}", *extra]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "MASTER_PORT": str(_port())}
    out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stderr[-4000:]
    return out.stdout + out.stderr


def _port() -> int:
    from tests.parallel._dist import free_port

    return free_port()


def metric(root: Path, name: str) -> dict[int, float]:
    with open(root / "metrics.csv") as f:
        return {int(r["step"]): float(r[name]) for r in csv.DictReader(f) if r.get(name)}


def test_fit_hsdp_checkpoint_resume_on_1_process(tmp_path):
    cache, first = tmp_path / "cache", tmp_path / "first"
    log = fit(first, cache, 4, 4, 2, "--trainer.strategy.data_parallel_replicate_size=2",
        "--trainer.callbacks+=tests.parallel._dist.RecordBatches",
        f"--trainer.callbacks.dirpath={tmp_path}", "--trainer.callbacks+=k3lit.train.expert_plots.ExpertLoadPlots",
        "--trainer.callbacks.every_n_steps=2", "--trainer.callbacks+=tests.parallel._dist.RecordInit",
        f"--trainer.callbacks.dirpath={tmp_path}")
    assert "device mesh data_parallel_replicate=2 x data_parallel=1 x expert_parallel=2 (HSDP" in log
    loss = metric(first, "train/loss")
    assert sorted(loss) == [0, 1, 2, 3] and all(v == v for v in loss.values())
    # built on the meta device; each rank then materialised only its shards (about half the model: a shard group
    # is 2 ranks), and the two replicas together hold every element twice
    inits = [torch.load(tmp_path / f"init.{r}.pt") for r in range(4)]
    sizes = [(i["meta_at_setup"], i["local_numel"], i["numel"]) for i in inits]
    assert all(i["meta_at_setup"] and i["local_numel"] < 0.6 * i["numel"] for i in inits), sizes
    assert sum(i["local_numel"] for i in inits) == 2 * inits[0]["numel"], sizes
    for a, b in ((0, 2), (1, 3)):  # ranks a and b: the same shards of the two replicas, initialised alike
        assert all(torch.equal(t, inits[b]["shards"][name]) for name, t in inits[a]["shards"].items())
    assert metric(first, "train/max_vio/layer0") and metric(first, "val/max_vio/layer1")
    assert sorted(p.name for p in (first / "expert_load").glob("*.png")) == ["step0000002.png", "step0000004.png"]
    ckpt = first / "checkpoints" / "last.ckpt"
    assert ckpt.is_dir() and len(list(ckpt.glob("*.distcp"))) == 4  # one shard file per rank
    # litdata under the strategy: no two ranks (replicas included) read the same sample
    rows = [{tuple(r.tolist()) for b in torch.load(tmp_path / f"batches.{r}.pt") for r in b} for r in range(4)]
    assert all(len(r) == 16 for r in rows) and len(set().union(*rows)) == 64

    root = tmp_path / "resumed"  # 4 -> 1 process: every shard is read back into one (DTensor resharding)
    fit(root, cache, 6, 1, 1, f"--ckpt_path={ckpt}")
    resumed = metric(root, "train/loss")
    assert sorted(resumed) == [4, 5], resumed
    # the trained weights were loaded: far below the first loss of the fresh model (about ln 256 = 5.5)
    assert resumed[4] < loss[0] - 0.3, (loss, resumed)

    # a new run from those weights on 2 processes, experts split over them (expert parallelism 2): each rank holds
    # its experts' and its FSDP shards of exactly the saved tensors, at step 0
    init = tmp_path / "init"
    init.mkdir()
    fit(init, cache, 1, 2, 2, f"--init_weights={ckpt}", "--trainer.callbacks+=tests.train.probes.StartWeights",
        f"--trainer.callbacks.dirpath={init}")
    dcp_to_torch_save(ckpt, tmp_path / "saved.pt")
    saved = torch.load(tmp_path / "saved.pt", weights_only=False)["state_dict"]
    start = torch.load(init / "start.pt", weights_only=False)
    assert start["step"] == 0 and start["optimizer_entries"] == 0 and start["state_dict"].keys() == saved.keys()
    for name, t in saved.items():
        assert torch.equal(start["state_dict"][name], t), name


def test_mesh_errors_print_every_factor():
    assert mesh_shape(8, 1, -1, 2) == (1, 4, 2) and mesh_shape(8, 1, 2, -1) == (1, 2, 4)
    assert mesh_shape(32, 4, -1, 8, n_experts=128) == (4, 1, 8) and mesh_shape(8, -1, 2, 2) == (2, 2, 2)
    with pytest.raises(ValueError, match=r"expert_parallel_size=3 = 3 does not divide world_size=8.*data_parallel_si"):
        mesh_shape(8, 1, -1, 3)
    with pytest.raises(ValueError, match=r"1 x 2 x 2 = 4 != world_size=8"):
        mesh_shape(8, 1, 2, 2)
    with pytest.raises(ValueError, match="at most one"):
        mesh_shape(8, -1, -1, 2)
    with pytest.raises(ValueError, match="data_parallel_replicate_size must be >= 1"):
        mesh_shape(8, 0, -1, 2)
    with pytest.raises(ValueError, match=r"expert_parallel_size=8 does not divide n_experts=12 \(world_size=32"):
        mesh_shape(32, 4, -1, 8, n_experts=12)
    ExpertParallelStrategy(expert_parallel_size=2, data_parallel_replicate_size=2)  # __init__ only stores settings
