"""Parallelism applied to a single-device K3LM: FSDP2 sharding (and, later, expert parallelism)."""

from k3lit.parallel.parallelize import parallelize

__all__ = ["parallelize"]
