"""Muon under FSDP2 and expert parallelism on real gloo processes: two optimizer steps leave every parameter as
one process's steps do."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from k3lit.model import K3LM, ModelConfig
from k3lit.parallel import parallelize
from k3lit.parallel.parallelize import DP, EP
from k3lit.train.optim import MuonAdamW, OptimConfig
from tests.parallel._dist import run_workers

CFG = dict(vocab_size=40, dim=32, n_layers=2, layer_pattern="KA", n_heads=2, head_dim=16, mlp_hidden=48,
           n_experts=4, top_k=2, expert_dim=16, n_shared_experts=1, first_dense_layers=1, attnres_block_size=2)


def _worker(rank: int, world: int, shape: tuple[int, ...]) -> None:
    torch.manual_seed(0)
    cfg = ModelConfig(**CFG)
    ref = K3LM(cfg).double()
    model = K3LM(cfg).double()
    model.load_state_dict(ref.state_dict())
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=(DP, EP)[: len(shape)])
    parallelize(model, mesh)
    optim = OptimConfig(name="muon", lr=1e-2, warmup_steps=1)
    opt, sched = optim.build(model, 4)
    ref_opt, ref_sched = optim.build(ref, 4)
    assert isinstance(opt, MuonAdamW)
    for step in range(2):
        idx = torch.randint(0, 40, (world, 2, 13), generator=torch.Generator().manual_seed(step))
        for m, tokens in ((model, idx[rank]), (ref, idx.flatten(0, 1))):  # equal token counts: mean of rank means
            logits = m(tokens[:, :-1])[0]
            F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten()).backward()
        for o, s in ((opt, sched), (ref_opt, ref_sched)):
            o.step()
            s.step()
            o.zero_grad()
    ref_params = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        assert isinstance(p, DTensor), name
        torch.testing.assert_close(p.full_tensor(), ref_params[name], msg=name)
    buffers = [s["momentum_buffer"] for s in opt.state.values() if "momentum_buffer" in s]
    assert buffers and all(isinstance(b, DTensor) for b in buffers)  # momentum stays sharded


@pytest.mark.parametrize("shape", [(2,), (1, 2), (2, 2)], ids=["fsdp2", "ep2", "fsdp2xep2"])
def test_muon_step_under_fsdp_and_expert_parallel_matches_one_process(tmp_path, shape):
    """FSDP2 alone, expert parallelism alone, and both (experts sharded over experts and data)."""
    run_workers(_worker, math.prod(shape), shape, tmp_path=tmp_path)
