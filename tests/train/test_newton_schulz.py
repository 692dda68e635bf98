"""Muon's batched Newton-Schulz iteration against torch.optim.Muon's one-matrix iteration, and the batching of a
whole optimizer step by block shape."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch.optim._muon import _zeropower_via_newtonschulz

from k3lit.model import K3LM, ModelConfig
from k3lit.train import newton_schulz as ns
from k3lit.train.optim import OptimConfig, muon_matrices

ROOT = Path(__file__).parents[2]


@pytest.mark.parametrize("shape", [(5, 96, 160), (4, 160, 96), (3, 64, 64), (1, 48, 16), (4, 3, 192), (4, 192, 3)])
def test_batched_iteration_agrees_with_torchs_per_matrix(shape):
    """Wide, tall, square and few-row matrices, each of the batch as torch's Muon orthogonalises it alone: the same
    bfloat16 operations in the same order, where a batched product may round an element differently in the last
    bit (on one CPU: 4 of 4,800 random matrices, by at most 1.5e-3 relative). So every matrix agrees to bfloat16's unit
    roundoff, 2^-8 relative (a wrong orientation, scale or coefficient is off by order one)."""
    x = torch.randn(shape, generator=torch.Generator().manual_seed(0))
    want = torch.stack([_zeropower_via_newtonschulz(m, ns.NS_COEFFICIENTS, 5, ns.NS_EPS) for m in x]).float()
    got = ns.newton_schulz(x, 5)
    assert got.dtype == torch.bfloat16 and got.shape == x.shape
    err = (got.float() - want).norm(dim=(-2, -1)) / want.norm(dim=(-2, -1))
    assert err.max() <= 2**-8, err


def test_zero_matrix_stays_zero():
    assert torch.equal(ns.newton_schulz(torch.zeros(2, 8, 12), 5), torch.zeros(2, 8, 12, dtype=torch.bfloat16))


def test_rejects_a_single_matrix():
    with pytest.raises(ValueError, match=r"\[N, A, C\]"):
        ns.newton_schulz(torch.randn(8, 12), 5)


def test_optimizer_step_runs_one_iteration_per_block_shape(monkeypatch):
    """A step of a model with MoE, KDA and softmax attention layers orthogonalises all of its blocks in one
    batched call per distinct (rows, columns) shape, every block once; on the CPU in float32 (``auto``)."""
    model = K3LM(ModelConfig(vocab_size=40, dim=32, n_layers=2, layer_pattern="KA", n_heads=2, head_dim=16,
                             mlp_hidden=48, n_experts=4, top_k=2, expert_dim=16, n_shared_experts=1,
                             first_dense_layers=1, attnres_block_size=2))
    opt, _ = OptimConfig(name="muon", lr=1e-2, warmup_steps=0).build(model, 10)
    layouts = muon_matrices(model)
    shapes: dict[tuple[int, int], int] = {}
    for p, (dim, sizes) in layouts.items():
        p.grad = torch.randn_like(p)
        for blk in p.detach().split(sizes, dim):
            shapes[tuple(blk.shape[-2:])] = shapes.get(tuple(blk.shape[-2:]), 0) + blk[..., 0, 0].numel()
    calls: list[tuple[int, ...]] = []
    real = ns.newton_schulz

    def counting(x, steps, dtype):
        calls.append((*x.shape, dtype))
        return real(x, steps, dtype)

    monkeypatch.setattr(ns, "newton_schulz", counting)
    opt.step()
    assert sorted(calls, key=str) == sorted(((n, *s, torch.float32) for s, n in shapes.items()), key=str)


def _model_and_muon(seed: int) -> tuple[K3LM, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = K3LM(ModelConfig(vocab_size=40, dim=32, n_layers=2, layer_pattern="KA", n_heads=2, head_dim=16,
                             mlp_hidden=48, n_experts=4, top_k=2, expert_dim=16, n_shared_experts=1,
                             first_dense_layers=1, attnres_block_size=2))
    return model, OptimConfig(name="muon", lr=1e-2, warmup_steps=0).build(model, 10)[0]


def test_a_step_joins_and_reshapes_nothing():
    """After the first step (which lays the blocks out), a step copies the pieces into the kept buffers and splits
    the results: no concatenation and no reshape per piece, and only the multi-piece updates are split."""
    from torch.utils._python_dispatch import TorchDispatchMode

    model, opt = _model_and_muon(0)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    opt.step()
    ops: list[str] = []

    class Record(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            ops.append(str(func))
            return func(*args, **(kwargs or {}))

    with Record():
        opt.step()
    multi = sum(len(sizes) > 1 for _, sizes in muon_matrices(model).values())
    shapes = len(opt._blocks._batches)
    assert "aten.cat.default" not in ops and "aten.view.default" not in ops
    assert ops.count("aten.split_with_sizes.default") == multi + shapes  # the updates' pieces, the results' blocks
    assert ops.count("aten.bmm.default") + ops.count("aten.baddbmm.default") == 15 * shapes  # 5 iterations of 3


def test_kept_blocks_follow_parameters_that_move():
    """The kept views of the parameters' pieces are rebuilt when a parameter's storage changes (a move to
    another device or dtype, a load that replaces ``.data``): the updates land in the parameters themselves."""
    (model_a, opt_a), (model_b, opt_b) = _model_and_muon(0), _model_and_muon(0)
    for step in range(3):
        grads = {name: torch.randn_like(p, generator=torch.Generator().manual_seed(step)) for name, p in
                 model_a.named_parameters()}
        for model in (model_a, model_b):
            for name, p in model.named_parameters():
                p.grad = grads[name].clone()
        opt_a.step()
        opt_b.step()
        for p in muon_matrices(model_b):
            p.data = p.data.clone()  # new storage, same parameter object
    for (name, a), b in zip(model_a.named_parameters(), model_b.parameters(), strict=True):
        assert torch.equal(a, b), name


def test_a_muon_step_of_small_issues_under_300_operators():
    """The figure RESULTS.md quotes ("Muon against AdamW (H200, 500 steps)": 281 operators a step of ``small``'s
    Muon part, 804 when the pieces were joined each step), counted on ``meta`` tensors: the host issues every
    one of them, one after the other, while a device would wait."""
    import yaml
    from torch.utils._python_dispatch import TorchDispatchMode

    cfg = yaml.safe_load((ROOT / "recipes" / "small.yaml").read_text())["model"]
    with torch.device("meta"):
        model = K3LM(ModelConfig(**cfg, vocab_size=16384))
    opt, _ = OptimConfig(name="muon", lr=1.5e-3).build(model, 1000)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    groups = [g for g in opt.param_groups if g["muon"]]
    count = [0]

    class Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            count[0] += 1
            return func(*args, **(kwargs or {}))

    with torch.no_grad():
        opt._muon_steps(groups)  # lays the blocks out
        with Count():
            opt._muon_steps(groups)
    assert sum(len(g["params"]) for g in groups) == 108
    assert count[0] <= 300, count[0]
