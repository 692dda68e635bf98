"""Triton kernels for the Attention-Residuals depth mix, importable as ``k3lit.kernels.attn_res``.

:func:`attn_res_mix_triton` is the fused form of :func:`k3lit.ops.attn_res.attn_res_mix` (which picks it on
CUDA): one forward kernel and one backward kernel over all N sources. Under ``torch.compile`` they run as the
torch custom ops ``k3lit::attn_res_mix_fwd`` / ``k3lit::attn_res_mix_bwd`` (autograd through
``register_autograd``), so the compiled graph keeps them; in eager mode as the plain autograd Function
``_MixFn`` over the same launchers, whose dispatch costs the host about a third of a custom op's (a block
AttnRes step mixes twice per sublayer: forward and backward). Math and layout: ``mix.py``.
"""

from __future__ import annotations

import torch

from k3lit.kernels import runs_on
from k3lit.kernels.attn_res.mix import DTYPE_CODES, MAX_DIM, mix_bwd, mix_fwd


@torch.library.custom_op("k3lit::attn_res_mix_fwd", mutates_args=())
def _mix_fwd_op(
    sources: list[torch.Tensor], query: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Returns ``(out, src_stats, row_stats)``; the statistics are saved for the backward (see ``mix_fwd``)."""
    return mix_fwd(sources, query, eps)


@_mix_fwd_op.register_fake
def _(sources, query, eps):
    first = sources[0]
    M = first.numel() // first.shape[-1]
    return (torch.empty_like(first), first.new_empty(2, len(sources), M, dtype=torch.float32),
            first.new_empty(2, M, dtype=torch.float32))


@torch.library.custom_op("k3lit::attn_res_mix_bwd", mutates_args=())
def _mix_bwd_op(
    sources: list[torch.Tensor], query: torch.Tensor, src_stats: torch.Tensor, row_stats: torch.Tensor,
    grad: torch.Tensor,
) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Returns ``(d_sources, d_query float32)``."""
    return mix_bwd(sources, query, src_stats, row_stats, grad)


@_mix_bwd_op.register_fake
def _(sources, query, src_stats, row_stats, grad):
    return [torch.empty_like(s) for s in sources], query.new_empty(query.shape, dtype=torch.float32)


def _setup_context(ctx, inputs, output):
    sources, query, _ = inputs
    _, src_stats, row_stats = output
    ctx.mark_non_differentiable(src_stats, row_stats)  # saved only: no zero gradient filled for them
    ctx.set_materialize_grads(False)
    ctx.save_for_backward(query, src_stats, row_stats, *sources)


def _backward(ctx, grad, *_unused):
    query, src_stats, row_stats, *sources = ctx.saved_tensors
    d_sources, d_query = _mix_bwd_op(sources, query, src_stats, row_stats, grad.contiguous())
    return d_sources, d_query.to(query.dtype), None


_mix_fwd_op.register_autograd(_backward, setup_context=_setup_context)


class _MixFn(torch.autograd.Function):
    """The eager form of the two custom ops: the same launchers, the same saved tensors."""

    @staticmethod
    def forward(ctx, query: torch.Tensor, eps: float, *sources: torch.Tensor) -> torch.Tensor:  # noqa: D102
        out, src_stats, row_stats = mix_fwd(list(sources), query, eps)
        ctx.save_for_backward(query, src_stats, row_stats, *sources)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # noqa: D102
        query, src_stats, row_stats, *sources = ctx.saved_tensors
        d_sources, d_query = mix_bwd(sources, query, src_stats, row_stats, grad.contiguous())
        return (d_query.to(query.dtype), None, *d_sources)


def unsupported(sources: list[torch.Tensor], query: torch.Tensor) -> str | None:
    """Why the Triton path cannot take these inputs (None when it can)."""
    if not sources:
        return "no sources"
    first = sources[0]
    if not runs_on(first):
        return "the Triton path needs CUDA tensors (or TRITON_INTERPRET=1)"
    if any(s.shape != first.shape or s.device != first.device for s in sources):
        return "sources differ in shape or device"
    if any(s.dtype not in DTYPE_CODES for s in sources) or query.dtype not in DTYPE_CODES:
        return f"dtypes must be among {sorted(map(str, DTYPE_CODES))}"
    if query.shape != first.shape[-1:] or query.device != first.device:
        return f"query must be [D] = [{first.shape[-1]}] on the sources' device, got {tuple(query.shape)}"
    if first.shape[-1] > MAX_DIM:
        return f"D = {first.shape[-1]} is above {MAX_DIM}"
    return None


def attn_res_mix_triton(sources: list[torch.Tensor], query: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """``Σ_i softmax_i((u·s_i) / rms(s_i)) s_i`` in two kernels (forward, backward), differentiable in the
    sources and the query.

    Args:
        sources: N tensors ``[..., D]`` of one shape, each float32, bfloat16 or float16 (dtypes may differ:
            float32 embedding beside bf16 sublayer outputs), D <= 8192.
        query: ``[D]`` pseudo-query times RMSNorm weight, float32 / bfloat16 / float16.
        eps: the RMSNorm epsilon.

    Returns:
        ``[..., D]`` in ``sources[0]``'s dtype; norms, logits, softmax and the weighted sum in float32. The
        backward saves ``[2, N, M]`` float32 (``s_i·u`` and ``1/rms(s_i)``) and ``[2, M]`` (the softmax's max
        and denominator), M = number of rows, plus references to the sources. Source gradients come in each
        source's dtype.

    Raises:
        ValueError: no sources, unsupported dtype, mismatched shapes or devices, D > 8192, or CPU tensors
            without ``TRITON_INTERPRET=1``.
    """
    reason = unsupported(sources, query)
    if reason is not None:
        raise ValueError(f"attn_res_mix_triton: {reason}")
    return fused_mix(sources, query, eps)


def fused_mix(sources: list[torch.Tensor], query: torch.Tensor, eps: float) -> torch.Tensor:
    """:func:`attn_res_mix_triton` without its checks, for callers that ran :func:`unsupported` themselves."""
    sources = [s.contiguous() for s in sources]
    if torch.compiler.is_compiling():
        return _mix_fwd_op(sources, query.contiguous(), float(eps))[0]
    return _MixFn.apply(query.contiguous(), float(eps), *sources)


__all__ = ["attn_res_mix_triton", "fused_mix", "unsupported"]
