"""Parallelism applied to a single-device K3LM: expert parallelism (all-to-all dispatch) and FSDP2 sharding,
through a Lightning strategy (:class:`ExpertParallelStrategy`)."""

from k3lit.parallel.clip import clip_grad_norm_, total_grad_norm
from k3lit.parallel.parallelize import init_sharded, parallelize
from k3lit.parallel.strategy import ExpertParallelStrategy, mesh_shape

__all__ = ["ExpertParallelStrategy", "clip_grad_norm_", "init_sharded", "mesh_shape", "parallelize", "total_grad_norm"]
