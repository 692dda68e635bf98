"""Triton kernels of two-phase Block AttnRes (k3lit.ops.attn_res, arXiv 2603.15031 §4) and their launchers.

Phase 1 (``inter``): the S sublayers of a block all read the same completed block summaries ``s_1 … s_N``
(``[D]`` per token row), each with its own query ``u_j`` (``w_j ⊙ γ_j``). One pass over the summaries serves
all S queries::

    r_i = 1 / sqrt(mean(s_i^2) + eps)    l_ij = (s_i·u_j) r_i    a_ij = softmax_i(l_ij)
    mix_j = Σ_i a_ij s_i                 lse_j = log Σ_i exp(l_ij)

Phase 2 (``merge``): sublayer j folds in its block's running partial sum ``p`` by the online-softmax rule::

    l_p = (p·u_j) r_p    w = sigmoid(lse_j - l_p)    h = w mix_j + (1 - w) p

which is the one-pass mix over ``[s_1 … s_N, p]`` (``k3lit.kernels.attn_res.mix``). In a block of S sublayers the
one-pass form writes S gradients of full ``[B, T, D]`` tensors per summary, which autograd then adds up (S - 1
additions), and reads every summary S times in the forward; phase 1 writes one gradient per summary, needs no
addition, and its forward reads every summary from memory once (the other queries find it in the SM's cache).
Its backward still reads each summary 2S + 1 times, all but the first from cache; phase 2 adds a read of
``mix_j`` and ``p`` per sublayer. On the H200 (benchmarks/RESULTS.md, "depth-mix kernel") a block's two phases
take less kernel time than its S one-pass reads (2.4 against 2.7 ms at 6 summaries, batch 8 x 4096 x 1024), and the
model gains more than that: autograd does not add up S gradients per summary.

Backward of phase 1, upstream ``g_j`` (of mix_j) and ``δ_j`` (of lse_j)::

    dl_ij = a_ij (g_j·s_i - g_j·mix_j + δ_j)        with g_j·mix_j = Σ_i a_ij g_j·s_i (pass 1 over the sources)
    ds_i = Σ_j [a_ij g_j + dl_ij (r_i u_j - (s_i·u_j) r_i^3 s_i / D)]        du_j = Σ_rows Σ_i dl_ij r_i s_i

Backward of phase 2, upstream ``g``::

    dmix = w g    δ = w (1 - w) g·(mix - p)    dl_p = -δ
    dp = (1 - w) g + dl_p (r_p u - (p·u) r_p^3 p / D)    du = Σ_rows dl_p r_p p

Phase 1 runs one program per row tile that serves the S queries one after another, so each summary tile comes
from memory once and from the SM's cache for the other queries; its backward is two kernels: per (query, row
tiles) ``dl_ij`` and ``du_j`` (two passes over the sources, the first for ``g_j·mix_j``), then per row tile
``ds_i`` for each source, summed over the queries. Every kernel works on ``[BT, BD]`` tiles of whole rows, as the
one-pass kernel does, one warp per 1024 columns for the forward and the logits pass (``common.row_tiles``).
Statistics are saved as there (``s_i·u_j``, ``r_i``, the softmax's max and denominator, not the log-sum-exp) so the
backward rebuilds ``a_ij`` bit for bit. The ``du`` reductions loop over row tiles on a fixed grid and reduce per
program: deterministic, no atomics.
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
def _inter_fwd(
    table, u_ptr, lse_ptr, su_ptr, r_ptr, m_ptr, z_ptr, M, N, S, eps,
    D: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr, ALIGNED: tl.constexpr,
):
    # one program per row tile, the queries one after another: the tile's summaries come from memory for the
    # first query and from the SM's cache for the others
    base, rows, m_row, mask, offs = row_tile(tl.program_id(0), M, D, BT, BD)
    cols = tl.arange(0, BD)
    for j in range(S):
        u = tl.load(u_ptr + j * D + cols, mask=cols < D, other=0.0).to(tl.float32)
        acc, m, z = online_mix(table, N, u, su_ptr, j * N, r_ptr, j == 0, base, offs, mask, rows, m_row, M, eps, D,
                               ALIGNED)
        store_as(tl.load(table + 2 * N + 1 + j), tl.load(table + 2 * N), base, offs, mask, acc / z[:, None],
                 ALIGNED)
        tl.store(m_ptr + j * M + rows, m, mask=m_row)
        tl.store(z_ptr + j * M + rows, z, mask=m_row)
        tl.store(lse_ptr + j * M + rows, m + tl.log(z), mask=m_row)


@triton.jit
def _inter_bwd_logits(
    table, dlse_ptr, su_ptr, r_ptr, m_ptr, z_ptr, dl_ptr, du_part, M, N, n_tiles,
    D: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr, ALIGNED: tl.constexpr, HAS_DLSE: tl.constexpr,
):
    """Per query j (program axis 0) over row tiles: ``dl_ij`` for every source (stored ``[S, N, M]``) and the
    program's share of ``du_j``."""
    j = tl.program_id(0)
    pid = tl.program_id(1)
    cols = tl.arange(0, BD)
    du = tl.zeros([BD], tl.float32)
    g_addr, g_code = tl.load(table + 3 * N + 1 + j), tl.load(table + 3 * N)
    for tile in range(pid, n_tiles, tl.num_programs(1)):
        base, rows, m_row, mask, offs = row_tile(tile, M, D, BT, BD)
        g = load_f32(g_addr, g_code, base, offs, mask, ALIGNED)
        m = tl.load(m_ptr + j * M + rows, mask=m_row, other=0.0)
        inv_z = 1.0 / tl.load(z_ptr + j * M + rows, mask=m_row, other=1.0)
        # g_j·mix_j - δ_j
        g_out = softmax_dot(table, N, g, su_ptr + j * N * M, r_ptr, m, inv_z, base, offs, mask, rows, m_row, M,
                            ALIGNED)
        if HAS_DLSE:
            g_out -= tl.load(dlse_ptr + j * M + rows, mask=m_row, other=0.0)
        for i in range(N):
            s = load_f32(tl.load(table + i), tl.load(table + N + i), base, offs, mask, ALIGNED)
            su = tl.load(su_ptr + (j * N + i) * M + rows, mask=m_row, other=0.0)
            r = tl.load(r_ptr + i * M + rows, mask=m_row, other=0.0)
            dl = softmax_weight(su, r, m, inv_z) * (tl.sum(g * s, axis=1) - g_out)
            tl.store(dl_ptr + (j * N + i) * M + rows, dl, mask=m_row)
            du += tl.sum((dl * r)[:, None] * s, axis=0)
    tl.store(du_part + (pid * tl.num_programs(0) + j) * D + cols, du, mask=cols < D)


@triton.jit
def _inter_bwd_sources(
    table, u_ptr, su_ptr, r_ptr, m_ptr, z_ptr, dl_ptr, M, N, S,
    D: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr, ALIGNED: tl.constexpr,
):
    """Per row tile, for each source i: ``ds_i`` summed over the S queries; the tile's S gradient tiles come from
    memory for the first source and from the SM's cache for the others."""
    base, rows, m_row, mask, offs = row_tile(tl.program_id(0), M, D, BT, BD)
    cols = tl.arange(0, BD)
    m_col = cols < D
    g_code = tl.load(table + 3 * N)
    for i in range(N):
        code = tl.load(table + N + i)
        s = load_f32(tl.load(table + i), code, base, offs, mask, ALIGNED)
        r = tl.load(r_ptr + i * M + rows, mask=m_row, other=0.0)
        ds = tl.zeros([BT, BD], tl.float32)
        c_s = tl.zeros([BT], tl.float32)
        for j in range(S):
            g = load_f32(tl.load(table + 3 * N + 1 + j), g_code, base, offs, mask, ALIGNED)
            u = tl.load(u_ptr + j * D + cols, mask=m_col, other=0.0).to(tl.float32)
            su = tl.load(su_ptr + (j * N + i) * M + rows, mask=m_row, other=0.0)
            m = tl.load(m_ptr + j * M + rows, mask=m_row, other=0.0)
            inv_z = 1.0 / tl.load(z_ptr + j * M + rows, mask=m_row, other=1.0)
            dl = tl.load(dl_ptr + (j * N + i) * M + rows, mask=m_row, other=0.0)
            ds += softmax_weight(su, r, m, inv_z)[:, None] * g + (dl * r)[:, None] * u[None, :]
            c_s += dl * su
        ds -= (c_s * r * r * r / D)[:, None] * s
        store_as(tl.load(table + 2 * N + i), code, base, offs, mask, ds, ALIGNED)


@triton.jit
def _merge_fwd(
    mix, lse, p_ptr, u_ptr, h, M, eps, D: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr,
):
    base, rows, m_row, mask, offs = row_tile(tl.program_id(0), M, D, BT, BD)
    offs += base
    cols = tl.arange(0, BD)
    u = tl.load(u_ptr + cols, mask=cols < D, other=0.0).to(tl.float32)
    x = tl.load(mix + offs, mask=mask, other=0.0).to(tl.float32)
    p = tl.load(p_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    l_p = tl.sum(p * u[None, :], axis=1) * tl.rsqrt(tl.sum(p * p, axis=1) / D + eps)
    w = 1.0 / (1.0 + tl.exp(l_p - tl.load(lse + rows, mask=m_row, other=0.0)))
    tl.store(h + offs, (w[:, None] * x + (1.0 - w)[:, None] * p).to(h.dtype.element_ty), mask=mask)


@triton.jit
def _merge_bwd(
    g_ptr, mix, lse, p_ptr, u_ptr, dmix, dlse, dp, du_part, M, n_tiles, eps,
    D: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr,
):
    pid = tl.program_id(0)
    cols = tl.arange(0, BD)
    m_col = cols < D
    u = tl.load(u_ptr + cols, mask=m_col, other=0.0).to(tl.float32)
    du = tl.zeros([BD], tl.float32)
    for tile in range(pid, n_tiles, tl.num_programs(0)):
        base, rows, m_row, mask, offs = row_tile(tile, M, D, BT, BD)
        offs += base
        g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        x = tl.load(mix + offs, mask=mask, other=0.0).to(tl.float32)
        p = tl.load(p_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        r_p = tl.rsqrt(tl.sum(p * p, axis=1) / D + eps)
        su_p = tl.sum(p * u[None, :], axis=1)
        w = 1.0 / (1.0 + tl.exp(su_p * r_p - tl.load(lse + rows, mask=m_row, other=0.0)))
        d = w * (1.0 - w) * tl.sum(g * (x - p), axis=1)  # δ, the gradient of lse
        tl.store(dlse + rows, d, mask=m_row)
        tl.store(dmix + offs, (w[:, None] * g).to(dmix.dtype.element_ty), mask=mask)
        c_u = -d * r_p
        c_s = -d * su_p * r_p * r_p * r_p / D
        d_p = (1.0 - w)[:, None] * g + c_u[:, None] * u[None, :] - c_s[:, None] * p
        tl.store(dp + offs, d_p.to(dp.dtype.element_ty), mask=mask)
        du += tl.sum(c_u[:, None] * p, axis=0)
    tl.store(du_part + pid * D + cols, du, mask=m_col)


def inter_fwd(
    blocks: list[torch.Tensor], queries: torch.Tensor, eps: float, out_dtype: torch.dtype | None = None
) -> tuple[list[torch.Tensor], torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Phase 1 forward on validated inputs.

    Args:
        blocks: N contiguous ``[..., D]`` summaries of one shape (float32 / bfloat16 / float16, may differ).
        queries: ``[S, D]`` contiguous.
        out_dtype: the mixes' dtype (float32 / bfloat16 / float16); None for blocks[0]'s.

    Returns:
        ``(mixes, lse, su, r, mz)``: S mixes ``[..., D]`` in ``out_dtype``; ``lse [S, ...]`` float32; for
        the backward ``su [S, N, M]`` (``s_i·u_j``), ``r [N, M]`` (``1/rms(s_i)``) and ``mz [2, S, M]`` (the
        softmax's max and denominator), float32, M = number of rows.
    """
    first = blocks[0]
    D, N, S = first.shape[-1], len(blocks), queries.shape[0]
    M = first.numel() // D
    mixes = [torch.empty_like(first, dtype=out_dtype) for _ in range(S)]
    lse = first.new_empty(S, *first.shape[:-1], dtype=torch.float32)
    su = first.new_empty(S, N, M, dtype=torch.float32)
    r = first.new_empty(N, M, dtype=torch.float32)
    mz = first.new_empty(2, S, M, dtype=torch.float32)
    if M == 0:
        return mixes, lse, su, r, mz
    addrs, out_addrs = [b.data_ptr() for b in blocks], [x.data_ptr() for x in mixes]
    codes = [DTYPE_CODES[b.dtype] for b in blocks]
    table = address_table([addrs, codes, [DTYPE_CODES[mixes[0].dtype]], out_addrs], first.device)
    BT, BD, warps = row_tiles(D, "inter_fwd")
    _inter_fwd[(triton.cdiv(M, BT),)](
        table, queries, lse, su, r, mz[0], mz[1], M, N, S, eps,
        D=D, BT=BT, BD=BD, ALIGNED=aligned(addrs + out_addrs), num_warps=warps)
    return mixes, lse, su, r, mz


def inter_bwd(
    blocks: list[torch.Tensor], queries: torch.Tensor, su: torch.Tensor, r: torch.Tensor, mz: torch.Tensor,
    grads: list[torch.Tensor], dlse: torch.Tensor | None,
) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Phase 1 backward: ``(d_blocks, d_queries)``, each block gradient in its block's dtype, ``d_queries``
    ``[S, D]`` float32. ``grads``: S contiguous gradients of the mixes (one dtype); ``dlse``: ``[S, ...]``
    contiguous float32, or None for no gradient through the log-sum-exp."""
    first = blocks[0]
    D, N, S = first.shape[-1], len(blocks), queries.shape[0]
    M = first.numel() // D
    d_blocks = [torch.empty_like(b) for b in blocks]
    if M == 0:
        return d_blocks, torch.zeros(S, D, dtype=torch.float32, device=first.device)
    BT, BD, warps = row_tiles(D, "inter_bwd_logits")
    n_tiles = triton.cdiv(M, BT)
    programs = min(n_tiles, max(1, grid_programs(first.device, warps) // S))
    du_part = first.new_empty(programs, S, D, dtype=torch.float32)
    dl = first.new_empty(S, N, M, dtype=torch.float32)
    addrs, d_addrs, g_addrs = ([x.data_ptr() for x in xs] for xs in (blocks, d_blocks, grads))
    table = address_table([addrs, [DTYPE_CODES[b.dtype] for b in blocks], d_addrs, [DTYPE_CODES[grads[0].dtype]],
                           g_addrs], first.device)
    ok = aligned(addrs + d_addrs + g_addrs)
    _inter_bwd_logits[(S, programs)](
        table, dlse if dlse is not None else su, su, r, mz[0], mz[1], dl, du_part, M, N, n_tiles,
        D=D, BT=BT, BD=BD, ALIGNED=ok, HAS_DLSE=dlse is not None, num_warps=warps)
    BT, BD, warps = row_tiles(D, "inter_bwd_sources")
    _inter_bwd_sources[(triton.cdiv(M, BT),)](
        table, queries, su, r, mz[0], mz[1], dl, M, N, S, D=D, BT=BT, BD=BD, ALIGNED=ok, num_warps=warps)
    return d_blocks, du_part.sum(0)


def merge_fwd(
    mix: torch.Tensor, lse: torch.Tensor, partial: torch.Tensor, query: torch.Tensor, eps: float
) -> torch.Tensor:
    """Phase 2 forward on validated contiguous inputs: ``h [..., D]`` in mix's dtype (``lse``: ``[...]`` float32)."""
    D = mix.shape[-1]
    M = mix.numel() // D
    h = torch.empty_like(mix)
    if M:
        BT, BD, warps = row_tiles(D, "merge_fwd")
        _merge_fwd[(triton.cdiv(M, BT),)](mix, lse, partial, query, h, M, eps, D=D, BT=BT, BD=BD, num_warps=warps)
    return h


def merge_bwd(
    grad: torch.Tensor, mix: torch.Tensor, lse: torch.Tensor, partial: torch.Tensor, query: torch.Tensor,
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Phase 2 backward: ``(d_mix, d_lse float32, d_partial, d_query [D] float32)``, each in its input's dtype."""
    D = mix.shape[-1]
    M = mix.numel() // D
    dmix, dp = torch.empty_like(mix), torch.empty_like(partial)
    dlse = torch.empty_like(lse)
    if M == 0:
        return dmix, dlse, dp, torch.zeros(D, dtype=torch.float32, device=mix.device)
    BT, BD, warps = row_tiles(D, "merge_bwd")
    n_tiles = triton.cdiv(M, BT)
    programs = min(n_tiles, grid_programs(mix.device, warps))
    du_part = mix.new_empty(programs, D, dtype=torch.float32)
    _merge_bwd[(programs,)](grad, mix, lse, partial, query, dmix, dlse, dp, du_part, M, n_tiles, eps,
                            D=D, BT=BT, BD=BD, num_warps=warps)
    return dmix, dlse, dp, du_part.sum(0)
