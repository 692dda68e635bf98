"""Chunked KDA in plain PyTorch: one uniform dense path for every intra-chunk block.

For a chunk of C tokens starting from state ``S_0`` (``G`` = cumulative log-decay inside the chunk,
``r`` = the chunk's middle row, docs/MATH.md §1)::

    A_kk = tril(K⊙exp(G - G_r) · (K⊙exp(G_r - G))^T, -1)       strictly lower
    A_qk = tril(Q⊙exp(G - G_r) · (K⊙exp(G_r - G))^T)            lower, diagonal included
    W    = (I + Diag(beta) A_kk)^-1 Diag(beta) (K⊙exp(G))       WY / UT transform (recursive block inverse)
    U    = (I + Diag(beta) A_kk)^-1 Diag(beta) V
    Delta = U - W S_0
    O    = scale * ((Q⊙exp(G)) S_0 + A_qk Delta)
    S_C  = Diag(exp(G_C)) S_0 + (K⊙exp(G_C - G))^T Delta

Rebasing on row r bounds every exponent by ``|g_min| * ceil((C - 1) / 2)`` (80 at g_min = -5, C = 32),
so ``exp(±(G - G_r))`` is finite in float32 and bfloat16 and the diagonal block needs no per-position
path. Entries above the diagonal may overflow; ``tril`` selects (it does not multiply) and drops them.
Everything but the state scan is batched over all chunks at once.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from k3lit.kernels.kda_validate import rebase_row, split_varlen


def _pad_time(x: torch.Tensor, total: int) -> torch.Tensor:
    """Zero-pad dim 1 (time) of ``[B, T, ...]`` to ``total``."""
    pad = total - x.shape[1]
    if pad == 0:
        return x
    return F.pad(x, [0, 0] * (x.dim() - 2) + [0, pad])


def _pack_varlen(xs: tuple[torch.Tensor, ...], cu_seqlens: torch.Tensor) -> tuple[list[torch.Tensor], list[int]]:
    """``[1, T_total, ...]`` packed tensors -> ``[N, T_max, ...]`` zero-padded batches and the lengths.

    Zero padding at the end of a sequence (g = 0, k = v = 0, beta = 0) leaves its state unchanged.
    """
    ranges = split_varlen(cu_seqlens)
    lens = [hi - lo for lo, hi in ranges]
    t_max = max(max(lens), 1)
    packed = [torch.cat([_pad_time(x[:, lo:hi], t_max) for lo, hi in ranges]) for x in xs]
    return packed, lens


def unit_lower_inverse(L: torch.Tensor) -> torch.Tensor:
    """``(I + L)^-1`` for strictly lower-triangular ``L [..., C, C]`` by recursive 2×2 block inversion.

    ``[[A, 0], [X, D]]^-1 = [[A^-1, 0], [-D^-1 X A^-1, D^-1]]``, batched over all diagonal blocks of one size
    at a time (1, 2, 4, … up to C, padded to a power of two): log2(C) rounds of batched matrix products, as
    stable as forward substitution, and unlike ``torch.linalg.solve_triangular`` its backward is fast on CPU.
    """
    C = L.shape[-1]
    P = 1 << max(C - 1, 0).bit_length()  # next power of two
    M = F.pad(L, [0, P - C, 0, P - C])
    batch = M.shape[:-2]
    inv = torch.ones(*batch, P, 1, 1, dtype=M.dtype, device=M.device)  # inverses of the 1x1 diagonal blocks
    b = 1
    while b < P:
        n = P // (2 * b)
        blocks = M.reshape(*batch, n, 2 * b, n, 2 * b).diagonal(dim1=-4, dim2=-2)  # [..., 2b, 2b, n]
        X = blocks.movedim(-1, -3)[..., b:, :b]  # lower-left b×b block of each 2b diagonal block
        A_inv, D_inv = inv[..., 0::2, :, :], inv[..., 1::2, :, :]
        lower = -(D_inv @ X @ A_inv)
        top = torch.cat([A_inv, torch.zeros_like(A_inv)], dim=-1)
        inv = torch.cat([top, torch.cat([lower, D_inv], dim=-1)], dim=-2)  # [..., n, 2b, 2b]
        b *= 2
    return inv[..., 0, :C, :C]


def kda_chunk(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float,
    initial_state: torch.Tensor | None,
    output_final_state: bool,
    cu_seqlens: torch.Tensor | None,
    chunk_size: int,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Chunked KDA forward; autograd supplies the backward. Shapes as :func:`k3lit.ops.kda`.

    Computes in float64 for float64 inputs and in float32 otherwise, autocast off (under fp16 autocast the
    rebased exponentials, up to e^87, would overflow the matrix products); o is returned in v's dtype and the final
    state in the compute dtype.
    """
    kind = q.device.type
    if torch.amp.is_autocast_available(kind) and torch.is_autocast_enabled(kind):
        with torch.autocast(kind, enabled=False):
            return kda_chunk(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens, chunk_size)
    if cu_seqlens is not None:
        (q, k, v, g, beta), lens = _pack_varlen((q, k, v, g, beta), cu_seqlens)
        o, state = kda_chunk(q, k, v, g, beta, scale, initial_state, output_final_state, None, chunk_size)
        o = torch.cat([o[n : n + 1, :t] for n, t in enumerate(lens)], dim=1)
        return o, state

    out_dtype = v.dtype
    dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    B, T, H, K = q.shape
    V = v.shape[-1]
    C = chunk_size
    N = max(-(-T // C), 1)
    # [B, T, H, X] -> [B, H, N, C, X] in the compute dtype, zero-padded to N * C tokens.
    def chunks(x: torch.Tensor) -> torch.Tensor:
        x = _pad_time(x.to(dtype), N * C)
        return x.reshape(B, N, C, H, -1).permute(0, 3, 1, 2, 4)

    q, k, v, g = chunks(q), chunks(k), chunks(v), chunks(g)
    beta = chunks(beta.unsqueeze(-1))  # [B, H, N, C, 1]

    G = g.cumsum(dim=-2)  # [B, H, N, C, K]
    r = rebase_row(C)
    G_r = G[..., r : r + 1, :]
    G_last = G[..., -1:, :]
    k_up = k * (G - G_r).exp()  # K ⊙ exp(G - G_r)
    k_down = k * (G_r - G).exp()  # K ⊙ exp(G_r - G)
    q_up = q * (G - G_r).exp()
    A_kk = torch.tril(k_up @ k_down.transpose(-1, -2), diagonal=-1)  # [B, H, N, C, C]
    A_qk = torch.tril(q_up @ k_down.transpose(-1, -2)) * scale

    T_inv = unit_lower_inverse(beta * A_kk)  # (I + Diag(beta) A_kk)^-1, [B, H, N, C, C]
    W = T_inv @ (beta * k * G.exp())
    U = T_inv @ (beta * v)
    q_in = q * G.exp() * scale  # reads the state entering the chunk
    k_out = k * (G_last - G).exp()  # writes the state leaving the chunk
    decay = G_last.exp().transpose(-1, -2)  # [B, H, N, K, 1]

    S = q.new_zeros(B, H, K, V) if initial_state is None else initial_state.to(dtype)
    o = []
    for n in range(N):
        delta = U[:, :, n] - W[:, :, n] @ S  # [B, H, C, V]
        o.append(q_in[:, :, n] @ S + A_qk[:, :, n] @ delta)
        S = decay[:, :, n] * S + k_out[:, :, n].transpose(-1, -2) @ delta
    out = torch.stack(o, dim=2).permute(0, 2, 3, 1, 4).reshape(B, N * C, H, V)[:, :T]
    return out.to(out_dtype), (S if output_final_state else None)
