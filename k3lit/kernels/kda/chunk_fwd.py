"""Chunked KDA forward in Triton: the kernels and their host launcher :func:`chunk_fwd`.

Every sequence is split into chunks of C tokens (C = 16, 32 or 64, the largest that the gate bound makes
safe, see README.md). Per chunk and head, with ``G`` the in-chunk cumulative log-decay, ``r = (C - 1) // 2``
its middle row and ``S`` the state entering the chunk (docs/MATH.md §1)::

    A    = tril(K⊙exp(G - G_r) · (K⊙exp(G_r - G))^T, -1)          dense tl.dot, no diagonal special case
    Aq   = scale * tril(Q⊙exp(G - G_r) · (K⊙exp(G_r - G))^T)
    M    = (I + Diag(beta) A)^-1                                    in registers, blockwise (_inverse)
    W    = M Diag(beta) (K⊙exp(G)),   U = M Diag(beta) V
    Delta = U - W S
    O    = scale (Q⊙exp(G)) S + Aq Delta
    S'   = Diag(exp(G_last)) S + (K⊙exp(G_last - G))^T Delta

Kernels: ``_intra_fwd`` (per chunk: G, A, Aq, L), ``_wy_fwd`` (per chunk: M, W, U), or both in one,
``_prep_fwd``; ``_scan_fwd`` (per sequence and value block: the sequential state recurrence, stores every chunk's
entering state and Delta), ``_out_fwd`` (per chunk: O); or, in place of the last two, ``_scan_fwd_t`` (the same
recurrence on the transposed state, writing O as it goes). Which of them run, and with which blocks, is the launch
plan's choice (``plan.py``); pipeline segments (``pipeline.py``) run each segment's scan on a side stream beside
another segment's per-chunk kernels.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from k3lit.kernels.kda.common import (
    _cc_offsets,
    _chunk_bounds,
    _chunk_program,
    _dot,
    _dot_aq,
    _g_last_of,
    _global_chunk,
    _op,
    _row,
    _scan_chunk,
    _scan_seq,
    _state_start,
    _tf32,
)
from k3lit.kernels.kda.index import chunk_meta, max_chunks
from k3lit.kernels.kda.pipeline import _on, _on_inputs_device, _pipeline, _segment_plan
from k3lit.kernels.kda.plan import (
    TUNING,
    _f32_operands,
    _plain_out_fused,
    _plain_out_shapes,
    _pow2,
    _scan_plan,
    _work_dtype,
)


@triton.jit
def _exp_rebased(x, F32: tl.constexpr):
    """``exp(x)`` of a rebased exponent, |x| <= ``EXP_LIMIT`` = 87 (k3lit/kernels/kda_validate.py): G - G_r, G_r and
    G_last - G_r in :func:`_intra_chunk`. Triton's ``tl.exp`` is ``ex2.approx.f32`` of x log2(e), which ptxas wraps
    in a subnormal fix-up (a compare and two predicated multiplies around each ``MUFU.EX2``); for |x| <= 87 < 87.34
    every result is a normal float32, where ``ex2.approx.ftz.f32`` gives the same bits without the fix-up, so
    ``_prep_fwd`` issues fewer instructions (counted from its sm_90a machine code; docs/DECISIONS.md, "KDA
    kernels"). ``_main_bwd`` keeps ``tl.exp``: with the flushed form it spills more registers at K = 256
    (``benchmarks/kernel_resources.py``). With ``F32`` (float32 inputs, and always under the interpreter, which runs
    no inline PTX) ``tl.exp``."""
    if F32:
        return tl.exp(x)
    else:
        return tl.inline_asm_elementwise("ex2.approx.ftz.f32 $0, $1;", "=r,r", [x * 1.4426950408889634],
                                         dtype=tl.float32, is_pure=True, pack=1)


@triton.jit
def _inverse(L, rows, C: tl.constexpr, BLOCK: tl.constexpr):
    """M = (I + L)^-1 of a strictly lower ``[C, C]`` float32 tile L, blockwise (BLOCK a power of two <= C).

    1. The ``BLOCK``-wide diagonal blocks by forward substitution, every block at once: at step s the s-th row r of
       each block becomes e_r - sum_{j<r} L_rj X_j. As X and the blocks' L are block-diagonal, one row extraction
       and one reduction over the tile serve all blocks: ``BLOCK - 1`` dependent steps instead of ``C - 1``.
    2. Doubling: with D the inverse of the b-wide blocks and N the entries of L between the two halves of each
       2b-wide block, I + L_2b = (I + L_b)(I + D N) and (D N)^2 = 0, so (I + L_2b)^-1 = D - D N D: two products,
       in 3xTF32 (float32 accuracy), per doubling: the blocked triangular inversion (Higham, Accuracy and
       Stability of Numerical Algorithms, 2nd ed., ch. 14), as fla's solve_tril merges its 16-row inverses.
    Default ``BLOCK`` 16 (``TUNING["inverse_block"]``): 15 steps and, at C = 32, one doubling."""
    r = rows[:, None]
    c = rows[None, :]
    X = (r == c).to(tl.float32)
    same = (r // BLOCK) == (c // BLOCK)
    Lb = tl.where(same, L, 0.0)
    off_diag = same & (r != c)  # the block entries a step writes (the diagonal stays 1)
    for s in range(1, BLOCK):
        sel = (rows % BLOCK) == s
        l_s = tl.sum(tl.where(sel[:, None], Lb, 0.0), axis=0)  # column j: L of the row of j's block being formed
        y = -tl.sum(l_s[:, None] * X, axis=0)  # column c: the new row of c's block, at c (X block-diagonal)
        X = tl.where(sel[:, None] & off_diag, y[None, :], X)
    for lvl in tl.static_range(6):  # b = BLOCK << lvl, while b < C
        if (BLOCK << lvl) < C:
            pair = (r // (BLOCK << (lvl + 1))) == (c // (BLOCK << (lvl + 1)))
            N = tl.where(pair & ((r // (BLOCK << lvl)) != (c // (BLOCK << lvl))), L, 0.0)
            X -= tl.dot(X, tl.dot(N, X, input_precision="tf32x3"), input_precision="tf32x3")
    return X


@triton.jit
def _log_decay(g, bias, off, msk, i_h, cols, g_min, K: tl.constexpr, GATE: tl.constexpr):
    """The ``[C, BK]`` log-decay tile at ``g + off`` as float32 (0 where masked). With ``GATE`` the tensor holds
    the gate pre-activation e and the tile is ``g_min * sigmoid(e + bias)`` (bias ``[H * K]`` float32)."""
    x = tl.load(g + off, mask=msk, other=0.0).to(tl.float32)
    if GATE:
        b = tl.load(bias + i_h * K + cols, mask=cols < K, other=0.0)
        x = tl.where(msk, g_min * tl.sigmoid(x + b[None, :]), 0.0)
    return x


@triton.jit
def _rnorm(x, tok, i_h, m_t, H: tl.constexpr, K: tl.constexpr, C: tl.constexpr, BK: tl.constexpr):
    """``1 / max(||x_t||, 1e-12)`` per row of the ``[C, K]`` slab at ``x`` (F.normalize's definition)."""
    ss = tl.zeros([C], dtype=tl.float32)
    for kb in range(0, K, BK):
        cols = kb + tl.arange(0, BK)
        msk = m_t[:, None] & (cols < K)[None, :]
        b = tl.load(x + tok[:, None] * (H * K) + i_h * K + cols[None, :], mask=msk, other=0.0).to(tl.float32)
        ss += tl.sum(b * b, axis=1)
    return 1.0 / tl.maximum(tl.sqrt(ss), 1e-12)


@triton.jit
def _intra_chunk(
    k, q, g, beta, Gc, Aq, Kd, Qg, W, scale, bias, g_min, rnq, rnk, i_h, t0, n_valid, rows, m_t, tok,
    H: tl.constexpr, K: tl.constexpr, C: tl.constexpr, BK: tl.constexpr, F32: tl.constexpr, GATE: tl.constexpr,
    L2: tl.constexpr, GC_ALL: tl.constexpr,
):
    """The per-chunk work of :func:`_intra_fwd` for the chunk of ``n_valid`` tokens from ``t0`` (rows ``rows``,
    mask ``m_t``, token indices ``tok``): stores G, Aq, Kd, Qg (and the reciprocal norms with ``L2``), and
    K⊙exp(G) in ``W``'s place, where :func:`_wy_chunk` reads it back and overwrites it with W; returns
    L ``[C, C]``."""
    R: tl.constexpr = (C - 1) // 2
    if L2:
        r_q = _rnorm(q, tok, i_h, m_t, H, K, C, BK)
        r_k = _rnorm(k, tok, i_h, m_t, H, K, C, BK)
        tl.store(rnq + tok * H + i_h, r_q, mask=m_t)
        tl.store(rnk + tok * H + i_h, r_k, mask=m_t)
    A = tl.zeros([C, C], dtype=tl.float32)
    B_qk = tl.zeros([C, C], dtype=tl.float32)
    for kb in range(0, K, BK):
        cols = kb + tl.arange(0, BK)
        msk = m_t[:, None] & (cols < K)[None, :]
        off = tok[:, None] * (H * K) + i_h * K + cols[None, :]
        b_G = tl.cumsum(_log_decay(g, bias, off, msk, i_h, cols, g_min, K, GATE), axis=0)
        if GC_ALL:  # all rows but the last, which the G_last store below writes
            tl.store(Gc + off, b_G, mask=msk & (rows != n_valid - 1)[:, None])
        b_Gr = _row(b_G, rows, R)
        up = _exp_rebased(b_G - b_Gr[None, :], F32)  # |exponent| <= |g_min| * ceil((C - 1) / 2) <= 87
        dn = _exp_rebased(b_Gr[None, :] - b_G, F32)
        b_k = tl.load(k + off, mask=msk, other=0.0).to(tl.float32)
        b_q = tl.load(q + off, mask=msk, other=0.0).to(tl.float32)
        if L2:
            b_k *= r_k[:, None]
            b_q *= r_q[:, None]
        g_last = _row(b_G, rows, n_valid - 1)
        # G_last, which the scans and the backward read, always from this vector: for the tile store Triton forms
        # the cumsum a second time in float32's store layout (twice the shuffles) rather than convert the tile,
        # and with GATE that second cumsum's last row differed from this one in the last bit for some inputs (on
        # an H100), so the inference forward's final state would differ from the training forward's
        tl.store(Gc + (t0 + n_valid - 1) * (H * K) + i_h * K + cols, g_last, mask=cols < K)
        # exp(G_last - G) = dn exp(G_last - G_R) and exp(G) = up exp(G_R): two exponentials of the tile, not four.
        # |G_R| and |G_last - G_R| <= |g_min| * ceil((C - 1) / 2) <= 87, so each factor is at least e^-87, a
        # normal float32
        e_r = _exp_rebased(b_Gr, F32)
        tl.store(Kd + off, (b_k * dn * _exp_rebased(g_last - b_Gr, F32)[None, :]).to(Kd.dtype.element_ty), mask=msk)
        tl.store(Qg + off, (b_q * up * (e_r * scale)[None, :]).to(Qg.dtype.element_ty), mask=msk)
        b_kup = b_k * up
        tl.store(W + off, (b_kup * e_r[None, :]).to(W.dtype.element_ty), mask=msk)  # K⊙exp(G), W's operand
        b_kdn = b_k * dn
        A += _dot(_op(b_kup, F32), tl.trans(_op(b_kdn, F32)), F32)
        B_qk += _dot_aq(_tf32(b_q * up, F32), tl.trans(_tf32(b_kdn, F32)), F32)
    b_beta = tl.load(beta + tok * H + i_h, mask=m_t, other=0.0).to(tl.float32)
    # Entries above the diagonal may be inf/nan (they pair a late row with an early column); where selects.
    L = tl.where(rows[:, None] > rows[None, :], A, 0.0) * b_beta[:, None]
    B_qk = tl.where(rows[:, None] >= rows[None, :], B_qk, 0.0) * scale
    tl.store(Aq + _cc_offsets(tok, i_h, rows, H, C), _tf32(B_qk, F32), mask=m_t[:, None])
    return L


@triton.jit
def _wy_chunk(
    L, v, beta, Mi, W, U, i_h, rows, m_t, tok,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    F32: tl.constexpr, SAVE: tl.constexpr, INV_BLOCK: tl.constexpr,
):
    """The per-chunk work of :func:`_wy_fwd` from the chunk's L (``[C, C]``): M (stored to ``Mi`` when ``SAVE``),
    W = M Diag(beta) (K⊙exp(G)) from the K⊙exp(G) that :func:`_intra_chunk` left in ``W`` (overwritten block by
    block: each block's product reads the whole block before any of it is stored), and U = M Diag(beta) V."""
    X = _inverse(L, rows, C, INV_BLOCK)
    if SAVE:
        tl.debug_barrier()  # every thread has read L (which _wy_fwd loads from Mi) before M overwrites it
        tl.store(Mi + _cc_offsets(tok, i_h, rows, H, C), X, mask=m_t[:, None])
    b_beta = tl.load(beta + tok * H + i_h, mask=m_t, other=0.0).to(tl.float32)
    Xb = _op(X * b_beta[None, :], F32)  # M Diag(beta)
    for kb in range(0, K, BK):
        cols = kb + tl.arange(0, BK)
        msk = m_t[:, None] & (cols < K)[None, :]
        off = tok[:, None] * (H * K) + i_h * K + cols[None, :]
        b_w = _dot(Xb, _op(tl.load(W + off, mask=msk, other=0.0), F32), F32)
        tl.store(W + off, b_w.to(W.dtype.element_ty), mask=msk)
    for vb in range(0, V, BV):
        cols = vb + tl.arange(0, BV)
        msk = m_t[:, None] & (cols < V)[None, :]
        off = tok[:, None] * (H * V) + i_h * V + cols[None, :]
        b_v = tl.load(v + off, mask=msk, other=0.0)
        b_u = _dot(Xb, _op(b_v, F32), F32)
        tl.store(U + off, b_u.to(U.dtype.element_ty), mask=msk)


@triton.jit(do_not_specialize_on_alignment=["cidx"])  # a segment's rows start anywhere
def _intra_fwd(
    k, q, g, beta, Gc, Aq, Mi, Kd, Qg, W, cu, cidx, scale, bias, g_min, rnq, rnk,
    H: tl.constexpr, K: tl.constexpr, C: tl.constexpr, BK: tl.constexpr, F32: tl.constexpr, GATE: tl.constexpr,
    L2: tl.constexpr, GC_ALL: tl.constexpr,
):
    """Per (chunk, head): G = cumsum(g), Aq (scaled, [C, C]), L = Diag(beta) A (strictly lower), and the scan's
    operands Kd = K⊙exp(G_last - G), Qg = scale Q⊙exp(G). With ``GATE``, g = g_min * sigmoid(e + bias) from
    the pre-activation e; with ``L2``, q and k are L2-normalised per token and head on load, and the
    reciprocal norms are stored in ``rnq``, ``rnk`` (``[T_total, H]`` float32 each) for the backward. L goes to
    ``Mi`` and K⊙exp(G) to ``W``, where :func:`_wy_fwd` replaces them by M = (I + L)^-1 and W. G goes to ``Gc``:
    every row with ``GC_ALL`` (for the backward), else only the chunk's last (the scans' G_last)."""
    i_h, t0, n_valid, rows, m_t, tok = _chunk_program(cu, cidx, C)
    L = _intra_chunk(k, q, g, beta, Gc, Aq, Kd, Qg, W, scale, bias, g_min, rnq, rnk, i_h, t0, n_valid, rows, m_t,
                     tok, H, K, C, BK, F32, GATE, L2, GC_ALL)
    tl.store(Mi + _cc_offsets(tok, i_h, rows, H, C), L, mask=m_t[:, None])  # _wy_fwd replaces L by M


@triton.jit(do_not_specialize_on_alignment=["cidx"])  # a segment's rows start anywhere
def _wy_fwd(
    v, beta, Mi, W, U, cu, cidx,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    F32: tl.constexpr, SAVE: tl.constexpr, INV_BLOCK: tl.constexpr,
):
    """Per (chunk, head), from the L = Diag(beta) A that :func:`_intra_fwd` left in ``Mi`` and the K⊙exp(G) it
    left in ``W``: M = (I + L)^-1 (stored over L when ``SAVE``, for the backward), W = M Diag(beta) (K⊙exp(G))
    (over K⊙exp(G)) and U = M Diag(beta) V.

    M by :func:`_inverse`: forward substitution, X_i = e_i - sum_{j<i} L_ij X_j (exact: L is strictly lower), on
    ``INV_BLOCK``-wide diagonal blocks (``INV_BLOCK - 1`` dependent steps, each two reductions over the ``[C, C]``
    tile), then doubled up to C with products. Launched with one warp, so the reductions never cross warps (no
    shared-memory exchange and no barrier per step), which on the H200 outweighs the parallelism of more warps
    (docs/DECISIONS.md, "KDA kernels")."""
    i_h, t0, n_valid, rows, m_t, tok = _chunk_program(cu, cidx, C)
    L = tl.load(Mi + _cc_offsets(tok, i_h, rows, H, C), mask=m_t[:, None], other=0.0)
    _wy_chunk(L, v, beta, Mi, W, U, i_h, rows, m_t, tok, H, K, V, C, BK, BV, F32, SAVE, INV_BLOCK)


@triton.jit(do_not_specialize_on_alignment=["cidx"])  # a segment's rows start anywhere
def _prep_fwd(
    k, q, v, g, beta, Gc, Aq, Mi, Kd, Qg, W, U, cu, cidx, scale, bias, g_min, rnq, rnk,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    F32: tl.constexpr, GATE: tl.constexpr, L2: tl.constexpr, SAVE: tl.constexpr, INV_BLOCK: tl.constexpr,
):
    """:func:`_intra_fwd` and :func:`_wy_fwd` in one program per (chunk, head) (``TUNING["fwd_prep"] = "fused"``):
    L stays in registers, G is stored only for the backward (``SAVE``; else only each chunk's last row, for the
    scans), and the W pass reads the K⊙exp(G) that the first pass stored in W's place back from the cache."""
    i_h, t0, n_valid, rows, m_t, tok = _chunk_program(cu, cidx, C)
    L = _intra_chunk(k, q, g, beta, Gc, Aq, Kd, Qg, W, scale, bias, g_min, rnq, rnk, i_h, t0, n_valid, rows, m_t,
                     tok, H, K, C, BK, F32, GATE, L2, SAVE)
    tl.debug_barrier()  # K⊙exp(G) stored by every thread is visible to every thread before the W pass reads it
    _wy_chunk(L, v, beta, Mi, W, U, i_h, rows, m_t, tok, H, K, V, C, BK, BV, F32, SAVE, INV_BLOCK)


@triton.jit(do_not_specialize=["it_lo", "it_hi"])  # one compile for every segment
def _scan_fwd(
    Kd, Gc, W, U, D, h, h0, ht, cu, coff, it_lo, it_hi, Qg, Aq, o,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    HAS_H0: tl.constexpr, STORE_HT: tl.constexpr, F32: tl.constexpr, OUT: tl.constexpr, SAVE: tl.constexpr,
):
    """Per (value block, sequence x head): S_{n+1} = Diag(exp(G_last)) S_n + Kd^T (U - W S_n), over the chunks
    ``it_lo <= it < it_hi`` of each sequence (a segment of :func:`chunk_fwd`'s pipeline: the state enters from
    ``h0`` and leaves to ``ht`` in float32, so segments chain without rounding). Stores every chunk's entering
    state and Delta for :func:`_out_fwd`; or, with ``OUT``, writes O = Qg S + Aq Delta itself (from the same
    bf16-rounded S and Delta) and stores the states and Delta only when ``SAVE`` (for the backward)."""
    i_nh, i_h, bos, eos, c0, n_chunks, rk, cv, rows, m_k, m_v = _scan_seq(cu, coff, H, K, V, C, BK, BV)
    off_s, m_kv, base, S = _state_start(h0, i_nh, rk, cv, m_k, m_v, K, V, HAS_H0, False)
    end = tl.minimum(n_chunks, it_hi)
    g_next = _g_last_of(Gc, bos, eos, it_lo, it_lo < end, i_h, rk, m_k, H, K, C)
    for it in range(it_lo, end):
        t0, n_valid, m_t, tok, offk, mk, offv, mv = _scan_chunk(bos, eos, it, i_h, rows, rk, cv, m_k, m_v, H, K, V,
                                                                C)
        decay = tl.exp(g_next)  # read one trip after its load was issued
        g_next = _g_last_of(Gc, bos, eos, it + 1, it + 1 < end, i_h, rk, m_k, H, K, C)
        if SAVE or not OUT:
            tl.store(h + ((c0 + it) * H + i_h) * K * V + off_s, S.to(h.dtype.element_ty), mask=m_kv)
        b_w = tl.load(W + offk, mask=mk, other=0.0)
        b_u = tl.load(U + offv, mask=mv, other=0.0).to(tl.float32)
        b_d = b_u - _dot(_op(b_w, F32), _op(S, F32), F32)
        if SAVE or not OUT:
            tl.store(D + offv, b_d.to(D.dtype.element_ty), mask=mv)
        if OUT:
            b_qg = tl.load(Qg + offk, mask=mk, other=0.0)
            b_a = tl.load(Aq + _cc_offsets(tok, i_h, rows, H, C), mask=m_t[:, None], other=0.0)
            b_o = _dot(_op(b_qg, F32), _op(S.to(h.dtype.element_ty), F32), F32)
            b_o += _dot_aq(b_a, b_d.to(D.dtype.element_ty), F32)
            tl.store(o + offv, b_o.to(o.dtype.element_ty), mask=mv)
        b_kd = tl.load(Kd + offk, mask=mk, other=0.0)
        S = S * decay[:, None] + _dot(tl.trans(_op(b_kd, F32)), _op(b_d, F32), F32)
    if STORE_HT:
        tl.store(ht + base + off_s, S, mask=m_kv)


@triton.jit(do_not_specialize=["it_lo", "it_hi"])  # one compile for every segment
def _scan_fwd_t(
    Kd, Gc, W, U, D, h, h0, ht, cu, coff, it_lo, it_hi, Qg, Aq, o,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    HAS_H0: tl.constexpr, STORE_HT: tl.constexpr, F32: tl.constexpr, SAVE: tl.constexpr,
):
    """:func:`_scan_fwd` with the state held transposed, ``S^T [BV, BK]``: Delta^T = U^T - S^T W^T and
    S^T <- S^T Diag(exp(G_last)) + Delta^T Kd. The state and Delta are then the left operands of both products,
    which Hopper's wgmma reads from registers (no shared-memory round trip on the sequential path). It also
    writes the output, O^T = S^T Qg^T + Delta^T Aq^T (products off the sequential path), in place of
    :func:`_out_fwd`, so it stores the entering states and Delta only when ``SAVE`` (for the backward)."""
    i_nh, i_h, bos, eos, c0, n_chunks, rk, cv, rows, m_k, m_v = _scan_seq(cu, coff, H, K, V, C, BK, BV)
    off_st, m_vk, base, St = _state_start(h0, i_nh, rk, cv, m_k, m_v, K, V, HAS_H0, True)
    end = tl.minimum(n_chunks, it_hi)
    g_next = _g_last_of(Gc, bos, eos, it_lo, it_lo < end, i_h, rk, m_k, H, K, C)
    for it in range(it_lo, end):
        t0, n_valid, m_t, tok, offk, mk, offv, mv = _scan_chunk(bos, eos, it, i_h, rows, rk, cv, m_k, m_v, H, K, V,
                                                                C)
        decay = tl.exp(g_next)  # read one trip after its load was issued
        g_next = _g_last_of(Gc, bos, eos, it + 1, it + 1 < end, i_h, rk, m_k, H, K, C)
        if SAVE:
            tl.store(h + ((c0 + it) * H + i_h) * K * V + off_st, St.to(h.dtype.element_ty), mask=m_vk)
        b_w = tl.load(W + offk, mask=mk, other=0.0)
        b_ut = tl.trans(tl.load(U + offv, mask=mv, other=0.0).to(tl.float32))
        b_dt = b_ut - _dot(_op(St, F32), tl.trans(_op(b_w, F32)), F32)
        if SAVE:
            tl.store(D + offv, tl.trans(b_dt).to(D.dtype.element_ty), mask=mv)
        b_qg = tl.load(Qg + offk, mask=mk, other=0.0)
        b_a = tl.load(Aq + _cc_offsets(tok, i_h, rows, H, C), mask=m_t[:, None], other=0.0)
        b_ot = _dot(_op(St, F32), tl.trans(_op(b_qg, F32)), F32) + _dot_aq(_op(b_dt, F32), tl.trans(b_a), F32)
        tl.store(o + offv, tl.trans(b_ot).to(o.dtype.element_ty), mask=mv)
        b_kd = tl.load(Kd + offk, mask=mk, other=0.0)
        St = St * decay[None, :] + _dot(_op(b_dt, F32), _op(b_kd, F32), F32)
    if STORE_HT:
        tl.store(ht + base + off_st, St, mask=m_vk)


@triton.jit(do_not_specialize_on_alignment=["cidx"])  # a segment's rows start anywhere
def _out_fwd(
    Qg, Aq, D, h, o, cu, cidx, coff,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    F32: tl.constexpr, SEGMENT: tl.constexpr,
):
    """Per (value block, chunk, head): O = scale (Q⊙exp(G)) S + Aq Delta. The chunk table ``cidx`` may be a
    pipeline segment's (``SEGMENT``): the chunk's state is then found by its sequence and position."""
    i_v, i_c, i_h = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_n, t0, n_valid = _chunk_bounds(cu, cidx, i_c, C)
    i_g = _global_chunk(coff, cidx, i_c, i_n, SEGMENT)
    rows = tl.arange(0, C)
    m_t = rows < n_valid
    tok = t0 + rows
    cv = i_v * BV + tl.arange(0, BV)
    m_v = cv < V
    acc = tl.zeros([C, BV], dtype=tl.float32)
    for kb in range(0, K, BK):
        rk = kb + tl.arange(0, BK)
        m_k = rk < K
        offk = tok[:, None] * (H * K) + i_h * K + rk[None, :]
        mk = m_t[:, None] & m_k[None, :]
        b_qg = tl.load(Qg + offk, mask=mk, other=0.0)
        b_h = tl.load(h + (i_g * H + i_h) * K * V + rk[:, None] * V + cv[None, :],
                      mask=m_k[:, None] & m_v[None, :], other=0.0)
        acc += _dot(_op(b_qg, F32), _op(b_h, F32), F32)
    offc = _cc_offsets(tok, i_h, rows, H, C)
    b_a = tl.load(Aq + offc, mask=m_t[:, None], other=0.0)
    offv = tok[:, None] * (H * V) + i_h * V + cv[None, :]
    mv = m_t[:, None] & m_v[None, :]
    b_d = tl.load(D + offv, mask=mv, other=0.0)
    acc += _dot_aq(b_a, b_d, F32)
    tl.store(o + offv, acc.to(o.dtype.element_ty), mask=mv)


class ChunkFwdOut(NamedTuple):
    """What :func:`chunk_fwd` returns: the output and final state, then what only the backward reads (written only
    with ``save``), in :func:`k3lit.kernels.kda.chunk_bwd.chunk_bwd`'s argument order (:attr:`saved`).
    ``[B, T, ...]`` tensors are in the input layout; "work" is bf16 for bf16 and fp16 inputs, float32 for float32."""

    o: torch.Tensor  #: ``[B, T, H, V]`` in v's dtype
    ht: torch.Tensor  #: ``[N, H, K, V]`` float32, the state after each sequence
    Gc: torch.Tensor  #: ``[B, T, H, K]`` float32, the in-chunk cumulative log-decay G
    Aq: torch.Tensor  #: ``[B, T, H, C]`` float32, the scaled intra-chunk scores (TF32 values but for float32 inputs)
    Mi: torch.Tensor  #: ``[B, T, H, C]`` float32, M = (I + Diag(beta) A)^-1, row t of its chunk
    W: torch.Tensor  #: ``[B, T, H, K]`` work, W = M Diag(beta) (K⊙exp(G))
    Kd: torch.Tensor  #: ``[B, T, H, K]`` work, K⊙exp(G_last - G)
    Qg: torch.Tensor  #: ``[B, T, H, K]`` work, scale Q⊙exp(G)
    h: torch.Tensor  #: ``[max_chunks, H, K, V]`` work, the state entering each chunk
    D: torch.Tensor  #: ``[B, T, H, V]`` work, Delta = U - W S
    Rn: torch.Tensor  #: ``[2, B, T, H]`` float32 reciprocal norms of q and k (fused L2 norm), else empty

    @property
    def saved(self) -> tuple[torch.Tensor, ...]:
        """``(Gc, Aq, Mi, W, Kd, Qg, h, D, Rn)``: what only the backward reads."""
        return self[2:]


@_on_inputs_device
def chunk_fwd(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, scale: float,
    initial_state: torch.Tensor | None, output_final_state: bool, cu_seqlens: torch.Tensor | None, C: int,
    gate_bias: torch.Tensor | None = None, g_min: float | None = None, qk_l2norm: bool = False, save: bool = True,
) -> ChunkFwdOut:
    """Forward launches. Inputs ``[B, T, H, *]`` contiguous. Returns :class:`ChunkFwdOut`.

    ``g_min`` given: ``g`` is the gate pre-activation and the kernel forms ``g_min * sigmoid(g + gate_bias)``
    (``gate_bias`` ``[H * K]`` float32 or None). ``qk_l2norm``: q and k are L2-normalised in the kernel and
    ``Rn [2, B, T, H]`` float32 holds their reciprocal norms (else ``Rn`` is empty). ``save=False`` (no backward
    will follow): M, and where the scan writes the output (transposed, or plain by :func:`_plain_out_fused`) the
    states h and Delta, are not written, and G only at each chunk's last row, so only ``o`` and ``ht`` are valid.
    Launches run on ``q``'s device, on its current stream and, in pipeline segments (:func:`_segments`), on two
    side streams joined back before returning."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    N = B if cu_seqlens is None else cu_seqlens.numel() - 1
    cu, cidx, coff, NC = chunk_meta(cu_seqlens, B, T, C, q.device)
    wdt = _work_dtype(q.dtype)
    F32 = _f32_operands(q.dtype)
    Gc = torch.empty(B, T, H, K, device=q.device, dtype=torch.float32)
    Aq = torch.empty(B, T, H, C, device=q.device, dtype=torch.float32)
    Mi = torch.empty(B, T, H, C, device=q.device, dtype=torch.float32)
    W = torch.empty(B, T, H, K, device=q.device, dtype=wdt)
    Kd = torch.empty(B, T, H, K, device=q.device, dtype=wdt)
    Qg = torch.empty(B, T, H, K, device=q.device, dtype=wdt)
    # read once by the scan; float32 by default (TUNING "u_dtype")
    U = torch.empty(B, T, H, V, device=q.device, dtype=torch.float32 if TUNING["u_dtype"] == "float32" else wdt)
    D = torch.empty(B, T, H, V, device=q.device, dtype=wdt)
    h = torch.empty(max_chunks(B * T, N, C), H, K, V, device=q.device, dtype=wdt)
    o = torch.empty_like(v)
    ht = torch.empty(N, H, K, V, device=q.device, dtype=torch.float32)
    Rn = torch.empty((2, B, T, H) if qk_l2norm else (0,), device=q.device, dtype=torch.float32)
    if NC == 0:
        ht.copy_(initial_state if initial_state is not None else torch.zeros_like(ht))
        return ChunkFwdOut(o, ht, Gc, Aq, Mi, W, Kd, Qg, h, D, Rn)
    BKo = _pow2(K) if _plain_out_shapes(K, V, q.dtype) else 64  # _out_fwd's key step (why: _plain_out_shapes)
    gate = g_min is not None
    bias = _bias(gate_bias, gate, H * K, q.device)
    rnq, rnk = Rn if qk_l2norm else (None, None)
    transposed, BK, BV, nw, ns = _scan_plan("fwd", N * H, K, V, q.device, F32, save)
    meta = dict(H=H, K=K, V=V, C=C, BK=BK, BV=BV, F32=F32, num_warps=nw, num_stages=ns)
    fused_out = not transposed and _plain_out_fused(save, K, V, q.dtype)
    gmin = g_min if gate else 0.0
    BKi = min(TUNING["intra_bk"] or 64, _pow2(K))
    step = 32 if TUNING["fwd_prep"] == "fused" else 64  # the WY step when TUNING leaves it None
    BKw, BVw = min(TUNING["wy_bk"] or step, _pow2(K)), min(TUNING["wy_bv"] or step, _pow2(V))
    fus = dict(H=H, K=K, C=C, F32=F32, GATE=gate, L2=qk_l2norm)
    inv_block = min(TUNING["inverse_block"] or C, C)
    table, segs = _segment_plan("fwd", B, H, T, C, cu_seqlens, cidx, NC, q.device)
    with _pipeline(q.device, len(segs)) as (main, side):
        for i, (r0, r1, it_lo, it_hi) in enumerate(segs):
            rows = table[r0:r1]
            args = (cu, rows, scale, bias, gmin, rnq, rnk)
            if TUNING["fwd_prep"] == "fused":
                _prep_fwd[(r1 - r0, H)](k, q, v, g, beta, Gc, Aq, Mi, Kd, Qg, W, U, *args, V=V, BV=BVw, BK=BKw,
                                        SAVE=save, INV_BLOCK=inv_block, num_warps=TUNING["prep_warps"], **fus)
            else:
                _intra_fwd[(r1 - r0, H)](k, q, g, beta, Gc, Aq, Mi, Kd, Qg, W, *args, BK=BKi, GC_ALL=save,
                                         num_warps=TUNING["intra_warps"], **fus)
                _wy_fwd[(r1 - r0, H)](v, beta, Mi, W, U, cu, rows, H=H, K=K, V=V, C=C, BK=BKw, BV=BVw, F32=F32,
                                      SAVE=save, INV_BLOCK=inv_block, num_warps=TUNING["wy_warps"])
            # the state enters segment i > 0 from ht, where segment i - 1 left it (float32)
            h0 = initial_state if i == 0 else ht
            scan_args = (Kd, Gc, W, U, D, h, h0, ht, cu, coff, it_lo, it_hi)
            seg_meta = dict(meta, HAS_H0=h0 is not None, STORE_HT=output_final_state or i < len(segs) - 1)
            with _on(side and side[0], main):
                if transposed:
                    _scan_fwd_t[(triton.cdiv(V, BV), N * H)](*scan_args, Qg, Aq, o, SAVE=save, **seg_meta)
                else:
                    _scan_fwd[(triton.cdiv(V, BV), N * H)](*scan_args, Qg, Aq, o, OUT=fused_out, SAVE=save, **seg_meta)
            if not (transposed or fused_out):
                BVo = min(64, _pow2(V))
                with _on(side and side[1], side and side[0]):
                    _out_fwd[(triton.cdiv(V, BVo), r1 - r0, H)](Qg, Aq, D, h, o, cu, rows, coff, H=H, K=K, V=V, C=C,
                                                                BK=BKo, BV=BVo, F32=F32, SEGMENT=len(segs) > 1,
                                                                num_warps=TUNING["out_warps"])
    return ChunkFwdOut(o, ht, Gc, Aq, Mi, W, Kd, Qg, h, D, Rn)


def _bias(gate_bias: torch.Tensor | None, gate: bool, n: int, device: torch.device) -> torch.Tensor | None:
    """The kernels' ``[H * K]`` float32 gate bias: None without the fused gate, zeros when the gate has none."""
    if not gate:
        return None
    if gate_bias is None:
        return torch.zeros(n, device=device, dtype=torch.float32)
    return gate_bias.reshape(n).to(torch.float32).contiguous()
