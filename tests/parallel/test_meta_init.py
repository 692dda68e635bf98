"""Meta-device initialisation on real gloo processes: a K3LM built on ``meta`` is sharded (expert parallelism +
FSDP2, or HSDP) without allocating it, then each rank materialises and initialises only its shards, with the
same per-parameter distribution as a normally constructed model, different numbers in different shards and the
same in HSDP replicas."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from k3lit.model import K3LM, ModelConfig
from k3lit.parallel import init_sharded, parallelize
from k3lit.parallel.parallelize import DP, EP, REPLICATE
from tests.parallel._dist import peers_equal, run_workers

CFG = ModelConfig(vocab_size=64, dim=32, n_layers=2, layer_pattern="KA", n_heads=2, head_dim=16, mlp_hidden=64,
                  n_experts=8, top_k=2, expert_dim=32, n_shared_experts=1, first_dense_layers=0,
                  attnres_block_size=2, kda_backend="torch")


def _meta_sharded(shape: tuple[int, ...], names: tuple[str, ...]) -> K3LM:
    """A K3LM built on meta, parallelized over a CPU mesh, allocated (NaN-filled) and ``init_sharded``."""
    torch.manual_seed(0)
    with torch.device("meta"):
        model = K3LM(CFG)
    assert all(t.is_meta for t in [*model.parameters(), *model.buffers()])
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
    parallelize(model, mesh)
    for name, p in model.named_parameters():  # sharded while still on meta: nothing allocated yet
        assert isinstance(p, DTensor) and p.to_local().is_meta, name
    model.to_empty(device="cpu")
    with torch.no_grad():  # whatever init_sharded leaves alone stays NaN (-1 for integer counters)
        for t in [*model.parameters(), *model.buffers()]:
            (t.to_local() if isinstance(t, DTensor) else t).fill_(float("nan") if t.is_floating_point() else -1)
    return init_sharded(model, mesh)


def _worker(rank: int, world: int) -> None:
    replicated = _meta_sharded((world, 1), (REPLICATE, DP))  # HSDP: 2 replicas of an unsharded model
    for name, p in replicated.named_parameters():
        assert p.to_local().numel() == p.numel() and peers_equal(p), name

    model = _meta_sharded((1, world), (DP, EP))
    for name, p in model.named_parameters():  # each rank holds a part: experts split over ep, the rest FSDP2
        assert p.to_local().numel() < p.numel(), name

    assert model.lm_head.weight is model.embed.weight
    ref = K3LM(CFG)  # a normal construction: the distribution every parameter must have
    ref_state = ref.state_dict()
    state = model.state_dict()
    assert state.keys() == ref_state.keys()
    for name, t in state.items():
        got = t.full_tensor() if isinstance(t, DTensor) else t
        want = ref_state[name]
        assert got.dtype == want.dtype and got.shape == want.shape, name
        assert torch.isfinite(got).all(), name
        if torch.all(want == want.flatten()[0]):  # constant inits (zeros, ones) exactly
            assert torch.equal(got, want), name
        else:  # random inits: same mean (0) and standard deviation, other numbers in each shard
            assert abs(got.mean()) < 0.2 * want.std(), (name, got.mean(), want.std())
            assert 0.75 < got.std() / want.std() < 1.33, (name, got.std(), want.std())
            assert not peers_equal(t), name
    assert model.moe_layers()[0].expert_bias.dtype == torch.float32

    idx = torch.randint(0, CFG.vocab_size, (2, 9), generator=torch.Generator().manual_seed(rank))
    logits = model(idx[:, :-1])[0]  # the materialised shards train: forward and backward run, all finite
    F.cross_entropy(logits.flatten(0, 1), idx[:, 1:].flatten()).backward()
    assert all(torch.isfinite(p.grad.full_tensor()).all() for p in model.parameters())


def test_meta_model_materialises_sharded_with_the_construction_distribution(tmp_path):
    run_workers(_worker, 2, tmp_path=tmp_path)
