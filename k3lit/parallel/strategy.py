"""ExpertParallelStrategy: Lightning's ModelParallelStrategy with a ``data_parallel_replicate x data_parallel x
expert_parallel`` mesh (FSDP2, hybrid sharding and expert parallelism).

    trainer = L.Trainer(strategy=ExpertParallelStrategy(expert_parallel_size=2), devices=4)
    k3lit fit --config recipes/tiny.yaml --trainer.strategy=k3lit.parallel.ExpertParallelStrategy \\
        --trainer.strategy.expert_parallel_size=2 --trainer.devices=4
    # 4 nodes x 8 GPUs: experts over a node's 8 GPUs, dense parts sharded within a node, replicated across nodes
    ExpertParallelStrategy(data_parallel_replicate_size=4, expert_parallel_size=8)  # data_parallel = 32 / 32 = 1

What it adds to ``ModelParallelStrategy`` (whose FSDP2 setup, materialisation and torch-distributed-checkpoint
saving/loading it keeps):

* the mesh: named axes ``(data_parallel_replicate, data_parallel, expert_parallel)`` (torchtitan's
  ``dp_replicate``, ``dp_shard / ep`` and ``ep``; ``expert_parallel`` innermost, so an expert group is
  consecutive ranks, i.e. GPUs of one node), ``-1`` fills one size from the world size, checked in
  ``setup_environment`` with errors that print every factor (:func:`mesh_shape`); it reaches
  ``LightningModule.configure_model`` as ``self.device_mesh``, where :func:`k3lit.parallel.parallelize`
  applies expert parallelism and FSDP2 (HSDP when ``data_parallel_replicate > 1``);
* data: every one of the ranks, replicas included, reads its own samples (``distributed_sampler_kwargs``
  spans the whole world; litdata reads the same rank and world size from ``torch.distributed``);
* CPU: gloo works -- the parent picks gloo for a CPU root device and only uses device ids for NCCL; we only
  make sure ``barrier`` never passes ``device_ids`` to a non-NCCL backend (see :meth:`barrier`).

Gradient clipping across expert and data shards is :func:`k3lit.parallel.clip_grad_norm_` (the norm of the
whole model from DTensor gradients on different meshes); :class:`~k3lit.train.module.K3LitModule` uses it.
Checkpoints are folders written by torch distributed checkpoint; they load into another world size or mesh
(DTensor resharding; replicated shards are written once), e.g. a 4-rank HSDP run resumed on 2 or 1 processes.
"""

from __future__ import annotations

import math
from datetime import timedelta
from typing import Any

import torch
from lightning.pytorch.strategies import ModelParallelStrategy
from lightning.pytorch.utilities import rank_zero_info
from torch.distributed.constants import default_pg_timeout
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from typing_extensions import override

from k3lit import lightning_compat as compat
from k3lit.parallel.parallelize import DP, EP, REPLICATE

__all__ = ["ExpertParallelStrategy", "mesh_shape"]


def mesh_shape(
    world_size: int,
    data_parallel_replicate_size: int = 1,
    data_parallel_size: int = -1,
    expert_parallel_size: int = 1,
    n_experts: int | None = None,
) -> tuple[int, int, int]:
    """Resolve ``(replicate, dp, ep)`` with ``replicate · dp · ep = world_size``; one size may be -1 (filled
    from the world size).

    Args:
        world_size: processes (nodes x devices per node).
        data_parallel_replicate_size: model replicas (HSDP groups); 1 = plain FSDP2.
        data_parallel_size: FSDP2 shards of each expert within a replica.
        expert_parallel_size: ranks an MoE layer's experts are split over.
        n_experts: if given, ``expert_parallel_size`` must divide it.

    Returns:
        ``(data_parallel_replicate, data_parallel, expert_parallel)`` sizes, all >= 1.

    Raises:
        ValueError: more than one size is -1, a size is < 1 (other than -1), the sizes do not multiply to the
            world size, or ``expert_parallel_size`` does not divide ``n_experts``; the message prints every
            factor and what to change.
    """
    sizes = {"data_parallel_replicate_size": data_parallel_replicate_size, "data_parallel_size": data_parallel_size,
             "expert_parallel_size": expert_parallel_size}
    what = f"world_size={world_size}, " + ", ".join(f"{k}={v}" for k, v in sizes.items())
    free = [k for k, v in sizes.items() if v == -1]
    if len(free) > 1:
        raise ValueError(f"ExpertParallelStrategy: at most one of the mesh sizes may be -1 ({what})")
    for name, v in sizes.items():
        if v != -1 and v < 1:
            raise ValueError(f"ExpertParallelStrategy: {name} must be >= 1 or -1 ({what})")
    fixed = 1
    for v in sizes.values():
        fixed *= v if v != -1 else 1
    if free:
        if world_size % fixed:
            others = " x ".join(f"{k}={v}" for k, v in sizes.items() if v != -1)
            raise ValueError(
                f"ExpertParallelStrategy: {others} = {fixed} does not divide world_size={world_size} ({what}): "
                f"pick sizes whose product divides {world_size}"
            )
        sizes[free[0]] = world_size // fixed
    r, dp, ep = sizes.values()
    if r * dp * ep != world_size:
        raise ValueError(
            f"ExpertParallelStrategy: data_parallel_replicate_size x data_parallel_size x expert_parallel_size = "
            f"{r} x {dp} x {ep} = {r * dp * ep} != world_size={world_size} ({what}): set one of them to -1 to fill "
            f"it from the world size"
        )
    if n_experts is not None and n_experts % ep:
        raise ValueError(
            f"ExpertParallelStrategy: expert_parallel_size={ep} does not divide n_experts={n_experts} ({what}): "
            f"choose an expert_parallel_size that divides both {n_experts} and {world_size}"
        )
    return r, dp, ep


class ExpertParallelStrategy(ModelParallelStrategy):
    """FSDP2 (or HSDP) + expert parallelism over a ``(data_parallel_replicate, data_parallel, expert_parallel)``
    device mesh; sizes multiply to the world size (:func:`mesh_shape`).

    Args:
        expert_parallel_size: ranks an MoE layer's experts are split over (must divide the world size and
            every MoE's expert count); -1 = what the other two sizes leave.
        data_parallel_size: FSDP2 shards of each expert within a replica; the dense parameters are sharded
            over ``data_parallel x expert_parallel`` ranks (the shard group, best one node);
            -1 (default) = ``world_size / (data_parallel_replicate_size x expert_parallel_size)``.
        data_parallel_replicate_size: replicas of the sharded model (hybrid sharding: gradients are
            reduce-scattered within a shard group, then all-reduced across the replicas, e.g. one replica per
            node); 1 (default) = plain FSDP2 over all ranks.
        save_distributed_checkpoint: True (default): one torch-distributed-checkpoint folder, each rank writes
            its shards; False: full state gathered into one file on rank 0.
        process_group_backend: None picks NCCL on GPU, gloo on CPU.
        timeout: collective timeout.
    """

    def __init__(
        self,
        expert_parallel_size: int = 1,
        data_parallel_size: int = -1,
        data_parallel_replicate_size: int = 1,
        save_distributed_checkpoint: bool = True,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
    ) -> None:
        super().__init__(
            data_parallel_size="auto",
            tensor_parallel_size="auto",
            save_distributed_checkpoint=save_distributed_checkpoint,
            process_group_backend=process_group_backend,
            timeout=timeout,
        )
        self.expert_parallel_size = expert_parallel_size
        self.data_parallel_size = data_parallel_size
        self.data_parallel_replicate_size = data_parallel_replicate_size

    @override
    def setup_environment(self) -> None:
        # Replaces the parent's (data_parallel, tensor_parallel) mesh by ours; process group setup unchanged.
        compat.setup_distributed(self)
        assert self.lightning_module is not None
        # expert_parallel_size must divide every MoE's expert count, i.e. their gcd (a K3LM has a single count)
        counts = [m.n_experts for m in self.lightning_module.modules() if hasattr(m, "dispatcher")]
        shape = mesh_shape(self.world_size, self.data_parallel_replicate_size, self.data_parallel_size,
                           self.expert_parallel_size, n_experts=math.gcd(*counts) if counts else None)
        compat.set_device_mesh(self, init_device_mesh(self.root_device.type, shape, mesh_dim_names=(REPLICATE, DP, EP)))
        rank_zero_info(f"ExpertParallelStrategy: device mesh {REPLICATE}={shape[0]} x {DP}={shape[1]} x {EP}={shape[2]}"
                       f" ({'HSDP' if shape[0] > 1 else 'FSDP2'}; world_size={self.world_size})")

    @property
    def mesh(self) -> DeviceMesh:
        """The ``(data_parallel_replicate, data_parallel, expert_parallel)`` mesh (after ``setup_environment``)."""
        return self.device_mesh

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        # Every rank (replicas, data- and expert-parallel ranks alike) consumes its own tokens: shard data over
        # the world.
        return {"num_replicas": self.world_size, "rank": self.global_rank}

    @override
    def barrier(self, name: str | None = None) -> None:
        # The parent passes device_ids only for NCCL; keep it explicit so gloo (CPU) never sees them.
        if not torch.distributed.is_available() or not torch.distributed.is_initialized():
            return
        if torch.distributed.get_backend() == "nccl":
            torch.distributed.barrier(device_ids=[self.root_device.index])
        else:
            torch.distributed.barrier()
