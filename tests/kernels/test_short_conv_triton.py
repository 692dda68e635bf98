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


@pytest.mark.parametrize("B,T,C,W", [(2, 70, 130, 4), (1, 1, 8, 4), (3, 3, 64, 4), (1, 129, 200, 3)])
def test_forward_and_gradients_match_float64(seed, B, T, C, W):
    x = torch.randn(B, T, C, device=DEV, requires_grad=True)
    w = torch.randn(C, W, device=DEV, requires_grad=True)
    dy = torch.randn(B, T, C, device=DEV)
    y = short_conv_silu_triton(x, w)
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
    assert rel_rms(short_conv_silu_triton(x, w), reference(x, w)) < 4e-3


def test_layer_triton_equals_torch_and_state_continues(seed):
    conv_t, conv_c = ShortConvolution(48, backend="triton").to(DEV), ShortConvolution(48, backend="torch").to(DEV)
    conv_c.load_state_dict(conv_t.state_dict())
    x = torch.randn(2, 11, 48, device=DEV)
    y_t, tail_t = conv_t(x)
    y_c, tail_c = conv_c(x)
    torch.testing.assert_close(y_t, y_c, rtol=1e-5, atol=1e-6)
    assert torch.equal(tail_t, tail_c)
    # the state from the Triton pass continues the sequence exactly as the torch pass does
    nxt = torch.randn(2, 1, 48, device=DEV)
    torch.testing.assert_close(conv_t(nxt, tail_t)[0], conv_c(torch.cat([x, nxt], 1))[0][:, -1:], rtol=1e-5,
                               atol=1e-6)
    short = torch.randn(1, 2, 48, device=DEV)  # T < W - 1: the state is zero-padded on the left
    assert torch.equal(conv_t(short)[1], conv_c(short)[1])


def test_bad_shapes_raise():
    with pytest.raises(ValueError, match="weight"):
        short_conv_silu_triton(torch.randn(1, 4, 8), torch.randn(7, 4))
    with pytest.raises(ValueError, match="backend"):
        ShortConvolution(8, backend="cuda")
