"""Expert-load accounting in K3LitModule: every token counted once per optimizer step, under activation
recomputation and gradient accumulation."""

from __future__ import annotations

import pytest
import torch

from k3lit.model import ModelConfig
from k3lit.train.module import K3LitModule


@pytest.mark.parametrize("policy", ["none", "layer"])
def test_micro_batches_counted_once(seed, policy):
    cfg = ModelConfig(vocab_size=32, dim=32, n_layers=2, layer_pattern="A", n_heads=2, head_dim=16, mlp_hidden=32,
                      n_experts=4, top_k=2, expert_dim=16, first_dense_layers=0, residual="plain",
                      activation_checkpointing=policy, balancer="quantile_hist")
    module = K3LitModule(cfg)
    B, T = 3, 9
    for _ in range(2):  # two micro-batches of one optimizer step (gradient accumulation)
        loss = module.training_step(torch.randint(0, 32, (B, T + 1)), 0)
        loss.backward()  # recomputes the layers under "layer": must not record again
    assert int(module.train_load.tokens) == 2 * B * T
    assert (module.train_load.load.sum(1) == 2 * B * T * cfg.top_k).all()
    assert all(m.pending_tokens == 2 * B * T for m in module.model.moe_layers())
    with pytest.warns(UserWarning):  # self.log without a trainer only warns
        module.on_before_optimizer_step(None)
    assert int(module.train_load.tokens) == 0  # consumed once per optimizer step
    assert module.last_expert_fraction.shape == (2, 4)
    torch.testing.assert_close(module.last_expert_fraction.sum(1), torch.ones(2))
    assert all(m.pending_tokens == 0 and m.expert_bias.abs().sum() > 0 for m in module.model.moe_layers())
