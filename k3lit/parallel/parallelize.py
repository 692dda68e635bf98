"""Apply data parallelism to a :class:`~k3lit.model.K3LM` in one fixed, documented order.

Order (torchtitan's habit, so composition is predictable):
1. activation checkpointing — already part of the model (``ModelConfig.activation_checkpointing``), because
   the block-level policy follows the attention-residual blocks;
2. FSDP2 ``fully_shard`` on every sublayer, then on the root (embedding, final AttnRes, norm, head).

The MoE balancer's ``expert_bias`` is a buffer: FSDP2 neither shards nor casts buffers, so it stays float32
and replicated; its statistics are pooled over the default process group in ``MoE.update_balancer``.
"""

from __future__ import annotations

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from k3lit.model import K3LM


def parallelize(
    model: K3LM, mesh: DeviceMesh, param_dtype: torch.dtype | None = None, dp_dim: str = "data_parallel"
) -> K3LM:
    """Shard ``model`` with FSDP2 over the ``dp_dim`` axis of ``mesh``.

    Args:
        model: the single-device model (parameters may still be on the meta device).
        mesh: a device mesh with a dimension named ``dp_dim`` (Lightning's ModelParallelStrategy names its
            axes ``data_parallel`` and ``tensor_parallel``).
        param_dtype: compute dtype of the sharded parameters (e.g. ``torch.bfloat16``); gradients are
            reduced in float32. None keeps the parameters' dtype.
        dp_dim: name of the data-parallel mesh dimension.

    Returns:
        The same module, sharded in place.

    Raises:
        ValueError: the mesh has no dimension called ``dp_dim``.
    """
    if dp_dim not in (mesh.mesh_dim_names or ()):
        raise ValueError(f"device mesh has dimensions {mesh.mesh_dim_names}; expected one named {dp_dim!r}")
    dp_mesh = mesh[dp_dim]
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
    for sub in model.sublayers:
        fully_shard(sub, mesh=dp_mesh, mp_policy=mp)
    fully_shard(model, mesh=dp_mesh, mp_policy=mp)
    return model
