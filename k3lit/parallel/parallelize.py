"""Apply expert and data parallelism to a :class:`~k3lit.model.K3LM` in one fixed, documented order.

Mesh (built by :class:`~k3lit.parallel.strategy.ExpertParallelStrategy`): ``(data_parallel_replicate,
data_parallel, expert_parallel)`` = ``(r, dp, ep)``, ``r · dp · ep = world size``, ``expert_parallel``
innermost (consecutive ranks, i.e. one node's GPUs). Every rank reads its own tokens (the batch is split over
all ranks); the ``ep`` ranks of an expert-parallel group exchange tokens so that each expert runs where its
weights live. A *shard group* is the ``dp · ep`` ranks of one replica; with ``r > 1`` the model is sharded
within a shard group and replicated across the ``r`` groups (hybrid sharding, HSDP: FSDP2 ``fully_shard``
on a 2-D ``(replicate, shard)`` mesh reduce-scatters gradients within a group, then all-reduces them across
groups).

Order (torchtitan's habit, so composition is predictable):

1. activation checkpointing -- already part of the model (``ModelConfig.activation_checkpointing``), because
   the block-level policy follows the attention-residual blocks;
2. expert parallelism -- each MoE's stacked expert weights ``[n, ...]`` become DTensors sharded on dim 0 over
   the ``expert_parallel`` axis (rank r keeps experts ``[r n/ep, (r+1) n/ep)``), and the MoE dispatches its
   tokens by all-to-all over that axis (``MoE.dispatcher = ExpertParallelDispatch(group)``,
   :mod:`k3lit.parallel.dispatch`);
3. FSDP2 on the experts -- ``fully_shard(moe.experts)`` over the ``data_parallel`` axis, on the 2-D
   ``(data_parallel_replicate, data_parallel)`` mesh when ``r > 1`` (the expert weights become DTensors on
   ``[data_parallel_replicate x] data_parallel x expert_parallel``), with the local gradient scaled by 1/ep
   (``GroupedExperts.grad_scale``): an expert's gradient already sums the tokens of every rank of its ep group
   and FSDP averages over the ``r · dp`` others, so the result is the gradient of the mean loss over all
   ranks, like the dense gradients;
4. FSDP2 on the dense parts -- ``fully_shard`` on every sublayer's AttnRes read (its own unit: the model calls
   it before the sublayer), on every sublayer (norm, token mixer, router, shared experts), then on the root
   (embedding, final AttnRes, norm, head), sharded over the whole shard group (``data_parallel x
   expert_parallel`` flattened) and, when ``r > 1``, replicated over ``data_parallel_replicate``.

The MoE balancer's ``expert_bias`` is a buffer: FSDP2 neither shards nor casts buffers, so it stays float32
and replicated; its statistics are pooled over the default process group (every rank routes its own tokens
with the same bias) in ``MoE.update_balancer``.

Meshes without an ``expert_parallel`` axis (e.g. Lightning's ``ModelParallelStrategy``: ``data_parallel`` x
``tensor_parallel``) get steps 1 and 4 only, FSDP over ``data_parallel``; without a
``data_parallel_replicate`` axis (or with one of size 1) nothing is replicated: plain FSDP2.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import Shard, distribute_tensor

from k3lit.model import K3LM
from k3lit.nn.moe import MoE
from k3lit.parallel.dispatch import ExpertParallelDispatch

REPLICATE, DP, EP = "data_parallel_replicate", "data_parallel", "expert_parallel"


def _replicas(mesh: DeviceMesh, replicate_dim: str) -> DeviceMesh | None:
    """The replicate axis when the mesh has one of size > 1 (hybrid sharding), else None."""
    if replicate_dim in (mesh.mesh_dim_names or ()) and mesh[replicate_dim].size() > 1:
        return mesh[replicate_dim]
    return None


def dense_mesh(mesh: DeviceMesh, dp_dim: str = DP, ep_dim: str = EP, replicate_dim: str = REPLICATE) -> DeviceMesh:
    """The mesh ``fully_shard`` gets for the dense parameters.

    1-D: ``dp_dim`` flattened with ``ep_dim`` if present (the shard group). 2-D ``(replicate_dim, shard group)``
    when the mesh has a ``replicate_dim`` axis of size > 1: FSDP2 then shards within a group and replicates
    across groups (HSDP).
    """
    if ep_dim in (mesh.mesh_dim_names or ()):
        shard = mesh[dp_dim, ep_dim]._flatten(f"{dp_dim}_{ep_dim}")
    else:
        shard = mesh[dp_dim]
    replicas = _replicas(mesh, replicate_dim)
    return shard if replicas is None else DeviceMesh._concatenate([replicas, shard])


def expert_mesh(mesh: DeviceMesh, dp_dim: str = DP, replicate_dim: str = REPLICATE) -> DeviceMesh:
    """The mesh ``fully_shard`` gets for the (expert-parallel) experts: ``dp_dim``, or ``(replicate_dim,
    dp_dim)`` when the mesh has a ``replicate_dim`` axis of size > 1 (HSDP)."""
    return mesh[dp_dim] if _replicas(mesh, replicate_dim) is None else mesh[replicate_dim, dp_dim]


def parallelize(
    model: K3LM,
    mesh: DeviceMesh,
    param_dtype: torch.dtype | None = None,
    dp_dim: str = DP,
    ep_dim: str = EP,
    replicate_dim: str = REPLICATE,
) -> K3LM:
    """Shard ``model`` in place: expert parallelism over ``ep_dim`` (if the mesh has it), FSDP2 over the rest,
    replicated over ``replicate_dim`` (if the mesh has it with size > 1: HSDP).

    Args:
        model: the single-device model, either materialised and identical on every rank, or built on the meta
            device (nothing allocated): then ``model.to_empty(device=...)`` and :func:`init_sharded` allocate
            and initialise only this rank's shards (``K3LitModule.configure_model`` does).
        mesh: a device mesh with a dimension named ``dp_dim`` and optionally ones named ``ep_dim`` and
            ``replicate_dim`` (the order ``(replicate_dim, dp_dim, ep_dim)`` keeps expert groups on consecutive
            ranks).
        param_dtype: compute dtype of the sharded parameters (e.g. ``torch.bfloat16``); gradients are
            reduced in float32. None keeps the parameters' dtype.
        dp_dim: name of the data-parallel mesh dimension FSDP2 shards over.
        ep_dim: name of the expert-parallel mesh dimension.
        replicate_dim: name of the mesh dimension the model is replicated over (hybrid sharding).

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
            moe.dispatcher = ExpertParallelDispatch(ep_mesh.get_group())
            # An expert's gradient sums the tokens of all ep ranks (all-to-all backward) and FSDP then averages
            # over (r x) dp: scale by 1/ep so it is the mean over all ranks, like the dense gradients. (Not
            # FSDP's set_gradient_divide_factor: its PREMUL_SUM reduce-scatter does not exist on gloo.)
            moe.experts.grad_scale = 1.0 / ep
        experts = expert_mesh(mesh, dp_dim, replicate_dim)
        for moe in moes:  # step 3: FSDP2 (or HSDP) on the experts over the data-parallel axis
            fully_shard(moe.experts, mesh=experts, mp_policy=mp)
    dense = dense_mesh(mesh, dp_dim, ep_dim, replicate_dim)
    for sub in model.sublayers:  # step 4: FSDP2 (or HSDP) on the dense parts over the shard group
        if sub.res_mixer is not None:  # called before its sublayer's forward: needs its own unshard hook
            fully_shard(sub.res_mixer, mesh=dense, mp_policy=mp)
        fully_shard(sub, mesh=dense, mp_policy=mp)
    fully_shard(model, mesh=dense, mp_policy=mp)
    return model


def init_sharded(model: K3LM, mesh: DeviceMesh, dp_dim: str = DP, ep_dim: str = EP) -> K3LM:
    """Initialise the shards of a model built on the meta device, sharded by :func:`parallelize` and allocated
    with ``model.to_empty(device=...)`` (only this rank's shards): :meth:`K3LM.init_weights` on every rank.

    On a CUDA mesh DTensor's RNG tracker gives every shard its own part of one random stream. A CPU mesh has no
    tracker, and each rank would draw its shards from its own generator, which every rank seeds alike (equal
    shards): so each shard position (the coordinate on ``dp_dim`` x ``ep_dim``) draws from the generator
    reseeded with one random number plus its index, replicas alike; the number is rank zero's, broadcast (the
    ranks' generators need not agree: rank zero alone prepares the data, which may draw from it); the global
    generator's state is restored afterwards.

    Args:
        model: the output of :func:`parallelize` for a model built under ``torch.device("meta")``, after
            ``to_empty``.
        mesh: the mesh it was parallelized over.
        dp_dim, ep_dim: names of the mesh dimensions parameters are sharded over (as for :func:`parallelize`).

    Returns:
        The same module: every parameter and buffer initialised, distributed as in ``K3LM(config)``.
    """
    if mesh.device_type != "cpu":
        model.init_weights()
        return model
    index = 0
    for name in (dp_dim, ep_dim):
        if name in (mesh.mesh_dim_names or ()):
            index = index * mesh[name].size() + mesh[name].get_local_rank()
    shared = torch.randint(2**62, ())
    if dist.is_initialized():
        dist.broadcast(shared, src=0)
    with torch.random.fork_rng(devices=[]):
        torch.default_generator.manual_seed(int(shared) + index)  # CPU generator only
        model.init_weights()
    return model
