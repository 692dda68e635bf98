"""Fused token-by-token KDA in Triton (forward only): :func:`kda_decode_triton` for decoding, and
:func:`kda_recurrent_triton` for short prompts.

One program per (value block, sequence x head) keeps its ``[K, BV]`` float32 slice of the state in
registers and walks the tokens (docs/MATH.md §1)::

    S <- Diag(exp(g_t)) S;   S <- S + beta_t k_t (v_t - S^T k_t)^T;   o_t = scale S^T q_t
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from k3lit.kernels.kda_validate import check_inputs


@triton.jit
def _fused_recurrent_fwd(
    q, k, v, g, beta, o, h0, ht, cu, scale,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    HAS_H0: tl.constexpr, STORE_HT: tl.constexpr,
):
    i_v, i_nh = tl.program_id(0), tl.program_id(1).to(tl.int64)  # state offsets N H K V: int64
    i_n, i_h = i_nh // H, i_nh % H
    bos = tl.load(cu + i_n).to(tl.int64)
    eos = tl.load(cu + i_n + 1).to(tl.int64)
    rk = tl.arange(0, BK)
    cv = i_v * BV + tl.arange(0, BV)
    m_k = rk < K
    m_v = cv < V
    m_kv = m_k[:, None] & m_v[None, :]
    off_s = (i_n * H + i_h) * K * V + rk[:, None] * V + cv[None, :]
    S = tl.zeros([BK, BV], dtype=tl.float32)
    if HAS_H0:
        S += tl.load(h0 + off_s, mask=m_kv, other=0.0).to(tl.float32)
    for t in range(bos, eos):
        offk = t * (H * K) + i_h * K + rk
        offv = t * (H * V) + i_h * V + cv
        b_q = tl.load(q + offk, mask=m_k, other=0.0).to(tl.float32)
        b_k = tl.load(k + offk, mask=m_k, other=0.0).to(tl.float32)
        b_g = tl.load(g + offk, mask=m_k, other=0.0).to(tl.float32)
        b_v = tl.load(v + offv, mask=m_v, other=0.0).to(tl.float32)
        b_b = tl.load(beta + t * H + i_h).to(tl.float32)
        S = S * tl.exp(b_g)[:, None]
        err = b_v - tl.sum(S * b_k[:, None], axis=0)
        S += (b_b * b_k)[:, None] * err[None, :]
        b_o = tl.sum(S * b_q[:, None], axis=0) * scale
        tl.store(o + offv, b_o.to(o.dtype.element_ty), mask=m_v)
    if STORE_HT:
        tl.store(ht + off_s, S, mask=m_kv)


def fused_recurrent_fwd(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, scale: float,
    initial_state: torch.Tensor | None, final_state: torch.Tensor | None, cu_seqlens: torch.Tensor | None,
) -> torch.Tensor:
    """Launch the recurrent kernel; writes ``final_state`` (may alias ``initial_state``) when given.

    Shapes as :func:`k3lit.kernels.kda.kda_triton`; returns o ``[B, T, H, V]`` in v's dtype.
    """
    B, T, H, K = q.shape
    V = v.shape[-1]
    if cu_seqlens is None:
        cu = torch.arange(0, B + 1, device=q.device, dtype=torch.int64) * T
        N = B
    else:
        cu = cu_seqlens.to(device=q.device, dtype=torch.int64)
        N = cu.numel() - 1
    BK = max(16, triton.next_power_of_2(K))
    BV = min(max(16, triton.next_power_of_2(V)), 32 if BK > 128 else 64)
    o = torch.empty_like(v)
    _fused_recurrent_fwd[(triton.cdiv(V, BV), N * H)](
        q, k, v, g, beta, o, initial_state, final_state, cu, scale, H=H, K=K, V=V, BK=BK, BV=BV,
        HAS_H0=initial_state is not None, STORE_HT=final_state is not None, num_warps=4 if BK <= 64 else 8)
    return o


def kda_recurrent_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Token-by-token KDA forward (no autograd) for any T. Shapes and returns as :func:`kda_triton`.

    Raises:
        ValueError: mismatched shapes, or K or V above 256.
    """
    check_inputs(q, k, v, g, beta, initial_state, cu_seqlens)
    K, V = q.shape[-1], v.shape[-1]
    if K > 256 or V > 256:
        raise ValueError(f"kda_recurrent_triton supports K, V <= 256, got K={K}, V={V}")
    scale = K**-0.5 if scale is None else float(scale)
    q, k, v, g, beta = (x.contiguous() for x in (q, k, v, g, beta))
    N = q.shape[0] if cu_seqlens is None else cu_seqlens.numel() - 1
    h0 = None if initial_state is None else initial_state.to(torch.float32).contiguous()
    ht = q.new_empty(N, q.shape[2], K, V, dtype=torch.float32) if output_final_state else None
    o = fused_recurrent_fwd(q, k, v, g, beta, scale, h0, ht, cu_seqlens)
    return o, ht


@torch.no_grad()
def kda_decode_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    scale: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One decoding step; ``state`` is updated in place.

    Args:
        q, k, g: ``[B, 1, H, K]`` (or ``[B, H, K]``) for the new token.
        v: ``[B, 1, H, V]`` (or ``[B, H, V]``).
        beta: ``[B, 1, H]`` (or ``[B, H]``).
        state: ``[B, H, K, V]`` float32 contiguous, the state before the token; overwritten with the state
            after it.
        scale: default ``K ** -0.5``.

    Returns:
        ``(o [B, 1, H, V] in v's dtype (or [B, H, V] when given 3-D inputs), state)``.

    Raises:
        ValueError: wrong shapes, or a state that is not float32 and contiguous.
    """
    squeeze = q.dim() == 3
    if squeeze:
        q, k, v, g, beta = q[:, None], k[:, None], v[:, None], g[:, None], beta[:, None]
    check_inputs(q, k, v, g, beta, state, None)
    if q.shape[1] != 1:
        raise ValueError(f"kda_decode_triton takes one token (T = 1), got T = {q.shape[1]}")
    if state.dtype != torch.float32 or not state.is_contiguous():
        raise ValueError(f"state must be a contiguous float32 tensor, got {state.dtype}")
    K = q.shape[-1]
    scale = K**-0.5 if scale is None else float(scale)
    q, k, v, g, beta = (x.contiguous() for x in (q, k, v, g, beta))
    o = fused_recurrent_fwd(q, k, v, g, beta, scale, state, state, None)
    return (o[:, 0] if squeeze else o), state
