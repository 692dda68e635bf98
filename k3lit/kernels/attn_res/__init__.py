"""Triton kernels for the Attention-Residuals depth mix, importable as ``k3lit.kernels.attn_res``.

:func:`attn_res_mix_triton` is the fused form of :func:`k3lit.ops.attn_res.attn_res_mix` (which picks it on
CUDA); :func:`inter_block_triton` and :func:`merge_triton` are the two phases of Block AttnRes. The ``fused_*``
forms skip the input checks for callers that ran the matching ``unsupported*`` check themselves.

Files: ``op.py`` (the differentiable entry points: custom ops under ``torch.compile``, autograd Functions in eager
mode, input checks), ``mix.py`` (one-pass mix kernels and launchers), ``two_phase.py`` (phase-1 and phase-2
kernels and launchers), ``common.py`` (what the kernels share: source address tables, typed tile loads and
stores, row tiles and launch settings).
"""

from k3lit.kernels.attn_res.op import (
    attn_res_mix_triton,
    fused_inter_block,
    fused_merge,
    fused_mix,
    inter_block_triton,
    merge_triton,
    unsupported,
    unsupported_inter,
    unsupported_merge,
)

__all__ = [
    "attn_res_mix_triton", "fused_inter_block", "fused_merge", "fused_mix", "inter_block_triton", "merge_triton",
    "unsupported", "unsupported_inter", "unsupported_merge",
]
