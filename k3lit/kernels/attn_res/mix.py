"""Triton kernels of the softmax-over-depth mix (k3lit.ops.attn_res, docs/MATH.md §3) and their launchers.

Per token row, with sources ``s_1 … s_N`` (``[D]`` each), query ``u`` and upstream gradient ``g``::

    r_i = 1 / sqrt(mean(s_i^2) + eps)      l_i = (s_i·u) r_i      a = softmax(l)      out = Σ a_i s_i
    dl_i = a_i (g·s_i - g·out)      ds_i = a_i g + dl_i (r_i u - (s_i·u) r_i^3 s_i / D)      du = Σ dl_i r_i s_i

Each program owns ``BT`` whole rows (``BD`` = D rounded up to a power of two, masked), so every reduction over D
stays on chip. The forward reads each source once and keeps an online softmax (running max ``m`` and sum
``z``, the float32 accumulator rescaled by ``exp(m_old - m_new)``); it saves ``s_i·u`` and ``r_i`` (``[N, M]``
float32) and the final ``m`` and ``z`` (``[M]``), from which the backward recomputes ``a_i = exp(l_i - m) / z``
with ``l_i = (s_i·u) r_i`` formed bit for bit as in the forward. Saving the log-sum-exp ``m + log z`` instead
would round it to the float32 spacing of ``m``: at logits of a few hundred ``Σ a_i`` would miss 1 by ~1e-5,
and ``du``, a difference of nearly equal terms when the sources align, would lose most of its digits.

The backward reads the sources twice per row tile (pass 1: ``g·out = Σ a_i g·s_i``; pass 2: the source
gradients, which need ``g·out``); the second read of a tile is meant to come from L2. It loops over row tiles
on a fixed grid, so ``du`` is reduced on chip per program and the ``[programs, D]`` partials are summed in
torch: deterministic, no atomics (activation checkpointing recomputes the same bits).

Sources arrive as one device table of addresses and dtype codes (``common.py``), with the addresses of their
gradients for the backward. One compiled kernel serves every N; the loop over sources is a runtime loop.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from k3lit.kernels.attn_res.common import (
    DTYPE_CODES,
    address_table,
    aligned,
    grid_programs,
    load_f32,
    online_mix,
    row_tile,
    row_tiles,
    softmax_dot,
    softmax_weight,
    store_as,
)


@triton.jit
def _mix_fwd(
    table, u_ptr, out, su_ptr, r_ptr, m_ptr, z_ptr, M, N, eps,
    D: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr, ALIGNED: tl.constexpr,
):
    base, rows, m_row, mask, offs = row_tile(tl.program_id(0), M, D, BT, BD)
    cols = tl.arange(0, BD)
    u = tl.load(u_ptr + cols, mask=cols < D, other=0.0).to(tl.float32)
    acc, m, z = online_mix(table, N, u, su_ptr, 0, r_ptr, True, base, offs, mask, rows, m_row, M, eps, D, ALIGNED)
    tl.store(out + base + offs, (acc / z[:, None]).to(out.dtype.element_ty), mask=mask)
    tl.store(m_ptr + rows, m, mask=m_row)
    tl.store(z_ptr + rows, z, mask=m_row)


@triton.jit
def _mix_bwd(
    table, u_ptr, g_ptr, su_ptr, r_ptr, m_ptr, z_ptr, du_part, M, N, n_tiles,
    D: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr, ALIGNED: tl.constexpr,
):
    pid = tl.program_id(0)
    cols = tl.arange(0, BD)
    m_col = cols < D
    u = tl.load(u_ptr + cols, mask=m_col, other=0.0).to(tl.float32)
    du = tl.zeros([BD], tl.float32)
    for tile in range(pid, n_tiles, tl.num_programs(0)):
        base, rows, m_row, mask, offs = row_tile(tile, M, D, BT, BD)
        g = tl.load(g_ptr + base + offs, mask=mask, other=0.0).to(tl.float32)
        m = tl.load(m_ptr + rows, mask=m_row, other=0.0)
        inv_z = 1.0 / tl.load(z_ptr + rows, mask=m_row, other=1.0)
        g_out = softmax_dot(table, N, g, su_ptr, r_ptr, m, inv_z, base, offs, mask, rows, m_row, M, ALIGNED)  # g·out
        for i in range(N):
            code = tl.load(table + N + i)
            s = load_f32(tl.load(table + i), code, base, offs, mask, ALIGNED)
            su = tl.load(su_ptr + i * M + rows, mask=m_row, other=0.0)
            r = tl.load(r_ptr + i * M + rows, mask=m_row, other=0.0)
            a = softmax_weight(su, r, m, inv_z)
            dl = a * (tl.sum(g * s, axis=1) - g_out)
            c_u = dl * r
            c_s = dl * su * r * r * r / D
            ds = a[:, None] * g + c_u[:, None] * u[None, :] - c_s[:, None] * s
            store_as(tl.load(table + 2 * N + i), code, base, offs, mask, ds, ALIGNED)
            du += tl.sum(c_u[:, None] * s, axis=0)
    tl.store(du_part + pid * D + cols, du, mask=m_col)


def mix_fwd(
    sources: list[torch.Tensor], query: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Launch the forward kernel on validated inputs (see :func:`k3lit.kernels.attn_res.attn_res_mix_triton`).

    Args:
        sources: N contiguous ``[..., D]`` tensors of one shape (float32 / bfloat16 / float16, may differ).
        query: ``[D]`` contiguous.

    Returns:
        ``(out, src_stats, row_stats)``: out ``[..., D]`` in sources[0]'s dtype; ``src_stats [2, N, M]`` float32
        holds ``s_i·u`` and ``1/rms(s_i)``; ``row_stats [2, M]`` float32 the softmax's max logit and denominator
        (M = number of rows).
    """
    first = sources[0]
    D, N = first.shape[-1], len(sources)
    M = first.numel() // D
    out = torch.empty_like(first)
    src_stats = first.new_empty(2, N, M, dtype=torch.float32)
    row_stats = first.new_empty(2, M, dtype=torch.float32)
    if M == 0:
        return out, src_stats, row_stats
    addrs = [s.data_ptr() for s in sources]
    table = address_table([addrs, [DTYPE_CODES[s.dtype] for s in sources]], first.device)
    BT, BD, warps = row_tiles(D, "mix_fwd")
    _mix_fwd[(triton.cdiv(M, BT),)](
        table, query, out, src_stats[0], src_stats[1], row_stats[0], row_stats[1], M, N, eps,
        D=D, BT=BT, BD=BD, ALIGNED=aligned(addrs), num_warps=warps)
    return out, src_stats, row_stats


def mix_bwd(
    sources: list[torch.Tensor], query: torch.Tensor, src_stats: torch.Tensor, row_stats: torch.Tensor,
    grad: torch.Tensor,
) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Launch the backward kernel: ``(d_sources, d_query)``, each source gradient in its source's dtype and
    ``d_query`` ``[D]`` float32. Statistics as :func:`mix_fwd` returns them; ``grad`` contiguous, out's shape."""
    first = sources[0]
    D, N = first.shape[-1], len(sources)
    M = first.numel() // D
    d_sources = [torch.empty_like(s) for s in sources]
    if M == 0:
        return d_sources, torch.zeros(D, dtype=torch.float32, device=first.device)
    BT, BD, warps = row_tiles(D, "mix_bwd")
    n_tiles = triton.cdiv(M, BT)
    programs = min(n_tiles, grid_programs(first.device, warps))
    du_part = first.new_empty(programs, D, dtype=torch.float32)
    addrs = [s.data_ptr() for s in sources]
    d_addrs = [d.data_ptr() for d in d_sources]
    table = address_table([addrs, [DTYPE_CODES[s.dtype] for s in sources], d_addrs], first.device)
    _mix_bwd[(programs,)](
        table, query, grad, src_stats[0], src_stats[1], row_stats[0], row_stats[1], du_part, M, N, n_tiles,
        D=D, BT=BT, BD=BD, ALIGNED=aligned(addrs + d_addrs), num_warps=warps)
    return d_sources, du_part.sum(0)
