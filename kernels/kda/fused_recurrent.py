"""Fused token-by-token KDA in Triton (forward only): decoding and short prompts.

One program per (value block, sequence x head) keeps its ``[K, BV]`` float32 slice of the state in
registers and walks the tokens (docs/MATH.md §1)::

    S <- Diag(exp(g_t)) S;   S <- S + beta_t k_t (v_t - S^T k_t)^T;   o_t = scale S^T q_t
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


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
