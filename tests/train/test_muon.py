"""Muon with AdamW (``optim.name=muon``) on one process: which parameters each part trains, the update against
torch's Muon and a float64 Newton-Schulz reference, and an exact resume from a saved state."""

from __future__ import annotations

import copy
import math

import pytest
import torch

from k3lit.model import K3LM, ModelConfig
from k3lit.train.optim import NS_COEFFICIENTS, MuonAdamW, OptimConfig, muon_matrices

CFG = dict(vocab_size=40, dim=32, n_layers=2, layer_pattern="KA", n_heads=2, head_dim=16, mlp_hidden=48,
           n_experts=4, top_k=2, expert_dim=16, n_shared_experts=1, first_dense_layers=1, attnres_block_size=2)


def _model(**kw) -> K3LM:
    torch.manual_seed(0)
    return K3LM(ModelConfig(**{**CFG, **kw}))


def _backward(model: K3LM, seed: int) -> None:
    idx = torch.randint(0, 40, (2, 11), generator=torch.Generator().manual_seed(seed))
    logits = model(idx[:, :-1])[0]
    torch.nn.functional.cross_entropy(logits.flatten(0, 1), idx[:, 1:].flatten()).backward()


def test_muon_trains_hidden_matrices_and_adamw_the_rest():
    for tie in (True, False):
        model = _model(tie_embeddings=tie)
        layouts = {name: muon_matrices(model).get(p) for name, p in model.named_parameters()}
        adamw = {n for n, lay in layouts.items() if lay is None}
        # embedding, head, short-convolution kernels and every 1-D parameter (norms, biases, gate biases,
        # AttnRes pseudo-queries)
        want = {n for n, p in model.named_parameters()
                if p.dim() < 2 or n.startswith(("embed.", "lm_head.")) or ".qkv_conv." in n}
        assert adamw == want
        assert {"embed.weight", "sublayers.0.op.gate_bias", "sublayers.0.res_mixer.query", "norm.weight",
                "sublayers.0.op.o_up.bias"} <= adamw
        assert ("lm_head.weight" in adamw) == (not tie)
        inner = 2 * 16
        assert layouts["sublayers.0.op.qkv_proj.weight"] == (-2, (inner,) * 3)
        assert layouts["sublayers.0.op.down_proj.weight"] == (-2, (2, 16, 16))
        assert layouts["sublayers.2.op.qkv.weight"] == (-2, (inner,) * 3)
        assert layouts["sublayers.1.op.w_gate_up.weight"] == (-2, (48, 48))
        assert layouts["sublayers.3.op.experts.w_gate_up"] == (-1, (16, 16))
        assert layouts["sublayers.3.op.experts.w_down"] == (-1, (32,))
        assert layouts["sublayers.0.op.o_proj.weight"] == (-2, (32,))
        assert layouts["sublayers.3.op.router.weight"] == (-2, (4,))


def _blocks(t: torch.Tensor, layout: tuple[int, tuple[int, ...]]) -> list[torch.Tensor]:
    """Every 2-D block of ``t`` under ``layout`` (views), expert by expert."""
    dim, sizes = layout
    return [b for part in t.split(sizes, dim) for b in (part if part.dim() == 3 else [part])]


def test_muon_update_equals_torch_muon_per_block_and_adamw_elsewhere():
    """Two steps of MuonAdamW against torch.optim.Muon(match_rms_adamw) run on each block as its own parameter
    (q, k, v, gate, up, each expert), and torch.optim.AdamW on the other parameters; the iteration in bfloat16,
    as torch's (on the CPU the default is float32)."""
    model = _model()
    cfg = OptimConfig(name="muon", lr=1e-2, warmup_steps=0, weight_decay=0.1, ns_dtype="bfloat16")
    opt, _ = cfg.build(model, 10)
    assert isinstance(opt, MuonAdamW)
    layouts = muon_matrices(model)
    ref = copy.deepcopy(model)
    ref_params = dict(ref.named_parameters())
    blocks = {n: [b.detach().clone().requires_grad_() for b in _blocks(ref_params[n], layouts[p])]
              for n, p in model.named_parameters() if p in layouts}
    torch_muon = torch.optim.Muon([b for bs in blocks.values() for b in bs], lr=1e-2, weight_decay=0.1,
                                  adjust_lr_fn="match_rms_adamw")
    rest = [ref_params[n] for n, p in model.named_parameters() if p not in layouts]
    torch_adamw = torch.optim.AdamW([{"params": [p for p in rest if p.dim() >= 2], "weight_decay": 0.1},
                                     {"params": [p for p in rest if p.dim() < 2], "weight_decay": 0.0}],
                                    lr=1e-2, betas=(0.9, 0.95), eps=1e-8)
    for step in range(2):
        _backward(model, step)
        _backward(ref, step)
        for n, bs in blocks.items():
            p = dict(model.named_parameters())[n]
            for b, g in zip(bs, _blocks(ref_params[n].grad, layouts[p]), strict=True):
                b.grad = g.clone()
        opt.step()
        torch_muon.step()
        torch_adamw.step()
        for m in (opt, torch_muon, torch_adamw):
            m.zero_grad()
        ref.zero_grad()
        for n, p in model.named_parameters():
            if p in layouts:
                for got, want in zip(_blocks(p.detach(), layouts[p]), blocks[n], strict=True):
                    torch.testing.assert_close(got, want.detach(), msg=n)
                    ref_params[n].data.copy_(p.detach())  # the reference model follows for the next gradient
            else:
                torch.testing.assert_close(p, ref_params[n], msg=n)


def _newton_schulz64(g: torch.Tensor, steps: int) -> torch.Tensor:
    """Float64 reference of the quintic Newton-Schulz iteration (on the wide orientation)."""
    a, b, c = NS_COEFFICIENTS
    x = g.double()
    tall = x.shape[0] > x.shape[1]
    x = x.T if tall else x
    x = x / x.norm().clamp(min=1e-7)
    for _ in range(steps):
        gram = x @ x.T
        x = a * x + (b * gram + c * gram @ gram) @ x
    return x.T if tall else x


@pytest.mark.parametrize("ns_dtype,tol", [("bfloat16", 3e-2), ("auto", 1e-4)])
def test_first_muon_step_matches_float64_reference(ns_dtype, tol):
    """First step from zero momentum with full-rank random gradients: the Nesterov update is ``(1 - m^2) g`` and
    the iteration is scale-free, so every block (q, k, v; gate, up of each expert; whole matrices) moves by
    ``lr 0.2 sqrt(max(a, c)) NS(g_block)`` after the decay. In bfloat16 (torch's iteration) the relative
    Frobenius error against float64 is about 1.5% on these shapes (a wrong block, orientation or scale is off
    by order one); ``auto`` runs the iteration in float32 on the CPU: within 1e-4. Rank-deficient
    blocks are left out: bfloat16 rounding moves their near-zero singular values, which the polynomial then
    amplifies."""
    model = _model()
    lr, wd = 1e-2, 0.1
    opt, _ = OptimConfig(name="muon", lr=lr, warmup_steps=0, weight_decay=wd, ns_dtype=ns_dtype).build(model, 10)
    layouts = muon_matrices(model)
    gen = torch.Generator().manual_seed(0)
    before = {p: p.detach().double().clone() for p in layouts}
    for p in layouts:
        p.grad = torch.randn(p.shape, generator=gen)
    opt.step()
    checked = 0
    for p, layout in layouts.items():
        moved = before[p] * (1 - lr * wd) - p.detach().double()
        for got, g in zip(_blocks(moved, layout), _blocks(p.grad.double(), layout), strict=True):
            scale = lr * 0.2 * math.sqrt(max(g.shape))
            want = scale * _newton_schulz64(g, 5)
            err = (got - want).norm() / want.norm()
            assert err < tol, (tuple(g.shape), err.item())
            s = torch.linalg.svdvals(got / scale)  # orthogonalised: singular values near one, not the gradient's
            assert 0.6 < s.median() and s.max() < 1.3, s
            checked += 1
    # KDA: q, k, v, beta, f-down, o-down, f_up, o_up, o_proj; SwiGLU: gate, up, down; attention: q, k, v, o;
    # MoE: router, 4 experts x (gate, up, down), shared gate, up, down
    assert checked == 9 + 3 + 4 + 1 + 4 * 3 + 3, checked


def test_state_dict_resume_continues_exactly(tmp_path):
    """Three steps straight equal two steps, a save of model and optimizer (torch.save), a load into a fresh
    model and optimizer, and the third step; the schedule continues as well."""
    cfg = OptimConfig(name="muon", lr=1e-2, warmup_steps=1)
    straight = _model()
    opt, sched = cfg.build(straight, 3)
    for step in range(3):
        _backward(straight, step)
        opt.step()
        sched.step()
        opt.zero_grad()
        if step == 1:
            torch.save({"model": straight.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict()},
                       tmp_path / "ckpt.pt")
    saved = torch.load(tmp_path / "ckpt.pt", weights_only=True)
    assert any("momentum_buffer" in s for s in saved["opt"]["state"].values())
    resumed = _model()
    resumed.load_state_dict(saved["model"])
    opt2, sched2 = cfg.build(resumed, 3)
    opt2.load_state_dict(saved["opt"])
    sched2.load_state_dict(saved["sched"])
    cfg.apply(opt2, sched2)
    _backward(resumed, 2)
    opt2.step()
    for (n, a), b in zip(straight.named_parameters(), resumed.parameters(), strict=True):
        assert torch.equal(a, b), n


def test_resume_with_the_other_optimizer_is_refused():
    model = _model()
    opt, sched = OptimConfig(name="adamw").build(model, 3)
    with pytest.raises(ValueError, match="--optim.name=adamw"):
        OptimConfig(name="muon").apply(opt, sched)
    with pytest.raises(ValueError, match="choose one of"):
        OptimConfig(name="sgd")


def test_an_unknown_iteration_dtype_is_refused():
    with pytest.raises(ValueError, match=r"ns_dtype='float16': choose one of \('auto', 'bfloat16', 'float32'\)"):
        OptimConfig(name="muon", ns_dtype="float16")


def test_resume_with_another_iteration_dtype_takes_it():
    """A run resumed with ``--optim.ns_dtype`` steps in that dtype: the same step as an optimizer built with it."""
    steps = []
    for dtype in ("bfloat16", "float32"):
        model = _model()
        opt, sched = OptimConfig(name="muon", lr=1e-2, warmup_steps=0).build(model, 10)
        OptimConfig(name="muon", lr=1e-2, warmup_steps=0, ns_dtype=dtype).apply(opt, sched)
        _backward(model, 0)
        opt.step()
        steps.append([p.detach().clone() for p in model.parameters()])
    fresh = _model()
    opt, _ = OptimConfig(name="muon", lr=1e-2, warmup_steps=0, ns_dtype="bfloat16").build(fresh, 10)
    _backward(fresh, 0)
    opt.step()
    assert all(torch.equal(a, b) for a, b in zip(steps[0], fresh.parameters(), strict=True))
    assert not all(torch.equal(a, b) for a, b in zip(steps[1], fresh.parameters(), strict=True))
