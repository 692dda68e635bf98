"""Rotary embeddings against the complex-number form, and the property they exist for."""

import pytest
import torch

from k3lit.nn.attention import SoftmaxAttention
from k3lit.ops.rope import rotary


def complex_rotary(x: torch.Tensor, start: int, theta: float) -> torch.Tensor:
    """Channel pair (i, i + d/2) as the complex number x_i + j x_{i+d/2}, multiplied by exp(j p theta^(-2i/d))."""
    d, T = x.shape[-1], x.shape[-2]
    z = torch.complex(x[..., : d // 2], x[..., d // 2 :])
    i = torch.arange(d // 2, dtype=torch.float64)
    p = torch.arange(start, start + T, dtype=torch.float64)
    turned = z * torch.polar(torch.ones(T, d // 2, dtype=torch.float64), p[:, None] * theta ** (-2 * i / d))
    return torch.cat([turned.real, turned.imag], dim=-1)


@pytest.mark.parametrize("start", [0, 7])
def test_rotary_equals_the_complex_rotation(seed, start):
    x = torch.randn(2, 3, 11, 16, dtype=torch.float64)
    torch.testing.assert_close(rotary(x, start, 500.0), complex_rotary(x, start, 500.0), rtol=1e-13, atol=1e-13)


def test_query_key_products_depend_on_the_offset_only(seed):
    q, k = torch.randn(1, 1, 1, 32, dtype=torch.float64), torch.randn(1, 1, 1, 32, dtype=torch.float64)
    dots = [(rotary(q, p + 5, 1e4) * rotary(k, p, 1e4)).sum() for p in (0, 3, 1000)]  # offset 5 each time
    torch.testing.assert_close(dots[1], dots[0], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(dots[2], dots[0], rtol=1e-12, atol=1e-12)
    other = (rotary(q, 6, 1e4) * rotary(k, 0, 1e4)).sum()
    assert (other - dots[0]).abs() > 1e-3  # another offset, another product


def test_rotary_keeps_the_dtype_and_rejects_odd_heads():
    x = torch.randn(1, 1, 4, 8, dtype=torch.bfloat16)
    assert rotary(x, 0, 1e4).dtype == torch.bfloat16
    with pytest.raises(ValueError, match="even head width"):
        rotary(torch.randn(1, 1, 4, 7), 0, 1e4)


def test_attention_with_rotary_embeddings_sees_order(seed):
    """NoPE attention cannot tell two permutations of its past apart at the last position; with rotary
    embeddings it can."""
    x = torch.randn(1, 6, 32, dtype=torch.float64)
    swapped = x[:, [1, 0, 2, 3, 4, 5]]
    for theta, differs in ((None, False), (1e4, True)):
        torch.manual_seed(0)
        attn = SoftmaxAttention(32, 2, 16, rope_theta=theta).double()
        a, b = attn(x)[0][:, -1], attn(swapped)[0][:, -1]
        assert (not torch.allclose(a, b, rtol=1e-12, atol=1e-12)) is differs


def test_compiled_rotary_equals_eager(seed):
    """Under torch.compile the tables come from their own op (not fused into the rotation) and the result is the
    same function."""
    x = torch.randn(2, 3, 16, 8)
    compiled = torch.compile(rotary, fullgraph=True)
    torch.testing.assert_close(compiled(x, 0, 1e4), rotary(x, 0, 1e4), rtol=1e-6, atol=1e-6)
