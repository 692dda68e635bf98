"""Chunked KDA in Triton: forward and backward kernels plus their host launchers.

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

Kernels (forward): ``_intra_fwd`` (per chunk: G, A, Aq, L), ``_wy_fwd`` (per chunk: M, W, U), or both in one,
``_prep_fwd``; ``_scan_fwd`` (per sequence and value block: the sequential state recurrence, stores every chunk's
entering state and Delta), ``_out_fwd`` (per chunk: O); or, in place of the last two, ``_scan_fwd_t`` (the same
recurrence on the transposed state, writing O as it goes). Backward: ``_scan_bwd`` or ``_scan_bwd_t`` (reverse
recurrence of dS, stores dS per chunk and dDelta), ``_main_bwd`` (per chunk: dq, dk, dv, dg, dbeta).
:func:`_scan_plan` picks the layout per shape; ``TUNING`` holds the launch settings, among them the pipeline
segments, with which each segment's scan runs on a side stream beside another segment's per-chunk kernels.
Precision: exponentials, cumulative sums, the inverse and the states in float32; matrix-product operands in
bfloat16 (float32 for float32 inputs) with float32 accumulation.

Every launcher works on a packed layout ``[1, T_total, H, X]``; a dense ``[B, T]`` batch is the packed batch
with ``cu_seqlens = [0, T, 2T, ...]``. Chunk metadata: ``chunk_idx [NC, 2]`` = (sequence, chunk in the
sequence) for every chunk, ``chunk_off [N + 1]`` = first global chunk of each sequence. Per-chunk buffers
(states) are allocated with the static upper bound ``T_total // C + N`` rows so that their shapes never
depend on the values of ``cu_seqlens`` (torch.compile's fake tensors need that).
"""

from __future__ import annotations

import contextlib
import functools
import os

import torch
import triton
import triton.language as tl


@triton.jit
def _op(x, F32: tl.constexpr):
    """Matrix-product operand: float32 for float32 inputs, else bfloat16 (exp-scaled values overflow fp16)."""
    if F32:
        return x.to(tl.float32)
    else:
        return x.to(tl.bfloat16)


@triton.jit
def _dot(a, b, F32: tl.constexpr):
    """``a @ b`` with float32 accumulation. For float32 inputs (``F32``) in 3xTF32 (three tensor-core TF32
    products that recover most of float32's mantissa, about 21 of its 24 bits: each operand split into two TF32
    parts, the small-by-small product dropped): Triton's default for float32 operands, one TF32 product (10-bit
    mantissa), would give float32 inputs bf16-like accuracy, and IEEE float32 (FMA, no tensor cores) spilled
    kilobytes per thread in every kernel (benchmarks/kernel_resources.py). Otherwise the default: bf16 operands,
    and the float32-operand products with M in TF32."""
    if F32:
        return tl.dot(a, b, input_precision="tf32x3")
    else:
        return tl.dot(a, b)


@triton.jit
def _tf32(x, F32: tl.constexpr):
    """float32 ``x`` rounded to the nearest TF32 value (10-bit mantissa; ``cvt.rna``), unchanged with ``F32``.
    The tensor cores read a float32 operand by dropping its 13 low mantissa bits: a truncation, always towards
    zero, whose bias adds up in long sums (on the H200 it pushed the gate-bias gradient, a sum over every token,
    past its tolerance). Operands rounded first are read exactly. Formed on the bits: adding half a TF32 unit
    (2^12) to the magnitude and clearing the 13 low bits rounds to nearest, ties away from zero, as ``cvt.rna``
    does for every finite float32 and infinity (a carry into the exponent is the round-up to the next binade),
    in two integer instructions where ptxas expands ``cvt.rna.tf32.f32`` into three with a NaN check; a NaN can
    come out as another NaN, an infinity or -0 (the operands here are finite for finite inputs)."""
    if F32:
        return x
    else:
        return ((x.to(tl.int32, bitcast=True) + 0x1000) & -0x2000).to(tl.float32, bitcast=True)


@triton.jit
def _dot_aq(a, b, F32: tl.constexpr):
    """``a @ b`` for the products that form Aq (intra-chunk query-key scores) and those that use it, on operands
    TF32 holds exactly: Aq is stored rounded to TF32 (:func:`_tf32`), its partners are bf16 (Delta, dO) or rounded
    by the caller. TF32's mantissa is 8x finer than bfloat16's, and in bf16 these roundings made most of the
    output's error: in the float64 emulation of benchmarks/kda_rounding.py (T 512, K = V = 64) rounding Aq's two
    operands to bf16 alone gives o a relative RMS error of 2.4e-3, all roundings together 3.4e-3, and 1.7e-3 with
    the Aq points in TF32 (the H200: 3.66e-3 -> 2.38e-3 at B2 T1024 H16 D128). Also the backward's pair terms
    (dAq, dA and the rebased K, Q, rounded by the caller; :func:`_main_bwd`). 3xTF32 for float32 inputs."""
    if F32:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="tf32x3")
    else:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="tf32")


@triton.jit
def _exp_rebased(x, F32: tl.constexpr):
    """``exp(x)`` of a rebased exponent, |x| <= ``EXP_LIMIT`` = 87 (kernels/kda_validate.py): G - G_r, G_r and
    G_last - G_r in :func:`_intra_chunk`. Triton's ``tl.exp`` is ``ex2.approx.f32`` of x log2(e), which ptxas wraps
    in a subnormal fix-up (a compare and two predicated multiplies around each ``MUFU.EX2``); for |x| <= 87 < 87.34
    every result is a normal float32, where ``ex2.approx.ftz.f32`` gives the same bits without the fix-up:
    ``_prep_fwd`` issues 16.3k warp instructions a chunk and head instead of 17.0k on triton 3.6 (16.8k for 17.7k
    on 3.8; ``benchmarks/kda_sass.py``). ``_main_bwd`` keeps ``tl.exp``: there the same change (not committed)
    raised its spills at K = 256 from 196 to 236 B a thread (triton 3.6, ``benchmarks/kernel_resources.py``).
    With ``F32`` (float32 inputs, and always under the interpreter, which runs no inline PTX) ``tl.exp``."""
    if F32:
        return tl.exp(x)
    else:
        return tl.inline_asm_elementwise("ex2.approx.ftz.f32 $0, $1;", "=r,r", [x * 1.4426950408889634],
                                         dtype=tl.float32, is_pure=True, pack=1)


@triton.jit
def _row(x, rows, i):
    """Row ``i`` of a ``[C, X]`` register tile as a ``[X]`` vector."""
    return tl.sum(tl.where((rows == i)[:, None], x, 0.0), axis=0)


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
def _chunk_bounds(cu, cidx, i_c, C: tl.constexpr):
    i_n = tl.load(cidx + 2 * i_c).to(tl.int64)
    i_t = tl.load(cidx + 2 * i_c + 1).to(tl.int64)
    bos = tl.load(cu + i_n).to(tl.int64)
    eos = tl.load(cu + i_n + 1).to(tl.int64)
    t0 = bos + i_t * C
    n_valid = tl.minimum(eos - t0, C)
    return i_n, t0, n_valid


@triton.jit
def _chunk_program(cu, cidx, C: tl.constexpr):
    """A per-(chunk, head) program's chunk (row ``program_id(0)`` of the table ``cidx``) and head: ``(i_h, t0,
    n_valid, rows, m_t, tok)``, the chunk's first token, valid rows, row indices ``[C]``, their mask and tokens."""
    i_c, i_h = tl.program_id(0), tl.program_id(1)
    _, t0, n_valid = _chunk_bounds(cu, cidx, i_c, C)
    rows = tl.arange(0, C)
    return i_h, t0, n_valid, rows, rows < n_valid, t0 + rows


@triton.jit
def _global_chunk(coff, cidx, i_c, i_n, SEGMENT: tl.constexpr):
    """Global (int64) index of row ``i_c`` of a chunk table, chunk of sequence ``i_n``: where its per-chunk states
    are stored. ``i_c`` itself in the table :func:`chunk_meta` builds; looked up in a pipeline segment's
    (``SEGMENT``), whose rows are in another order."""
    if SEGMENT:
        return tl.load(coff + i_n).to(tl.int64) + tl.load(cidx + 2 * i_c + 1).to(tl.int64)
    else:
        return i_c.to(tl.int64)


# ----------------------------------------------------------------------------------------------------------
# forward
# ----------------------------------------------------------------------------------------------------------


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
        if GC_ALL:
            tl.store(Gc + off, b_G, mask=msk)
        b_Gr = _row(b_G, rows, R)
        up = _exp_rebased(b_G - b_Gr[None, :], F32)  # |exponent| <= |g_min| * ceil((C - 1) / 2) <= 87
        dn = _exp_rebased(b_Gr[None, :] - b_G, F32)
        b_k = tl.load(k + off, mask=msk, other=0.0).to(tl.float32)
        b_q = tl.load(q + off, mask=msk, other=0.0).to(tl.float32)
        if L2:
            b_k *= r_k[:, None]
            b_q *= r_q[:, None]
        g_last = _row(b_G, rows, n_valid - 1)
        if not GC_ALL:
            # the scans' G_last alone, as a vector: the tile store would get float32's own layout, for which
            # Triton forms the cumsum a second time (twice the shuffles) rather than convert the tile
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
    shared-memory exchange and no barrier per step): on the H200 this kernel plus an inverse-free
    :func:`_intra_fwd` took 0.6x the time of one kernel doing both with four warps (benchmarks/kda_breakdown.py)."""
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


@triton.jit
def _scan_seq(cu, coff, H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, C: tl.constexpr, BK: tl.constexpr,
              BV: tl.constexpr):
    """A scan program's sequence, head and tiles: ``(i_nh, i_h, bos, eos, c0, n_chunks, rk, cv, rows, m_k, m_v)``
    with the sequence's first and end token and its first global chunk as int64, the key rows ``rk [BK]``, this
    program's value columns ``cv [BV]``, the chunk rows ``rows [C]`` and the key and value masks."""
    i_v, i_nh = tl.program_id(0), tl.program_id(1)
    i_n = i_nh // H
    bos = tl.load(cu + i_n).to(tl.int64)
    eos = tl.load(cu + i_n + 1).to(tl.int64)
    c0 = tl.load(coff + i_n).to(tl.int64)
    rk = tl.arange(0, BK)
    cv = i_v * BV + tl.arange(0, BV)
    return i_nh, i_nh % H, bos, eos, c0, tl.cdiv(eos - bos, C), rk, cv, tl.arange(0, C), rk < K, cv < V


@triton.jit
def _scan_chunk(bos, eos, it, i_h, rows, rk, cv, m_k, m_v, H: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                C: tl.constexpr):
    """Chunk ``it`` of a scan's sequence: ``(t0, n_valid, m_t, tok, offk, mk, offv, mv)``, its first token, valid
    rows and their mask, token indices, and the offsets and masks of its ``[C, BK]`` key and ``[C, BV]`` value
    tiles."""
    t0 = bos + it * C
    n_valid = tl.minimum(eos - t0, C)
    m_t = rows < n_valid
    tok = t0 + rows
    offk = tok[:, None] * (H * K) + i_h * K + rk[None, :]
    mk = m_t[:, None] & m_k[None, :]
    offv = tok[:, None] * (H * V) + i_h * V + cv[None, :]
    mv = m_t[:, None] & m_v[None, :]
    return t0, n_valid, m_t, tok, offk, mk, offv, mv


@triton.jit
def _state_start(ptr, i_nh, rk, cv, m_k, m_v, K: tl.constexpr, V: tl.constexpr, LOAD: tl.constexpr,
                 TRANS: tl.constexpr):
    """A scan program's tile of the ``[K, V]`` state of sequence x head ``i_nh``: ``(off, msk, base, S)`` with the
    tile's offsets in one state and its mask (``[BK, BV]``, or ``[BV, BK]`` with ``TRANS``, element (v, k) being
    S[k, v]), the int64 offset of that state in an ``[N, H, K, V]`` tensor, and its starting value in float32:
    read from ``ptr`` with ``LOAD``, else zeros."""
    if TRANS:
        off = cv[:, None] + rk[None, :] * V
        msk = m_v[:, None] & m_k[None, :]
    else:
        off = rk[:, None] * V + cv[None, :]
        msk = m_k[:, None] & m_v[None, :]
    base = i_nh.to(tl.int64) * (K * V)
    S = tl.zeros(off.shape, dtype=tl.float32)
    if LOAD:
        S += tl.load(ptr + base + off, mask=msk, other=0.0).to(tl.float32)
    return off, msk, base, S


@triton.jit
def _g_last(Gc, t0, n_valid, i_h, rk, m_k, H: tl.constexpr, K: tl.constexpr):
    """The ``[BK]`` cumulative log-decay of a chunk's last valid row, G_last."""
    return tl.load(Gc + (t0 + n_valid - 1) * (H * K) + i_h * K + rk, mask=m_k, other=0.0)


@triton.jit
def _g_last_of(Gc, bos, eos, it, ok, i_h, rk, m_k, H: tl.constexpr, K: tl.constexpr, C: tl.constexpr):
    """:func:`_g_last` of chunk ``it`` of the sequence ``[bos, eos)`` where ``ok``, else zeros (nothing read).
    The scans load it one chunk ahead of its use: it is their only per-chunk load that the software pipeliner
    leaves as a plain global load (the matrix operands go through asynchronous copies to shared memory), and
    Nsight Compute put 40% of the forward scan's stall cycles on a global load's scoreboard (B1 T16384 H16). Each
    trip starts by taking the exponential of the value loaded on the trip before, so that the machine code first
    reads the loaded register one trip after the load (``benchmarks/kda_sass.py --scan`` checks it): a copy of it
    into the next trip's register, which ptxas placed mid-trip, would wait for the load."""
    t0 = bos + it * C
    return _g_last(Gc, t0, tl.minimum(eos - t0, C), i_h, rk, m_k & ok, H, K)


@triton.jit
def _cc_offsets(tok, i_h, rows, H: tl.constexpr, C: tl.constexpr):
    """Offsets of a chunk's ``[C, C]`` tile (Aq, L or M) in a ``[T_total, H, C]`` tensor."""
    return tok[:, None] * (H * C) + i_h * C + rows[None, :]


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


# ----------------------------------------------------------------------------------------------------------
# backward
# ----------------------------------------------------------------------------------------------------------


@triton.jit(do_not_specialize=["it_lo", "it_hi"])
def _scan_bwd(
    Qg, Kd, Gc, W, Aq, do, dD, dh, dht, dh0, cu, coff, it_lo, it_hi,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    HAS_DHT: tl.constexpr, STORE_DH0: tl.constexpr, F32: tl.constexpr,
):
    """Reverse recurrence over the chunks ``it_lo <= it < it_hi`` of each sequence, last to first (a segment of
    :func:`chunk_bwd`'s pipeline: dS enters from ``dht`` and leaves to ``dh0`` in float32). With dS the gradient of
    the state leaving the chunk::

        dDelta = Aq^T dO + Kd dS
        dS    <- Diag(exp(G_last)) dS + scale (Q⊙exp(G))^T dO - W^T dDelta
    """
    i_nh, i_h, bos, eos, c0, n_chunks, rk, cv, rows, m_k, m_v = _scan_seq(cu, coff, H, K, V, C, BK, BV)
    off_s, m_kv, base, dS = _state_start(dht, i_nh, rk, cv, m_k, m_v, K, V, HAS_DHT, False)
    it_end = tl.minimum(n_chunks, it_hi)
    g_next = _g_last_of(Gc, bos, eos, it_end - 1, it_lo < it_end, i_h, rk, m_k, H, K, C)
    for j in range(0, it_end - it_lo):
        it = it_end - 1 - j
        t0, n_valid, m_t, tok, offk, mk, offv, mv = _scan_chunk(bos, eos, it, i_h, rows, rk, cv, m_k, m_v, H, K, V,
                                                                C)
        decay = tl.exp(g_next)  # read one trip after its load was issued
        g_next = _g_last_of(Gc, bos, eos, it - 1, it > it_lo, i_h, rk, m_k, H, K, C)
        tl.store(dh + ((c0 + it) * H + i_h) * K * V + off_s, dS.to(dh.dtype.element_ty), mask=m_kv)
        b_do = tl.load(do + offv, mask=mv, other=0.0)
        b_a = tl.load(Aq + _cc_offsets(tok, i_h, rows, H, C), mask=m_t[:, None], other=0.0)
        b_kd = tl.load(Kd + offk, mask=mk, other=0.0)
        b_dd = _dot_aq(tl.trans(b_a), b_do, F32) + _dot(_op(b_kd, F32), _op(dS, F32), F32)
        tl.store(dD + offv, b_dd.to(dD.dtype.element_ty), mask=mv)
        b_w = tl.load(W + offk, mask=mk, other=0.0)
        b_qg = tl.load(Qg + offk, mask=mk, other=0.0)
        dS = dS * decay[:, None] + _dot(tl.trans(_op(b_qg, F32)), _op(b_do, F32), F32)
        dS -= _dot(tl.trans(_op(b_w, F32)), _op(b_dd, F32), F32)
    if STORE_DH0:
        tl.store(dh0 + base + off_s, dS, mask=m_kv)


@triton.jit(do_not_specialize=["it_lo", "it_hi"])
def _scan_bwd_t(
    Qg, Kd, Gc, W, Aq, do, dD, dh, dht, dh0, cu, coff, it_lo, it_hi,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    HAS_DHT: tl.constexpr, STORE_DH0: tl.constexpr, F32: tl.constexpr,
):
    """:func:`_scan_bwd` with the state gradient held transposed, ``dS^T [BV, BK]``::

        dDelta^T = dO^T Aq + dS^T Kd^T
        dS^T    <- dS^T Diag(exp(G_last)) + dO^T (scale Q⊙exp(G)) - dDelta^T W
    """
    i_nh, i_h, bos, eos, c0, n_chunks, rk, cv, rows, m_k, m_v = _scan_seq(cu, coff, H, K, V, C, BK, BV)
    off_st, m_vk, base, dSt = _state_start(dht, i_nh, rk, cv, m_k, m_v, K, V, HAS_DHT, True)
    it_end = tl.minimum(n_chunks, it_hi)
    g_next = _g_last_of(Gc, bos, eos, it_end - 1, it_lo < it_end, i_h, rk, m_k, H, K, C)
    for j in range(0, it_end - it_lo):
        it = it_end - 1 - j
        t0, n_valid, m_t, tok, offk, mk, offv, mv = _scan_chunk(bos, eos, it, i_h, rows, rk, cv, m_k, m_v, H, K, V,
                                                                C)
        decay = tl.exp(g_next)  # read one trip after its load was issued
        g_next = _g_last_of(Gc, bos, eos, it - 1, it > it_lo, i_h, rk, m_k, H, K, C)
        tl.store(dh + ((c0 + it) * H + i_h) * K * V + off_st, dSt.to(dh.dtype.element_ty), mask=m_vk)
        b_dot = _op(tl.trans(tl.load(do + offv, mask=mv, other=0.0)), F32)  # dO^T [BV, C]
        b_a = tl.load(Aq + _cc_offsets(tok, i_h, rows, H, C), mask=m_t[:, None], other=0.0)
        b_kd = tl.load(Kd + offk, mask=mk, other=0.0)
        b_ddt = _dot_aq(b_dot, b_a, F32) + _dot(_op(dSt, F32), tl.trans(_op(b_kd, F32)), F32)
        tl.store(dD + offv, tl.trans(b_ddt).to(dD.dtype.element_ty), mask=mv)
        b_w = tl.load(W + offk, mask=mk, other=0.0)
        b_qg = tl.load(Qg + offk, mask=mk, other=0.0)
        dSt = dSt * decay[None, :] + _dot(b_dot, _op(b_qg, F32), F32)
        dSt -= _dot(_op(b_ddt, F32), _op(b_w, F32), F32)
    if STORE_DH0:
        tl.store(dh0 + base + off_st, dSt, mask=m_vk)


@triton.jit(do_not_specialize_on_alignment=["cidx"])  # a segment's rows start anywhere
def _main_bwd(
    q, k, v, beta, Gc, Mi, h, dh, D, dD, do, dq, dk, dv, dg, dbeta, s_dqg, s_dkd, s_dw, s_dq, s_dk, dgs, cu, cidx,
    coff, scale, e, bias, g_min, rnq, rnk,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    F32: tl.constexpr, GATE: tl.constexpr, L2: tl.constexpr, SEGMENT: tl.constexpr,
):
    """Per (chunk, head): every input gradient of the chunk from h, dh, Delta, dDelta and dO. The chunk table
    ``cidx`` may be a pipeline segment's (``SEGMENT``); the chunk's states are then found by its sequence and
    position.

    Value side: dAq = dO Delta^T, dv = Diag(beta) M^T dDelta, dM = dDelta (Diag(beta) V)^T. Key side in
    K blocks, two passes. Pass 1: dQg = dO S^T, dKd = Delta dS^T, dW = -dDelta S^T, dM += dW X^T with
    X = Diag(beta) K⊙exp(G); dQg, dKd and M^T dW are kept in the float32 scratch ``s_dqg``, ``s_dkd``, ``s_dw``
    (each ``[T, H, K]``), so that M is not needed in pass 2. Then dL = -M^T dM M^T and dA = Diag(beta) dL.
    Pass 2: dq, dk and the dense pair terms of A and Aq (same rebasing as the forward), dG and dg = reverse
    cumsum of dG (per channel, so per block); A itself (for dbeta's dL term) from the forward's bf16 operands.
    The pair terms' products take TF32 operands (dA, dAq and the rebased K, Q rounded by :func:`_tf32`), as the
    forward's Aq does: dG subtracts the column terms from the row terms, and the bf16 roundings of their operands
    made most of dg's error (H200, B2 T1024 H16 D128, mean of 8 draws, ``benchmarks/kda_accuracy.py``: dg
    3.25e-3 with bf16 operands, 2.35e-3 with TF32, fla 2.80e-3; forward+backward 1-3.3% slower).

    With ``GATE`` the stored gradient is that of the pre-activation e: dg * g_min * sigmoid(x) sigmoid(-x),
    x = e + bias (= s (1 - s), relative accuracy kept where s rounds to 1). With ``L2`` pass 2 works on the
    normalised q̂, k̂ (reciprocal norms ``rnq``, ``rnk``), keeps dq̂, dk̂ in ``s_dq``, ``s_dk`` and
    the row sums q̂·dq̂, k̂·dk̂; pass 3 applies the norm's backward dx = r (dx̂ - x̂ (x̂·dx̂)) (no projection where
    the norm was clamped at 1e-12, as F.normalize).
    """
    i_c, i_h = tl.program_id(0), tl.program_id(1)
    i_n, t0, n_valid = _chunk_bounds(cu, cidx, i_c, C)
    i_g = _global_chunk(coff, cidx, i_c, i_n, SEGMENT)
    R: tl.constexpr = (C - 1) // 2
    rows = tl.arange(0, C)
    m_t = rows < n_valid
    tok = t0 + rows
    m_lo = rows[:, None] > rows[None, :]
    b_beta = tl.load(beta + tok * H + i_h, mask=m_t, other=0.0).to(tl.float32)
    offc = _cc_offsets(tok, i_h, rows, H, C)
    b_mt = tl.trans(tl.load(Mi + offc, mask=m_t[:, None], other=0.0))
    hbase = (i_g * H + i_h) * K * V  # int64: chunks x H x K x V passes 2^31 at long T, many heads
    if L2:
        r_q = tl.load(rnq + tok * H + i_h, mask=m_t, other=0.0)
        r_k = tl.load(rnk + tok * H + i_h, mask=m_t, other=0.0)
    dAq = tl.zeros([C, C], dtype=tl.float32)
    dM = tl.zeros([C, C], dtype=tl.float32)
    db = tl.zeros([C], dtype=tl.float32)
    for vb in range(0, V, BV):
        cv = vb + tl.arange(0, BV)
        offv = tok[:, None] * (H * V) + i_h * V + cv[None, :]
        mv = m_t[:, None] & (cv < V)[None, :]
        b_d = tl.load(D + offv, mask=mv, other=0.0)
        b_dd = tl.load(dD + offv, mask=mv, other=0.0)
        b_do = tl.load(do + offv, mask=mv, other=0.0)
        b_v = tl.load(v + offv, mask=mv, other=0.0).to(tl.float32)
        dAq += _dot(_op(b_do, F32), tl.trans(_op(b_d, F32)), F32)
        b_dy = _dot(b_mt, b_dd.to(tl.float32), F32)  # M^T dDelta, float32 operands (tf32 on GPU)
        tl.store(dv + offv, (b_dy * b_beta[:, None]).to(dv.dtype.element_ty), mask=mv)
        db += tl.sum(b_dy * b_v, axis=1)
        dM += _dot(_op(b_dd, F32), tl.trans(_op(b_v * b_beta[:, None], F32)), F32)
    for kb in range(0, K, BK):
        rk = kb + tl.arange(0, BK)
        m_k = rk < K
        offk = tok[:, None] * (H * K) + i_h * K + rk[None, :]
        mk = m_t[:, None] & m_k[None, :]
        dQg = tl.zeros([C, BK], dtype=tl.float32)
        dKd = tl.zeros([C, BK], dtype=tl.float32)
        dW = tl.zeros([C, BK], dtype=tl.float32)
        dGs = tl.zeros([BK], dtype=tl.float32)
        for vb in range(0, V, BV):
            cv = vb + tl.arange(0, BV)
            m_v = cv < V
            offv = tok[:, None] * (H * V) + i_h * V + cv[None, :]
            mv = m_t[:, None] & m_v[None, :]
            offs = hbase + rk[:, None] * V + cv[None, :]
            m_kv = m_k[:, None] & m_v[None, :]
            b_h = tl.load(h + offs, mask=m_kv, other=0.0)
            b_dh = tl.load(dh + offs, mask=m_kv, other=0.0)
            b_d = tl.load(D + offv, mask=mv, other=0.0)
            b_dd = tl.load(dD + offv, mask=mv, other=0.0)
            b_do = tl.load(do + offv, mask=mv, other=0.0)
            dQg += _dot(_op(b_do, F32), tl.trans(_op(b_h, F32)), F32)
            dKd += _dot(_op(b_d, F32), tl.trans(_op(b_dh, F32)), F32)
            dW -= _dot(_op(b_dd, F32), tl.trans(_op(b_h, F32)), F32)
            dGs += tl.sum(b_h.to(tl.float32) * b_dh.to(tl.float32), axis=1)
        tl.store(s_dqg + offk, dQg, mask=mk)
        tl.store(s_dkd + offk, dKd, mask=mk)
        tl.store(dgs + (i_g * H + i_h) * K + rk, dGs, mask=m_k)
        b_k = tl.load(k + offk, mask=mk, other=0.0).to(tl.float32)
        if L2:
            b_k *= r_k[:, None]
        b_G = tl.load(Gc + offk, mask=mk, other=0.0)
        b_kg = b_k * tl.exp(b_G)
        dM += _dot(dW, tl.trans(b_kg * b_beta[:, None]), F32)
        dMW = _dot(b_mt, dW, F32)  # M^T dW: pass 2 reads it back (exact float32) instead of M and dW
        tl.store(s_dw + offk, dMW, mask=mk)
        db += tl.sum(dMW * b_kg, axis=1)
    tl.debug_barrier()  # pass 2 reads the scratch this program wrote
    # M = (I + L)^-1: dL = -M^T dM M^T, strictly lower; L = Diag(beta) A
    dL = tl.where(m_lo, -_dot(_dot(b_mt, dM, F32), b_mt, F32), 0.0)
    dA = _tf32(dL * b_beta[:, None], F32)
    # Aq's diagonal carries no decay (exp(G_i - G_i) = 1): it feeds dq and dk elementwise and never dG, so
    # dG has no pair of O(1) terms that cancel (that cancellation costs dg its relative accuracy when the
    # true dg is as small as exp(g_min)).
    d_ii = tl.sum(tl.where(rows[:, None] == rows[None, :], dAq, 0.0), axis=1) * scale
    dAq = _tf32(tl.where(m_lo, dAq, 0.0) * scale, F32)
    dot_q = tl.zeros([C], dtype=tl.float32)
    A = tl.zeros([C, C], dtype=tl.float32)
    dot_k = tl.zeros([C], dtype=tl.float32)
    for kb in range(0, K, BK):
        rk = kb + tl.arange(0, BK)
        m_k = rk < K
        offk = tok[:, None] * (H * K) + i_h * K + rk[None, :]
        mk = m_t[:, None] & m_k[None, :]
        dQg = tl.load(s_dqg + offk, mask=mk, other=0.0)
        dKd = tl.load(s_dkd + offk, mask=mk, other=0.0)
        dMW = tl.load(s_dw + offk, mask=mk, other=0.0)
        dGs = tl.load(dgs + (i_g * H + i_h) * K + rk, mask=m_k, other=0.0)
        b_q = tl.load(q + offk, mask=mk, other=0.0).to(tl.float32)
        b_k = tl.load(k + offk, mask=mk, other=0.0).to(tl.float32)
        if L2:
            b_q *= r_q[:, None]
            b_k *= r_k[:, None]
        b_G = tl.load(Gc + offk, mask=mk, other=0.0)
        g_last = _g_last(Gc, t0, n_valid, i_h, rk, m_k, H, K)
        e_g = tl.exp(b_G)
        # W = M X, X = Diag(beta) K⊙exp(G)
        b_kg = b_k * e_g
        dKg = dMW * b_beta[:, None]
        b_dk = dKg * e_g
        dG = dKg * b_kg
        # O's state term scale (Q⊙exp(G)) S
        b_dq = dQg * e_g * scale
        dG += b_dq * b_q
        # dense pair terms of A and Aq (strictly lower)
        b_Gr = _row(b_G, rows, R)
        up = tl.exp(b_G - b_Gr[None, :])
        dn = tl.exp(b_Gr[None, :] - b_G)
        kup = b_k * up
        kdn = b_k * dn
        A += _dot(_op(kup, F32), tl.trans(_op(kdn, F32)), F32)  # the forward's A (for dbeta), its bf16 operands
        kup = _tf32(kup, F32)
        kdn = _tf32(kdn, F32)
        qup = _tf32(b_q * up, F32)
        dq_p = _dot_aq(dAq, kdn, F32) * up
        dk_r = _dot_aq(dA, kdn, F32) * up
        dk_c = (_dot_aq(tl.trans(dA), kup, F32) + _dot_aq(tl.trans(dAq), qup, F32)) * dn
        b_dq += dq_p + d_ii[:, None] * b_k
        b_dk += dk_r + dk_c + d_ii[:, None] * b_q
        dG += b_q * dq_p + b_k * (dk_r - dk_c)
        # S' = Diag(exp(G_last)) S + (K⊙exp(G_last - G))^T Delta; the last row's Kd has no decay either.
        e_d = tl.exp(g_last[None, :] - b_G)
        b_kd = b_k * e_d
        b_dk += dKd * e_d
        x_kd = tl.where((rows == n_valid - 1)[:, None], 0.0, dKd * b_kd)
        dG -= x_kd
        dGl = dGs * tl.exp(g_last) + tl.sum(x_kd, axis=0)
        dG += tl.where((rows == n_valid - 1)[:, None], dGl[None, :], 0.0)
        b_dg = tl.cumsum(dG, axis=0, reverse=True)
        if GATE:
            x = tl.load(e + offk, mask=mk, other=0.0).to(tl.float32) + tl.load(bias + i_h * K + rk, mask=m_k,
                                                                                other=0.0)[None, :]
            b_dg *= g_min * tl.sigmoid(x) * tl.sigmoid(-x)  # s (1 - s) without 1 - s rounding to 0 at large x
        tl.store(dg + offk, b_dg.to(dg.dtype.element_ty), mask=mk)
        if L2:
            tl.store(s_dq + offk, b_dq, mask=mk)
            tl.store(s_dk + offk, b_dk, mask=mk)
            dot_q += tl.sum(b_dq * b_q, axis=1)
            dot_k += tl.sum(b_dk * b_k, axis=1)
        else:
            tl.store(dq + offk, b_dq.to(dq.dtype.element_ty), mask=mk)
            tl.store(dk + offk, b_dk.to(dk.dtype.element_ty), mask=mk)
    db += tl.sum(dL * tl.where(m_lo, A, 0.0), axis=1)
    tl.store(dbeta + tok * H + i_h, db.to(dbeta.dtype.element_ty), mask=m_t)
    if L2:
        tl.debug_barrier()  # pass 3 reads the dq̂, dk̂ this program wrote
        dot_q = tl.where(r_q < 1e12, dot_q, 0.0)  # clamped norm: y = x / 1e-12, no projection
        dot_k = tl.where(r_k < 1e12, dot_k, 0.0)
        for kb in range(0, K, BK):
            rk = kb + tl.arange(0, BK)
            offk = tok[:, None] * (H * K) + i_h * K + rk[None, :]
            mk = m_t[:, None] & (rk < K)[None, :]
            b_q = tl.load(q + offk, mask=mk, other=0.0).to(tl.float32) * r_q[:, None]
            b_k = tl.load(k + offk, mask=mk, other=0.0).to(tl.float32) * r_k[:, None]
            b_dq = (tl.load(s_dq + offk, mask=mk, other=0.0) - b_q * dot_q[:, None]) * r_q[:, None]
            b_dk = (tl.load(s_dk + offk, mask=mk, other=0.0) - b_k * dot_k[:, None]) * r_k[:, None]
            tl.store(dq + offk, b_dq.to(dq.dtype.element_ty), mask=mk)
            tl.store(dk + offk, b_dk.to(dk.dtype.element_ty), mask=mk)


# ----------------------------------------------------------------------------------------------------------
# host launchers
# ----------------------------------------------------------------------------------------------------------


def chunk_meta(
    cu_seqlens: torch.Tensor | None, B: int, T: int, C: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """Packed-layout chunk metadata.

    Returns ``(cu [N + 1] int64, chunk_idx [NC, 2] int32, chunk_off [N + 1] int32, NC)``. For a dense batch
    (``cu_seqlens`` None) it is built without reading device memory and cached per (B, T, C, device, stream):
    the tensors are shared by every call with that key, so callers must only read them. During CUDA graph
    capture it is built afresh (a table made inside a capture holds its values only when the graph replays);
    for a packed batch it reads the lengths.
    """
    if cu_seqlens is None:
        if device.type != "cuda":
            return _dense_meta(B, T, C, device, 0)
        if torch.cuda.is_current_stream_capturing():
            return _dense_meta.__wrapped__(B, T, C, device, 0)
        return _dense_meta(B, T, C, device, torch.cuda.current_stream(device).cuda_stream)
    cu = cu_seqlens.to(device=device, dtype=torch.int64)
    n_chunks = (cu[1:] - cu[:-1] + C - 1) // C
    off = torch.cat([n_chunks.new_zeros(1), n_chunks.cumsum(0)]).to(torch.int32)
    nc = int(off[-1].item())
    seq = torch.repeat_interleave(torch.arange(len(n_chunks), device=device, dtype=torch.int32), n_chunks,
                                  output_size=nc)
    pos = torch.arange(nc, device=device, dtype=torch.int32) - off[:-1].long()[seq.long()].to(torch.int32)
    return cu, torch.stack([seq, pos], 1).contiguous(), off, nc


@functools.lru_cache(maxsize=64)
def _dense_meta(B: int, T: int, C: int, device: torch.device, stream: int
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """:func:`chunk_meta` of a dense batch, built once per (B, T, C, device, stream): every KDA call of a training
    step (forward, backward, recomputation) reuses it instead of launching ~10 small kernels. The kernels only read
    it. ``stream`` (the CUDA stream's handle, 0 elsewhere) is only part of the key: a kernel on another stream
    gets its own copy instead of one whose building it is not ordered after."""
    n_per = triton.cdiv(T, C)
    cu = torch.arange(0, B + 1, device=device, dtype=torch.int64) * T
    seq = torch.arange(B, device=device, dtype=torch.int32).repeat_interleave(n_per)
    pos = torch.arange(n_per, device=device, dtype=torch.int32).repeat(B)
    off = torch.arange(0, B + 1, device=device, dtype=torch.int32) * n_per
    return cu, torch.stack([seq, pos], 1).contiguous(), off, B * n_per


def max_chunks(T_total: int, N: int, C: int) -> int:
    """Static upper bound on the number of chunks of a packed batch (each sequence adds one partial chunk)."""
    return T_total // C + N


def _pow2(x: int) -> int:
    return max(16, triton.next_power_of_2(x))


def _work_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float32 if dtype == torch.float32 else torch.bfloat16


def _f32_operands(dtype: torch.dtype) -> bool:
    """float32 matrix operands for float32 inputs, and always under the interpreter (which multiplies
    bfloat16 operands in float16, where the rebased exponentials overflow)."""
    return dtype == torch.float32 or os.environ.get("TRITON_INTERPRET") == "1"


#: Launch settings. ``fwd_scan`` / ``bwd_scan``: ``"plain"`` keeps a scan's state as ``[BK, BV]``
#: (:func:`_scan_fwd` + :func:`_out_fwd`, :func:`_scan_bwd`), ``"transposed"`` as ``[BV, BK]`` (:func:`_scan_fwd_t`,
#: which writes the output itself, :func:`_scan_bwd_t`), ``"auto"`` picks by :func:`_scan_plan`; ``fwd_bv`` /
#: ``bwd_bv``: value columns per scan program (None: by :func:`_scan_plan`); ``*_warps``: warps per program
#: (``scan_warps`` None: 4 for K <= 128, else 8); ``main_bwd_bv``: value block of :func:`_main_bwd` (None: 64, or
#: 32 for V > 128, where 32 took 14.43 against 14.81 ms fwd+bwd at B8 T2048 H32 D256 on the H200).
#: Each setting below was timed in the H200 sweeps of sessions 9 and 10 (benchmarks/RESULTS.md, "KDA launch
#: settings"; forward without gradients / forward + backward, ms).
#: ``fwd_prep``: ``"fused"`` (default) runs the forward's per-chunk work in one kernel, :func:`_prep_fwd`, on
#: ``prep_warps`` warps (default 1); ``"split"`` runs :func:`_intra_fwd` then :func:`_wy_fwd`. Fused on 1 warp in
#: 32-wide steps: 0.72 -> 0.63 / 2.78 -> 2.71 at B8 T2048 H16 D128, 3.95 -> 3.80 / 13.47 -> 13.36 at B8 T2048 H32
#: D256; on 2 or 4 warps it is slower than split (0.92, 1.06 at B8 T2048), and in 64-wide steps twice as slow (its
#: registers spill).
#: ``inverse_block``: the width of the diagonal blocks that :func:`_inverse` inverts by forward substitution before
#: doubling them up to C with 3xTF32 products (None or >= C: the plain substitution, C - 1 dependent steps).
#: Session 10's H200 sweep, with the two exponentials of :func:`_intra_chunk`: 16 took 0.60 ms against the plain
#: substitution's 0.65 at B8 T2048 H16 D128, 1.92 against 2.06 at B1 T8192 H96, 3.73 against 3.79 at D256 and was
#: the fastest of 32 / 16 / 8 / 4 at every shape (at B8 T2048: 8-wide 0.64 with the two exponentials, 4-wide 0.97
#: without; each doubling's two products cost more than the steps they save).
#: ``intra_bk``, ``wy_bk``, ``wy_bv``: key / value columns per step of :func:`_intra_fwd` and of :func:`_wy_fwd` or
#: :func:`_prep_fwd` (None: 64 split, 32 fused; K / V rounded up to a power of two when smaller).
#: ``fwd_plain_out``: with the plain forward scan, ``"separate"`` forms the output in :func:`_out_fwd` from the stored
#: states, ``"fused"`` in the scan itself (the per-chunk states and Delta are then stored only for the backward),
#: ``"auto"`` (default) by :func:`_plain_out_fused`: fused where no backward follows.
#: ``u_dtype``: the dtype U = M Diag(beta) V is stored in between the per-chunk kernels and the forward scan:
#: ``"float32"``, or ``"work"`` (bf16 for bf16 and fp16 inputs), half U's bytes: 1-4% faster forward (0.63 -> 0.61 at
#: B8 T2048) for a relative difference of 1.2e-3 from float32 U on o and the gradients, so not the default.
#: ``fwd_segments`` / ``bwd_segments``: pipeline segments over a dense batch (1: none; ``"auto"``: by
#: :func:`_segments`). Segment s covers the same range of chunks of every sequence; on CUDA its state scan (and
#: output kernel) runs on side streams as soon as its per-chunk kernels are done, concurrently with the next
#: segment's, so the latency-bound scan no longer waits for the whole sequence's per-chunk work. The backward goes
#: last segment first: each segment's reverse scan runs on a side stream and its ``_main_bwd`` on the caller's stream
#: once that scan is done, beside the scan of the segment before it. The outputs are bit-identical for any count.
#: ``benchmarks/kda_breakdown.py --sweep`` times alternatives.
TUNING: dict = dict(fwd_scan="auto", fwd_bv=None, bwd_scan="auto", bwd_bv=None, scan_warps=None, intra_warps=2,
                    wy_warps=1, out_warps=4, main_bwd_warps=4, main_bwd_bv=None, intra_bk=None, wy_bk=None,
                    wy_bv=None, fwd_segments="auto", bwd_segments="auto", fwd_plain_out="auto",
                    u_dtype="float32", fwd_prep="fused", prep_warps=1, inverse_block=16)


def _segments(which: str, B: int, H: int, T: int, C: int, cu_seqlens: torch.Tensor | None) -> int:
    """Pipeline segments of the ``"fwd"`` or ``"bwd"`` launches (``TUNING[which + "_segments"]``; ``"auto"``: the
    rule below). Only a dense batch of more than one chunk is cut. ``"auto"`` takes 4 backward segments where the
    reverse scan is one long latency-bound chain beside little other work, B·H <= 16 and at least 512 chunks a
    sequence (T >= 16384 at C = 32: forward+backward 3.57 -> 3.26 ms at B1·T16384·H16, 13.94 -> 12.68 at T65536 on
    the H200, session 12), and never forward segments: since the forward scans load G_last ahead (session 11) the
    forward without segments was faster or within 1% at every shape timed but B1·T8192·H96 (4 segments 1.78
    against 1.86 ms there, not taken as a rule fitted to one shape), eagerly (3.62 against 3.68 ms at T65536, 1.83
    against 1.87 at T32768) and replayed from a CUDA graph (0.94 against 1.00 ms at B1·T16384·H16, 0.86 against 0.85
    at B2·T8192·H16; benchmarks/RESULTS.md, "KDA launch settings")."""
    P = TUNING[which + "_segments"]
    n = triton.cdiv(T, C)
    if P == "auto":
        P = 4 if which == "bwd" and B * H <= 16 and n >= 512 else 1
    return P if cu_seqlens is None and n > 1 else 1


def _segment_plan(which: str, B: int, H: int, T: int, C: int, cu_seqlens: torch.Tensor | None, cidx: torch.Tensor,
                  NC: int, device: torch.device) -> tuple[torch.Tensor, tuple[tuple[int, int, int, int], ...]]:
    """The chunk table and ``((row_lo, row_hi, it_lo, it_hi), ...)`` segments the ``"fwd"`` or ``"bwd"`` launches
    run over: :func:`_segment_table` for :func:`_segments` > 1, else ``cidx`` whole, its chunks unbounded."""
    P = _segments(which, B, H, T, C, cu_seqlens)
    if P == 1:
        return cidx, ((0, NC, 0, 2**31 - 1),)
    return _segment_table(B, triton.cdiv(T, C), P, device)


@functools.lru_cache(maxsize=64)
def _segment_table_cached(B: int, n_per: int, P: int, device: torch.device, stream: int
                          ) -> tuple[torch.Tensor, tuple[tuple[int, int, int, int], ...]]:
    """The chunk table of a dense batch of B sequences with ``n_per`` chunks each, ordered by pipeline segment:
    segment s (of ``min(P, n_per)``) covers chunks ``[lo_s, lo_{s+1})`` of every sequence, ``lo_s = s n_per // P``
    (the longer segments last: the first one's per-chunk kernels run before any scan can start). Returns ``(table
    [NC, 2] int32, ((row_lo, row_hi, lo, hi), ...))``: each segment's rows of the table and its chunk range. Cached
    like :func:`_dense_meta`."""
    P = min(P, n_per)
    bounds = [s * n_per // P for s in range(P + 1)]
    parts, segs = [], []
    for lo, hi in zip(bounds[:-1], bounds[1:]):
        seq = torch.arange(B, device=device, dtype=torch.int32).repeat_interleave(hi - lo)
        pos = torch.arange(lo, hi, device=device, dtype=torch.int32).repeat(B)
        parts.append(torch.stack([seq, pos], 1))
        row = segs[-1][1] if segs else 0
        segs.append((row, row + B * (hi - lo), lo, hi))
    return torch.cat(parts).contiguous(), tuple(segs)


def _segment_table(B: int, n_per: int, P: int, device: torch.device
                   ) -> tuple[torch.Tensor, tuple[tuple[int, int, int, int], ...]]:
    """:func:`_segment_table_cached` for the current stream (built afresh during CUDA graph capture)."""
    if device.type != "cuda":
        return _segment_table_cached(B, n_per, P, device, 0)
    if torch.cuda.is_current_stream_capturing():
        return _segment_table_cached.__wrapped__(B, n_per, P, device, 0)
    return _segment_table_cached(B, n_per, P, device, torch.cuda.current_stream(device).cuda_stream)


@functools.cache
def _side_streams_of(device: torch.device, caller: int) -> tuple[torch.cuda.Stream, torch.cuda.Stream]:
    """The pipeline's two side streams on a CUDA ``device`` for work queued on the stream with handle ``caller``
    (each caller stream its own, so that pipelines on different streams never wait for each other): the state
    scans' and the output kernel's. The scans are
    the pipeline's critical path, so their stream has a higher priority: the block scheduler then places a scan's
    programs before waiting blocks of the per-chunk kernels as SMs free up."""
    return torch.cuda.Stream(device, priority=-1), torch.cuda.Stream(device)  # -1: above the default 0


def _side_streams(device: torch.device) -> tuple[torch.cuda.Stream, torch.cuda.Stream]:
    """:func:`_side_streams_of` the current stream of ``device``."""
    return _side_streams_of(device, torch.cuda.current_stream(device).cuda_stream)


@contextlib.contextmanager
def _pipeline(device: torch.device, segments: int):
    """``(caller's stream, side streams)`` of a pipeline of ``segments`` segments on ``device``, ``(None, None)``
    where nothing runs concurrently (one segment, or not CUDA): the side streams wait for the work queued on the
    caller's stream on entry, and the caller's stream waits for theirs on exit, also when a launch fails (buffers
    the side streams read are freed on the caller's stream, and a CUDA graph capture must join every stream it
    forked)."""
    if device.type != "cuda" or segments < 2:
        yield None, None
        return
    main = torch.cuda.current_stream(device)
    side = _side_streams(device)
    for s in side:
        s.wait_stream(main)
    try:
        yield main, side
    finally:
        for s in side:
            main.wait_stream(s)


@contextlib.contextmanager
def _on(stream: torch.cuda.Stream | None, after: torch.cuda.Stream | None):
    """Launch on ``stream`` once the work queued so far on ``after`` (if any) is done; with no stream, where we
    are."""
    if stream is None:
        yield
        return
    if after is not None:
        stream.wait_event(after.record_event())
    with torch.cuda.stream(stream):
        yield


@functools.cache
def _sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA ``device``; 132 (an H100/H200) for any other device (the interpreter,
    ``meta`` tensors in benchmarks/kernel_resources.py), so :func:`_scan_plan` picks what it would on the H200."""
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 132


def _plain_out_shapes(K: int, V: int, dtype: torch.dtype) -> bool:
    """Where the plain forward scan may write the output under ``"auto"``: K, V <= 128 and bf16 or fp16 inputs.
    There :func:`_out_fwd` takes all keys in one product, as the scan does, so that the two sum alike; elsewhere
    it takes 64-wide key steps (float32 inputs' 3xTF32 products in one 128-wide step spill 132 B a thread on
    triton 3.6 and 216 B on 3.8, none in 64-wide ones: a one-off compile of kernel_resources.py's K = V = 128
    launch with BK = 128, not kept)."""
    return max(K, V) <= 128 and dtype != torch.float32


def _plain_out_fused(save: bool, K: int, V: int, dtype: torch.dtype) -> bool:
    """Whether the plain forward scan writes the output itself (``TUNING["fwd_plain_out"]``; ``"auto"``: when no
    backward follows, at :func:`_plain_out_shapes`). Without a backward the fused output saves
    :func:`_out_fwd`'s reading back of every per-chunk state, and the scan then stores neither the states nor
    Delta: forward without gradients 0.697 -> 0.623 ms at B2 T8192 H16 D128, 0.815 -> 0.799 at B1 T16384, 1.591 ->
    1.569 at B1 T32768 (H200, session 16, ``kda_breakdown.py --sweep``). With a backward to follow the scan must
    store them anyway and its longer trips cost more than :func:`_out_fwd` (forward+backward 3.26 -> 3.40 ms at B1
    T16384). Not taken at K or V > 128, where the fused scan needed 255 registers (3.78 -> 4.53 ms at B8 T2048 H32
    D256, session 9), nor for float32 inputs (untimed)."""
    mode = TUNING["fwd_plain_out"]
    if mode == "auto":
        return not save and _plain_out_shapes(K, V, dtype)
    return mode == "fused"


def _scan_plan(which: str, NH: int, K: int, V: int, device: torch.device, F32: bool, save: bool = True
               ) -> tuple[bool, int, int, int, int]:
    """``(transposed, BK, BV, num_warps, num_stages)`` of the ``"fwd"`` or ``"bwd"`` scan over ``NH`` = sequences x
    heads, with float32 matrix operands when ``F32``; ``save=False``: a forward with no backward to follow.

    The scans are latency-bound: one program per (sequence, head, value block) walks all chunks in order. Rule
    from H200 timings (benchmarks/RESULTS.md, "KDA launch settings"): the transposed state in 64-wide value
    blocks (fewer, shorter steps) once there are enough programs for it, NH >= 64 forward and NH >= 96 backward;
    else the plain state in 32-wide blocks, 16-wide for the forward when even 16-wide ones leave SMs idle (B1 H16:
    128 programs on 132 SMs, forward 0.82 ms against 0.93 in 32-wide blocks at T16384; B2 H16: 256 programs,
    0.74 against 0.70). Session 13: at K = V = 256 (B8 H32) the transposed forward took 2.74 ms against the plain
    scan and output kernel's 3.29, which until then the rule kept for K > 128. Session 14: without a backward to
    follow, at K > 128 the transposed forward in 128-wide value blocks, 2.33 ms against 2.76 (its scan 1.20 against
    1.63), the outputs bit-identical. Eight warps over a 64-row state split the products' columns: each chunk the
    state goes through shared memory to both warpgroups, which both form the [64, C] products (read off triton
    3.6's TTGIR in session 14, not checked by a script); on 128 rows each warpgroup owns 64. With the states
    stored for the backward the 128-wide blocks were slower (forward+backward 13.06 against 12.39 ms), so 64.
    Float32 operands at K > 128 (sm_90a, benchmarks/kernel_resources.py): the transposed scans would need 408 KB of
    shared memory a block (the H200 has 227), so the plain ones, in 2 pipeline stages: at Triton's default 3 the
    plain backward scan needs 272 KB (triton 3.6), the forward 232 (3.8)."""
    wide_f32 = F32 and K > 128
    mode = TUNING[which + "_scan"]
    if mode == "auto":
        mode = "transposed" if NH >= (64 if which == "fwd" else 96) and not wide_f32 else "plain"
    BV = TUNING[which + "_bv"]
    if BV is None:
        if mode == "transposed":
            BV = 128 if which == "fwd" and not save and K > 128 else 64
        elif which == "fwd" and NH * triton.cdiv(V, 16) < _sm_count(device):
            BV = 16
        else:
            BV = 32
    BK = _pow2(K)
    stages = 2 if wide_f32 else 3
    return mode == "transposed", BK, min(_pow2(V), BV), TUNING["scan_warps"] or (4 if BK <= 128 else 8), stages


def _on_inputs_device(launcher):
    """Run ``launcher(q, ...)`` with ``q``'s CUDA device current: Triton launches on the current device's current
    stream, and the pipeline's streams and events belong to ``q``'s device."""
    @functools.wraps(launcher)
    def run(q: torch.Tensor, *args, **kwargs):
        if q.device.type != "cuda":
            return launcher(q, *args, **kwargs)
        with torch.cuda.device(q.device):
            return launcher(q, *args, **kwargs)
    return run


@_on_inputs_device
def chunk_fwd(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, scale: float,
    initial_state: torch.Tensor | None, output_final_state: bool, cu_seqlens: torch.Tensor | None, C: int,
    gate_bias: torch.Tensor | None = None, g_min: float | None = None, qk_l2norm: bool = False, save: bool = True,
) -> tuple[torch.Tensor, ...]:
    """Forward launches. Inputs ``[B, T, H, *]`` contiguous. Returns ``(o, ht, Gc, Aq, Mi, W, Kd, Qg, h, D, Rn)``.

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
        return o, ht, Gc, Aq, Mi, W, Kd, Qg, h, D, Rn
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
    return o, ht, Gc, Aq, Mi, W, Kd, Qg, h, D, Rn


def _bias(gate_bias: torch.Tensor | None, gate: bool, n: int, device: torch.device) -> torch.Tensor | None:
    """The kernels' ``[H * K]`` float32 gate bias: None without the fused gate, zeros when the gate has none."""
    if not gate:
        return None
    if gate_bias is None:
        return torch.zeros(n, device=device, dtype=torch.float32)
    return gate_bias.reshape(n).to(torch.float32).contiguous()


@_on_inputs_device
def chunk_bwd(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, Gc: torch.Tensor,
    Aq: torch.Tensor, Mi: torch.Tensor, W: torch.Tensor, Kd: torch.Tensor, Qg: torch.Tensor, h: torch.Tensor,
    D: torch.Tensor, Rn: torch.Tensor, do: torch.Tensor, dht: torch.Tensor | None, need_dh0: bool, scale: float,
    cu_seqlens: torch.Tensor | None, C: int, gate_bias: torch.Tensor | None = None, g_min: float | None = None,
    qk_l2norm: bool = False,
) -> tuple[torch.Tensor, ...]:
    """Backward launches, fusion arguments as :func:`chunk_fwd` (``g`` is read only with the fused gate).
    Returns ``(dq, dk, dv, dg, dbeta, dh0)``; dg (of the log-decay, or of the pre-activation with the fused
    gate) and dh0 are float32."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    N = B if cu_seqlens is None else cu_seqlens.numel() - 1
    cu, cidx, coff, NC = chunk_meta(cu_seqlens, B, T, C, q.device)
    F32 = _f32_operands(q.dtype)
    wdt = _work_dtype(q.dtype)
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    dg = torch.empty(B, T, H, K, device=q.device, dtype=torch.float32)
    dbeta = torch.empty_like(beta)
    dh0 = torch.empty(N, H, K, V, device=q.device, dtype=torch.float32)
    if NC == 0:
        dh0.copy_(dht if dht is not None else torch.zeros_like(dh0))
        return dq, dk, dv, dg, dbeta, dh0
    dh = torch.empty_like(h)
    dD = torch.empty(B, T, H, V, device=q.device, dtype=wdt)
    transposed, BK, BV, nw, ns = _scan_plan("bwd", N * H, K, V, q.device, F32)
    scan = _scan_bwd_t if transposed else _scan_bwd
    # float32 scratch: dQg, dKd, dW between passes 1 and 2; with the fused L2 norm also dq̂, dk̂ (passes 2 -> 3)
    scr = torch.empty(5 if qk_l2norm else 3, B, T, H, K, device=q.device, dtype=torch.float32)
    s_dq, s_dk = (scr[3], scr[4]) if qk_l2norm else (None, None)
    dgs = torch.empty(h.shape[0] * H * K, device=q.device, dtype=torch.float32)
    gate = g_min is not None
    rnq, rnk = Rn if qk_l2norm else (None, None)
    bias = _bias(gate_bias, gate, H * K, q.device)
    table, segs = _segment_plan("bwd", B, H, T, C, cu_seqlens, cidx, NC, q.device)
    BVb = min(TUNING["main_bwd_bv"] or (32 if V > 128 else 64), _pow2(V))
    with _pipeline(q.device, len(segs)) as (main, side):
        for i, (r0, r1, it_lo, it_hi) in reversed(list(enumerate(segs))):
            # dS enters segment i < last from dh0, where segment i + 1 left it (float32)
            dS_in = dht if i == len(segs) - 1 else dh0
            with _on(side and side[0], None):
                scan[(triton.cdiv(V, BV), N * H)](
                    Qg, Kd, Gc, W, Aq, do, dD, dh, dS_in, dh0, cu, coff, it_lo, it_hi, H=H, K=K, V=V, C=C, BK=BK,
                    BV=BV, HAS_DHT=dS_in is not None, STORE_DH0=need_dh0 or i > 0, F32=F32, num_warps=nw,
                    num_stages=ns)
            if side:  # this segment's _main_bwd waits for its scan, and runs beside the next one
                main.wait_event(side[0].record_event())
            _main_bwd[(r1 - r0, H)](q, k, v, beta, Gc, Mi, h, dh, D, dD, do, dq, dk, dv, dg, dbeta, scr[0], scr[1],
                                    scr[2], s_dq, s_dk, dgs, cu, table[r0:r1], coff, scale, g if gate else None, bias,
                                    g_min if gate else 0.0, rnq, rnk, H=H, K=K, V=V, C=C, BK=min(64, _pow2(K)), BV=BVb,
                                    F32=F32, GATE=gate, L2=qk_l2norm, SEGMENT=len(segs) > 1,
                                    num_warps=TUNING["main_bwd_warps"])
    return dq, dk, dv, dg, dbeta, dh0
