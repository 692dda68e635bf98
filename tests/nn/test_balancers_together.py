"""``update_balancers``: MoE layers whose update is the quantile of their own scores share one batched quantile,
and each gets the bias its own update gives, to the bit."""

from __future__ import annotations

import copy

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from k3lit.nn import MoE, update_balancers
from k3lit.ops import quantile_bias

DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA device (run on the H200)")])]


def _layers(n_layers: int, device: str = "cpu", **kw) -> list[MoE]:
    torch.manual_seed(0)
    layers = [MoE(24, 8, 2, 16, 1, **kw).to(device).train() for _ in range(n_layers)]
    for moe in layers:
        moe.router.weight.data.mul_(8)  # a skewed router: biases far from zero
        for _ in range(2):  # two micro-batches of one optimizer step
            moe(torch.randn(3, 41, 24, device=device))
    return layers


class _Count(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN206
        self.n += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("rate", [1.0, 0.1])
def test_layers_updated_together_get_their_own_updates_to_the_bit(rate, device):
    layers = _layers(5, device, quantile_rate=rate)
    alone = copy.deepcopy(layers)
    count_alone, count = _Count(), _Count()
    with count_alone:
        for moe in alone:
            moe.update_balancer()
    with count:
        update_balancers(layers)
    for a, b in zip(alone, layers, strict=True):
        assert torch.equal(a.expert_bias, b.expert_bias) and a.expert_bias.abs().sum() > 0
        assert a.balancer_step == b.balancer_step == 1 and b.pending_tokens == 0
    assert count_alone.n >= 5 * 20 and count.n <= 40, (count_alone.n, count.n)  # host operators issued


def test_quantile_bias_batches_leading_dimensions():
    g = torch.Generator().manual_seed(3)
    scores, bias = torch.rand(4, 257, 16, generator=g), 0.1 * torch.randn(4, 16, generator=g)
    batched = quantile_bias(scores, bias, 3)
    for i in range(4):
        assert torch.equal(batched[i], quantile_bias(scores[i], bias[i], 3))
    with pytest.raises(ValueError, match=r"bias must be \[\.\.\., n\] = \[4, 16\]"):
        quantile_bias(scores, bias[0], 3)


def test_other_updates_run_alone_and_groups_follow_their_settings():
    """Layers with other tokens, another rate or another balancer are not pooled with the rest; the results equal
    each layer's own update."""
    layers = _layers(3) + _layers(2, quantile_rate=0.5) + _layers(1, balancer="aux_free") + _layers(
        1, capacity_factor=1.0, capacity_mode="quantile")
    layers[1](torch.randn(1, 7, 24))  # a third micro-batch: more tokens than the others
    alone = copy.deepcopy(layers)
    for moe in alone:
        moe.update_balancer()
    update_balancers(layers)
    for a, b in zip(alone, layers, strict=True):
        assert torch.equal(a.expert_bias, b.expert_bias) and torch.equal(a.capacity_threshold, b.capacity_threshold)
        assert b.pending_tokens == 0
