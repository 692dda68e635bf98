"""Chunked PyTorch KDA against the float64 token-by-token recurrence, forward and backward, at the edges."""

import math

import pytest
import torch
import torch.nn.functional as F

from k3lit.ops.kda import bounded_log_decay, check_gate_bound, kda, kda_reference, largest_safe_chunk
from k3lit.testing import rel_rms


def make_inputs(B, T, H, K, V, g_fill=None, dtype=torch.float64, g_min=-5.0):
    q = F.normalize(torch.randn(B, T, H, K, dtype=dtype), dim=-1)
    k = F.normalize(torch.randn(B, T, H, K, dtype=dtype), dim=-1)
    v = torch.randn(B, T, H, V, dtype=dtype)
    g = bounded_log_decay(torch.randn(B, T, H, K, dtype=dtype) * 4, g_min).to(dtype)
    if g_fill is not None:
        g = torch.full_like(g, g_fill)
    beta = torch.rand(B, T, H, dtype=dtype)
    h0 = torch.randn(B, H, K, V, dtype=dtype)
    return [x.requires_grad_() for x in (q, k, v, g, beta, h0)]


def run_both(xs, **kw):
    q, k, v, g, beta, h0 = xs
    o1, s1 = kda(q, k, v, g, beta, initial_state=h0, output_final_state=True, backend="torch", **kw)
    o2, s2 = kda_reference(q, k, v, g, beta, initial_state=h0, output_final_state=True)
    w_o, w_s = torch.randn_like(o2), torch.randn_like(s2)
    g1 = torch.autograd.grad((o1 * w_o).sum() + (s1 * w_s).sum(), xs)
    g2 = torch.autograd.grad((o2 * w_o).sum() + (s2 * w_s).sum(), xs)
    return (o1, s1, g1), (o2, s2, g2)


@pytest.mark.parametrize(
    "T,K,V,g_fill",
    [
        (100, 16, 8, None),  # T not a multiple of the chunk
        (1, 8, 8, None),  # a single token
        (64, 12, 5, -5.0),  # gate pinned at its bound, K not a power of two
        (70, 7, 9, 0.0),  # no decay at all
        (32, 16, 16, None),  # exactly one chunk
        (17, 33, 20, None),  # below a chunk, odd K
    ],
)
def test_chunk_matches_reference_fwd_bwd(seed, T, K, V, g_fill):
    xs = make_inputs(2, T, 3, K, V, g_fill)
    (o1, s1, g1), (o2, s2, g2) = run_both(xs)
    assert rel_rms(o1, o2) < 1e-12
    assert rel_rms(s1, s2) < 1e-12
    for name, a, b in zip(("dq", "dk", "dv", "dg", "dbeta", "dh0"), g1, g2):
        assert rel_rms(a, b) < 1e-11, name


def test_gate_at_bound_stays_finite_in_float32(seed):
    """g = g_min everywhere makes exp(±(G - G_r)) reach exp(80): the dense path must stay finite and exact."""
    xs = make_inputs(1, 96, 2, 32, 16, g_fill=-5.0)
    q, k, v, g, beta, h0 = (x.detach() for x in xs)
    o32, s32 = kda(q.float(), k.float(), v.float(), g.float(), beta.float(), initial_state=h0.float(),
                   output_final_state=True, backend="torch")
    o64, s64 = kda_reference(q, k, v, g, beta, initial_state=h0, output_final_state=True)
    assert torch.isfinite(o32).all() and torch.isfinite(s32).all()
    assert rel_rms(o32, o64) < 1e-5 and rel_rms(s32, s64) < 1e-5


def test_bf16_inputs(seed):
    xs = make_inputs(2, 80, 2, 32, 32)
    q, k, v, g, beta, _ = (x.detach() for x in xs)
    bf = [t.bfloat16() for t in (q, k, v)]
    o, s = kda(*bf, g.float(), beta.bfloat16(), output_final_state=True, backend="torch")
    o_ref, s_ref = kda_reference(*(t.double() for t in bf), g, beta.bfloat16().double(), output_final_state=True)
    assert o.dtype == torch.bfloat16 and s.dtype == torch.float32
    assert rel_rms(o, o_ref) < 0.005 and rel_rms(s, s_ref) < 0.005


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_autocast_leaves_the_torch_path_in_float32(seed, dtype):
    """Under autocast the chunked PyTorch form still computes in float32 (fp16 matrix products overflowed on the
    rebased exponentials at the gate's bound): the same values and gradients as without autocast, all finite."""
    xs = [x.detach().float().requires_grad_() for x in make_inputs(2, 70, 2, 16, 8, g_fill=-5.0)]
    results = []
    for on in (False, True):
        with torch.autocast("cpu", dtype=dtype, enabled=on):
            o, s = kda(*xs[:5], initial_state=xs[5], output_final_state=True, backend="torch")
        results.append((o, s, *torch.autograd.grad(o.sum() + s.sum(), xs)))
    for a, b in zip(*results):
        assert torch.isfinite(b).all() and torch.equal(a, b)


def test_varlen_equals_separate_sequences(seed):
    lens = [5, 40, 1, 33]
    xs = make_inputs(1, sum(lens), 2, 16, 8)
    q, k, v, g, beta, _ = xs
    h0 = torch.randn(len(lens), 2, 16, 8, dtype=torch.float64, requires_grad=True)
    cu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), dtype=torch.int64)
    o, s = kda(q, k, v, g, beta, initial_state=h0, output_final_state=True, cu_seqlens=cu, backend="torch")
    for n, (lo, hi) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        o_n, s_n = kda_reference(q[:, lo:hi], k[:, lo:hi], v[:, lo:hi], g[:, lo:hi], beta[:, lo:hi],
                                 initial_state=h0[n : n + 1], output_final_state=True)
        assert rel_rms(o[:, lo:hi], o_n) < 1e-12
        assert rel_rms(s[n : n + 1], s_n) < 1e-12
    w = torch.randn_like(o)
    grads = torch.autograd.grad((o * w).sum() + s.sum(), (q, g, h0))
    o_r, s_r = kda_reference(q, k, v, g, beta, initial_state=h0, output_final_state=True, cu_seqlens=cu)
    grads_r = torch.autograd.grad((o_r * w).sum() + s_r.sum(), (q, g, h0))
    for a, b in zip(grads, grads_r):
        assert rel_rms(a, b) < 1e-11


def test_state_carry_equals_one_pass(seed):
    q, k, v, g, beta, h0 = (x.detach() for x in make_inputs(2, 90, 2, 16, 8))
    o_full, s_full = kda(q, k, v, g, beta, initial_state=h0, output_final_state=True, backend="torch")
    t = 37
    o_a, s_a = kda(q[:, :t], k[:, :t], v[:, :t], g[:, :t], beta[:, :t], initial_state=h0,
                   output_final_state=True, backend="torch")
    o_b, s_b = kda(q[:, t:], k[:, t:], v[:, t:], g[:, t:], beta[:, t:], initial_state=s_a,
                   output_final_state=True, backend="torch")
    assert rel_rms(torch.cat([o_a, o_b], 1), o_full) < 1e-12
    assert rel_rms(s_b, s_full) < 1e-12


def test_near_collinear_keys(seed):
    """Keys that nearly repeat make (I + diag(beta) A_kk) ill-conditioned; the WY solve must stay exact."""
    xs = make_inputs(1, 64, 2, 16, 8)
    q, k, v, g, beta, h0 = (x.detach() for x in xs)
    k = F.normalize(k[:, :1] + 1e-3 * torch.randn_like(k), dim=-1)
    beta = torch.full_like(beta, 0.999)
    o, s = kda(q, k, v, g, beta, initial_state=h0, output_final_state=True, backend="torch")
    o_r, s_r = kda_reference(q, k, v, g, beta, initial_state=h0, output_final_state=True)
    assert rel_rms(o, o_r) < 1e-10 and rel_rms(s, s_r) < 1e-10


def test_unsafe_gate_bound_raises():
    assert largest_safe_chunk(-5.0) == 32
    assert largest_safe_chunk(-2.0) == 64
    # the limit |g_min| * ceil((C - 1) / 2) <= 87 at its edges: 87 / 32, 87 / 16, 87 / 8
    assert [largest_safe_chunk(g) for g in (-2.71875, -2.72, -5.4375, -5.44, -10.875)] == [64, 32, 32, 16, 16]
    check_gate_bound(-5.0, 32)
    with pytest.raises(ValueError, match="past the limit exp"):
        check_gate_bound(-5.0, 64)
    with pytest.raises(ValueError, match="too strong"):
        largest_safe_chunk(-10.9)
    with pytest.raises(ValueError, match="negative"):
        check_gate_bound(0.5, 16)
    with pytest.raises(ValueError, match="too strong for every supported chunk size"):
        largest_safe_chunk(-20.0)
    xs = make_inputs(1, 8, 1, 4, 4)
    with pytest.raises(ValueError, match="too strong"):
        kda(*xs[:5], g_min=-20.0)
    kda(*xs[:5], g_min=-20.0, chunk_size=4, backend="torch")  # the advice it gives: an explicit small chunk
    with pytest.raises(ValueError, match="past the limit exp"):
        kda(*xs[:5], g_min=-5.0, chunk_size=64)


def test_explicit_triton_backend_on_cpu_without_interpreter_raises(monkeypatch):
    import k3lit.kernels.kda  # noqa: F401 - defined under the interpreter, as the other tests of this process need

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    xs = make_inputs(1, 8, 1, 4, 4)
    with pytest.raises(ValueError, match="backend='triton' needs CUDA tensors"):
        kda(*(x.float().cpu() for x in xs[:5]), backend="triton")


def test_integer_gate_bias_rejected():
    q, k, v, g, beta, _ = (x.detach() for x in make_inputs(1, 8, 2, 4, 4))
    with pytest.raises(ValueError, match="floating-point"):
        kda(q, k, v, g, beta, backend="torch", use_gate_in_kernel=True, gate_bias=torch.zeros(8, dtype=torch.int64))


def test_gate_outside_bound_rejected():
    q, k, v, g, beta, _ = (x.detach() for x in make_inputs(1, 8, 1, 4, 4))
    with pytest.raises(ValueError, match=r"g must lie in \[g_min, 0\]"):
        kda(q, k, v, g - 10, beta, backend="torch")


def test_bad_shapes_raise():
    q, k, v, g, beta, h0 = (x.detach() for x in make_inputs(2, 8, 2, 4, 4))
    with pytest.raises(ValueError, match="beta must be"):
        kda(q, k, v, g, beta[..., :1])
    with pytest.raises(ValueError, match="initial_state must be"):
        kda(q, k, v, g, beta, initial_state=h0[:1])
    with pytest.raises(ValueError, match="B = 1"):
        kda(q, k, v, g, beta, cu_seqlens=torch.tensor([0, 8]))
    with pytest.raises(ValueError, match="backend"):
        kda(q, k, v, g, beta, backend="cuda")


def test_bounded_gate_range(seed):
    e = torch.randn(1000) * 50
    g = bounded_log_decay(e, -5.0)
    assert g.dtype == torch.float32 and g.min() >= -5.0 and g.max() <= 0
    assert math.isclose(bounded_log_decay(torch.zeros(1), -5.0).item(), -2.5)
