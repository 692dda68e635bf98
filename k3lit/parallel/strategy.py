"""ExpertParallelStrategy: Lightning's ModelParallelStrategy with a ``data_parallel x expert_parallel`` mesh.

    trainer = L.Trainer(strategy=ExpertParallelStrategy(expert_parallel_size=2), devices=4)
    k3lit fit --config recipes/tiny.yaml --trainer.strategy=k3lit.parallel.ExpertParallelStrategy \\
        --trainer.strategy.expert_parallel_size=2 --trainer.devices=4

What it adds to ``ModelParallelStrategy`` (whose FSDP2 setup, materialisation and torch-distributed-checkpoint
saving/loading it keeps):

* the mesh: named axes ``data_parallel`` and ``expert_parallel`` (``-1`` fills from the world size), checked
  in ``setup_environment`` with errors that print every factor; it reaches ``LightningModule.configure_model``
  as ``self.device_mesh``, where :func:`k3lit.parallel.parallelize` applies expert parallelism and FSDP2;
* data: every one of the ``dp x ep`` ranks reads its own samples (``distributed_sampler_kwargs`` spans the
  whole world; litdata reads the same rank and world size from ``torch.distributed``);
* CPU: gloo works -- the parent picks gloo for a CPU root device and only uses device ids for NCCL; we only
  make sure ``barrier`` never passes ``device_ids`` to a non-NCCL backend (see :meth:`barrier`).

Gradient clipping across expert and data shards is :func:`k3lit.parallel.clip_grad_norm_` (the norm of the
whole model from DTensor gradients on different meshes); :class:`~k3lit.train.module.K3LitModule` uses it.
Checkpoints are folders written by torch distributed checkpoint; they load into another world size or mesh
(DTensor resharding), e.g. a 2-rank ``ep=2`` run resumed on one process.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import torch
from lightning.pytorch.strategies import ModelParallelStrategy
from torch.distributed.constants import default_pg_timeout
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from typing_extensions import override

from k3lit.parallel.parallelize import DP, EP

__all__ = ["ExpertParallelStrategy", "mesh_shape"]


def mesh_shape(world_size: int, data_parallel_size: int, expert_parallel_size: int) -> tuple[int, int]:
    """Resolve ``(dp, ep)`` with ``dp · ep = world_size``; one of them may be -1 (fill from the world size).

    Raises:
        ValueError: both are -1, a size is < 1 (other than -1), or the product is not the world size; the
            message prints every factor.
    """
    dp, ep = data_parallel_size, expert_parallel_size
    what = f"world_size={world_size}, data_parallel_size={dp}, expert_parallel_size={ep}"
    if dp == -1 and ep == -1:
        raise ValueError(f"ExpertParallelStrategy: at most one of the mesh sizes may be -1 ({what})")
    for name, v in ((DP, dp), (EP, ep)):
        if v != -1 and v < 1:
            raise ValueError(f"ExpertParallelStrategy: {name} size must be >= 1 or -1 ({what})")
    if dp == -1:
        if world_size % ep:
            raise ValueError(
                f"ExpertParallelStrategy: expert_parallel_size={ep} does not divide world_size={world_size} "
                f"({what}): pick an expert_parallel_size among the divisors of {world_size}"
            )
        dp = world_size // ep
    elif ep == -1:
        if world_size % dp:
            raise ValueError(
                f"ExpertParallelStrategy: data_parallel_size={dp} does not divide world_size={world_size} ({what})"
            )
        ep = world_size // dp
    if dp * ep != world_size:
        raise ValueError(
            f"ExpertParallelStrategy: data_parallel_size x expert_parallel_size = {dp} x {ep} = {dp * ep} != "
            f"world_size={world_size} ({what})"
        )
    return dp, ep


class ExpertParallelStrategy(ModelParallelStrategy):
    """FSDP2 + expert parallelism over a ``(data_parallel, expert_parallel)`` device mesh.

    Args:
        expert_parallel_size: ranks an MoE layer's experts are split over (must divide the world size and
            every MoE's expert count); -1 = the whole world.
        data_parallel_size: FSDP shards of each expert (the dense parameters are sharded over all ranks);
            -1 (default) = ``world_size / expert_parallel_size``.
        save_distributed_checkpoint: True (default): one torch-distributed-checkpoint folder, each rank writes
            its shards; False: full state gathered into one file on rank 0.
        process_group_backend: None picks NCCL on GPU, gloo on CPU.
        timeout: collective timeout.
    """

    def __init__(
        self,
        expert_parallel_size: int = 1,
        data_parallel_size: int = -1,
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

    @override
    def setup_environment(self) -> None:
        # Replaces the parent's (data_parallel, tensor_parallel) mesh by ours; process group setup unchanged.
        self._setup_distributed()
        dp, ep = mesh_shape(self.world_size, self.data_parallel_size, self.expert_parallel_size)
        assert self.lightning_module is not None
        for module in self.lightning_module.modules():
            n = getattr(module, "n_experts", None)
            if isinstance(n, int) and hasattr(module, "ep_group") and n % ep:
                raise ValueError(
                    f"ExpertParallelStrategy: expert_parallel_size={ep} does not divide n_experts={n} "
                    f"(world_size={self.world_size} = data_parallel_size {dp} x expert_parallel_size {ep}): "
                    f"choose an expert_parallel_size that divides both {n} and {self.world_size}"
                )
        self._device_mesh = init_device_mesh(self.root_device.type, (dp, ep), mesh_dim_names=(DP, EP))
        self.lightning_module._device_mesh = self._device_mesh

    @property
    def mesh(self) -> DeviceMesh:
        """The ``(data_parallel, expert_parallel)`` mesh (after ``setup_environment``)."""
        return self.device_mesh

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        # Every rank (data- and expert-parallel alike) consumes its own tokens: shard data over the world.
        return {"num_replicas": self.world_size, "rank": self.global_rank}

    @override
    def barrier(self, name: str | None = None) -> None:
        # The parent passes device_ids only for NCCL; keep it explicit so gloo (CPU) never sees them.
        if not torch.distributed.is_available() or not torch.distributed.is_initialized():
            return
        if torch.distributed.get_backend() == "nccl":
            torch.distributed.barrier(device_ids=self._determine_device_ids())
        else:
            torch.distributed.barrier()
