"""Apply expert and data parallelism to a :class:`~k3lit.model.K3LM` in one fixed, documented order.

Mesh (built by :class:`~k3lit.parallel.strategy.ExpertParallelStrategy`): ``(data_parallel, expert_parallel)``
= ``(dp, ep)``, ``dp · ep = world size``. Every rank reads its own tokens (the batch is split over all
``dp · ep`` ranks); the ``ep`` ranks of an expert-parallel group exchange tokens so that each expert runs
where its weights live.

Order (torchtitan's habit, so composition is predictable):

1. activation checkpointing -- already part of the model (``ModelConfig.activation_checkpointing``), because
   the block-level policy follows the attention-residual blocks;
2. expert parallelism -- each MoE's stacked expert weights ``[n, ...]`` become DTensors sharded on dim 0 over
   the ``expert_parallel`` axis (rank r keeps experts ``[r n/ep, (r+1) n/ep)``) and the MoE gets that axis'
   process group (``MoE.ep_group``), which switches on the all-to-all dispatch
   (:mod:`k3lit.parallel.dispatch`);
3. FSDP2 on the experts -- ``fully_shard(moe.experts)`` over the remaining ``data_parallel`` axis (the expert
   weights become 2-D DTensors: ``data_parallel`` x ``expert_parallel``), with the local gradient scaled by
   1/ep (``GroupedExperts.grad_scale``): an expert's gradient already sums the tokens of every rank of its ep
   group and FSDP averages over dp, so the result is the gradient of the mean loss over all ranks, like the
   dense gradients;
4. FSDP2 on the dense parts -- ``fully_shard`` on every sublayer's AttnRes read (its own unit: the model calls
   it before the sublayer), on every sublayer (norm, token mixer, router, shared experts), then on the root
   (embedding, final AttnRes, norm, head), over *all* ranks: the flattened
   ``data_parallel x expert_parallel`` axis.

The MoE balancer's ``expert_bias`` is a buffer: FSDP2 neither shards nor casts buffers, so it stays float32
and replicated; its statistics are pooled over the default process group (every rank routes its own tokens
with the same bias) in ``MoE.update_balancer``.

Meshes without an ``expert_parallel`` axis (e.g. Lightning's ``ModelParallelStrategy``: ``data_parallel`` x
``tensor_parallel``) get steps 1 and 4 only, FSDP over ``data_parallel``.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import Shard, distribute_tensor

from k3lit.model import K3LM
from k3lit.nn.moe import MoE

DP, EP = "data_parallel", "expert_parallel"


def dense_mesh(mesh: DeviceMesh, dp_dim: str = DP, ep_dim: str = EP) -> DeviceMesh:
    """The 1-D mesh the dense parameters are sharded over: ``dp_dim`` flattened with ``ep_dim`` if present."""
    if ep_dim in (mesh.mesh_dim_names or ()):
        return mesh[dp_dim, ep_dim]._flatten(f"{dp_dim}_{ep_dim}")
    return mesh[dp_dim]


def parallelize(
    model: K3LM,
    mesh: DeviceMesh,
    param_dtype: torch.dtype | None = None,
    dp_dim: str = DP,
    ep_dim: str = EP,
) -> K3LM:
    """Shard ``model`` in place: expert parallelism over ``ep_dim`` (if the mesh has it), FSDP2 over the rest.

    Args:
        model: the single-device model (parameters materialised, identical on every rank).
        mesh: a device mesh with a dimension named ``dp_dim`` and optionally one named ``ep_dim``.
        param_dtype: compute dtype of the sharded parameters (e.g. ``torch.bfloat16``); gradients are
            reduced in float32. None keeps the parameters' dtype.
        dp_dim: name of the data-parallel mesh dimension.
        ep_dim: name of the expert-parallel mesh dimension.

    Returns:
        The same module, sharded in place.

    Raises:
        ValueError: the mesh has no dimension called ``dp_dim``; or the expert count is not divisible by the
            expert-parallel size (the message prints both).
    """
    names = mesh.mesh_dim_names or ()
    if dp_dim not in names:
        raise ValueError(f"device mesh has dimensions {names}; expected one named {dp_dim!r}")
    # Low-precision parameters reduce their gradients in float32; otherwise gradients reduce in their own dtype.
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32 if param_dtype is not None else None)
    moes = [m for m in model.modules() if isinstance(m, MoE)]
    if ep_dim in names:
        ep_mesh = mesh[ep_dim]
        ep = ep_mesh.size()
        for moe in moes:  # step 2: expert parallelism
            if moe.n_experts % ep:
                raise ValueError(
                    f"expert parallelism: n_experts={moe.n_experts} is not divisible by expert_parallel_size={ep} "
                    f"(mesh {dict(zip(names, mesh.shape, strict=True))}): choose an expert_parallel_size that "
                    f"divides {moe.n_experts}"
                )
            for name, p in list(moe.experts.named_parameters(recurse=False)):
                shard = distribute_tensor(p.detach(), ep_mesh, [Shard(0)])
                setattr(moe.experts, name, nn.Parameter(shard, requires_grad=p.requires_grad))
            moe.ep_group = ep_mesh.get_group()
            # An expert's gradient sums the tokens of all ep ranks (all-to-all backward) and FSDP then averages
            # over dp: scale by 1/ep so it is the mean over all dp x ep ranks, like the dense gradients. (Not
            # FSDP's set_gradient_divide_factor: its PREMUL_SUM reduce-scatter does not exist on gloo.)
            moe.experts.grad_scale = 1.0 / ep
        for moe in moes:  # step 3: FSDP2 on the experts over the data-parallel axis
            fully_shard(moe.experts, mesh=mesh[dp_dim], mp_policy=mp)
    dense = dense_mesh(mesh, dp_dim, ep_dim)
    for sub in model.sublayers:  # step 4: FSDP2 on the dense parts over every rank
        if sub.res_mixer is not None:  # called before its sublayer's forward: needs its own unshard hook
            fully_shard(sub.res_mixer, mesh=dense, mp_policy=mp)
        fully_shard(sub, mesh=dense, mp_policy=mp)
    fully_shard(model, mesh=dense, mp_policy=mp)
    return model
