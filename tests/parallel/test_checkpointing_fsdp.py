"""Activation-checkpointing policies composed with FSDP2 and with expert parallelism (2 gloo processes): same
loss and gradients as no recomputation, bit for bit, and as one process over the whole batch; MoE token
statistics recorded once per forward, not again by the recomputation."""

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from k3lit.model import K3LM, ModelConfig
from k3lit.parallel import parallelize
from k3lit.testing import rel_rms
from tests.parallel._dist import run_workers

CFG = ModelConfig(vocab_size=64, dim=32, n_layers=4, layer_pattern="KKA", n_heads=2, head_dim=16, mlp_hidden=48,
                  n_experts=4, top_k=2, expert_dim=16, kda_backend="torch", residual="block_attnres",
                  attnres_block_size=2)


def loss_and_grads(model: torch.nn.Module, idx: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    logits, _ = model(idx[:, :-1])
    loss = F.cross_entropy(logits.flatten(0, 1), idx[:, 1:].flatten())
    loss.backward()
    grads = {}
    for name, p in model.named_parameters():
        g = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
        grads[name.replace("_checkpoint_wrapped_module.", "")] = g.detach().clone()
    return loss.detach(), grads


def _worker(rank: int, world: int, layout: str) -> None:
    torch.manual_seed(0)
    reference = K3LM(CFG).double()
    idx = torch.randint(0, 64, (2 * world, 17))
    _, single = loss_and_grads(reference, idx)  # one process, whole batch
    if layout == "fsdp":
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("data_parallel",))
    else:  # experts sharded over both ranks, dense parts FSDP over both
        mesh = init_device_mesh("cpu", (1, world), mesh_dim_names=("data_parallel", "expert_parallel"))
    local = idx[2 * rank : 2 * rank + 2]
    results = {}
    for policy in ("none", "layer", "block", "selective"):
        model = K3LM(dataclasses.replace(CFG, activation_checkpointing=policy)).double()
        model.load_state_dict(reference.state_dict())
        parallelize(model, mesh)
        results[policy] = loss_and_grads(model, local)
        for moe in model.moe_layers():  # recorded in the forward only, not again when recomputed in backward
            assert moe.pending_tokens == local[:, :-1].numel(), (policy, moe.pending_tokens)
    for policy, (loss, grads) in results.items():
        assert torch.equal(loss, results["none"][0]), policy
        for name, g in grads.items():
            assert torch.equal(g, results["none"][1][name]), (policy, name)
    errs = {name: rel_rms(g, single[name]) for name, g in results["none"][1].items()}
    assert not {n: e for n, e in errs.items() if e > 1e-12}, errs  # FSDP2 averages the two halves' gradients


@pytest.mark.parametrize("layout", ["fsdp", "expert_parallel"])
def test_checkpoint_policies_compose_with_parallelism(tmp_path, layout):
    run_workers(_worker, 2, layout, tmp_path=tmp_path)
