"""The Attention-Residuals kernels as differentiable ops, with their input checks.

:func:`attn_res_mix_triton` is the fused form of :func:`k3lit.ops.attn_res.attn_res_mix` (which picks it on
CUDA): one forward kernel and one backward kernel over all N sources. Under ``torch.compile`` they run as the
torch custom ops ``k3lit::attn_res_mix_fwd`` / ``k3lit::attn_res_mix_bwd`` (autograd through
``register_autograd``), so the compiled graph keeps them; in eager mode as the plain autograd Function
``_MixFn`` over the same launchers, whose dispatch costs the host about a third of a custom op's (a block
AttnRes step mixes twice per sublayer: forward and backward). Math and layout: ``mix.py``.

:func:`inter_block_triton` and :func:`merge_triton` are the two phases of Block AttnRes (``two_phase.py``), in
the same two forms: custom ops ``k3lit::attn_res_inter_{fwd,bwd}`` / ``k3lit::attn_res_merge_{fwd,bwd}`` under
``torch.compile``, the autograd Functions ``_InterFn`` / ``_MergeFn`` in eager mode.
"""

from __future__ import annotations

import torch

from k3lit.kernels import runs_on
from k3lit.kernels.attn_res.common import DTYPE_CODES, MAX_DIM
from k3lit.kernels.attn_res.mix import mix_bwd, mix_fwd
from k3lit.kernels.attn_res.two_phase import inter_bwd, inter_fwd, merge_bwd, merge_fwd


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


@torch.library.custom_op("k3lit::attn_res_inter_fwd", mutates_args=())
def _inter_fwd_op(
    blocks: list[torch.Tensor], queries: torch.Tensor, eps: float, out_dtype: torch.dtype
) -> tuple[list[torch.Tensor], torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Returns ``(mixes, lse, su, r, mz)``; the last three are saved for the backward (see ``inter_fwd``)."""
    return inter_fwd(blocks, queries, eps, out_dtype)


@_inter_fwd_op.register_fake
def _(blocks, queries, eps, out_dtype):
    first, N, S = blocks[0], len(blocks), queries.shape[0]
    M = first.numel() // first.shape[-1]
    f32 = torch.float32
    return ([torch.empty_like(first, dtype=out_dtype) for _ in range(S)],
            first.new_empty(S, *first.shape[:-1], dtype=f32), first.new_empty(S, N, M, dtype=f32),
            first.new_empty(N, M, dtype=f32), first.new_empty(2, S, M, dtype=f32))


@torch.library.custom_op("k3lit::attn_res_inter_bwd", mutates_args=())
def _inter_bwd_op(
    blocks: list[torch.Tensor], queries: torch.Tensor, su: torch.Tensor, r: torch.Tensor, mz: torch.Tensor,
    grads: list[torch.Tensor], dlse: torch.Tensor | None,
) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Returns ``(d_blocks, d_queries float32)``."""
    return inter_bwd(blocks, queries, su, r, mz, grads, dlse)


@_inter_bwd_op.register_fake
def _(blocks, queries, su, r, mz, grads, dlse):
    return [torch.empty_like(b) for b in blocks], queries.new_empty(queries.shape, dtype=torch.float32)


def _mix_grads(ctx, grads) -> list[torch.Tensor]:
    """The phase-1 mixes' gradients, contiguous; zeros for a mix that got none (``ctx.mix_like``: its shape and
    dtype)."""
    shape, dtype = ctx.mix_like
    return [torch.zeros(shape, dtype=dtype, device=ctx.saved_tensors[0].device) if g is None else g.contiguous()
            for g in grads]


def _inter_setup_context(ctx, inputs, output):
    blocks, queries, _, _ = inputs
    mixes, _, su, r, mz = output
    ctx.mark_non_differentiable(su, r, mz)
    ctx.set_materialize_grads(False)
    ctx.save_for_backward(queries, su, r, mz, *blocks)
    ctx.mix_like = (mixes[0].shape, mixes[0].dtype)


def _inter_backward(ctx, mix_grads, dlse, *_unused):
    queries, su, r, mz, *blocks = ctx.saved_tensors
    dlse = dlse.contiguous() if dlse is not None else None
    d_blocks, d_queries = _inter_bwd_op(blocks, queries, su, r, mz, _mix_grads(ctx, mix_grads), dlse)
    return d_blocks, d_queries.to(queries.dtype), None, None


_inter_fwd_op.register_autograd(_inter_backward, setup_context=_inter_setup_context)


class _InterFn(torch.autograd.Function):
    """The eager form of the phase-1 custom ops: ``(*mixes, lse)`` from ``(queries, eps, out_dtype, *blocks)``."""

    @staticmethod
    def forward(ctx, queries: torch.Tensor, eps: float, out_dtype: torch.dtype, *blocks: torch.Tensor):  # noqa: D102
        mixes, lse, su, r, mz = inter_fwd(list(blocks), queries, eps, out_dtype)
        ctx.mark_non_differentiable(su, r, mz)
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(queries, su, r, mz, *blocks)
        ctx.mix_like = (mixes[0].shape, mixes[0].dtype)
        return (*mixes, lse)

    @staticmethod
    def backward(ctx, *grads: torch.Tensor):  # noqa: D102
        queries, su, r, mz, *blocks = ctx.saved_tensors
        dlse = grads[-1].contiguous() if grads[-1] is not None else None
        d_blocks, d_queries = inter_bwd(blocks, queries, su, r, mz, _mix_grads(ctx, grads[:-1]), dlse)
        return (d_queries.to(queries.dtype), None, None, *d_blocks)


@torch.library.custom_op("k3lit::attn_res_merge_fwd", mutates_args=())
def _merge_fwd_op(
    mix: torch.Tensor, lse: torch.Tensor, partial: torch.Tensor, query: torch.Tensor, eps: float
) -> torch.Tensor:
    """Returns ``h``, the sublayer's input."""
    return merge_fwd(mix, lse, partial, query, eps)


@_merge_fwd_op.register_fake
def _(mix, lse, partial, query, eps):
    return torch.empty_like(mix)


@torch.library.custom_op("k3lit::attn_res_merge_bwd", mutates_args=())
def _merge_bwd_op(
    grad: torch.Tensor, mix: torch.Tensor, lse: torch.Tensor, partial: torch.Tensor, query: torch.Tensor,
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Returns ``(d_mix, d_lse, d_partial, d_query float32)``."""
    return merge_bwd(grad, mix, lse, partial, query, eps)


@_merge_bwd_op.register_fake
def _(grad, mix, lse, partial, query, eps):
    return (torch.empty_like(mix), torch.empty_like(lse), torch.empty_like(partial),
            query.new_empty(query.shape, dtype=torch.float32))


def _merge_setup_context(ctx, inputs, output):
    mix, lse, partial, query, eps = inputs
    ctx.eps = eps
    ctx.save_for_backward(mix, lse, partial, query)


def _merge_backward(ctx, grad):
    mix, lse, partial, query = ctx.saved_tensors
    dmix, dlse, dp, du = _merge_bwd_op(grad.contiguous(), mix, lse, partial, query, ctx.eps)
    return dmix, dlse, dp, du.to(query.dtype), None


_merge_fwd_op.register_autograd(_merge_backward, setup_context=_merge_setup_context)


class _MergeFn(torch.autograd.Function):
    """The eager form of the phase-2 custom ops."""

    @staticmethod
    def forward(ctx, query, eps, mix, lse, partial):  # noqa: D102
        ctx.eps = eps
        ctx.save_for_backward(mix, lse, partial, query)
        return merge_fwd(mix, lse, partial, query, eps)

    @staticmethod
    def backward(ctx, grad):  # noqa: D102
        mix, lse, partial, query = ctx.saved_tensors
        dmix, dlse, dp, du = merge_bwd(grad.contiguous(), mix, lse, partial, query, ctx.eps)
        return du.to(query.dtype), None, dmix, dlse, dp


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


def unsupported_inter(
    blocks: list[torch.Tensor], queries: torch.Tensor, out_dtype: torch.dtype | None = None
) -> str | None:
    """Why :func:`inter_block_triton` cannot take these inputs (None when it can)."""
    if queries.dim() != 2 or queries.shape[0] == 0:
        return f"queries must be [S, D] with S >= 1, got {tuple(queries.shape)}"
    if out_dtype is not None and out_dtype not in DTYPE_CODES:
        return f"out_dtype must be among {sorted(map(str, DTYPE_CODES))}, got {out_dtype}"
    return unsupported(blocks, queries[0])


def unsupported_merge(mix: torch.Tensor, lse: torch.Tensor, partial: torch.Tensor, query: torch.Tensor) -> str | None:
    """Why :func:`merge_triton` cannot take these inputs (None when it can)."""
    if lse.dtype != torch.float32 or lse.shape != mix.shape[:-1] or lse.device != mix.device:
        return f"lse must be float32 {tuple(mix.shape[:-1])} on mix's device, got {lse.dtype} {tuple(lse.shape)}"
    return unsupported([mix, partial], query)


def inter_block_triton(
    blocks: list[torch.Tensor], queries: torch.Tensor, eps: float = 1e-6, out_dtype: torch.dtype | None = None
) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Phase 1 of two-phase Block AttnRes in Triton: every query's softmax mix over the N completed block
    summaries, and its log-sum-exp, in one launch (``two_phase.py``). Differentiable in the blocks and queries.

    Args:
        blocks: N tensors ``[..., D]`` of one shape, each float32, bfloat16 or float16 (may differ), D <= 8192.
        queries: ``[S, D]``, one ``w ⊙ γ`` per sublayer of the block.
        eps: the RMSNorm epsilon.
        out_dtype: the mixes' dtype (float32, bfloat16 or float16); None for blocks[0]'s.

    Returns:
        ``(mixes, lse)``: S tensors ``[..., D]`` in ``out_dtype`` and ``lse [S, ...]`` float32. The backward
        saves ``[S, N, M]`` + ``[N, M]`` + ``[2, S, M]`` float32 statistics (M rows) and references to the blocks.

    Raises:
        ValueError: as :func:`attn_res_mix_triton`, queries not ``[S, D]``, or an unsupported ``out_dtype``.
    """
    reason = unsupported_inter(blocks, queries, out_dtype)
    if reason is not None:
        raise ValueError(f"inter_block_triton: {reason}")
    return fused_inter_block(blocks, queries, eps, out_dtype)


def fused_inter_block(
    blocks: list[torch.Tensor], queries: torch.Tensor, eps: float, out_dtype: torch.dtype | None = None
) -> tuple[list[torch.Tensor], torch.Tensor]:
    """:func:`inter_block_triton` without its checks, for callers that ran :func:`unsupported_inter`."""
    blocks, queries = [b.contiguous() for b in blocks], queries.contiguous()
    out_dtype = out_dtype or blocks[0].dtype
    if torch.compiler.is_compiling():
        mixes, lse = _inter_fwd_op(blocks, queries, float(eps), out_dtype)[:2]
        return mixes, lse
    *mixes, lse = _InterFn.apply(queries, float(eps), out_dtype, *blocks)
    return list(mixes), lse


def merge_triton(
    mix: torch.Tensor, lse: torch.Tensor, partial: torch.Tensor, query: torch.Tensor, eps: float = 1e-6
) -> torch.Tensor:
    """Phase 2 of two-phase Block AttnRes in Triton: ``w mix + (1 - w) partial`` with
    ``w = sigmoid(lse - (u·partial) / rms(partial))`` (``two_phase.py``), differentiable in all four tensors.

    Args:
        mix, lse: one sublayer's phase-1 output ``[..., D]`` and its ``[...]`` float32 log-sum-exp.
        partial: ``[..., D]`` the block's running partial sum; query: ``[D]``, ``w ⊙ γ``.

    Returns:
        ``[..., D]`` in mix's dtype; the backward saves nothing beyond references to the inputs.

    Raises:
        ValueError: as :func:`attn_res_mix_triton` for ``[mix, partial]``, or lse not float32 of mix's rows.
    """
    reason = unsupported_merge(mix, lse, partial, query)
    if reason is not None:
        raise ValueError(f"merge_triton: {reason}")
    return fused_merge(mix, lse, partial, query, eps)


def fused_merge(
    mix: torch.Tensor, lse: torch.Tensor, partial: torch.Tensor, query: torch.Tensor, eps: float
) -> torch.Tensor:
    """:func:`merge_triton` without its checks, for callers that ran :func:`unsupported_merge`."""
    mix, lse, partial, query = (x.contiguous() for x in (mix, lse, partial, query))
    if torch.compiler.is_compiling():
        return _merge_fwd_op(mix, lse, partial, query, float(eps))
    return _MergeFn.apply(query, float(eps), mix, lse, partial)


__all__ = [
    "attn_res_mix_triton", "fused_inter_block", "fused_merge", "fused_mix", "inter_block_triton", "merge_triton",
    "unsupported", "unsupported_inter", "unsupported_merge",
]
