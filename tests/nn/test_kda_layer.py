"""The KDA layer: its fused path (q/k L2 norm and gate inside the Triton kernels, under the interpreter on CPU)
gives the outputs and parameter gradients of the float64 token-by-token reference, and decoding one token at a
time continues a prefill exactly."""

from __future__ import annotations

import copy

import torch

from k3lit.nn.kda import KimiDeltaAttention
from k3lit.testing import rel_rms

DEV = "cuda" if torch.cuda.is_available() else "cpu"  # on CPU the Triton path runs under TRITON_INTERPRET=1


def _layer(backend: str) -> KimiDeltaAttention:
    torch.manual_seed(0)
    layer = KimiDeltaAttention(dim=40, n_heads=2, head_dim=24, backend=backend)
    with torch.no_grad():
        layer.gate_bias.normal_()  # a non-zero bias, so its gradient and its place inside the sigmoid count
    return layer


def test_triton_layer_matches_float64_reference(seed):
    triton_layer = _layer("triton").to(DEV)
    ref = copy.deepcopy(triton_layer).double()
    ref.backend, ref.qkv_conv.backend = "reference", "torch"  # float64 token-by-token KDA, torch's conv
    x = torch.randn(2, 45, 40, device=DEV)  # 45 tokens: two chunks of 32, the second partial
    y, _ = triton_layer(x)
    y_ref, _ = ref(x.double())
    dy = torch.randn_like(y_ref)
    (y.double() * dy).sum().backward()
    (y_ref * dy).sum().backward()
    assert rel_rms(y, y_ref) < 2e-5
    for (name, p), p_ref in zip(triton_layer.named_parameters(), ref.parameters()):
        assert rel_rms(p.grad, p_ref.grad) < 2e-5, name


def test_decoding_continues_prefill(seed):
    layer = _layer("torch")
    x = torch.randn(1, 12, 40)
    full, _ = layer(x)
    _, state = layer(x[:, :9], return_state=True)
    steps = []
    for t in range(9, 12):
        y, state = layer(x[:, t : t + 1], state)
        steps.append(y)
    torch.testing.assert_close(torch.cat(steps, 1), full[:, 9:], rtol=1e-5, atol=1e-6)
