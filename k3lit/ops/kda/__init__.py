"""Kimi Delta Attention: one public op with three faces (float64-able reference, chunked PyTorch, Triton) and the
bounded-gate safety checks. Math: docs/MATH.md §1; chunk size and the overflow bound: k3lit/kernels/kda/README.md.

Files: ``op.py`` (:func:`kda`, :func:`kda_step`: checks and backend dispatch), ``reference.py`` (the token-by-token
recurrence), ``chunk.py`` (the chunked PyTorch form), ``gate.py`` (log-decay gates). The input checks are shared
with the Triton kernels and live beside them, in ``k3lit.kernels.kda_validate``.
"""

from k3lit.kernels.kda_validate import check_gate_bound, largest_safe_chunk
from k3lit.ops.kda.gate import bounded_log_decay, softplus_log_decay
from k3lit.ops.kda.op import fuse_inputs, kda, kda_step, triton_available
from k3lit.ops.kda.reference import kda_reference

__all__ = [
    "kda",
    "kda_step",
    "fuse_inputs",
    "kda_reference",
    "bounded_log_decay",
    "softplus_log_decay", "check_gate_bound", "largest_safe_chunk", "triton_available"]
