"""ExpertLoad: MaxVio and token fractions against hand-computed values."""

from __future__ import annotations

import pytest
import torch

from k3lit.train.metrics import ExpertLoad


def test_expert_load_hand_computed():
    metric = ExpertLoad(n_layers=2, n_experts=4, top_k=2)
    # 4 tokens, k = 2 -> 8 routed slots, mean load 2 per expert
    metric.update(torch.tensor([[5.0, 2.0, 1.0, 0.0], [2.0, 2.0, 2.0, 2.0]]))
    out = metric.compute()
    torch.testing.assert_close(out["max_vio"], torch.tensor([1.5, 0.0]))  # (5 - 2) / 2
    torch.testing.assert_close(out["fraction"], torch.tensor([[5, 2, 1, 0], [2, 2, 2, 2]]) / 8.0)

    # accumulating (MaxVio_global): 4 more tokens -> totals [[6, 4, 3, 3], [2, 5, 5, 4]], mean 4
    metric.update(torch.tensor([[1.0, 2.0, 2.0, 3.0], [0.0, 3.0, 3.0, 2.0]]))
    out = metric.compute()
    torch.testing.assert_close(out["max_vio"], torch.tensor([0.5, 0.25]))
    torch.testing.assert_close(out["fraction"][1], torch.tensor([2.0, 5.0, 5.0, 4.0]) / 16)

    # per batch (MaxVio_batch): reset between batches
    metric.reset()
    metric.update(torch.tensor([[3.0, 3.0, 3.0, 3.0], [6.0, 6.0, 0.0, 0.0]]))
    torch.testing.assert_close(metric.compute()["max_vio"], torch.tensor([0.0, 1.0]))


def test_expert_load_explicit_token_count_and_shapes():
    metric = ExpertLoad(1, 4, 1)
    # 10 tokens of which 2 were dropped (capacity): mean load is still 10 k / n = 2.5
    metric.update(torch.tensor([[4.0, 2.0, 1.0, 1.0]]), n_tokens=10)
    torch.testing.assert_close(metric.compute()["max_vio"], torch.tensor([0.6]))
    with pytest.raises(ValueError, match="loads must be"):
        metric.update(torch.zeros(2, 4))
    with pytest.raises(ValueError, match="top_k"):
        ExpertLoad(1, 4, 5)


def test_expert_load_matches_moe_counts(seed):
    from k3lit.nn import MoE
    from k3lit.ops import max_violation

    layers = [MoE(8, 6, 2, 8).eval() for _ in range(3)]
    metric = ExpertLoad(3, 6, 2)
    total = torch.zeros(3, 6)
    for _ in range(4):
        x = torch.randn(2, 5, 8)
        loads = []
        for moe in layers:
            moe(x)
            loads.append(moe.last_load)
        metric.update(torch.stack(loads))
        total += torch.stack(loads)
    torch.testing.assert_close(metric.compute()["max_vio"], max_violation(total, 2, 4 * 10))
