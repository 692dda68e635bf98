"""Token-by-token KDA recurrence: the truth every faster form is tested against.

Kimi Delta Attention (Kimi Linear, arXiv 2510.26692), per head and token t::

    S'_t = Diag(exp(g_t)) S_{t-1}                         (decay first)
    S_t  = S'_t + beta_t k_t (v_t - S'_t^T k_t)^T
    o_t  = scale * S_t^T q_t
"""

from __future__ import annotations

import torch

from k3lit.kernels.kda_validate import check_inputs, split_varlen


def kda_reference(
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
    """Run the KDA recurrence one token at a time.

    Args:
        q, k: ``[B, T, H, K]`` queries and keys (the layer L2-normalises them; this op does not).
        v: ``[B, T, H, V]`` values.
        g: ``[B, T, H, K]`` per-channel log-decay, ``<= 0`` (natural-log units).
        beta: ``[B, T, H]`` delta-rule write strength in ``(0, 1)``.
        scale: output scale, default ``K ** -0.5``.
        initial_state: ``[N, H, K, V]`` state before the first token (N = B, or the number of
            sequences when ``cu_seqlens`` is given); zeros if None.
        output_final_state: also return the state after the last token.
        cu_seqlens: ``[N + 1]`` int64 cumulative sequence lengths of a packed batch (then B must be 1).

    Returns:
        ``(o, final_state)``: o ``[B, T, H, V]`` in v's dtype, final_state ``[N, H, K, V]`` in the
        compute dtype (float64 for float64 inputs, else float32) or None.

    The arithmetic runs in float64 when given float64 and in float32 otherwise.
    """
    check_inputs(q, k, v, g, beta, initial_state, cu_seqlens)
    if cu_seqlens is not None:
        outs, states = [], []
        for n, (lo, hi) in enumerate(split_varlen(cu_seqlens)):
            h0 = None if initial_state is None else initial_state[n : n + 1]
            o_n, s_n = kda_reference(
                q[:, lo:hi], k[:, lo:hi], v[:, lo:hi], g[:, lo:hi], beta[:, lo:hi], scale, h0, True
            )
            outs.append(o_n)
            states.append(s_n)
        o = torch.cat(outs, dim=1)
        return o, (torch.cat(states) if output_final_state else None)

    B, T, H, K = q.shape
    V = v.shape[-1]
    scale = K**-0.5 if scale is None else scale
    dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    q, k, v, g, beta = (x.to(dtype) for x in (q, k, v, g, beta))
    S = q.new_zeros(B, H, K, V) if initial_state is None else initial_state.to(dtype)
    o = []
    for t in range(T):
        S = S * g[:, t].exp()[..., None]  # [B, H, K, V]
        k_t = k[:, t]  # [B, H, K]
        err = v[:, t] - torch.einsum("bhkv,bhk->bhv", S, k_t)
        S = S + beta[:, t, :, None, None] * k_t[..., None] * err[:, :, None, :]
        o.append(scale * torch.einsum("bhkv,bhk->bhv", S, q[:, t]))
    out = torch.stack(o, dim=1) if T else v.new_zeros(B, 0, H, V, dtype=dtype)
    return out.to(v.dtype), (S if output_final_state else None)
