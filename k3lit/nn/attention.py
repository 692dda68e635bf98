"""Softmax attention through SDPA (the 'A' layers of a hybrid pattern): no positional encoding by default, as in
Kimi Linear, or rotary embeddings."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from k3lit.nn.documents import Documents
from k3lit.nn.norm import RMSNorm
from k3lit.ops.rope import rotary


@dataclass
class KVCache:
    """Keys and values seen so far, ``[B, H, T_past, head_dim]`` each."""

    k: torch.Tensor
    v: torch.Tensor


class SoftmaxAttention(nn.Module):
    """Causal multi-head softmax attention with QK-norm; without positional encoding (NoPE, as in Kimi Linear,
    where the KDA layers carry position) or with rotary embeddings on the normalised queries and keys.

    Args:
        dim: model width D.
        n_heads: heads H.
        head_dim: width per head.
        norm_eps: epsilon of the q and k RMSNorms.
        rope_theta: None (NoPE) or the rotary frequency base (:func:`k3lit.ops.rope.rotary`).

    ``forward(x [B, T, D], cache: KVCache | None, return_state, docs) -> (y [B, T, D], KVCache | None)``.
    With a cache, the new tokens attend to every cached token and causally among themselves. With ``docs``
    (:class:`~k3lit.nn.documents.Documents` of the batch) a token attends only to its own document
    (:meth:`~k3lit.nn.documents.Documents.attention_mask`; rotary angles stay those of the sequence position,
    which changes no logit, as they depend on the distance only).

    Raises:
        ValueError: ``forward`` with ``docs`` and a cache or ``return_state``.
    """

    def __init__(
        self, dim: int, n_heads: int, head_dim: int, norm_eps: float = 1e-6, rope_theta: float | None = None
    ) -> None:
        super().__init__()
        self.n_heads, self.head_dim, self.rope_theta = n_heads, head_dim, rope_theta
        self.qkv = nn.Linear(dim, 3 * n_heads * head_dim, bias=False)
        self.q_norm = RMSNorm(head_dim, eps=norm_eps)
        self.k_norm = RMSNorm(head_dim, eps=norm_eps)
        self.o_proj = nn.Linear(n_heads * head_dim, dim, bias=False)

    def forward(
        self, x: torch.Tensor, cache: KVCache | None = None, return_state: bool = False, docs: Documents | None = None
    ) -> tuple[torch.Tensor, KVCache | None]:
        B, T, _ = x.shape
        if docs is not None and (cache is not None or return_state):
            raise ValueError("SoftmaxAttention: document masking is for training and scoring; decoding takes no docs")
        q, k, v = self.qkv(x).view(B, T, 3, self.n_heads, self.head_dim).unbind(2)
        q, k = self.q_norm(q), self.k_norm(k)  # QK-norm keeps NoPE logits bounded
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # [B, H, T, hd]
        if self.rope_theta is not None:  # the cache holds rotated keys
            start = 0 if cache is None else cache.k.shape[2]
            q, k = rotary(q, start, self.rope_theta), rotary(k, start, self.rope_theta)
        if cache is not None:
            k = torch.cat([cache.k, k], dim=2)
            v = torch.cat([cache.v, v], dim=2)
        t_past = k.shape[2] - T
        if docs is not None:
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=docs.attention_mask())
        elif t_past == 0:
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:  # new token i sees all cached tokens and new tokens j <= i
            mask = torch.ones(T, k.shape[2], dtype=torch.bool, device=x.device).tril(diagonal=t_past)
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        y = self.o_proj(o.transpose(1, 2).reshape(B, T, -1))
        return y, (KVCache(k, v) if (return_state or cache is not None) else None)
