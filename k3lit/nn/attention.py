"""Softmax attention through SDPA (the 'A' layers of a hybrid pattern): no positional encoding by default, as in
Kimi Linear, or rotary embeddings; optionally a sliding window and log-n query scaling, for reading sequences
longer than the training length."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from k3lit.nn.documents import Documents
from k3lit.nn.norm import RMSNorm
from k3lit.ops.rope import rotary


@dataclass
class KVCache:
    """Keys and values of the positions ``start .. start + T_kept - 1``, ``[B, H, T_kept, head_dim]`` each: every
    position seen so far (``start`` 0), or under a window of W only the last ``W - 1``, all that a later token
    can see, so decoding holds a fixed-size cache."""

    k: torch.Tensor
    v: torch.Tensor
    start: int = 0

    @property
    def end(self) -> int:
        """The position of the next token: how many tokens the sequence has seen."""
        return self.start + self.k.shape[2]


class SoftmaxAttention(nn.Module):
    """Causal multi-head softmax attention with QK-norm; without positional encoding (NoPE, as in Kimi Linear,
    where the KDA layers carry position) or with rotary embeddings on the normalised queries and keys.

    Args:
        dim: model width D.
        n_heads: heads H.
        head_dim: width per head.
        norm_eps: epsilon of the q and k RMSNorms.
        rope_theta: None (NoPE) or the rotary frequency base (:func:`k3lit.ops.rope.rotary`).
        window: None (every earlier token) or W >= 1: a token at position p attends to positions
            ``(p - W, p]`` only (:func:`windowed_attention`).
        logn_base: None, or n0 >= 2: the query at position p (0-based, counted from the sequence's first token,
            cached ones included) is scaled by ``max(1, ln(p + 1) / ln(n0))`` (:func:`logn_scale`).

    ``forward(x [B, T, D], cache: KVCache | None, return_state, docs) -> (y [B, T, D], KVCache | None)``.
    With a cache, the new tokens attend to every cached token (within the window) and causally among
    themselves; the returned cache keeps the last ``window - 1`` positions under a window. With ``docs``
    (:class:`~k3lit.nn.documents.Documents` of the batch) a token attends only to its own document
    (:meth:`~k3lit.nn.documents.Documents.attention_mask`; rotary angles stay those of the sequence position,
    which changes no logit, as they depend on the distance only).

    Raises:
        ValueError: ``forward`` with ``docs`` and a cache or ``return_state``.
    """

    def __init__(
        self, dim: int, n_heads: int, head_dim: int, norm_eps: float = 1e-6, rope_theta: float | None = None,
        window: int | None = None, logn_base: int | None = None,
    ) -> None:
        super().__init__()
        self.n_heads, self.head_dim, self.rope_theta = n_heads, head_dim, rope_theta
        self.window, self.logn_base = window, logn_base
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
        t_past = 0 if cache is None else cache.end  # the first new token's position
        if self.rope_theta is not None:  # the cache holds rotated keys
            q, k = rotary(q, t_past, self.rope_theta), rotary(k, t_past, self.rope_theta)
        if self.logn_base is not None and t_past + T > self.logn_base:
            q = q * logn_scale(t_past, T, self.logn_base, q.device).to(q.dtype)[:, None]
        if cache is not None:
            k = torch.cat([cache.k, k], dim=2)
            v = torch.cat([cache.v, v], dim=2)
        windowed = self.window is not None and t_past + T > self.window
        if docs is not None:
            mask = docs.attention_mask()
            if windowed:
                mask = mask & _band(T, T, 0, self.window, x.device)
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        elif windowed:
            o = windowed_attention(q, k, v, self.window)
        elif t_past == 0:
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:  # new token i sees all cached tokens and new tokens j <= i
            mask = torch.ones(T, k.shape[2], dtype=torch.bool, device=x.device).tril(diagonal=k.shape[2] - T)
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        y = self.o_proj(o.transpose(1, 2).reshape(B, T, -1))
        if not (return_state or cache is not None):
            return y, None
        keep = k.shape[2] if self.window is None else min(k.shape[2], self.window - 1)
        return y, KVCache(k[:, :, k.shape[2] - keep:], v[:, :, k.shape[2] - keep:], t_past + T - keep)


def logn_scale(start: int, length: int, base: int, device: torch.device | None = None) -> torch.Tensor:
    """Log-n query scale of positions ``start .. start + length - 1`` (0-based): float32 ``[length]`` of
    ``max(1, ln(p + 1) / ln(base))``, so that a query among ``n = p + 1`` keys has logits ``ln(n) / ln(base)``
    times larger than it would at ``n <= base``: the softmax over more keys than in training stays as peaked as
    it was at the training length. 1 at every position below ``base``.

    Raises:
        ValueError: ``base`` below 2.
    """
    if base < 2:
        raise ValueError(f"log-n scaling needs a base of at least 2 positions, got {base}")
    n = torch.arange(start + 1, start + length + 1, device=device, dtype=torch.float64)
    return (n.log() / math.log(base)).clamp(min=1.0).float()


def _band(queries: int, keys: int, t_past: int, window: int, device: torch.device) -> torch.Tensor:
    """bool ``[queries, keys]``: the query at position ``t_past + i`` may see key position j (``j <= t_past + i``
    and ``j > t_past + i - window``)."""
    q = torch.arange(t_past, t_past + queries, device=device)[:, None]
    j = torch.arange(keys, device=device)[None, :]
    return (j <= q) & (j > q - window)


def windowed_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int) -> torch.Tensor:
    """Causal sliding-window attention: ``[B, H, T, d]`` queries (the last T of the ``[B, H, S, d]`` keys and
    values, ``S >= T``: the first ``S - T`` are cached), each query at position p attending to key positions
    ``(p - window, p]``. Queries are taken ``window`` at a time against the ``2 window - 1`` keys they can see,
    so memory grows with ``T · window``, not ``T · S``.

    Raises:
        ValueError: ``window`` below 1, or fewer keys than queries.
    """
    T, S = q.shape[2], k.shape[2]
    if window < 1 or S < T:
        raise ValueError(f"windowed attention needs window >= 1 and at least as many keys as queries "
                         f"(window {window}, {T} queries, {S} keys)")
    t_past, out = S - T, []
    for s in range(0, T, window):
        e = min(s + window, T)
        lo = max(0, t_past + s - window + 1)  # the first key the chunk's first query sees
        mask = _band(e - s, t_past + e - lo, t_past + s - lo, window, q.device)
        out.append(F.scaled_dot_product_attention(q[:, :, s:e], k[:, :, lo:t_past + e], v[:, :, lo:t_past + e],
                                                  attn_mask=mask))
    return torch.cat(out, dim=2)
