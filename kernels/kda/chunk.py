"""Chunked KDA in Triton: forward and backward kernels plus their host launchers.

Every sequence is split into chunks of C tokens (C = 64, or 32 for strong gate bounds; README.md). The
state scans step over whole chunks; inside a chunk every block is a dense ``tl.dot`` on two halves of
``S = C / 2`` rows. With ``G`` the in-chunk cumulative log-decay, ``S`` the state entering the chunk
(REFERENCE.md §1) and the halves 0 (rows ``[0, S)``) and 1 (rows ``[S, C)``)::

    A    = tril(K⊙exp(G) · (K⊙exp(-G))^T, -1)        strictly lower [C, C]; three [S, S] blocks:
             A00, A11: operands rebased on the half's own middle row r_h = S_h + (S - 1) // 2
                       (K⊙exp(G - G_r), K⊙exp(G_r - G): |exponent| <= |g_min| * ceil((S - 1) / 2))
             A10:      rebased on the boundary row b = S - 1 (K1⊙exp(G1 - G_b) and K0⊙exp(G_b - G0), both <= 1;
                       an underflowing factor bounds a product below e^-87)
    Aq   = scale * tril(Q⊙exp(G) · (K⊙exp(-G))^T)     diagonal included, the same three blocks
    M    = (I + Diag(beta) A)^-1:   M00, M11 by forward substitution, M10 = -M11 (Diag(beta) A)10 M00
    W    = M Diag(beta) (K⊙exp(G)),   U = M Diag(beta) V
    Delta = U - W S
    O    = scale (Q⊙exp(G)) S + Aq Delta
    S'   = Diag(exp(G_last)) S + (K⊙exp(G_last - G))^T Delta

Numeric argument (README.md): with g in [g_min, 0], the largest exponent formed is
``E(g_min, S) = |g_min| * ceil((S - 1) / 2)``, which must stay <= 88 (exp overflows float32 and bfloat16 at
88.7): halves of S = 32 (C = 64) for g_min >= -5.5 (E = 80 at the default -5), of S = 16 (C = 32) for
g_min >= -11.

Kernels (forward): ``_cumsum_fwd`` (per chunk: G), ``_intra_fwd`` (per chunk: A, Aq, M, W, U),
``_scan_fwd`` (per sequence and value block: the sequential state recurrence, stores every chunk's entering
state and Delta), ``_out_fwd`` (per chunk: O). Backward: ``_scan_bwd`` (reverse recurrence of dS, stores dS
per chunk and dDelta), ``_dA_bwd`` (per chunk: dv, dbeta and the pair-term gradients), ``_dqkg_bwd`` (per
chunk and K block: dq, dk, dg). Precision: exponentials, cumulative sums, A, the inverse and the states in
float32; matrix-product operands in bfloat16 (float32 for float32 inputs) with float32 accumulation.

Every launcher works on a packed layout ``[1, T_total, H, X]``; a dense ``[B, T]`` batch is the packed batch
with ``cu_seqlens = [0, T, 2T, ...]``. Chunk metadata: ``chunk_idx [NC, 2]`` = (sequence, chunk in the
sequence) for every chunk, ``chunk_off [N + 1]`` = first global chunk of each sequence. Per-chunk buffers
(states) are allocated with the static upper bound ``T_total // C + N`` rows so that their shapes never
depend on the values of ``cu_seqlens`` (torch.compile's fake tensors need that). The ``[T, H, C]`` buffers
(``Akk``, ``Aq``, ``Mi``, ``dA``, ``dAq``) hold each token's row of its chunk's matrix; their upper-right
``[S, S]`` block is zero by structure and is never written nor read.
"""

from __future__ import annotations

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
def _chunk_bounds(cu, cidx, i_c, C: tl.constexpr):
    i_n = tl.load(cidx + 2 * i_c).to(tl.int64)
    i_t = tl.load(cidx + 2 * i_c + 1).to(tl.int64)
    bos = tl.load(cu + i_n).to(tl.int64)
    eos = tl.load(cu + i_n + 1).to(tl.int64)
    t0 = bos + i_t * C
    n_valid = tl.minimum(eos - t0, C)
    return i_n, t0, n_valid


@triton.jit
def _load_blocks(x, offc0, m0, m1, H: tl.constexpr, C: tl.constexpr):
    """The three stored ``[S, S]`` blocks (00, 10, 11) of a chunk's lower block-triangular matrix."""
    S: tl.constexpr = C // 2
    offc1 = offc0 + S * H * C
    return (tl.load(x + offc0, mask=m0[:, None], other=0.0), tl.load(x + offc1, mask=m1[:, None], other=0.0),
            tl.load(x + offc1 + S, mask=m1[:, None], other=0.0))


@triton.jit
def _store_blocks(x, offc0, m0, m1, X00, X10, X11, H: tl.constexpr, C: tl.constexpr):
    S: tl.constexpr = C // 2
    offc1 = offc0 + S * H * C
    tl.store(x + offc0, X00.to(x.dtype.element_ty), mask=m0[:, None])
    tl.store(x + offc1, X10.to(x.dtype.element_ty), mask=m1[:, None])
    tl.store(x + offc1 + S, X11.to(x.dtype.element_ty), mask=m1[:, None])


@triton.jit
def _ref_rows(Gc, t0, n_valid, i_h, rk, m_k, H: tl.constexpr, K: tl.constexpr, S: tl.constexpr):
    """The rows of the cumulative log-decay ``Gc`` that one K block is rebased on, loaded as ``[BK]`` vectors:
    ``(G_r0, G_r1, G_b, G_last)`` with r_h = S_h + (S - 1) // 2 the middle row of half h, b = S - 1 the
    boundary and G_last the chunk's last valid row. A reference row past the chunk's end stands for G_last,
    the value the zero-padded cumsum carried there."""
    R: tl.constexpr = (S - 1) // 2
    last = n_valid - 1
    base = Gc + (t0 * H + i_h) * K + rk
    return (tl.load(base + tl.minimum(R, last) * (H * K), mask=m_k, other=0.0),
            tl.load(base + tl.minimum(S + R, last) * (H * K), mask=m_k, other=0.0),
            tl.load(base + tl.minimum(S - 1, last) * (H * K), mask=m_k, other=0.0),
            tl.load(base + last * (H * K), mask=m_k, other=0.0))


@triton.jit
def _load_G(Gc, off0, off1, msk0, msk1, g_last):
    """Stored cumulative log-decay of one K block as the halves ``(G0, G1)``; rows past the chunk's end hold
    G_last (as the zero-padded cumsum did), so that every rebased exponential of a padded row stays bounded."""
    G0 = tl.load(Gc + off0, mask=msk0, other=0.0)
    G1 = tl.load(Gc + off1, mask=msk1, other=0.0)
    return tl.where(msk0, G0, g_last[None, :]), tl.where(msk1, G1, g_last[None, :])


@triton.jit
def _pair_operands(G0, G1, Gr0, Gr1, Gb):
    """Rebasing factors of one K block: ``(up0, dn0, up1, dn1, e1b, eb0)``.

    ``up_h = exp(G_h - G_{r_h})`` and ``dn_h = exp(G_{r_h} - G_h)`` rebase half h on its middle row r_h
    (bounded by exp(|g_min| * ceil((S - 1) / 2))); ``e1b = exp(G1 - G_b)`` and ``eb0 = exp(G_b - G0)``
    rebase the off-diagonal block on the boundary row b = S - 1 (both <= 1)."""
    return (tl.exp(G0 - Gr0[None, :]), tl.exp(Gr0[None, :] - G0), tl.exp(G1 - Gr1[None, :]),
            tl.exp(Gr1[None, :] - G1), tl.exp(G1 - Gb[None, :]), tl.exp(Gb[None, :] - G0))


@triton.jit
def _unit_lower_inv(Akk, beta, tok_b, col_b, n_b, i_h, H: tl.constexpr, C: tl.constexpr, S: tl.constexpr):
    """``(I + Diag(beta) A)^-1`` of one diagonal ``[S, S]`` block, A strictly lower and stored in ``Akk``
    (block rows are tokens ``tok_b + i``, columns ``col_b + j``; ``n_b`` of its rows are valid).

    Forward substitution in column form: ``Y = M^T`` obeys ``Y[:, i] = e_i - beta_i Y A[i, :]^T`` for
    i = 1 .. S - 1 (exact, A being strictly lower). Each step reads row i of A from memory (independent of Y,
    so the unrolled loads are issued early) and reduces along the rows of Y, within a warp: no exchange
    between warps on the sequential path."""
    rows = tl.arange(0, S)
    Y = (rows[:, None] == rows[None, :]).to(tl.float32)
    for i in tl.static_range(1, S):
        a_i = tl.load(Akk + (tok_b + i) * (H * C) + i_h * C + col_b + rows, mask=(rows < i) & (i < n_b), other=0.0)
        b_i = tl.load(beta + (tok_b + i) * H + i_h, mask=i < n_b, other=0.0).to(tl.float32)
        s = tl.sum(Y * a_i[None, :], axis=1) * b_i
        Y = tl.where(rows[None, :] == i, (rows == i).to(tl.float32)[:, None] - s[:, None], Y)
    return tl.trans(Y)


# ----------------------------------------------------------------------------------------------------------
# forward
# ----------------------------------------------------------------------------------------------------------


@triton.jit
def _cumsum_fwd(
    g, Gc, cu, cidx,
    H: tl.constexpr, K: tl.constexpr, C: tl.constexpr, BK: tl.constexpr,
):
    """Per (chunk, head): Gc = in-chunk cumulative sum of g over the tokens (float32, padded rows not written)."""
    i_c, i_h = tl.program_id(0), tl.program_id(1)
    _, t0, n_valid = _chunk_bounds(cu, cidx, i_c, C)
    rows = tl.arange(0, C)
    for kb in range(0, K, BK):
        rk = kb + tl.arange(0, BK)
        off = (t0 + rows)[:, None] * (H * K) + i_h * K + rk[None, :]
        msk = (rows < n_valid)[:, None] & (rk < K)[None, :]
        tl.store(Gc + off, tl.cumsum(tl.load(g + off, mask=msk, other=0.0).to(tl.float32), axis=0), mask=msk)


@triton.jit
def _intra_fwd(
    k, v, q, beta, Gc, Akk, Aq, Mi, W, U, Kd, Qg, cu, cidx, scale,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    F32: tl.constexpr,
):
    """Per (chunk, head), from Gc: A (stored, float32), Aq (scaled), M = (I + Diag(beta) A)^-1, W, U, and the
    scan's operands Kd = K⊙exp(G_last - G), Qg = scale Q⊙exp(G). In every [T, H, *] buffer the rows of
    half 1 are those of half 0 shifted by S tokens."""
    i_c, i_h = tl.program_id(0), tl.program_id(1)
    _, t0, n_valid = _chunk_bounds(cu, cidx, i_c, C)
    S: tl.constexpr = C // 2
    rows = tl.arange(0, S)
    m0 = rows < n_valid
    m1 = rows + S < n_valid
    tok = t0 + rows
    A00 = tl.zeros([S, S], dtype=tl.float32)
    A11 = tl.zeros([S, S], dtype=tl.float32)
    A10 = tl.zeros([S, S], dtype=tl.float32)
    B00 = tl.zeros([S, S], dtype=tl.float32)
    B11 = tl.zeros([S, S], dtype=tl.float32)
    B10 = tl.zeros([S, S], dtype=tl.float32)
    for kb in range(0, K, BK):
        rk = kb + tl.arange(0, BK)
        m_k = rk < K
        off0 = tok[:, None] * (H * K) + i_h * K + rk[None, :]
        off1 = off0 + S * H * K
        msk0 = m0[:, None] & m_k[None, :]
        msk1 = m1[:, None] & m_k[None, :]
        Gr0, Gr1, Gb, g_last = _ref_rows(Gc, t0, n_valid, i_h, rk, m_k, H, K, S)
        G0, G1 = _load_G(Gc, off0, off1, msk0, msk1, g_last)
        k0 = tl.load(k + off0, mask=msk0, other=0.0).to(tl.float32)
        k1 = tl.load(k + off1, mask=msk1, other=0.0).to(tl.float32)
        q0 = tl.load(q + off0, mask=msk0, other=0.0).to(tl.float32)
        q1 = tl.load(q + off1, mask=msk1, other=0.0).to(tl.float32)
        tl.store(Kd + off0, (k0 * tl.exp(g_last[None, :] - G0)).to(Kd.dtype.element_ty), mask=msk0)
        tl.store(Kd + off1, (k1 * tl.exp(g_last[None, :] - G1)).to(Kd.dtype.element_ty), mask=msk1)
        tl.store(Qg + off0, (q0 * tl.exp(G0) * scale).to(Qg.dtype.element_ty), mask=msk0)
        tl.store(Qg + off1, (q1 * tl.exp(G1) * scale).to(Qg.dtype.element_ty), mask=msk1)
        up0, dn0, up1, dn1, e1b, eb0 = _pair_operands(G0, G1, Gr0, Gr1, Gb)
        kdn0 = tl.trans(_op(k0 * dn0, F32))
        kdn1 = tl.trans(_op(k1 * dn1, F32))
        kb0 = tl.trans(_op(k0 * eb0, F32))
        A00 += tl.dot(_op(k0 * up0, F32), kdn0)
        B00 += tl.dot(_op(q0 * up0, F32), kdn0)
        A11 += tl.dot(_op(k1 * up1, F32), kdn1)
        B11 += tl.dot(_op(q1 * up1, F32), kdn1)
        A10 += tl.dot(_op(k1 * e1b, F32), kb0)
        B10 += tl.dot(_op(q1 * e1b, F32), kb0)
    # Entries above a diagonal block's diagonal may be inf/nan (late row, early column); where selects.
    lo = rows[:, None] > rows[None, :]
    le = rows[:, None] >= rows[None, :]
    offc0 = tok[:, None] * (H * C) + i_h * C + rows[None, :]
    _store_blocks(Aq, offc0, m0, m1, tl.where(le, B00, 0.0) * scale, B10 * scale, tl.where(le, B11, 0.0) * scale,
                  H, C)
    _store_blocks(Akk, offc0, m0, m1, tl.where(lo, A00, 0.0), A10, tl.where(lo, A11, 0.0), H, C)
    tl.debug_barrier()  # the inversions read back rows of A that other warps stored
    M00 = _unit_lower_inv(Akk, beta, t0, 0, n_valid, i_h, H, C, S)
    M11 = _unit_lower_inv(Akk, beta, t0 + S, S, n_valid - S, i_h, H, C, S)
    beta0 = tl.load(beta + tok * H + i_h, mask=m0, other=0.0).to(tl.float32)
    beta1 = tl.load(beta + (tok + S) * H + i_h, mask=m1, other=0.0).to(tl.float32)
    M10 = -tl.dot(tl.dot(M11, A10 * beta1[:, None]), M00)  # float32 operands (tf32 on the GPU)
    _store_blocks(Mi, offc0, m0, m1, M00, M10, M11, H, C)
    X00 = _op(M00 * beta0[None, :], F32)  # M Diag(beta), by blocks
    X10 = _op(M10 * beta0[None, :], F32)
    X11 = _op(M11 * beta1[None, :], F32)
    for kb in range(0, K, BK):
        rk = kb + tl.arange(0, BK)
        off0 = tok[:, None] * (H * K) + i_h * K + rk[None, :]
        off1 = off0 + S * H * K
        msk0 = m0[:, None] & (rk < K)[None, :]
        msk1 = m1[:, None] & (rk < K)[None, :]
        kg0 = _op(tl.load(k + off0, mask=msk0, other=0.0).to(tl.float32)
                  * tl.exp(tl.load(Gc + off0, mask=msk0, other=0.0)), F32)
        kg1 = _op(tl.load(k + off1, mask=msk1, other=0.0).to(tl.float32)
                  * tl.exp(tl.load(Gc + off1, mask=msk1, other=0.0)), F32)
        tl.store(W + off0, tl.dot(X00, kg0).to(W.dtype.element_ty), mask=msk0)
        tl.store(W + off1, (tl.dot(X10, kg0) + tl.dot(X11, kg1)).to(W.dtype.element_ty), mask=msk1)
    for vb in range(0, V, BV):
        cols = vb + tl.arange(0, BV)
        off0 = tok[:, None] * (H * V) + i_h * V + cols[None, :]
        off1 = off0 + S * H * V
        msk0 = m0[:, None] & (cols < V)[None, :]
        msk1 = m1[:, None] & (cols < V)[None, :]
        v0 = _op(tl.load(v + off0, mask=msk0, other=0.0), F32)
        v1 = _op(tl.load(v + off1, mask=msk1, other=0.0), F32)
        tl.store(U + off0, tl.dot(X00, v0).to(U.dtype.element_ty), mask=msk0)
        tl.store(U + off1, (tl.dot(X10, v0) + tl.dot(X11, v1)).to(U.dtype.element_ty), mask=msk1)


@triton.jit
def _scan_fwd(
    Kd, Gc, W, U, D, h, h0, ht, cu, coff,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    HAS_H0: tl.constexpr, STORE_HT: tl.constexpr, F32: tl.constexpr,
):
    """Per (value block, sequence x head): S_{n+1} = Diag(exp(G_last)) S_n + Kd^T (U - W S_n)."""
    i_v, i_nh = tl.program_id(0), tl.program_id(1)
    i_n, i_h = i_nh // H, i_nh % H
    bos = tl.load(cu + i_n).to(tl.int64)
    eos = tl.load(cu + i_n + 1).to(tl.int64)
    c0 = tl.load(coff + i_n).to(tl.int64)
    n_chunks = tl.cdiv(eos - bos, C)
    rk = tl.arange(0, BK)
    cv = i_v * BV + tl.arange(0, BV)
    rows = tl.arange(0, C)
    m_k = rk < K
    m_v = cv < V
    m_kv = m_k[:, None] & m_v[None, :]
    off_s = rk[:, None] * V + cv[None, :]
    S = tl.zeros([BK, BV], dtype=tl.float32)
    if HAS_H0:
        S += tl.load(h0 + (i_n * H + i_h) * K * V + off_s, mask=m_kv, other=0.0).to(tl.float32)
    for it in range(0, n_chunks):
        t0 = bos + it * C
        n_valid = tl.minimum(eos - t0, C)
        m_t = rows < n_valid
        tok = t0 + rows
        tl.store(h + ((c0 + it) * H + i_h) * K * V + off_s, S.to(h.dtype.element_ty), mask=m_kv)
        offk = tok[:, None] * (H * K) + i_h * K + rk[None, :]
        mk = m_t[:, None] & m_k[None, :]
        offv = tok[:, None] * (H * V) + i_h * V + cv[None, :]
        mv = m_t[:, None] & m_v[None, :]
        b_w = tl.load(W + offk, mask=mk, other=0.0)
        b_u = tl.load(U + offv, mask=mv, other=0.0).to(tl.float32)
        b_d = b_u - tl.dot(_op(b_w, F32), _op(S, F32))
        tl.store(D + offv, b_d.to(D.dtype.element_ty), mask=mv)
        b_kd = tl.load(Kd + offk, mask=mk, other=0.0)
        g_last = tl.load(Gc + (t0 + n_valid - 1) * (H * K) + i_h * K + rk, mask=m_k, other=0.0)
        S = S * tl.exp(g_last)[:, None] + tl.dot(tl.trans(_op(b_kd, F32)), _op(b_d, F32))
    if STORE_HT:
        tl.store(ht + (i_n * H + i_h) * K * V + off_s, S, mask=m_kv)


@triton.jit
def _load_chunk_rows(x, tok, rows, m_t, H: tl.constexpr, C: tl.constexpr, i_h):
    """A token's row of its chunk's ``[C, C]`` matrix from a ``[T, H, C]`` buffer, the never-written
    upper-right ``[S, S]`` block read as zeros."""
    S: tl.constexpr = C // 2
    m = m_t[:, None] & ((rows[:, None] >= S) | (rows[None, :] < S))
    return tl.load(x + tok[:, None] * (H * C) + i_h * C + rows[None, :], mask=m, other=0.0)


@triton.jit
def _out_fwd(
    Qg, Aq, D, h, o, cu, cidx,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    F32: tl.constexpr,
):
    """Per (value block, chunk, head): O = scale (Q⊙exp(G)) S + Aq Delta."""
    i_v, i_c, i_h = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    _, t0, n_valid = _chunk_bounds(cu, cidx, i_c, C)
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
        b_h = tl.load(h + (i_c * H + i_h) * K * V + rk[:, None] * V + cv[None, :],
                      mask=m_k[:, None] & m_v[None, :], other=0.0)
        acc += tl.dot(_op(b_qg, F32), _op(b_h, F32))
    b_a = _load_chunk_rows(Aq, tok, rows, m_t, H, C, i_h)
    offv = tok[:, None] * (H * V) + i_h * V + cv[None, :]
    mv = m_t[:, None] & m_v[None, :]
    b_d = tl.load(D + offv, mask=mv, other=0.0)
    acc += tl.dot(_op(b_a, F32), _op(b_d, F32))
    tl.store(o + offv, acc.to(o.dtype.element_ty), mask=mv)


# ----------------------------------------------------------------------------------------------------------
# backward
# ----------------------------------------------------------------------------------------------------------


@triton.jit
def _scan_bwd(
    Qg, Kd, Gc, W, Aq, do, dD, dh, dht, dh0, cu, coff,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    HAS_DHT: tl.constexpr, STORE_DH0: tl.constexpr, F32: tl.constexpr,
):
    """Reverse recurrence, chunks last to first. With dS the gradient of the state leaving the chunk::

        dDelta = Aq^T dO + Kd dS
        dS    <- Diag(exp(G_last)) dS + scale (Q⊙exp(G))^T dO - W^T dDelta
    """
    i_v, i_nh = tl.program_id(0), tl.program_id(1)
    i_n, i_h = i_nh // H, i_nh % H
    bos = tl.load(cu + i_n).to(tl.int64)
    eos = tl.load(cu + i_n + 1).to(tl.int64)
    c0 = tl.load(coff + i_n).to(tl.int64)
    n_chunks = tl.cdiv(eos - bos, C)
    rk = tl.arange(0, BK)
    cv = i_v * BV + tl.arange(0, BV)
    rows = tl.arange(0, C)
    m_k = rk < K
    m_v = cv < V
    m_kv = m_k[:, None] & m_v[None, :]
    off_s = rk[:, None] * V + cv[None, :]
    dS = tl.zeros([BK, BV], dtype=tl.float32)
    if HAS_DHT:
        dS += tl.load(dht + (i_n * H + i_h) * K * V + off_s, mask=m_kv, other=0.0).to(tl.float32)
    for j in range(0, n_chunks):
        it = n_chunks - 1 - j
        t0 = bos + it * C
        n_valid = tl.minimum(eos - t0, C)
        m_t = rows < n_valid
        tok = t0 + rows
        tl.store(dh + ((c0 + it) * H + i_h) * K * V + off_s, dS.to(dh.dtype.element_ty), mask=m_kv)
        offk = tok[:, None] * (H * K) + i_h * K + rk[None, :]
        mk = m_t[:, None] & m_k[None, :]
        offv = tok[:, None] * (H * V) + i_h * V + cv[None, :]
        mv = m_t[:, None] & m_v[None, :]
        b_do = tl.load(do + offv, mask=mv, other=0.0)
        b_a = _load_chunk_rows(Aq, tok, rows, m_t, H, C, i_h)
        b_kd = tl.load(Kd + offk, mask=mk, other=0.0)
        g_last = tl.load(Gc + (t0 + n_valid - 1) * (H * K) + i_h * K + rk, mask=m_k, other=0.0)
        b_dd = tl.dot(tl.trans(_op(b_a, F32)), _op(b_do, F32)) + tl.dot(_op(b_kd, F32), _op(dS, F32))
        tl.store(dD + offv, b_dd.to(dD.dtype.element_ty), mask=mv)
        b_w = tl.load(W + offk, mask=mk, other=0.0)
        b_qg = tl.load(Qg + offk, mask=mk, other=0.0)
        dS = dS * tl.exp(g_last)[:, None] + tl.dot(tl.trans(_op(b_qg, F32)), _op(b_do, F32))
        dS -= tl.dot(tl.trans(_op(b_w, F32)), _op(b_dd, F32))
    if STORE_DH0:
        tl.store(dh0 + (i_n * H + i_h) * K * V + off_s, dS, mask=m_kv)


@triton.jit
def _dA_bwd(
    k, v, beta, Gc, Akk, Mi, h, D, dD, do, dv, dbeta, dA, dAq, dii, cu, cidx, scale,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    F32: tl.constexpr,
):
    """Per (chunk, head): dv, dbeta, and the pair-term gradients the key side needs.

    Delta = M Y with Y = Diag(beta) Vt, Vt = V - (K⊙exp(G)) S, so with dy = M^T dDelta::

        dv = Diag(beta) dy,   dL = -M^T (dDelta Y^T) M^T = -tril(dy Delta^T, -1),   dA = Diag(beta) dL
        dbeta = rowsum(dy ⊙ Vt) + rowsum(dL ⊙ A),   dAq = tril(dO Delta^T)

    Stores dA and scale * dAq without their diagonal (blocks 00, 10, 11 as ``Aq``) and the diagonal
    ``dii = scale * diag(dO Delta^T)``. ``Xab`` names the [S, S] block of X with rows in half a, columns in b.
    """
    i_c, i_h = tl.program_id(0), tl.program_id(1)
    _, t0, n_valid = _chunk_bounds(cu, cidx, i_c, C)
    S: tl.constexpr = C // 2
    rows = tl.arange(0, S)
    m0 = rows < n_valid
    m1 = rows + S < n_valid
    tok = t0 + rows
    offc0 = tok[:, None] * (H * C) + i_h * C + rows[None, :]
    M00, M10, M11 = _load_blocks(Mi, offc0, m0, m1, H, C)
    M00t, M10t, M11t = tl.trans(M00), tl.trans(M10), tl.trans(M11)
    hbase = (i_c * H + i_h) * K * V
    dAq00 = tl.zeros([S, S], dtype=tl.float32)
    dAq10 = tl.zeros([S, S], dtype=tl.float32)
    dAq11 = tl.zeros([S, S], dtype=tl.float32)
    dL00 = tl.zeros([S, S], dtype=tl.float32)
    dL10 = tl.zeros([S, S], dtype=tl.float32)
    dL11 = tl.zeros([S, S], dtype=tl.float32)
    db0 = tl.zeros([S], dtype=tl.float32)
    db1 = tl.zeros([S], dtype=tl.float32)
    for vb in range(0, V, BV):
        cv = vb + tl.arange(0, BV)
        m_v = cv < V
        off0 = tok[:, None] * (H * V) + i_h * V + cv[None, :]
        off1 = off0 + S * H * V
        mv0 = m0[:, None] & m_v[None, :]
        mv1 = m1[:, None] & m_v[None, :]
        # Vt = V - (K⊙exp(G)) S on this value block
        P0 = tl.zeros([S, BV], dtype=tl.float32)
        P1 = tl.zeros([S, BV], dtype=tl.float32)
        for kb in range(0, K, BK):
            rk = kb + tl.arange(0, BK)
            m_k = rk < K
            offk0 = tok[:, None] * (H * K) + i_h * K + rk[None, :]
            offk1 = offk0 + S * H * K
            msk0 = m0[:, None] & m_k[None, :]
            msk1 = m1[:, None] & m_k[None, :]
            kg0 = _op(tl.load(k + offk0, mask=msk0, other=0.0).to(tl.float32)
                      * tl.exp(tl.load(Gc + offk0, mask=msk0, other=0.0)), F32)
            kg1 = _op(tl.load(k + offk1, mask=msk1, other=0.0).to(tl.float32)
                      * tl.exp(tl.load(Gc + offk1, mask=msk1, other=0.0)), F32)
            b_h = _op(tl.load(h + hbase + rk[:, None] * V + cv[None, :], mask=m_k[:, None] & m_v[None, :],
                              other=0.0), F32)
            P0 += tl.dot(kg0, b_h)
            P1 += tl.dot(kg1, b_h)
        dd0 = tl.load(dD + off0, mask=mv0, other=0.0).to(tl.float32)
        dd1 = tl.load(dD + off1, mask=mv1, other=0.0).to(tl.float32)
        dy0 = tl.dot(M00t, dd0) + tl.dot(M10t, dd1)  # M^T dDelta, float32 operands (tf32 on GPU)
        dy1 = tl.dot(M11t, dd1)
        db0 += tl.sum(dy0 * (tl.load(v + off0, mask=mv0, other=0.0).to(tl.float32) - P0), axis=1)
        db1 += tl.sum(dy1 * (tl.load(v + off1, mask=mv1, other=0.0).to(tl.float32) - P1), axis=1)
        beta0 = tl.load(beta + tok * H + i_h, mask=m0, other=0.0).to(tl.float32)
        beta1 = tl.load(beta + (tok + S) * H + i_h, mask=m1, other=0.0).to(tl.float32)
        tl.store(dv + off0, (dy0 * beta0[:, None]).to(dv.dtype.element_ty), mask=mv0)
        tl.store(dv + off1, (dy1 * beta1[:, None]).to(dv.dtype.element_ty), mask=mv1)
        D0 = tl.load(D + off0, mask=mv0, other=0.0)
        D1 = tl.load(D + off1, mask=mv1, other=0.0)
        D0f = tl.trans(D0.to(tl.float32))
        dL00 -= tl.dot(dy0, D0f)
        dL10 -= tl.dot(dy1, D0f)
        dL11 -= tl.dot(dy1, tl.trans(D1.to(tl.float32)))
        do0 = _op(tl.load(do + off0, mask=mv0, other=0.0), F32)
        do1 = _op(tl.load(do + off1, mask=mv1, other=0.0), F32)
        D0t = tl.trans(_op(D0, F32))
        dAq00 += tl.dot(do0, D0t)
        dAq10 += tl.dot(do1, D0t)
        dAq11 += tl.dot(do1, tl.trans(_op(D1, F32)))
    lo = rows[:, None] > rows[None, :]
    dL00 = tl.where(lo, dL00, 0.0)
    dL11 = tl.where(lo, dL11, 0.0)
    A00, A10, A11 = _load_blocks(Akk, offc0, m0, m1, H, C)  # the forward's A (diagonal blocks strictly lower)
    db0 += tl.sum(dL00 * A00, axis=1)
    db1 += tl.sum(dL10 * A10 + dL11 * A11, axis=1)
    tl.store(dbeta + tok * H + i_h, db0.to(dbeta.dtype.element_ty), mask=m0)
    tl.store(dbeta + (tok + S) * H + i_h, db1.to(dbeta.dtype.element_ty), mask=m1)
    beta0 = tl.load(beta + tok * H + i_h, mask=m0, other=0.0).to(tl.float32)
    beta1 = tl.load(beta + (tok + S) * H + i_h, mask=m1, other=0.0).to(tl.float32)
    _store_blocks(dA, offc0, m0, m1, dL00 * beta0[:, None], dL10 * beta1[:, None], dL11 * beta1[:, None], H, C)
    # Aq's diagonal carries no decay (exp(G_i - G_i) = 1): it feeds dq and dk elementwise and never dG, so
    # dG has no pair of O(1) terms that cancel (that cancellation costs dg its relative accuracy when the
    # true dg is as small as exp(g_min)).
    eye = rows[:, None] == rows[None, :]
    tl.store(dii + tok * H + i_h, tl.sum(tl.where(eye, dAq00, 0.0), axis=1) * scale, mask=m0)
    tl.store(dii + (tok + S) * H + i_h, tl.sum(tl.where(eye, dAq11, 0.0), axis=1) * scale, mask=m1)
    _store_blocks(dAq, offc0, m0, m1, tl.where(lo, dAq00, 0.0) * scale, dAq10 * scale,
                  tl.where(lo, dAq11, 0.0) * scale, H, C)


@triton.jit
def _dqkg_bwd(
    q, k, Gc, h, dh, D, do, dv, dA, dAq, dii, dq, dk, dg, cu, cidx, scale,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    F32: tl.constexpr,
):
    """Per (K block, chunk, head): dq, dk and dg of the block.

    State terms: dKd = Delta dS^T (the update (K⊙exp(G_last - G))^T Delta), dQg = dO S^T (O's
    scale (Q⊙exp(G)) S), dKg = -dv S^T (Vt's (K⊙exp(G)) S). Pair terms of A and Aq from the ``_dA_bwd``
    blocks with the forward's rebasing. dg = reverse cumsum of dG over the chunk (per channel).
    """
    i_kb, i_c, i_h = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    _, t0, n_valid = _chunk_bounds(cu, cidx, i_c, C)
    S: tl.constexpr = C // 2
    rows = tl.arange(0, S)
    m0 = rows < n_valid
    m1 = rows + S < n_valid
    tok = t0 + rows
    rk = i_kb * BK + tl.arange(0, BK)
    m_k = rk < K
    hbase = (i_c * H + i_h) * K * V
    dQg0 = tl.zeros([S, BK], dtype=tl.float32)
    dQg1 = tl.zeros([S, BK], dtype=tl.float32)
    dKd0 = tl.zeros([S, BK], dtype=tl.float32)
    dKd1 = tl.zeros([S, BK], dtype=tl.float32)
    dKg0 = tl.zeros([S, BK], dtype=tl.float32)
    dKg1 = tl.zeros([S, BK], dtype=tl.float32)
    dGs = tl.zeros([BK], dtype=tl.float32)
    for vb in range(0, V, BV):
        cv = vb + tl.arange(0, BV)
        m_v = cv < V
        off0 = tok[:, None] * (H * V) + i_h * V + cv[None, :]
        off1 = off0 + S * H * V
        mv0 = m0[:, None] & m_v[None, :]
        mv1 = m1[:, None] & m_v[None, :]
        offs = hbase + rk[:, None] * V + cv[None, :]
        m_kv = m_k[:, None] & m_v[None, :]
        b_h = tl.load(h + offs, mask=m_kv, other=0.0)
        b_dh = tl.load(dh + offs, mask=m_kv, other=0.0)
        hT = tl.trans(_op(b_h, F32))
        dhT = tl.trans(_op(b_dh, F32))
        dQg0 += tl.dot(_op(tl.load(do + off0, mask=mv0, other=0.0), F32), hT)
        dQg1 += tl.dot(_op(tl.load(do + off1, mask=mv1, other=0.0), F32), hT)
        dKd0 += tl.dot(_op(tl.load(D + off0, mask=mv0, other=0.0), F32), dhT)
        dKd1 += tl.dot(_op(tl.load(D + off1, mask=mv1, other=0.0), F32), dhT)
        dKg0 -= tl.dot(_op(tl.load(dv + off0, mask=mv0, other=0.0), F32), hT)
        dKg1 -= tl.dot(_op(tl.load(dv + off1, mask=mv1, other=0.0), F32), hT)
        dGs += tl.sum(b_h.to(tl.float32) * b_dh.to(tl.float32), axis=1)
    off0 = tok[:, None] * (H * K) + i_h * K + rk[None, :]
    off1 = off0 + S * H * K
    msk0 = m0[:, None] & m_k[None, :]
    msk1 = m1[:, None] & m_k[None, :]
    Gr0, Gr1, Gb, g_last = _ref_rows(Gc, t0, n_valid, i_h, rk, m_k, H, K, S)
    G0, G1 = _load_G(Gc, off0, off1, msk0, msk1, g_last)
    k0 = tl.load(k + off0, mask=msk0, other=0.0).to(tl.float32)
    k1 = tl.load(k + off1, mask=msk1, other=0.0).to(tl.float32)
    # S' = Diag(exp(G_last)) S + (K⊙exp(G_last - G))^T Delta; the last row's Kd has no decay.
    ed0 = tl.exp(g_last[None, :] - G0)
    ed1 = tl.exp(g_last[None, :] - G1)
    dk0 = dKd0 * ed0
    dk1 = dKd1 * ed1
    last0 = (rows == n_valid - 1)[:, None]
    last1 = (rows + S == n_valid - 1)[:, None]
    x0 = tl.where(last0, 0.0, dk0 * k0)
    x1 = tl.where(last1, 0.0, dk1 * k1)
    dGl = dGs * tl.exp(g_last) + tl.sum(x0, axis=0) + tl.sum(x1, axis=0)
    dG0 = tl.where(last0, dGl[None, :], -x0)
    dG1 = tl.where(last1, dGl[None, :], -x1)
    # Vt's (K⊙exp(G)) S and O's scale (Q⊙exp(G)) S
    q0 = tl.load(q + off0, mask=msk0, other=0.0).to(tl.float32)
    q1 = tl.load(q + off1, mask=msk1, other=0.0).to(tl.float32)
    e0 = tl.exp(G0)
    e1 = tl.exp(G1)
    dk0 += dKg0 * e0
    dk1 += dKg1 * e1
    dq0 = dQg0 * e0 * scale
    dq1 = dQg1 * e1 * scale
    dG0 += dKg0 * e0 * k0 + dq0 * q0
    dG1 += dKg1 * e1 * k1 + dq1 * q1
    d_ii0 = tl.load(dii + tok * H + i_h, mask=m0, other=0.0)
    d_ii1 = tl.load(dii + (tok + S) * H + i_h, mask=m1, other=0.0)
    dq0 += d_ii0[:, None] * k0
    dq1 += d_ii1[:, None] * k1
    dk0 += d_ii0[:, None] * q0
    dk1 += d_ii1[:, None] * q1
    # dense pair terms of A and Aq: diagonal blocks rebased on the half's middle row, blocks 10 on b
    offc0 = tok[:, None] * (H * C) + i_h * C + rows[None, :]
    dA00, dA10, dA11 = _load_blocks(dA, offc0, m0, m1, H, C)
    dAq00, dAq10, dAq11 = _load_blocks(dAq, offc0, m0, m1, H, C)
    up0, dn0, up1, dn1, e1b, eb0 = _pair_operands(G0, G1, Gr0, Gr1, Gb)
    kdn0 = _op(k0 * dn0, F32)
    kdn1 = _op(k1 * dn1, F32)
    kb0 = _op(k0 * eb0, F32)
    dq_p0 = tl.dot(dAq00, kdn0) * up0
    dq_p1 = tl.dot(dAq11, kdn1) * up1 + tl.dot(dAq10, kb0) * e1b
    dk_r0 = tl.dot(dA00, kdn0) * up0
    dk_r1 = tl.dot(dA11, kdn1) * up1 + tl.dot(dA10, kb0) * e1b
    dk_c0 = ((tl.dot(tl.trans(dA00), _op(k0 * up0, F32)) + tl.dot(tl.trans(dAq00), _op(q0 * up0, F32))) * dn0
             + (tl.dot(tl.trans(dA10), _op(k1 * e1b, F32)) + tl.dot(tl.trans(dAq10), _op(q1 * e1b, F32))) * eb0)
    dk_c1 = (tl.dot(tl.trans(dA11), _op(k1 * up1, F32)) + tl.dot(tl.trans(dAq11), _op(q1 * up1, F32))) * dn1
    dq0 += dq_p0
    dq1 += dq_p1
    dk0 += dk_r0 + dk_c0
    dk1 += dk_r1 + dk_c1
    dG0 += q0 * dq_p0 + k0 * (dk_r0 - dk_c0)
    dG1 += q1 * dq_p1 + k1 * (dk_r1 - dk_c1)
    dg1 = tl.cumsum(dG1, axis=0, reverse=True)
    dg0 = tl.cumsum(dG0, axis=0, reverse=True) + tl.sum(dG1, axis=0)[None, :]
    tl.store(dq + off0, dq0.to(dq.dtype.element_ty), mask=msk0)
    tl.store(dq + off1, dq1.to(dq.dtype.element_ty), mask=msk1)
    tl.store(dk + off0, dk0.to(dk.dtype.element_ty), mask=msk0)
    tl.store(dk + off1, dk1.to(dk.dtype.element_ty), mask=msk1)
    tl.store(dg + off0, dg0.to(dg.dtype.element_ty), mask=msk0)
    tl.store(dg + off1, dg1.to(dg.dtype.element_ty), mask=msk1)


# ----------------------------------------------------------------------------------------------------------
# host launchers
# ----------------------------------------------------------------------------------------------------------


def chunk_meta(
    cu_seqlens: torch.Tensor | None, B: int, T: int, C: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """Packed-layout chunk metadata.

    Returns ``(cu [N + 1] int64, chunk_idx [NC, 2] int32, chunk_off [N + 1] int32, NC)``. For a dense batch
    (``cu_seqlens`` None) it is built without reading device memory; for a packed one it reads the lengths.
    """
    if cu_seqlens is None:
        n_per = triton.cdiv(T, C)
        cu = torch.arange(0, B + 1, device=device, dtype=torch.int64) * T
        seq = torch.arange(B, device=device, dtype=torch.int32).repeat_interleave(n_per)
        pos = torch.arange(n_per, device=device, dtype=torch.int32).repeat(B)
        off = torch.arange(0, B + 1, device=device, dtype=torch.int32) * n_per
        return cu, torch.stack([seq, pos], 1).contiguous(), off, B * n_per
    cu = cu_seqlens.to(device=device, dtype=torch.int64)
    n_chunks = (cu[1:] - cu[:-1] + C - 1) // C
    off = torch.cat([n_chunks.new_zeros(1), n_chunks.cumsum(0)]).to(torch.int32)
    nc = int(off[-1].item())
    seq = torch.repeat_interleave(torch.arange(len(n_chunks), device=device, dtype=torch.int32), n_chunks,
                                  output_size=nc)
    pos = torch.arange(nc, device=device, dtype=torch.int32) - off[:-1].long()[seq.long()].to(torch.int32)
    return cu, torch.stack([seq, pos], 1).contiguous(), off, nc


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


def launch_cfg(K: int, V: int) -> dict[str, dict[str, int]]:
    """Block sizes, warps and pipeline stages of every kernel: fixed functions of K and V, never of T (a new
    sequence length compiles nothing). The scans keep their state tile [BK, BV] in registers; BV = 32 gives
    more programs (they are latency-bound when B * H is small); at K = 256 fewer stages keep the pipelined
    operands within the 227 KB of shared memory."""
    BK, BV = _pow2(K), _pow2(V)
    return {
        "cumsum": dict(BK=min(64, BK), num_warps=4),
        "intra": dict(BK=min(32, BK), BV=min(64, BV), num_warps=4),
        "scan_fwd": dict(BK=BK, BV=min(BV, 32), num_warps=4 if BK <= 128 else 8, num_stages=3 if BK <= 128 else 2),
        "out": dict(BK=min(64, BK), BV=min(64, BV), num_warps=8),
        "scan_bwd": dict(BK=BK, BV=min(BV, 32), num_warps=4 if BK <= 128 else 8, num_stages=3 if BK <= 128 else 1),
        "dA": dict(BK=min(32, BK), BV=min(32, BV), num_warps=4),
        "dqkg": dict(BK=min(16, BK), BV=min(64, BV), num_warps=8),
    }


def chunk_fwd(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, scale: float,
    initial_state: torch.Tensor | None, output_final_state: bool, cu_seqlens: torch.Tensor | None, C: int,
) -> tuple[torch.Tensor, ...]:
    """Forward launches. Inputs ``[B, T, H, *]`` contiguous, C in {32, 64}.

    Returns ``(o, ht, Gc, Akk, Aq, Mi, W, Kd, Qg, h, D)``: o ``[B, T, H, V]``, ht ``[N, H, K, V]`` float32
    and the tensors the backward needs: Gc ``[B, T, H, K]`` float32, Akk ``[B, T, H, C]`` float32, Aq
    ``[B, T, H, C]`` (work dtype), Mi ``[B, T, H, C]`` float32, W, Kd, Qg ``[B, T, H, K]``, h
    ``[max_chunks, H, K, V]``, D ``[B, T, H, V]`` (work dtype: bfloat16, float32 for float32 inputs).
    """
    B, T, H, K = q.shape
    V = v.shape[-1]
    N = B if cu_seqlens is None else cu_seqlens.numel() - 1
    cu, cidx, coff, NC = chunk_meta(cu_seqlens, B, T, C, q.device)
    wdt = _work_dtype(q.dtype)
    F32 = _f32_operands(q.dtype)
    Gc = torch.empty(B, T, H, K, device=q.device, dtype=torch.float32)
    Akk = torch.empty(B, T, H, C, device=q.device, dtype=torch.float32)
    Aq = torch.empty(B, T, H, C, device=q.device, dtype=wdt)
    Mi = torch.empty(B, T, H, C, device=q.device, dtype=torch.float32)
    W = torch.empty(B, T, H, K, device=q.device, dtype=wdt)
    Kd = torch.empty(B, T, H, K, device=q.device, dtype=wdt)
    Qg = torch.empty(B, T, H, K, device=q.device, dtype=wdt)
    U = torch.empty(B, T, H, V, device=q.device, dtype=torch.float32)  # read once by the scan; keeps ht exact-er
    D = torch.empty(B, T, H, V, device=q.device, dtype=wdt)
    h = torch.empty(max_chunks(B * T, N, C), H, K, V, device=q.device, dtype=wdt)
    o = torch.empty_like(v)
    ht = torch.empty(N, H, K, V, device=q.device, dtype=torch.float32)
    if NC == 0:
        ht.copy_(initial_state if initial_state is not None else torch.zeros_like(ht))
        return o, ht, Gc, Akk, Aq, Mi, W, Kd, Qg, h, D
    cfg = launch_cfg(K, V)
    _cumsum_fwd[(NC, H)](g, Gc, cu, cidx, H=H, K=K, C=C, **cfg["cumsum"])
    _intra_fwd[(NC, H)](k, v, q, beta, Gc, Akk, Aq, Mi, W, U, Kd, Qg, cu, cidx, scale, H=H, K=K, V=V, C=C,
                        F32=F32, **cfg["intra"])
    _scan_fwd[(triton.cdiv(V, cfg["scan_fwd"]["BV"]), N * H)](
        Kd, Gc, W, U, D, h, initial_state, ht, cu, coff, H=H, K=K, V=V, C=C, HAS_H0=initial_state is not None,
        STORE_HT=output_final_state, F32=F32, **cfg["scan_fwd"])
    _out_fwd[(triton.cdiv(V, cfg["out"]["BV"]), NC, H)](Qg, Aq, D, h, o, cu, cidx, H=H, K=K, V=V, C=C, F32=F32,
                                                      **cfg["out"])
    return o, ht, Gc, Akk, Aq, Mi, W, Kd, Qg, h, D


def chunk_bwd(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, beta: torch.Tensor, Gc: torch.Tensor, Akk: torch.Tensor,
    Aq: torch.Tensor, Mi: torch.Tensor, W: torch.Tensor, Kd: torch.Tensor, Qg: torch.Tensor, h: torch.Tensor,
    D: torch.Tensor, do: torch.Tensor, dht: torch.Tensor | None, need_dh0: bool, scale: float,
    cu_seqlens: torch.Tensor | None, C: int,
) -> tuple[torch.Tensor, ...]:
    """Backward launches (the forward's saved tensors, see :func:`chunk_fwd`).

    Returns ``(dq, dk, dv, dg, dbeta, dh0)``: dq, dk, dv, dbeta in their input's dtype, dg ``[B, T, H, K]``
    and dh0 ``[N, H, K, V]`` float32.
    """
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
    cfg = launch_cfg(K, V)
    _scan_bwd[(triton.cdiv(V, cfg["scan_bwd"]["BV"]), N * H)](
        Qg, Kd, Gc, W, Aq, do, dD, dh, dht, dh0, cu, coff, H=H, K=K, V=V, C=C, HAS_DHT=dht is not None,
        STORE_DH0=need_dh0, F32=F32, **cfg["scan_bwd"])
    dA = torch.empty(B, T, H, C, device=q.device, dtype=wdt)  # Diag(beta) dL, blocks 00, 10, 11
    dAq = torch.empty(B, T, H, C, device=q.device, dtype=wdt)  # scale * dAq without its diagonal
    dii = torch.empty(B, T, H, device=q.device, dtype=torch.float32)  # scale * diag(dAq)
    _dA_bwd[(NC, H)](k, v, beta, Gc, Akk, Mi, h, D, dD, do, dv, dbeta, dA, dAq, dii, cu, cidx, scale, H=H, K=K,
                     V=V, C=C, F32=F32, **cfg["dA"])
    _dqkg_bwd[(triton.cdiv(K, cfg["dqkg"]["BK"]), NC, H)](
        q, k, Gc, h, dh, D, do, dv, dA, dAq, dii, dq, dk, dg, cu, cidx, scale, H=H, K=K, V=V, C=C, F32=F32,
        **cfg["dqkg"])
    return dq, dk, dv, dg, dbeta, dh0
