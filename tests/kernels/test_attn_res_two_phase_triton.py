"""Two-phase Block AttnRes kernels (k3lit.kernels.attn_res, two_phase.py) against float64.

Phase 1 (every query's mix over the blocks, with its log-sum-exp) and phase 2 (the merge with the partial sum) are
checked against the PyTorch forms of :mod:`k3lit.ops.attn_res` run in float64 on the same values, and their
composition against the literal one-pass read. CPU: ``TRITON_INTERPRET=1`` on row counts that are not multiples of
the row tile, D not a power of two, S not a power of two and more row tiles than backward
programs; NaN-filled allocations (conftest.py) catch unwritten outputs. GPU (``-m gpu``): the 300m model's shapes.
"""

from __future__ import annotations

import pytest
import torch

from k3lit.ops.attn_res import attn_res_inter_block, attn_res_merge, attn_res_reference
from k3lit.testing import rel_rms

DEV = "cuda" if torch.cuda.is_available() else "cpu"
TOL_F32 = 2e-5  # float32 arithmetic on inputs exact in float32
TOL_QUERY = 5e-5  # query gradients sum N·M terms that partly cancel (as in test_attn_res_triton.py)
# A result stored in bfloat16: rounding to nearest errs by ~1e-3 RMS; the interpreter truncates (~2x).
TOL_LOW = 4e-3 if DEV == "cuda" else 1e-2


def leaves(n, shape, dtypes=(torch.float32,), device=DEV):
    """n blocks of growing scale, the i-th in ``dtypes[min(i, len - 1)]``, as leaves."""
    return [(torch.randn(*shape, device=device) * (i + 1)).to(dtypes[min(i, len(dtypes) - 1)]).requires_grad_()
            for i in range(n)]


def double_leaves(xs):
    return [x.detach().double().requires_grad_() for x in xs]


def check_inter(blocks, queries, tol_out, tol_blocks, use=None, out_dtype=None):
    """Phase 1 on the kernels against float64: mixes, lse and the gradients of every block and of the queries,
    under a loss that weighs each mix and each log-sum-exp by random values. ``use``: the mixes that enter the
    loss (others get no gradient); all by default. ``out_dtype``: the mixes' dtype (blocks[0]'s by default)."""
    queries = queries.clone().requires_grad_()
    mixes, lse = attn_res_inter_block(blocks, queries, backend="triton", out_dtype=out_dtype)
    ref_in = double_leaves([*blocks, queries])
    ref_mixes, ref_lse = attn_res_inter_block(ref_in[:-1], ref_in[-1], backend="torch")
    S = queries.shape[0]
    use = range(S) if use is None else use
    assert len(mixes) == S and lse.dtype == torch.float32 and lse.shape == (S, *blocks[0].shape[:-1])
    assert rel_rms(lse, ref_lse) < TOL_F32
    for x, r in zip(mixes, ref_mixes):
        assert x.dtype == (out_dtype or blocks[0].dtype) and rel_rms(x, r) < tol_out
    dys = [torch.randn_like(r) for r in ref_mixes]
    dl = torch.randn_like(ref_lse)
    (sum((mixes[j] * dys[j].to(mixes[j].dtype)).sum() for j in use) + (lse * dl.float()).sum()).backward()
    (sum((ref_mixes[j] * dys[j].to(mixes[j].dtype).double()).sum() for j in use) + (ref_lse * dl).sum()).backward()
    for i, (b, r, tol) in enumerate(zip(blocks, ref_in, tol_blocks)):
        assert b.grad.dtype == b.dtype and rel_rms(b.grad, r.grad) < tol, f"block {i}"
    assert rel_rms(queries.grad, ref_in[-1].grad) < TOL_QUERY


@pytest.mark.parametrize("n,S,shape", [(1, 1, (2, 5, 96)), (4, 3, (3, 7, 200)), (2, 5, (2, 45, 96))])
def test_inter_float32_matches_reference(seed, n, S, shape):
    D = shape[-1]
    check_inter(leaves(n, shape), torch.randn(S, D, device=DEV), TOL_F32, [TOL_F32] * n)


def test_inter_mixed_dtypes_and_unused_mix(seed):
    """float32 embedding beside bf16 summaries (the model's layout); a mix outside the loss gets no gradient."""
    blocks = leaves(4, (2, 9, 200), (torch.float32, torch.bfloat16))
    check_inter(blocks, torch.randn(4, 200, device=DEV), TOL_F32, [TOL_F32] + [TOL_LOW] * 3, use=[0, 2])


def test_inter_bf16_mixes_of_float32_embedding(seed):
    """``out_dtype``: the model's reads under bf16 autocast mix the float32 embedding and bf16 summaries into bf16
    mixes, whose gradients then arrive in bf16; the float32 embedding's gradient stays float32-accurate."""
    blocks = leaves(3, (2, 9, 200), (torch.float32, torch.bfloat16))
    check_inter(blocks, torch.randn(3, 200, device=DEV), TOL_LOW, [TOL_F32] + [TOL_LOW] * 2,
                out_dtype=torch.bfloat16)


def test_inter_many_queries(seed):
    """A block of 8 sublayers (the medium recipe's) at D 200: every query its own program."""
    check_inter(leaves(3, (2, 11, 200)), torch.randn(8, 200, device=DEV), TOL_F32, [TOL_F32] * 3)


@pytest.mark.parametrize("dtypes", [(torch.float32, torch.float32), (torch.float32, torch.bfloat16)])
def test_merge_matches_reference(seed, dtypes):
    """Phase 2: float32 mix (the embedding's dtype) with a float32 or bf16 partial sum."""
    D = 200
    mix, partial = (torch.randn(3, 7, D, device=DEV).to(dt).requires_grad_() for dt in dtypes)
    lse = (torch.randn(3, 7, device=DEV) * 3).requires_grad_()
    u = torch.randn(D, device=DEV, requires_grad=True)
    ref_in = double_leaves([mix, lse, partial, u])
    h = attn_res_merge(mix, lse, partial, u, backend="triton")
    ref = attn_res_merge(*ref_in, backend="torch")
    assert h.dtype == mix.dtype and rel_rms(h, ref) < TOL_F32
    dy = torch.randn_like(ref)
    (h * dy.float()).sum().backward()
    (ref * dy).sum().backward()
    tols = [TOL_F32, TOL_F32, TOL_F32 if dtypes[1] == torch.float32 else TOL_LOW, TOL_QUERY]
    for x, r, tol in zip((mix, lse, partial, u), ref_in, tols):
        assert x.grad.dtype == x.dtype and rel_rms(x.grad, r.grad) < tol


def test_two_phase_equals_one_pass(seed):
    """Block AttnRes's reads, both phases on the kernels, against the literal softmax over blocks + partial
    (float64), for each sublayer of a block."""
    blocks, (partial,) = leaves(3, (2, 13, 96)), leaves(1, (2, 13, 96))
    w, gamma = torch.randn(3, 96, device=DEV), 1 + 0.1 * torch.randn(3, 96, device=DEV)
    mixes, lse = attn_res_inter_block(blocks, w * gamma, backend="triton")
    ref_in = double_leaves(blocks + [partial])
    for j in range(1, 3):
        h = attn_res_merge(mixes[j], lse[j], partial, w[j] * gamma[j], backend="triton")
        assert rel_rms(h, attn_res_reference(ref_in, w[j].double(), gamma[j].double())) < TOL_F32
    assert rel_rms(mixes[0], attn_res_reference(ref_in[:-1], w[0].double(), gamma[0].double())) < TOL_F32


def test_torch_compile_no_graph_break(seed):
    """fullgraph=True fails on any graph break; aot_eager traces the backward through the fake kernels. Compiled
    (custom ops) and eager (autograd Functions) call the same launchers: equal bit for bit."""
    blocks, (partial,) = leaves(3, (1, 6, 96), (torch.float32, torch.bfloat16)), leaves(1, (1, 6, 96))
    queries = torch.randn(2, 96, device=DEV, requires_grad=True)
    twins = [x.detach().clone().requires_grad_() for x in (queries, partial, *blocks)]

    def loss(queries, partial, *blocks):
        mixes, lse = attn_res_inter_block(list(blocks), queries, backend="triton")
        h = attn_res_merge(mixes[1], lse[1], partial, queries[1], backend="triton")
        return mixes[0].square().sum() + h.square().sum()

    compiled = torch.compile(loss, fullgraph=True, backend="aot_eager")(queries, partial, *blocks)
    compiled.backward()
    eager = loss(*twins)
    eager.backward()
    assert torch.equal(compiled, eager)
    for a, b in zip((queries, partial, *blocks), twins):
        assert a.grad is not None and torch.equal(a.grad, b.grad)


def test_triton_rejects():
    x = torch.zeros(1, 2, 8, device=DEV)
    with pytest.raises(ValueError, match=r"queries must be \[S, D\]"):
        attn_res_inter_block([x], torch.zeros(8, device=DEV), backend="triton")
    with pytest.raises(ValueError, match="lse must be float32"):
        attn_res_merge(x, torch.zeros(1, 2, dtype=torch.float64, device=DEV), x, torch.zeros(8, device=DEV),
                       backend="triton")
    with pytest.raises(ValueError, match="at least one block"):
        attn_res_inter_block([], torch.zeros(1, 8, device=DEV))
    with pytest.raises(ValueError, match="out_dtype must be among"):
        attn_res_inter_block([x], torch.zeros(1, 8, device=DEV), backend="triton", out_dtype=torch.float64)


# ------------------------------------------------------------------------------------------------------------
# GPU: the 300m model's block (D 1024, S 4) at T 4096, float32 embedding beside bf16 summaries
# ------------------------------------------------------------------------------------------------------------

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (run on the H200)")


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("n,S,D", [(1, 4, 1024), (10, 4, 1024), (5, 8, 2048), (3, 3, 1000)])
def test_gpu_inter_matches_reference(seed, n, S, D):
    blocks = leaves(n, (2, 4096, D), (torch.float32, torch.bfloat16), device="cuda")
    check_inter(blocks, torch.randn(S, D, device="cuda") * 0.3, TOL_F32, [TOL_F32] + [TOL_LOW] * (n - 1))


@pytest.mark.gpu
@gpu
def test_gpu_deterministic(seed):
    """Recomputation (activation checkpointing) must reproduce the same bits: no atomics anywhere."""
    blocks = leaves(6, (2, 4096, 1024), (torch.float32, torch.bfloat16), device="cuda")
    (partial,) = leaves(1, (2, 4096, 1024), (torch.bfloat16,), device="cuda")
    queries = torch.randn(4, 1024, device="cuda", requires_grad=True)
    runs = []
    for _ in range(2):
        mixes, lse = attn_res_inter_block(blocks, queries)
        h = attn_res_merge(mixes[2], lse[2], partial, queries[2])
        loss = mixes[0].square().sum() + h.square().sum()
        runs.append((mixes[0], h, *torch.autograd.grad(loss, [queries, partial, *blocks])))
    for a, b in zip(*runs):
        assert torch.equal(a, b)
