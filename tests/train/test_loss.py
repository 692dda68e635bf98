"""The training loss, eager and compiled on its own, against a float64 reference."""

from __future__ import annotations

import torch

from k3lit.model import ModelConfig
from k3lit.train.loss import compiled_next_token_loss, next_token_loss
from k3lit.train.module import K3LitModule


def _reference(logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Loss and its gradient with respect to the logits, in float64: ``mean(lse(z) - z[y])`` and
    ``(softmax(z) - onehot(y)) / N``."""
    z = logits.double().flatten(0, 1)
    y = targets.flatten()
    lse = torch.logsumexp(z, dim=-1)
    loss = (lse - z.gather(1, y[:, None])[:, 0]).mean()
    grad = (torch.exp(z - lse[:, None]) - torch.nn.functional.one_hot(y, z.shape[1]).double()) / z.shape[0]
    return loss, grad.view_as(logits)


def _draw(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    logits = (4 * torch.randn(3, 37, 1000, generator=g)).bfloat16()  # spread wide: softmax far from uniform
    logits[0, 0, 7] = 60.0  # one near-certain position: its gradient entries are tiny
    targets = torch.randint(0, 1000, (3, 37), generator=g)
    targets[0, 0] = 7
    return logits, targets


def _loss_and_grad(fn, logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    z = logits.clone().requires_grad_(True)
    loss = fn(z, targets)
    loss.backward()
    return loss.detach(), z.grad


def test_loss_and_gradient_match_float64_eager_and_compiled():
    """Both forms give the float64 loss to float32 rounding and each gradient entry to the bf16 rounding of the
    float64 value (half a unit in its last place, and float32 noise)."""
    logits, targets = _draw(0)
    want_loss, want_grad = _reference(logits, targets)
    for fn in (next_token_loss, compiled_next_token_loss()):
        loss, grad = _loss_and_grad(fn, logits, targets)
        assert loss.dtype == torch.float32 and grad.dtype == torch.bfloat16
        torch.testing.assert_close(loss.double(), want_loss, rtol=2e-6, atol=0)
        spacing = 2.0 ** (torch.frexp(want_grad).exponent.double() - 8)  # bf16's unit in the last place
        assert ((grad.double() - want_grad).abs() <= 0.5 * spacing * (1 + 1e-3)).all()


def test_compiled_loss_is_one_graph():
    logits, targets = _draw(1)
    explained = torch._dynamo.explain(next_token_loss)(logits, targets)
    assert explained.graph_count == 1 and explained.graph_break_count == 0


def test_a_compiling_module_takes_the_compiled_loss():
    cfg = ModelConfig(vocab_size=64, dim=32, n_layers=2, layer_pattern="A", n_heads=2, head_dim=16)
    eager, compiled = K3LitModule(cfg, compile=False), K3LitModule(cfg, compile=True)
    for module in (eager, compiled):
        module.configure_model()
    assert eager._loss_fn is next_token_loss
    assert compiled._loss_fn is compiled_next_token_loss()
