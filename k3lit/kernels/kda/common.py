"""The @triton.jit helpers that the chunked KDA forward (``chunk_fwd.py``) and backward (``chunk_bwd.py``) share.

Matrix products (:func:`_op`, :func:`_dot`, :func:`_dot_aq`, :func:`_tf32`): exponentials, cumulative sums, the
inverse and the states are float32; matrix-product operands bfloat16 (float32 for float32 inputs) with float32
accumulation, and the intra-chunk query-key scores Aq and their partners in TF32. Chunk programs
(:func:`_chunk_bounds`, :func:`_chunk_program`, :func:`_global_chunk`, :func:`_cc_offsets`): where a per-chunk
program's chunk lies in the packed layout (``index.py``). Scan programs (:func:`_scan_seq`, :func:`_scan_chunk`,
:func:`_state_start`, :func:`_g_last`, :func:`_g_last_of`): a sequential scan's sequence, chunks and state tile.
"""

from __future__ import annotations

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
    mantissa), would give float32 inputs bf16-like accuracy, and IEEE float32 (FMA, no tensor cores) spills
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
    zero, whose bias adds up in long sums (on the H200 it pushes the gate-bias gradient, a sum over every token,
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
    by the caller. TF32's mantissa is 8x finer than bfloat16's, and in bf16 these roundings would make most of the
    output's error (a float64 replay of the forward with each rounding switchable;
    docs/DECISIONS.md). Also the backward's pair terms (dAq, dA and the
    rebased K, Q, rounded by the caller; ``_main_bwd``). 3xTF32 for float32 inputs."""
    if F32:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="tf32x3")
    else:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="tf32")


@triton.jit
def _row(x, rows, i):
    """Row ``i`` of a ``[C, X]`` register tile as a ``[X]`` vector."""
    return tl.sum(tl.where((rows == i)[:, None], x, 0.0), axis=0)


@triton.jit
def _chunk_bounds(cu, cidx, i_c, C: tl.constexpr):
    """``(i_n, t0, n_valid)`` of row ``i_c`` of the chunk table ``cidx``: the chunk's sequence, first token (both
    int64) and valid rows."""
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
    are stored. ``i_c`` itself in the table ``index.chunk_meta`` builds; looked up in a pipeline segment's
    (``SEGMENT``), whose rows are in another order."""
    if SEGMENT:
        return tl.load(coff + i_n).to(tl.int64) + tl.load(cidx + 2 * i_c + 1).to(tl.int64)
    else:
        return i_c.to(tl.int64)


@triton.jit
def _cc_offsets(tok, i_h, rows, H: tl.constexpr, C: tl.constexpr):
    """Offsets of a chunk's ``[C, C]`` tile (Aq, L or M) in a ``[T_total, H, C]`` tensor."""
    return tok[:, None] * (H * C) + i_h * C + rows[None, :]


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
    loaded where it is used its wait dominates the scan's stalls (Nsight Compute; docs/DECISIONS.md, "KDA
    kernels"). Each trip starts by taking the exponential of the value loaded on the trip before, so that the
    machine code first reads the loaded register one trip after the load (as a reading of the sm_90a machine
    code showed; docs/DECISIONS.md): a copy of it into the next trip's register, which ptxas places mid-trip,
    would wait for the load."""
    t0 = bos + it * C
    return _g_last(Gc, t0, tl.minimum(eos - t0, C), i_h, rk, m_k & ok, H, K)
