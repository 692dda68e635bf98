"""Depth-wise softmax mixing of Attention Residuals (arXiv 2603.15031), REFERENCE.md §3.

A sublayer l reads ``h_l = Σ_i a_i v_i`` with ``a = softmax_i(w_l^T RMSNorm_l(v_i))`` over its sources v_i
(block summaries, the running partial sum, or every earlier output for Full AttnRes). Because
``w^T (γ ⊙ v / rms(v)) = ((w ⊙ γ)^T v) / rms(v)``, each source is stored once with its ``1 / rms`` and no
normalised copy of any source is kept alive.
"""

from __future__ import annotations

import torch


def inv_rms(v: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """``1 / sqrt(mean(v^2) + eps)`` over the last dim: ``[..., D] -> [...]`` in float32 (float64 for float64)."""
    return torch.rsqrt(v.to(torch.promote_types(v.dtype, torch.float32)).pow(2).mean(-1) + eps)


def attn_res_mix(
    sources: list[torch.Tensor], source_inv_rms: list[torch.Tensor], query: torch.Tensor
) -> torch.Tensor:
    """Softmax-over-depth mix of ``N`` sources in one pass.

    Args:
        sources: N tensors ``[B, T, D]`` (any float dtype).
        source_inv_rms: N tensors ``[B, T]`` from :func:`inv_rms` of each source.
        query: ``[D]`` pseudo-query already multiplied by the RMSNorm weight (``w ⊙ γ``).

    Returns:
        ``[B, T, D]`` in the sources' dtype; logits, softmax and the weighted sum in float32 (float64 for
        float64 sources).
    """
    if len(sources) != len(source_inv_rms) or not sources:
        raise ValueError(f"need one inv_rms per source and at least one source, got {len(sources)}, "
                         f"{len(source_inv_rms)}")
    acc = torch.promote_types(sources[0].dtype, torch.float32)
    logits = torch.stack([(v @ query.to(v.dtype)).to(acc) * r for v, r in zip(sources, source_inv_rms)])
    a = torch.softmax(logits, dim=0)  # [N, B, T]
    out = a[0, ..., None] * sources[0].to(acc)
    for i in range(1, len(sources)):
        out = out + a[i, ..., None] * sources[i].to(acc)
    return out.to(sources[0].dtype)


def attn_res_reference(
    sources: list[torch.Tensor], w: torch.Tensor, norm_weight: torch.Tensor, eps: float = 1e-6
) -> torch.Tensor:
    """Literal form ``Σ_i softmax_i(w^T RMSNorm(v_i)) v_i`` in the sources' dtype (float64 in tests)."""
    V = torch.stack(sources)  # [N, B, T, D]
    normed = V * torch.rsqrt(V.pow(2).mean(-1, keepdim=True) + eps) * norm_weight
    a = torch.softmax(normed @ w, dim=0)  # [N, B, T]
    return (a[..., None] * V).sum(0)


def attn_res_inter_block(
    blocks: list[torch.Tensor], blocks_inv_rms: list[torch.Tensor], queries: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Phase 1 of two-phase Block AttnRes (decoding): the softmax mix over the N completed block summaries for
    all S sublayers of the current block in one batched product, with its log-sum-exp for the later merge.

    Args:
        blocks: N summaries ``[B, T, D]``; ``blocks_inv_rms``: their ``[B, T]`` from :func:`inv_rms`.
        queries: ``[S, D]`` the S sublayers' ``w ⊙ γ``.

    Returns:
        ``(mix [S, B, T, D], lse [S, B, T])`` in float32 (float64 for float64 blocks).
    """
    acc = torch.promote_types(blocks[0].dtype, torch.float32)
    V = torch.stack(blocks)  # [N, B, T, D]
    logits = torch.einsum("nbtd,sd->snbt", V, queries.to(V.dtype)).to(acc) * torch.stack(blocks_inv_rms)
    lse = torch.logsumexp(logits, dim=1)  # [S, B, T]
    mix = torch.einsum("snbt,nbtd->sbtd", torch.exp(logits - lse[:, None]), V.to(acc))
    return mix, lse


def attn_res_merge(
    mix: torch.Tensor, lse: torch.Tensor, partial: torch.Tensor, partial_inv_rms: torch.Tensor, query: torch.Tensor
) -> torch.Tensor:
    """Phase 2: online-softmax merge of one sublayer's inter-block ``mix`` (``[B, T, D]``, log-sum-exp ``lse``
    ``[B, T]``) with the block's partial sum ``[B, T, D]``; equals :func:`attn_res_mix` over blocks + partial.

    The inter-block part weighs ``e^lse / (e^lse + e^l_p) = sigmoid(lse - l_p)`` with ``l_p`` the partial's logit.
    Returns ``[B, T, D]`` in the partial's dtype.
    """
    l_p = (partial @ query.to(partial.dtype)).to(mix.dtype) * partial_inv_rms
    w = torch.sigmoid(lse - l_p)[..., None]
    return (w * mix + (1 - w) * partial.to(mix.dtype)).to(partial.dtype)
