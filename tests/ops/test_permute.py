import pytest
import torch

from k3lit.ops.permute import dispatch_tokens, sort_slots, undo_sort


@pytest.mark.parametrize("m,k,n", [(1, 1, 3), (7, 2, 4), (33, 3, 5)])
def test_gathers_equal_plain_indexing_forward_and_backward(m, k, n):
    g = torch.Generator().manual_seed(m * 100 + k)
    idx = torch.stack([torch.randperm(n, generator=g)[:k] for _ in range(m)])  # distinct experts per token
    h = torch.randn(m, 6, dtype=torch.float64, generator=g, requires_grad=True)
    order, inverse = sort_slots(idx)
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
    order, inverse = sort_slots(idx)
    h = torch.randn(5, 3, dtype=torch.float64, generator=g, requires_grad=True)
    torch.autograd.gradcheck(lambda t: undo_sort(dispatch_tokens(t, order, inverse, 2) ** 2, order, inverse), (h,))
