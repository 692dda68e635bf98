"""Chunked KDA backward in Triton: the kernels and their host launcher :func:`chunk_bwd`.

A reverse scan per sequence and value block, ``_scan_bwd`` or, on the transposed state, ``_scan_bwd_t`` (as the
launch plan picks, ``plan.py``), carries the state gradient dS from the last chunk to the first and stores it per
chunk, with dDelta; then ``_main_bwd``, one program per chunk and head, forms every input gradient from the
forward's saved tensors (``chunk_fwd.ChunkFwdOut``) and those. The math: README.md, "Chunked form".
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from k3lit.kernels.kda.chunk_fwd import _bias
from k3lit.kernels.kda.common import (
    _cc_offsets,
    _chunk_bounds,
    _dot,
    _dot_aq,
    _g_last,
    _g_last_of,
    _global_chunk,
    _op,
    _row,
    _scan_chunk,
    _scan_seq,
    _state_start,
    _tf32,
)
from k3lit.kernels.kda.index import chunk_meta
from k3lit.kernels.kda.pipeline import _on, _on_inputs_device, _pipeline, _segment_plan
from k3lit.kernels.kda.plan import TUNING, _f32_operands, _pow2, _scan_plan, _work_dtype


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
    F32: tl.constexpr, GATE: tl.constexpr, L2: tl.constexpr, SEGMENT: tl.constexpr, KEEP: tl.constexpr,
):
    """Per (chunk, head): every input gradient of the chunk from h, dh, Delta, dDelta and dO. The chunk table
    ``cidx`` may be a pipeline segment's (``SEGMENT``); the chunk's states are then found by its sequence and
    position.

    Value side: dAq = dO Delta^T, dv = Diag(beta) M^T dDelta, dM = dDelta (Diag(beta) V)^T. Key side in
    K blocks, two passes. Pass 1: dQg = dO S^T, dKd = Delta dS^T, dW = -dDelta S^T, dM += dW X^T with
    X = Diag(beta) K⊙exp(G); dQg, dKd and M^T dW are kept in the float32 scratch ``s_dqg``, ``s_dkd``, ``s_dw``
    (each ``[T, H, K]``), so that M is not needed in pass 2, or, with ``KEEP`` (one key block, K <= BK), in
    registers, the same values without the round trip through memory. Then dL = -M^T dM M^T and dA = Diag(beta) dL.
    Pass 2: dq, dk and the dense pair terms of A and Aq (same rebasing as the forward), dG and dg = reverse
    cumsum of dG (per channel, so per block); A itself (for dbeta's dL term) from the forward's bf16 operands.
    The pair terms' products take TF32 operands (dA, dAq and the rebased K, Q rounded by :func:`_tf32`), as the
    forward's Aq does: dG subtracts the column terms from the row terms, and bf16 roundings of their operands would
    make most of dg's error (``benchmarks/kda_accuracy.py``; benchmarks/RESULTS.md, "KDA kernels: against the
    targets").

    With ``GATE`` the stored gradient is that of the pre-activation e: dg * g_min * sigmoid(x) sigmoid(-x),
    x = e + bias (= s (1 - s), relative accuracy kept where s rounds to 1). With ``L2`` pass 2 works on the
    normalised q̂, k̂ (reciprocal norms ``rnq``, ``rnk``), keeps dq̂, dk̂ in ``s_dq``, ``s_dk`` (``KEEP``: in
    registers) and the row sums q̂·dq̂, k̂·dk̂; pass 3 applies the norm's backward dx = r (dx̂ - x̂ (x̂·dx̂)) (no
    projection where the norm was clamped at 1e-12, as F.normalize).
    """
    i_c, i_h = tl.program_id(0), tl.program_id(1)
    i_n, t0, n_valid = _chunk_bounds(cu, cidx, i_c, C)
    i_g = _global_chunk(coff, cidx, i_c, i_n, SEGMENT)
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
    else:  # not read
        r_q, r_k = b_beta, b_beta
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
    if KEEP:  # one key block: pass 1's results stay in registers for pass 2
        dQg, dKd, dMW, dGs, dM, db = _key_pass1(0, dM, db, tok, m_t, i_h, hbase, b_beta, b_mt, r_k, k, Gc, h, dh, D,
                                                dD, do, s_dqg, s_dkd, s_dw, dgs, H, K, V, BK, BV, F32, L2, False)
    else:
        for kb in range(0, K, BK):
            dQg, dKd, dMW, dGs, dM, db = _key_pass1(kb, dM, db, tok, m_t, i_h, hbase, b_beta, b_mt, r_k, k, Gc, h,
                                                    dh, D, dD, do, s_dqg, s_dkd, s_dw, dgs + (i_g * H + i_h) * K, H,
                                                    K, V, BK, BV, F32, L2, True)
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
    if KEEP:
        b_dq, b_dk, A, dot_q, dot_k = _key_pass2(
            0, A, dot_q, dot_k, dQg, dKd, dMW, dGs, t0, n_valid, tok, m_t, rows, i_h, b_beta, r_q, r_k, dA, dAq,
            d_ii, scale, q, k, Gc, e, bias, g_min, dq, dk, dg, s_dq, s_dk, H, K, C, BK, F32, GATE, L2, False)
    else:
        for kb in range(0, K, BK):
            rk = kb + tl.arange(0, BK)
            offk = tok[:, None] * (H * K) + i_h * K + rk[None, :]
            mk = m_t[:, None] & (rk < K)[None, :]
            b_dq, b_dk, A, dot_q, dot_k = _key_pass2(
                kb, A, dot_q, dot_k, tl.load(s_dqg + offk, mask=mk, other=0.0),
                tl.load(s_dkd + offk, mask=mk, other=0.0), tl.load(s_dw + offk, mask=mk, other=0.0),
                tl.load(dgs + (i_g * H + i_h) * K + rk, mask=rk < K, other=0.0), t0, n_valid, tok, m_t, rows,
                i_h, b_beta, r_q, r_k, dA, dAq, d_ii, scale, q, k, Gc, e, bias, g_min, dq, dk, dg, s_dq, s_dk, H, K,
                C, BK, F32, GATE, L2, True)
    db += tl.sum(dL * tl.where(m_lo, A, 0.0), axis=1)
    tl.store(dbeta + tok * H + i_h, db.to(dbeta.dtype.element_ty), mask=m_t)
    if L2:
        dot_q = tl.where(r_q < 1e12, dot_q, 0.0)  # clamped norm: y = x / 1e-12, no projection
        dot_k = tl.where(r_k < 1e12, dot_k, 0.0)
        if KEEP:
            _l2_norm_bwd(0, b_dq, b_dk, tok, m_t, i_h, r_q, r_k, dot_q, dot_k, q, k, dq, dk, H, K, BK)
        else:
            tl.debug_barrier()  # pass 3 reads the dq̂, dk̂ this program wrote
            for kb in range(0, K, BK):
                rk = kb + tl.arange(0, BK)
                offk = tok[:, None] * (H * K) + i_h * K + rk[None, :]
                mk = m_t[:, None] & (rk < K)[None, :]
                _l2_norm_bwd(kb, tl.load(s_dq + offk, mask=mk, other=0.0), tl.load(s_dk + offk, mask=mk, other=0.0),
                             tok, m_t, i_h, r_q, r_k, dot_q, dot_k, q, k, dq, dk, H, K, BK)


@triton.jit
def _key_pass1(kb, dM, db, tok, m_t, i_h, hbase, b_beta, b_mt, r_k, k, Gc, h, dh, D, dD, do, s_dqg, s_dkd, s_dw, s_dgs,
               H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
               F32: tl.constexpr, L2: tl.constexpr, STORE: tl.constexpr):
    """:func:`_main_bwd`'s pass 1 over the key block from ``kb``: ``(dQg, dKd, M^T dW [C, BK], dGs [BK], dM [C, C]
    and db [C] with the block's terms added)``, float32; with ``STORE`` also written to the scratch (``s_dgs``:
    this chunk and head's row of dGs), each as soon as it is formed."""
    C: tl.constexpr = tok.shape[0]
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
    if STORE:
        tl.store(s_dqg + offk, dQg, mask=mk)
        tl.store(s_dkd + offk, dKd, mask=mk)
        tl.store(s_dgs + rk, dGs, mask=m_k)
    b_k = tl.load(k + offk, mask=mk, other=0.0).to(tl.float32)
    if L2:
        b_k *= r_k[:, None]
    b_G = tl.load(Gc + offk, mask=mk, other=0.0)
    b_kg = b_k * tl.exp(b_G)
    dM += _dot(dW, tl.trans(b_kg * b_beta[:, None]), F32)
    dMW = _dot(b_mt, dW, F32)  # M^T dW: pass 2 takes it (exact float32) instead of M and dW
    if STORE:
        tl.store(s_dw + offk, dMW, mask=mk)
    db += tl.sum(dMW * b_kg, axis=1)
    return dQg, dKd, dMW, dGs, dM, db


@triton.jit
def _key_pass2(kb, A, dot_q, dot_k, dQg, dKd, dMW, dGs, t0, n_valid, tok, m_t, rows, i_h, b_beta, r_q, r_k, dA, dAq,
               d_ii, scale, q, k, Gc, e, bias, g_min, dq, dk, dg, s_dq, s_dk, H: tl.constexpr, K: tl.constexpr,
               C: tl.constexpr, BK: tl.constexpr, F32: tl.constexpr, GATE: tl.constexpr, L2: tl.constexpr,
               STORE: tl.constexpr):
    """:func:`_main_bwd`'s pass 2 over the key block from ``kb``, from pass 1's results for it: stores dg (and, without
    ``L2``, dq and dk; with ``L2`` and ``STORE``, dq̂ and dk̂ to the scratch); returns ``(dq, dk [C, BK] before the L2
    norm's backward, the forward's A [C, C] and the row sums q̂·dq̂, k̂·dk̂ [C] with the block's terms added (the sums
    only with L2))``."""
    R: tl.constexpr = (C - 1) // 2
    rk = kb + tl.arange(0, BK)
    m_k = rk < K
    offk = tok[:, None] * (H * K) + i_h * K + rk[None, :]
    mk = m_t[:, None] & m_k[None, :]
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
        if STORE:
            tl.store(s_dq + offk, b_dq, mask=mk)
            tl.store(s_dk + offk, b_dk, mask=mk)
        dot_q += tl.sum(b_dq * b_q, axis=1)
        dot_k += tl.sum(b_dk * b_k, axis=1)
    else:
        tl.store(dq + offk, b_dq.to(dq.dtype.element_ty), mask=mk)
        tl.store(dk + offk, b_dk.to(dk.dtype.element_ty), mask=mk)
    return b_dq, b_dk, A, dot_q, dot_k


@triton.jit
def _l2_norm_bwd(kb, b_dq, b_dk, tok, m_t, i_h, r_q, r_k, dot_q, dot_k, q, k, dq, dk, H: tl.constexpr,
                 K: tl.constexpr, BK: tl.constexpr):
    """:func:`_main_bwd`'s pass 3 over the key block from ``kb``: the L2 norm's backward ``dx = r (dx̂ - x̂ (x̂·dx̂))``
    from dq̂, dk̂ ``[C, BK]`` float32, stored as dq and dk."""
    rk = kb + tl.arange(0, BK)
    offk = tok[:, None] * (H * K) + i_h * K + rk[None, :]
    mk = m_t[:, None] & (rk < K)[None, :]
    b_q = tl.load(q + offk, mask=mk, other=0.0).to(tl.float32) * r_q[:, None]
    b_k = tl.load(k + offk, mask=mk, other=0.0).to(tl.float32) * r_k[:, None]
    tl.store(dq + offk, ((b_dq - b_q * dot_q[:, None]) * r_q[:, None]).to(dq.dtype.element_ty), mask=mk)
    tl.store(dk + offk, ((b_dk - b_k * dot_k[:, None]) * r_k[:, None]).to(dk.dtype.element_ty), mask=mk)


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
    BKm = min(64, _pow2(K))
    keep = TUNING["main_bwd_keep"] == "registers" and K <= BKm
    # float32 scratch: dQg, dKd, dW between passes 1 and 2; with the fused L2 norm also dq̂, dk̂ (passes 2 -> 3);
    # none where one key block keeps them in registers (never read: dg stands in for their pointers)
    scr = [dg] * 5 if keep else torch.empty(5 if qk_l2norm else 3, B, T, H, K, device=q.device, dtype=torch.float32)
    s_dq, s_dk = (scr[3], scr[4]) if qk_l2norm else (None, None)
    dgs = dg if keep else torch.empty(h.shape[0] * H * K, device=q.device, dtype=torch.float32)
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
                                    g_min if gate else 0.0, rnq, rnk, H=H, K=K, V=V, C=C, BK=BKm, BV=BVb, F32=F32,
                                    GATE=gate, L2=qk_l2norm, SEGMENT=len(segs) > 1, KEEP=keep,
                                    num_warps=TUNING["main_bwd_warps"])
    return dq, dk, dv, dg, dbeta, dh0
