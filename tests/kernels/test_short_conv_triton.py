"""The Triton short convolution (causal depthwise conv + SiLU) against F.conv1d in float64."""

import pytest
import torch
import torch.nn.functional as F

from k3lit.kernels.short_conv import short_conv_silu_triton
from k3lit.nn.short_conv import ShortConvolution
from k3lit.testing import rel_rms

DEV = "cuda" if torch.cuda.is_available() else "cpu"  # CPU runs the kernels under TRITON_INTERPRET=1


def reference(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Float64 ``silu(conv1d)`` over a zero history: ``x [B, T, C]``, ``w [C, W]``."""
    C, W = w.shape
    xt = F.pad(x.double().transpose(1, 2), (W - 1, 0))
    return F.silu(F.conv1d(xt, w.double()[:, None], groups=C)).transpose(1, 2)


@pytest.mark.gpu  # also on the CPU: the GPU suite checks the compiled kernels against float64 too
@pytest.mark.parametrize("B,T,C,W", [(2, 70, 130, 4), (1, 1, 8, 4), (3, 3, 64, 4), (1, 129, 200, 3)])
def test_forward_and_gradients_match_float64(seed, B, T, C, W):
    x = torch.randn(B, T, C, device=DEV, requires_grad=True)
    w = torch.randn(C, W, device=DEV, requires_grad=True)
    dy = torch.randn(B, T, C, device=DEV)
    (y,) = short_conv_silu_triton(x, w)
    dx, dw = torch.autograd.grad(y, (x, w), dy)
    x64, w64 = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    y64 = reference(x64, w64)
    dx64, dw64 = torch.autograd.grad(y64, (x64, w64), dy.double())
    assert rel_rms(y, y64) < 1e-6
    assert rel_rms(dx, dx64) < 1e-6
    assert rel_rms(dw, dw64) < 1e-6


def test_bf16_sums_in_float32(seed):
    x = torch.randn(2, 40, 96, device=DEV).bfloat16()
    w = torch.randn(96, 4, device=DEV).bfloat16()
    # bf16 in and out, float32 inside: only the final rounding to bf16 (2^-8 relative) remains
    assert rel_rms(short_conv_silu_triton(x, w)[0], reference(x, w)) < 4e-3


@pytest.mark.parametrize("B,T,C", [(2, 70, 3 * 40), (1, 5, 3 * 64), (1, 9, 3 * 128), (2, 33, 3 * 100)])
def test_three_parts_are_the_channel_groups_to_the_bit(seed, B, T, C):
    """KDA's q, k, v: the output as three contiguous channel groups and their gradients read where they are give
    what the one-tensor form gives for the joined tensors, bit for bit (the same sums; only where they are
    stored differs): with 64-channel tiles inside one group (C / 3 = 64, 128: the base pointer picked once per tile)
    and straddling two (C / 3 = 40, 100: a base pointer per channel)."""
    x = torch.randn(B, T, C, device=DEV).bfloat16().requires_grad_()
    w = torch.randn(C, 4, device=DEV).bfloat16().requires_grad_()
    dy = torch.randn(B, T, C, device=DEV).bfloat16()
    parts = short_conv_silu_triton(x, w, 3)
    assert len(parts) == 3 and all(p.shape == (B, T, C // 3) and p.is_contiguous() for p in parts)
    got = torch.autograd.grad(parts, (x, w), [t.contiguous() for t in dy.chunk(3, -1)])
    (y,) = short_conv_silu_triton(x, w)
    assert torch.equal(torch.cat(parts, -1), y)
    want = torch.autograd.grad(y, (x, w), dy)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    with pytest.raises(ValueError, match="parts"):
        short_conv_silu_triton(x[..., :-1], w[:-1], 3)


def test_layer_triton_equals_torch_and_state_continues(seed):
    conv_t, conv_c = ShortConvolution(48, backend="triton").to(DEV), ShortConvolution(48, backend="torch").to(DEV)
    conv_c.load_state_dict(conv_t.state_dict())
    x = torch.randn(2, 11, 48, device=DEV)
    (y_t,), tail_t = conv_t(x)
    (y_c,), tail_c = conv_c(x)
    torch.testing.assert_close(y_t, y_c, rtol=1e-5, atol=1e-6)
    assert torch.equal(tail_t, tail_c)
    # the state from the Triton pass continues the sequence exactly as the torch pass does
    nxt = torch.randn(2, 1, 48, device=DEV)
    torch.testing.assert_close(conv_t(nxt, tail_t)[0][0], conv_c(torch.cat([x, nxt], 1))[0][0][:, -1:], rtol=1e-5,
                               atol=1e-6)
    short = torch.randn(1, 2, 48, device=DEV)  # T < W - 1: the state is zero-padded on the left
    assert torch.equal(conv_t(short)[1], conv_c(short)[1])


def test_bad_shapes_raise():
    with pytest.raises(ValueError, match="weight"):
        short_conv_silu_triton(torch.randn(1, 4, 8), torch.randn(7, 4))
    with pytest.raises(ValueError, match="backend"):
        ShortConvolution(8, backend="cuda")
    with pytest.raises(ValueError, match="parts"):
        ShortConvolution(8, parts=3)


def test_three_parts_trace_as_one_graph_with_their_backward(seed):
    """The custom ops (a list of outputs, a list of gradients) under dynamo and AOT autograd, without a graph
    break, give the eager bits."""
    x = torch.randn(2, 20, 3 * 32, device=DEV).requires_grad_()
    w = torch.randn(3 * 32, 4, device=DEV).requires_grad_()

    def f(x, w):  # noqa: ANN001, ANN202
        q, k, v = short_conv_silu_triton(x, w, 3)
        return (q * k).sum() + v.square().sum()

    compiled = torch.compile(f, backend="aot_eager", fullgraph=True)
    got = torch.autograd.grad(compiled(x, w), (x, w))
    want = torch.autograd.grad(f(x, w), (x, w))
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
