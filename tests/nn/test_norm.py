"""k3lit.nn.norm.RMSNorm: torch's RMSNorm, with the weight cast to a bf16 / fp16 input's dtype."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from k3lit.nn.norm import RMSNorm
from k3lit.testing import rel_rms


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_full_precision_inputs_take_torchs_path(seed, dtype):
    ours, ref = RMSNorm(40, eps=1e-6).to(dtype), nn.RMSNorm(40, eps=1e-6).to(dtype)
    with torch.no_grad():
        ours.weight.normal_()
        ref.weight.copy_(ours.weight)
    x = torch.randn(3, 5, 40, dtype=dtype)
    assert torch.equal(ours(x), ref(x))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_input_with_float32_weight(seed, dtype):
    """Output: the norm in the input's dtype with the weight rounded to it; the weight's gradient is float32 and
    matches float64 to the input dtype's rounding."""
    norm = RMSNorm(64, eps=1e-6)
    with torch.no_grad():
        norm.weight.normal_()
    x = torch.randn(4, 7, 64).to(dtype)
    y = norm(x)
    assert y.dtype == dtype and torch.equal(y, F.rms_norm(x, (64,), norm.weight.to(dtype), 1e-6))
    dy = torch.randn(4, 7, 64).to(dtype)
    (y.float() * dy.float()).sum().backward()
    w64 = norm.weight.detach().double().requires_grad_()
    (F.rms_norm(x.double(), (64,), w64, 1e-6) * dy.double()).sum().backward()
    assert norm.weight.grad.dtype == torch.float32 and rel_rms(norm.weight.grad, w64.grad) < 1e-2


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (run on the H200)")
def test_gpu_autocast_keeps_the_input_dtype(seed):
    """Under CUDA autocast (which upcasts ``rms_norm`` to float32 on some torch versions) the norm of a bf16 input
    is the fused bf16 kernel's: bf16 out, equal to ``F.rms_norm`` with autocast off and the weight in bf16."""
    norm = RMSNorm(1024, eps=1e-6).cuda()
    with torch.no_grad():
        norm.weight.normal_()
    x = torch.randn(8, 1024, device="cuda").bfloat16()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        y = norm(x)
    assert y.dtype == torch.bfloat16 and torch.equal(y, F.rms_norm(x, (1024,), norm.weight.bfloat16(), 1e-6))
