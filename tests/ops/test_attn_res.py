"""Attention-residual mixing against its literal float64 form."""

import pytest
import torch

from k3lit.ops.attn_res import attn_res_inter_block, attn_res_merge, attn_res_mix, attn_res_reference
from k3lit.testing import rel_rms


def test_zero_query_is_uniform_mean(seed):
    sources = [torch.randn(2, 5, 8, dtype=torch.float64) for _ in range(4)]
    out = attn_res_mix(sources, torch.zeros(8, dtype=torch.float64))
    assert rel_rms(out, torch.stack(sources).mean(0)) < 1e-14


@pytest.mark.parametrize("n", [1, 3, 9])
def test_mix_matches_reference_fwd_bwd(seed, n):
    sources = [(torch.randn(2, 5, 16, dtype=torch.float64) * (i + 1)).requires_grad_() for i in range(n)]
    w = torch.randn(16, dtype=torch.float64, requires_grad=True)
    gamma = (1 + 0.1 * torch.randn(16, dtype=torch.float64)).requires_grad_()
    out = attn_res_mix(sources, w * gamma)
    ref = attn_res_reference(sources, w, gamma)
    assert rel_rms(out, ref) < 1e-13
    dy = torch.randn_like(ref)
    g1 = torch.autograd.grad((out * dy).sum(), sources + [w, gamma])
    g2 = torch.autograd.grad((ref * dy).sum(), sources + [w, gamma])
    for a, b in zip(g1, g2):
        assert rel_rms(a, b) < 1e-12


def test_no_sources_raise():
    with pytest.raises(ValueError, match="at least one source"):
        attn_res_mix([], torch.zeros(4))


@pytest.mark.parametrize("backend", ["torch", "auto"])
def test_inter_block_out_dtype(seed, backend):
    """``out_dtype`` sets the mixes' dtype on the PyTorch path too (values as float32 mixes rounded once); a
    non-floating dtype is refused whichever path would run."""
    blocks, queries = [torch.randn(2, 5, 16) for _ in range(3)], torch.randn(2, 16)
    mixes, lse = attn_res_inter_block(blocks, queries, backend=backend)
    low, lse_low = attn_res_inter_block(blocks, queries, backend=backend, out_dtype=torch.bfloat16)
    assert all(m.dtype == torch.bfloat16 and torch.equal(m, f.bfloat16()) for m, f in zip(low, mixes))
    assert torch.equal(lse, lse_low)
    with pytest.raises(ValueError, match="out_dtype must be a floating-point dtype"):
        attn_res_inter_block(blocks, queries, backend=backend, out_dtype=torch.int32)


def test_mix_bf16_matches_float64(seed):
    sources = [torch.randn(2, 5, 64, dtype=torch.float64) * (i + 1) for i in range(5)]
    w = torch.randn(64, dtype=torch.float64)
    bf = [s.bfloat16().requires_grad_() for s in sources]
    wb = w.clone().requires_grad_()
    out = attn_res_mix(bf, wb)
    ref_sources = [s.detach().double().requires_grad_() for s in bf]
    w64 = w.clone().requires_grad_()
    ref = attn_res_reference(ref_sources, w64, torch.ones(64, dtype=torch.float64))
    assert out.dtype == torch.bfloat16 and rel_rms(out, ref) < 5e-3
    dy = torch.randn_like(ref)
    (out * dy.bfloat16()).sum().backward()
    (ref * dy.bfloat16().double()).sum().backward()
    assert rel_rms(wb.grad, w64.grad) < 5e-3
    for a, b in zip(bf, ref_sources):
        assert a.grad.dtype == torch.bfloat16 and rel_rms(a.grad, b.grad) < 5e-3


@pytest.mark.parametrize("n_blocks,n_queries", [(1, 1), (4, 3), (2, 4)])
def test_two_phase_equals_one_pass_fwd_bwd(seed, n_blocks, n_queries):
    """Phase 1 (one read of the blocks for every query) merged with the partial sum (phase 2) is the one softmax
    over blocks + partial: outputs and the gradients of blocks, partial and queries, in float64."""
    blocks = [(torch.randn(2, 3, 16, dtype=torch.float64) * (i + 1)).requires_grad_() for i in range(n_blocks)]
    partial = torch.randn(2, 3, 16, dtype=torch.float64, requires_grad=True)
    queries = torch.randn(n_queries, 16, dtype=torch.float64, requires_grad=True)
    mixes, lse = attn_res_inter_block(blocks, queries)
    assert len(mixes) == n_queries and lse.shape == (n_queries, 2, 3)
    two = [mixes[0]] + [attn_res_merge(mixes[j], lse[j], partial, queries[j]) for j in range(1, n_queries)]
    one = [attn_res_mix(blocks, queries[0])] + [attn_res_mix(blocks + [partial], queries[j])
                                                 for j in range(1, n_queries)]
    dys = [torch.randn_like(o) for o in one]
    leaves = blocks + [partial, queries]
    g2 = torch.autograd.grad(sum((t * dy).sum() for t, dy in zip(two, dys)), leaves, allow_unused=True)
    g1 = torch.autograd.grad(sum((o * dy).sum() for o, dy in zip(one, dys)), leaves, allow_unused=True)
    for t, o in zip(two, one):
        assert rel_rms(t, o) < 1e-13
    for a, b in zip(g2, g1):
        assert (a is None) == (b is None)
        if a is not None:
            assert rel_rms(a, b) < 1e-12
