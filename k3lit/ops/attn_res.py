"""Depth-wise softmax mixing of Attention Residuals (arXiv 2603.15031), docs/MATH.md §3.

A sublayer l reads ``h_l = Σ_i a_i v_i`` with ``a = softmax_i(w_l^T RMSNorm_l(v_i))`` over its sources v_i
(block summaries, the running partial sum, or every earlier output for Full AttnRes). Because
``w^T (γ ⊙ v / rms(v)) = ((w ⊙ γ)^T v) / rms(v)``, no normalised copy of any source is ever formed.
"""

from __future__ import annotations

import functools
from types import ModuleType

import torch


def inv_rms(v: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """``1 / sqrt(mean(v^2) + eps)`` over the last dim: ``[..., D] -> [...]`` in float32 (float64 for float64)."""
    return torch.rsqrt(v.to(torch.promote_types(v.dtype, torch.float32)).pow(2).mean(-1) + eps)


class _AttnResMix(torch.autograd.Function):
    """Softmax-over-depth mix with a hand-written backward that saves only the ``[N, B, T]`` weights.

    With ``r_i = 1/rms(s_i)``, ``l_i = (s_i·u) r_i``, ``a = softmax(l)``, ``out = Σ a_i s_i`` and upstream ``g``:
    ``dl_i = a_i (g·s_i - g·out)``; ``ds_i = a_i g + dl_i (r_i u - (s_i·u) r_i^3 s_i / D)``;
    ``du = Σ_{i,b,t} dl_i r_i s_i``. The sources themselves are alive anyway (they are the residual state), so
    no float32 copy of any of them is kept for backward, as plain autograd would.
    """

    @staticmethod
    def forward(ctx, query: torch.Tensor, eps: float, *sources: torch.Tensor) -> torch.Tensor:
        acc = torch.promote_types(sources[0].dtype, torch.float32)
        u = query.to(acc)
        r = torch.stack([inv_rms(s, eps) for s in sources])  # [N, B, T]
        logits = torch.stack([s.to(acc) @ u for s in sources]) * r
        a = torch.softmax(logits, dim=0)
        out = torch.zeros(sources[0].shape, dtype=acc, device=sources[0].device)
        for i, s in enumerate(sources):
            out.addcmul_(a[i, ..., None], s)
        ctx.save_for_backward(query, a, r, *sources)
        return out.to(sources[0].dtype)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        query, a, r, *sources = ctx.saved_tensors
        acc = a.dtype
        g = grad.to(acc)
        u = query.to(acc)
        D = g.shape[-1]
        dots = torch.stack([(g * s).sum(-1) for s in sources])  # g·s_i, [N, B, T]
        g_out = (a * dots).sum(0)  # g·out
        d_query = torch.zeros_like(u)
        d_sources = []
        for i, s in enumerate(sources):
            s32 = s.to(acc)
            dl = a[i] * (dots[i] - g_out)  # [B, T]
            su = s32 @ u
            coef = (dl * su * r[i].pow(3) / D)[..., None]
            d_sources.append((a[i, ..., None] * g + (dl * r[i])[..., None] * u - coef * s32).to(s.dtype))
            d_query += ((dl * r[i])[..., None] * s32).flatten(0, -2).sum(0)
        return (d_query.to(query.dtype), None, *d_sources)


BACKENDS = ("auto", "torch", "triton")


def attn_res_mix(
    sources: list[torch.Tensor], query: torch.Tensor, eps: float = 1e-6, backend: str = "auto"
) -> torch.Tensor:
    """Softmax-over-depth mix ``Σ_i softmax_i((u^T s_i) / rms(s_i)) s_i`` of ``N`` sources in one pass.

    Args:
        sources: N tensors ``[B, T, D]`` of one shape (dtypes may differ: the float32 embedding beside bf16
            sublayer outputs).
        query: ``[D]`` pseudo-query already multiplied by the RMSNorm weight (``u = w ⊙ γ``).
        eps: the RMSNorm epsilon.
        backend: ``"auto"`` (the fused Triton kernels, :mod:`k3lit.kernels.attn_res`, for CUDA tensors they
            support; this PyTorch form otherwise), ``"torch"`` or ``"triton"`` (also on CPU under
            ``TRITON_INTERPRET=1``).

    Returns:
        ``[B, T, D]`` in ``sources[0]``'s dtype; logits, softmax and the weighted sum in float32 (float64 for
        float64 sources). Backward keeps only ``[N, B, T]`` float32 statistics (see :class:`_AttnResMix`).

    Raises:
        ValueError: no sources, an unknown backend, or ``"triton"`` for inputs the kernels do not take
            (float64, D > 8192, CPU tensors without the interpreter).
    """
    if not sources:
        raise ValueError("attn_res_mix needs at least one source")
    kernels = _dispatch(backend, sources[0])
    if backend == "triton":
        return kernels.attn_res_mix_triton(sources, query, eps)
    if kernels is not None and kernels.unsupported(sources, query) is None:  # checked once, here
        return kernels.fused_mix(sources, query, eps)
    return _AttnResMix.apply(query, eps, *sources)


@functools.cache
def _kernels() -> ModuleType | None:
    """``k3lit.kernels.attn_res``, or None where Triton is not installed (imported once)."""
    try:
        import k3lit.kernels.attn_res as kernels
    except ImportError:
        return None
    return kernels


def attn_res_reference(
    sources: list[torch.Tensor], w: torch.Tensor, norm_weight: torch.Tensor, eps: float = 1e-6
) -> torch.Tensor:
    """Literal form ``Σ_i softmax_i(w^T RMSNorm(v_i)) v_i`` in the sources' dtype (float64 in tests)."""
    V = torch.stack(sources)  # [N, B, T, D]
    normed = V * torch.rsqrt(V.pow(2).mean(-1, keepdim=True) + eps) * norm_weight
    a = torch.softmax(normed @ w, dim=0)  # [N, B, T]
    return (a[..., None] * V).sum(0)


def attn_res_inter_block(
    blocks: list[torch.Tensor], queries: torch.Tensor, eps: float = 1e-6, backend: str = "auto",
    out_dtype: torch.dtype | None = None,
) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Phase 1 of two-phase Block AttnRes (arXiv 2603.15031 §4): the softmax mix over the N completed block
    summaries for all S sublayers of a block, in one read of the summaries, with each mix's log-sum-exp for the
    merge with the partial sum (:func:`attn_res_merge`). Used in training and in decoding.

    Args:
        blocks: N summaries ``[B, T, D]`` (dtypes may differ, as in :func:`attn_res_mix`).
        queries: ``[S, D]`` the S sublayers' ``w ⊙ γ``.
        eps: the RMSNorm epsilon.
        backend: as :func:`attn_res_mix` (Triton: :func:`k3lit.kernels.attn_res.inter_block_triton`).
        out_dtype: the mixes' dtype; None for ``blocks[0]``'s. The block stream passes the autocast dtype under
            autocast (the mixes are sublayer inputs; the summaries they mix are in that dtype already).

    Returns:
        ``(mixes, lse)``: S tensors ``[B, T, D]`` in ``out_dtype``, and ``lse [S, B, T]`` in float32
        (float64 for float64 blocks); ``mixes[j]`` equals :func:`attn_res_mix` of the blocks with query j.

    Raises:
        ValueError: no blocks, an unknown backend, a non-floating ``out_dtype``, or ``"triton"`` for inputs the
            kernels do not take.
    """
    if not blocks:
        raise ValueError("attn_res_inter_block needs at least one block")
    if out_dtype is not None and not out_dtype.is_floating_point:
        raise ValueError(f"out_dtype must be a floating-point dtype (or None for blocks[0]'s), got {out_dtype}")
    kernels = _dispatch(backend, blocks[0])
    if backend == "triton":
        return kernels.inter_block_triton(blocks, queries, eps, out_dtype)
    if kernels is not None and kernels.unsupported_inter(blocks, queries, out_dtype) is None:
        return kernels.fused_inter_block(blocks, queries, eps, out_dtype)
    acc = torch.promote_types(blocks[0].dtype, torch.float32)
    u = queries.to(acc)
    logits = torch.stack([(b.to(acc) @ u.T) * inv_rms(b, eps)[..., None] for b in blocks])  # [N, B, T, S]
    lse = torch.logsumexp(logits, dim=0)  # [B, T, S]
    a = torch.exp(logits - lse)
    mixes = [sum(a[i, ..., j, None] * b.to(acc) for i, b in enumerate(blocks)).to(out_dtype or blocks[0].dtype)
             for j in range(queries.shape[0])]
    return mixes, lse.movedim(-1, 0)


def attn_res_merge(
    mix: torch.Tensor, lse: torch.Tensor, partial: torch.Tensor, query: torch.Tensor, eps: float = 1e-6,
    backend: str = "auto",
) -> torch.Tensor:
    """Phase 2: online-softmax merge of one sublayer's inter-block ``mix`` (``[B, T, D]``, log-sum-exp ``lse``
    ``[B, T]``) with its block's partial sum ``[B, T, D]``; equals :func:`attn_res_mix` over blocks + partial.

    The inter-block part weighs ``e^lse / (e^lse + e^l_p) = sigmoid(lse - l_p)``, ``l_p`` the partial's logit
    ``(u·partial) / rms(partial)``. ``query``: ``[D]``, ``w ⊙ γ``. ``backend`` as :func:`attn_res_mix`
    (Triton: :func:`k3lit.kernels.attn_res.merge_triton`). Returns ``[B, T, D]`` in mix's dtype.

    Raises:
        ValueError: an unknown backend, or ``"triton"`` for inputs the kernels do not take.
    """
    kernels = _dispatch(backend, mix)
    if backend == "triton":
        return kernels.merge_triton(mix, lse, partial, query, eps)
    if kernels is not None and kernels.unsupported_merge(mix, lse, partial, query) is None:
        return kernels.fused_merge(mix, lse, partial, query, eps)
    acc = lse.dtype
    l_p = (partial.to(acc) @ query.to(acc)) * inv_rms(partial, eps)
    w = torch.sigmoid(lse - l_p)[..., None]
    return (w * mix.to(acc) + (1 - w) * partial.to(acc)).to(mix.dtype)


def _dispatch(backend: str, first: torch.Tensor) -> ModuleType | None:
    """The Triton kernels module where ``backend`` asks for them (``"triton"``) or may use them (``"auto"`` on CUDA
    tensors); None for the PyTorch form."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "triton":
        import k3lit.kernels.attn_res as kernels

        return kernels
    return _kernels() if backend == "auto" and first.is_cuda else None
