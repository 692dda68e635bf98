import pytest
import torch

from k3lit.ops.permute import dispatch_tokens, sort_slots, undo_sort


@pytest.mark.parametrize("m,k,n", [(1, 1, 3), (7, 2, 4), (33, 3, 5)])
def test_gathers_equal_plain_indexing_forward_and_backward(m, k, n):
    g = torch.Generator().manual_seed(m * 100 + k)
    idx = torch.stack([torch.randperm(n, generator=g)[:k] for _ in range(m)])  # distinct experts per token
    h = torch.randn(m, 6, dtype=torch.float64, generator=g, requires_grad=True)
    order, inverse, _ = sort_slots(idx, n)
    assert torch.equal(idx.reshape(-1)[order], idx.reshape(-1).sort(stable=True).values)
    assert torch.equal(order[inverse], torch.arange(m * k))

    xs = dispatch_tokens(h, order, inverse, k)
    ys = xs * torch.arange(1, m * k + 1, dtype=torch.float64)[:, None]  # row-dependent, so a wrong order shows
    y = undo_sort(ys, order, inverse)
    w = torch.randn(m * k, 6, dtype=torch.float64, generator=g)
    (y * w).sum().backward()

    h_ref = h.detach().clone().requires_grad_()
    ys_ref = h_ref[order // k] * torch.arange(1, m * k + 1, dtype=torch.float64)[:, None]
    y_ref = ys_ref[inverse]
    (y_ref * w).sum().backward()
    torch.testing.assert_close(y, y_ref, rtol=0, atol=0)
    torch.testing.assert_close(h.grad, h_ref.grad, rtol=1e-12, atol=1e-12)  # a k-term sum in another order


def test_gradcheck():
    g = torch.Generator().manual_seed(0)
    idx = torch.randint(0, 4, (5, 2), generator=g)
    order, inverse, _ = sort_slots(idx, 4)
    h = torch.randn(5, 3, dtype=torch.float64, generator=g, requires_grad=True)
    torch.autograd.gradcheck(lambda t: undo_sort(dispatch_tokens(t, order, inverse, 2) ** 2, order, inverse), (h,))


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("m,k,n,dropped", [(1, 1, 3, 0.0), (700, 2, 16, 0.0), (600, 2, 16, 0.2), (513, 4, 6, 0.3),
                                           (300, 3, 40, 0.1)])
def test_sort_slots_is_the_stable_argsort(backend, m, k, n, dropped):
    """Both backends against ``argsort(stable=True)`` with dropped slots (-1) sorted after every expert: the order,
    its inverse and each expert's end. The Triton counting sort (under the interpreter on CPU) takes blocks of 4,096
    / G tokens, G = n + 1 groups padded to a power of two (256 for 6 experts, 128 for 16, 64 for 40): m = 700 spans
    six, and a token may hold two dropped slots."""
    g = torch.Generator().manual_seed(m + k + n)
    idx = torch.stack([torch.randperm(n, generator=g)[:k] for _ in range(m)])
    idx[torch.rand(m, k, generator=g) < dropped] = -1
    order, inverse, ends = sort_slots(idx, n, backend=backend)
    flat = torch.where(idx.reshape(-1) < 0, n, idx.reshape(-1))
    assert torch.equal(order, flat.argsort(stable=True))
    assert torch.equal(inverse[order], torch.arange(m * k))
    assert ends.dtype == torch.int32 and ends.tolist() == [int((flat <= e).sum()) for e in range(n)]
    if dropped:
        assert ((idx == -1).sum(1) > 1).any()  # some token drops two slots


def test_sort_slots_kernel_compiles_into_one_graph():
    idx = torch.randint(0, 8, (300, 2))
    fn = torch.compile(lambda i: sort_slots(i, 8, backend="triton"), fullgraph=True, backend="aot_eager")
    got, want = fn(idx), sort_slots(idx, 8, backend="torch")
    assert all(torch.equal(a, b) for a, b in zip(got, want))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (run on the H200)")
@pytest.mark.parametrize("dropped", [0.0, 0.1])
def test_gpu_sort_slots_at_the_small_recipe_shape(dropped):
    """At ``small``'s MoE shape (m = 16 x 2048 tokens, 16 experts, top-2) the counting sort is the stable argsort,
    and a call after the first synchronises nothing with the host."""
    torch.manual_seed(0)
    idx = torch.rand(16 * 2048, 16, device="cuda").topk(2, dim=-1).indices
    idx[torch.rand(idx.shape, device="cuda") < dropped] = -1
    want = sort_slots(idx, 16, backend="torch")
    got = sort_slots(idx, 16, backend="triton")
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    torch.cuda.set_sync_debug_mode("error")
    try:
        sort_slots(idx, 16, backend="triton")
    finally:
        torch.cuda.set_sync_debug_mode("default")


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_sort_slots_of_no_tokens_and_bad_input(backend):
    order, inverse, ends = sort_slots(torch.empty(0, 2, dtype=torch.int64), 4, backend=backend)
    assert order.numel() == inverse.numel() == 0 and ends.tolist() == [0, 0, 0, 0]
    with pytest.raises(ValueError, match=r"must be a \[m, k\] int64 tensor"):
        sort_slots(torch.zeros(3, 2, dtype=torch.int32), 4, backend=backend)
    with pytest.raises(ValueError, match=r"must be a \[m, k\] int64 tensor"):
        sort_slots(torch.zeros(6, dtype=torch.int64), 4, backend=backend)


def test_triton_backend_on_cpu_tensors_needs_the_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="backend='triton' needs CUDA tensors"):
        sort_slots(torch.zeros(3, 2, dtype=torch.int64), 4, backend="triton")
    with pytest.raises(ValueError, match="backend must be"):
        sort_slots(torch.zeros(3, 2, dtype=torch.int64), 4, backend="cuda")
    assert sort_slots(torch.zeros(3, 2, dtype=torch.int64), 4)[2].tolist() == [6, 6, 6, 6]  # auto: torch on CPU
