"""Operators as functions: KDA, MoE routing and balancing, grouped matmul."""

from k3lit.ops.grouped_mm import grouped_mm
from k3lit.ops.kda import bounded_log_decay, kda, kda_reference
from k3lit.ops.routing import aux_loss, expert_load, max_violation, quantile_bias, route, sign_bias_update

__all__ = [
    "kda",
    "kda_reference",
    "bounded_log_decay",
    "route",
    "quantile_bias",
    "sign_bias_update",
    "aux_loss",
    "expert_load",
    "max_violation",
    "grouped_mm",
]
