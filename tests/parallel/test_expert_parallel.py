"""Expert parallelism, FSDP2 and hybrid sharding (HSDP) on real gloo processes: forward and gradients equal
the single-process model; an HSDP + EP checkpoint loads into one process."""

from __future__ import annotations

import pytest
import torch
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from k3lit.model import K3LM, ModelConfig
from k3lit.nn.moe import MoE
from k3lit.parallel import clip_grad_norm_, parallelize, total_grad_norm
from k3lit.parallel.dispatch import ExpertParallelDispatch
from k3lit.parallel.parallelize import DP, EP, REPLICATE
from tests.parallel._dist import peers_equal, run_workers

CFG = dict(vocab_size=40, dim=32, n_layers=2, layer_pattern="KA", n_heads=2, head_dim=16, mlp_hidden=48,
           n_experts=8, top_k=2, expert_dim=16, n_shared_experts=1, first_dense_layers=0, attnres_block_size=2)


def _moe_worker(rank: int, world: int, path: str) -> None:
    for capacity, mode in ((None, "forward"), (0.6, "forward"), (0.6, "causal")):  # 0.6: re-routed and dropped
        _moe_parity(rank, world, capacity, mode)


def _moe_parity(rank: int, world: int, capacity: float | None, mode: str) -> None:
    torch.manual_seed(0)
    ref = MoE(16, 8, 2, 8, n_shared_experts=1, capacity_factor=capacity, capacity_mode=mode).double()
    ref.expert_bias.copy_(torch.randn(8) * 0.2)
    xs = torch.randn(world, 3, 7, 16, dtype=torch.float64)  # rank r gets xs[r]; the reference gets all
    ep = MoE(16, 8, 2, 8, n_shared_experts=1, capacity_factor=capacity, capacity_mode=mode).double()
    ep.load_state_dict(ref.state_dict())
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("expert_parallel",))
    for name in ("w_gate_up", "w_down"):
        p = getattr(ep.experts, name)
        setattr(ep.experts, name, torch.nn.Parameter(distribute_tensor(p.detach(), mesh, [Shard(0)])))
    ep.dispatcher = ExpertParallelDispatch(mesh.get_group())

    x = xs[rank].clone().requires_grad_()
    out = ep(x)
    g = torch.randn(world, 3, 7, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    (out * g[rank]).sum().backward()

    xr = xs.clone().requires_grad_()
    # capacity is per forward: run the reference per rank's batch so the limits agree
    out_ref = torch.stack([ref(xr[r]) for r in range(world)])
    (out_ref * g).sum().backward()
    torch.testing.assert_close(out, out_ref[rank])
    torch.testing.assert_close(x.grad, xr.grad[rank])
    n_local = 8 // world
    for name in ("w_gate_up", "w_down"):  # the local shard's gradient is the full gradient of those experts
        got = getattr(ep.experts, name).grad
        assert isinstance(got, DTensor)
        want = getattr(ref.experts, name).grad[rank * n_local : (rank + 1) * n_local]
        torch.testing.assert_close(got.to_local(), want)
    # dense gradients are per-rank partial sums: their sum is the reference
    router = ep.router.weight.grad.clone()
    torch.distributed.all_reduce(router)
    torch.testing.assert_close(router, ref.router.weight.grad)
    if capacity is not None:  # the constructed case really exercises re-routing and dropping
        assert ep.last_stats["rerouted"] > 0 and ep.last_stats["dropped"] > 0, ep.last_stats


def test_moe_expert_parallel_matches_single_process(tmp_path):
    run_workers(_moe_worker, 2, str(tmp_path), tmp_path=tmp_path)


def _model_worker(rank: int, world: int, shapes: list[tuple[int, ...]], ckpt: str) -> None:
    for shape in shapes:
        _model_parity(rank, world, shape, ckpt)


def _model_parity(rank: int, world: int, shape: tuple[int, ...], ckpt: str) -> None:
    """``shape``: ``(dp, ep)`` or ``(replicate, dp, ep)`` (hybrid sharding); the HSDP + EP model is saved to
    ``ckpt`` after one SGD step (``want.pt`` beside it: the single-process weights after the same step)."""
    torch.manual_seed(0)
    cfg = ModelConfig(**CFG)
    ref = K3LM(cfg).double()
    model = K3LM(cfg).double()
    model.load_state_dict(ref.state_dict())
    idx = torch.randint(0, 40, (world, 2, 13), generator=torch.Generator().manual_seed(3))
    names = (REPLICATE, DP, EP)[-len(shape):]
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
    ep = shape[-1]
    if ep > 1:
        odd = K3LM(ModelConfig(**{**CFG, "n_experts": 3}))
        with pytest.raises(ValueError, match=rf"n_experts=3 is not divisible by expert_parallel_size={ep}.*data_par"):
            parallelize(odd, mesh)
    parallelize(model, mesh)
    assert all(isinstance(m.dispatcher, ExpertParallelDispatch) for m in model.moe_layers())

    def loss_of(m, i):
        logits = m(i[:, :-1])[0]
        return F.cross_entropy(logits.flatten(0, 1), i[:, 1:].flatten())

    loss = loss_of(model, idx[rank])
    loss.backward()
    ref_loss = loss_of(ref, idx.flatten(0, 1))  # equal token counts: the mean of the rank means
    ref_loss.backward()
    losses = [torch.zeros_like(loss) for _ in range(world)]
    torch.distributed.all_gather(losses, loss.detach())
    torch.testing.assert_close(torch.stack(losses).mean(), ref_loss.detach())
    ref_params = dict(ref.named_parameters())
    replicas = shape[0] if len(shape) == 3 else 1
    for name, p in model.named_parameters():
        assert isinstance(p, DTensor), name
        torch.testing.assert_close(p.grad.full_tensor(), ref_params[name].grad, msg=name)
        _check_layout(name, p, replicas, world)
    # clipping: the total norm over expert and dense shards is the single-process norm
    want = torch.nn.utils.clip_grad_norm_(ref.parameters(), 1e-3)
    got = clip_grad_norm_(model.parameters(), 1e-3)
    torch.testing.assert_close(got, want.float())
    torch.testing.assert_close(total_grad_norm(model.parameters()), torch.tensor(1e-3, dtype=torch.float32),
                               rtol=1e-4, atol=0)
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad.full_tensor(), ref_params[name].grad, msg=name)
    if replicas > 1 and ep > 1:  # the HSDP + EP checkpoint that test_hsdp_checkpoint_loads_in_one_process reads
        torch.optim.SGD(model.parameters(), lr=10.0).step()
        torch.optim.SGD(ref.parameters(), lr=10.0).step()
        dcp.save(model.state_dict(), checkpoint_id=ckpt)
        if rank == 0:
            torch.save(ref.state_dict(), f"{ckpt}.want.pt")


def _check_layout(name: str, p: DTensor, replicas: int, world: int) -> None:
    """Sharded within a shard group (each group holds every element once) and, with ``replicas > 1``, placement
    ``Replicate`` on the ``data_parallel_replicate`` axis with the same local *gradient* shard on every replica
    (the replicas saw different tokens, so equal gradients mean they were all-reduced across replicas; equal
    weights would prove nothing before an optimizer step)."""
    numel = torch.tensor(p.to_local().numel())
    torch.distributed.all_reduce(numel)
    assert numel == replicas * p.numel(), (name, numel, p.numel())
    if replicas == 1:
        return
    assert p.device_mesh.mesh_dim_names[0] == REPLICATE and p.placements[0] == Replicate(), (name, p.placements)
    assert all(not isinstance(pl, Replicate) for pl in p.placements[1:]) or p.device_mesh.size() == replicas, name
    assert peers_equal(p.grad, group=p.device_mesh.get_group(0)), name


@pytest.mark.parametrize("world,shapes", [(2, [(1, 2)]), (4, [(2, 2), (2, 2, 1), (2, 1, 2)])],
                         ids=["dp1xep2", "dp2xep2+hsdp2x2+hsdp2xep2"])
def test_model_ep_fsdp_hsdp_matches_single_process(tmp_path, world, shapes):
    """Forward, gradients, clipping equal one process; 4 processes add hybrid sharding: replicate 2 x shard 2
    without (2, 2, 1) and with (2, 1, 2) expert parallelism."""
    run_workers(_model_worker, world, shapes, str(tmp_path / "hsdp"), tmp_path=tmp_path)
    if world == 4:  # the 4-process HSDP + EP checkpoint loads into one process (no process group)
        model = K3LM(ModelConfig(**CFG)).double()
        state = model.state_dict()
        dcp.load(state, checkpoint_id=str(tmp_path / "hsdp"))
        want = torch.load(tmp_path / "hsdp.want.pt")
        assert state.keys() == want.keys()
        for name, t in want.items():
            torch.testing.assert_close(state[name], t, msg=name)
