"""Triton kernels of the causal depthwise short convolution + SiLU of KDA layers, in ``[B, T, C]`` layout.

    pre[b, t, c] = Σ_j w[c, j] · x[b, t - (W-1) + j, c]      (x = 0 before t = 0)      y = silu(pre)

Backward, with ``p = dy · silu'(pre)`` and ``silu'(z) = σ(z) (1 + z (1 - σ(z)))``::

    dx[b, s, c] = Σ_j w[c, j] · p[b, s + (W-1) - j, c]      (p = 0 at t >= T)
    dw[c, j]    = Σ_{b, t} p[b, t, c] · x[b, t - (W-1) + j, c]

The forward keeps nothing but its inputs. The backward is one kernel on a persistent grid: each program owns a
block of channels and walks its share of the ``(sequence, time tile)`` pairs; for a tile of ``BT`` steps it forms
``p`` (recomputing ``pre``) at the tile's steps and at the ``W - 1`` steps after it, keeps them in a small float32
scratch of its own (reused from tile to tile, so it stays in the L2 cache instead of making a round trip through
memory), reads them back at the ``W`` shifts ``dx`` needs, and adds the tile's ``dw`` terms to per-program
float32 sums. The halo costs ``(W - 1) / BT`` more ``pre`` evaluations; recomputing ``pre`` at every shift
instead would cost ``W²`` tile loads and ``W`` sigmoids per element, bound by instructions rather than bytes.
All sums in float32; ``dx``'s in the order of the one-pass form, so the scratch changes no bit. The
``[programs, C, W]`` partials of ``dw`` are summed in torch (deterministic, no atomics). The layout needs no
transposes: the projections produce ``[B, T, C]`` and the KDA op consumes it.

With ``parts = 3`` (KDA's fused q, k, v) ``y`` comes as three contiguous ``[B, T, C / 3]`` tensors, channel
groups ``[0, C/3)``, ``[C/3, 2C/3)``, ``[2C/3, C)``, and ``dy`` is read from three such tensors: the KDA op takes
q, k and v contiguous and returns their gradients apart, so neither the forward's split nor the backward's join
copies them. A tile takes its part's base pointer once when C / 3 is a multiple of its width (KDA's head widths);
otherwise each channel's base pointer is picked from the three, so a tile may straddle two groups.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from k3lit.kernels import gpu

TUNING: dict[str, tuple[int, int, int]] = {"fwd": (64, 64, 4), "bwd": (64, 32, 4)}
"""Per kernel: (time steps, channels) per tile and warps. The forward's 64 x 64 float32 tiles hold 32 values a
thread at 4 warps; 64 x 128 spilled. The backward's ``dw`` sums keep ``W`` tiles of x in flight: compiled for sm_90a
by triton 3.6 it takes 152 registers a thread at 64 x 32 (3 programs an SM; benchmarks/RESULTS.md, "Kernel
resources"), and at 64 x 64 all 255 with spills (triton 3.8, the same script with ``TUNING["bwd"] = (64, 64,
4)``). ``benchmarks/short_conv.py --sweep`` times others."""
BWD_PROGRAMS_PER_SM = 3
"""Programs of the backward's persistent grid per streaming multiprocessor (all channel blocks together): as many as
its registers let an SM hold at once."""


@triton.jit
def _pre(x_ptr, w_ptr, b, t, c, T, C, W: tl.constexpr):
    """``pre`` at times ``t [BT]`` and channels ``c [BC]`` of sequence ``b``, float32 (0 where t >= T)."""
    acc = tl.zeros((t.shape[0], c.shape[0]), dtype=tl.float32)
    cmask = c < C
    for j in tl.static_range(W):
        src = t - (W - 1) + j
        m = ((src >= 0) & (src < T))[:, None] & cmask[None, :]
        xv = tl.load(x_ptr + (b * T + src)[:, None] * C + c[None, :], mask=m, other=0.0).to(tl.float32)
        wj = tl.load(w_ptr + c * W + j, mask=cmask, other=0.0).to(tl.float32)
        acc += xv * wj[None, :]
    return tl.where((t < T)[:, None], acc, 0.0)


@triton.jit
def _part_ptrs(ptr0, ptr1, ptr2, b, t, c, c0, T, C, PARTS: tl.constexpr, STRADDLE: tl.constexpr):
    """Pointers ``[BT, BC]`` to ``(b, t, c)`` in ``[B, T, C]`` at ``ptr0`` (``PARTS = 1``), or in the part
    ``[B, T, C / 3]`` that holds channel c (``PARTS = 3``). A tile whose channels all lie in one part (``STRADDLE``
    false: C / 3 a multiple of the tile's width) picks that part's base pointer once, from its first channel ``c0``;
    one that may straddle two parts picks a base per channel (more registers: 64-bit pointers per column)."""
    if PARTS == 1:
        return ptr0 + (b * T + t)[:, None] * C + c[None, :]
    cp = C // 3
    if STRADDLE:
        part = c // cp
        base = tl.where(part == 0, ptr0, tl.where(part == 1, ptr1, ptr2))
        return base[None, :] + ((b * T + t)[:, None] * cp + (c - part * cp)[None, :])
    part = c0 // cp
    base = tl.where(part == 0, ptr0, tl.where(part == 1, ptr1, ptr2))
    return base + ((b * T + t)[:, None] * cp + (c - part * cp)[None, :])


@triton.jit
def _fwd(x_ptr, w_ptr, y_ptr, y1_ptr, y2_ptr, T, C, W: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr,
         BIG: tl.constexpr, PARTS: tl.constexpr, STRADDLE: tl.constexpr):
    pt, pc, b = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    if BIG:  # B T C >= 2^31: element offsets (b T + t) C in int64 (costs registers, so only then)
        b = b.to(tl.int64)
    t = pt * BT + tl.arange(0, BT)
    c = pc * BC + tl.arange(0, BC)
    pre = _pre(x_ptr, w_ptr, b, t, c, T, C, W)
    y = (pre * tl.sigmoid(pre)).to(y_ptr.dtype.element_ty)
    m = (t < T)[:, None] & (c < C)[None, :]
    tl.store(_part_ptrs(y_ptr, y1_ptr, y2_ptr, b, t, c, pc * BC, T, C, PARTS, STRADDLE), y, mask=m)


@triton.jit
def _p_rows(x_ptr, w_ptr, dy_ptr, dy1_ptr, dy2_ptr, b, t, c, c0, T, C, W: tl.constexpr, PARTS: tl.constexpr,
            STRADDLE: tl.constexpr):
    """``p = dy · silu'(pre)`` (float32) at times ``t`` and channels ``c`` of sequence ``b``; 0 where t >= T."""
    m = (t < T)[:, None] & (c < C)[None, :]
    # dy first: its pointers are dead before pre's are formed (fewer live registers)
    dy = tl.load(_part_ptrs(dy_ptr, dy1_ptr, dy2_ptr, b, t, c, c0, T, C, PARTS, STRADDLE), mask=m,
                 other=0.0).to(tl.float32)
    pre = _pre(x_ptr, w_ptr, b, t, c, T, C, W)
    sig = tl.sigmoid(pre)
    return dy * sig * (1.0 + pre * (1.0 - sig))


@triton.jit
def _conv_bwd(x_ptr, w_ptr, dy_ptr, dy1_ptr, dy2_ptr, dx_ptr, dw_part_ptr, scratch_ptr, B, T, C, W: tl.constexpr,
              WP: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr, BH: tl.constexpr, BIG: tl.constexpr,
              PARTS: tl.constexpr, STRADDLE: tl.constexpr):
    """Program ``(pc, pp)``: channels ``[pc BC, (pc + 1) BC)``, the ``(b, time tile)`` pairs ``pp, pp + P, ...``
    (``P`` programs per channel block). Per tile: ``p`` at its ``BT`` steps and the ``BH >= W - 1`` after it into
    the program's scratch ``[BT + BH, BC]``, then ``dx[s] = Σ_j w[j] · p[s + (W-1) - j]`` read back from it, and
    ``Σ_s p[s] x[s - (W-1) + j]`` added to the program's ``dw`` sums, written once as its ``[C, W]`` partial."""
    pc, pp, n_pp = tl.program_id(0), tl.program_id(1), tl.num_programs(1)
    c = pc * BC + tl.arange(0, BC)
    cmask = c < C
    rows, halo, taps = tl.arange(0, BT), tl.arange(0, BH), tl.arange(0, WP)
    scratch = scratch_ptr + (pc * n_pp + pp).to(tl.int64) * ((BT + BH) * BC)
    cols = tl.arange(0, BC)[None, :]
    dw = tl.zeros((BC, WP), dtype=tl.float32)
    n_t = tl.cdiv(T, BT)
    for i in range(pp, B * n_t, n_pp):
        b = i // n_t
        if BIG:  # B T C >= 2^31: element offsets (b T + t) C in int64 (costs registers, so only then)
            b = b.to(tl.int64)
        t0 = (i % n_t) * BT
        s = t0 + rows
        # p at the tile's steps and at the halo after it into the scratch, each stored as soon as it is formed
        p = _p_rows(x_ptr, w_ptr, dy_ptr, dy1_ptr, dy2_ptr, b, s, c, pc * BC, T, C, W, PARTS, STRADDLE)
        tl.store(scratch + rows[:, None] * BC + cols, p)
        p = _p_rows(x_ptr, w_ptr, dy_ptr, dy1_ptr, dy2_ptr, b, t0 + BT + halo, c, pc * BC, T, C, W, PARTS,
                    STRADDLE)
        tl.store(scratch + (BT + halo)[:, None] * BC + cols, p)
        tl.debug_barrier()  # every thread's p is in the scratch before any thread reads another's
        dx = tl.zeros((BT, BC), dtype=tl.float32)
        for j in tl.static_range(W):
            wj = tl.load(w_ptr + c * W + j, mask=cmask, other=0.0).to(tl.float32)
            dx += wj[None, :] * tl.load(scratch + (rows + (W - 1) - j)[:, None] * BC + cols)
        m = (s < T)[:, None] & cmask[None, :]
        tl.store(dx_ptr + (b * T + s)[:, None] * C + c[None, :], dx.to(dx_ptr.dtype.element_ty), mask=m)
        p = tl.load(scratch + rows[:, None] * BC + cols)
        for j in tl.static_range(W):
            src = s - (W - 1) + j
            mj = ((src >= 0) & (src < T))[:, None] & cmask[None, :]
            xv = tl.load(x_ptr + (b * T + src)[:, None] * C + c[None, :], mask=mj, other=0.0).to(tl.float32)
            dw += tl.where(taps[None, :] == j, tl.sum(p * xv, axis=0)[:, None], 0.0)
        tl.debug_barrier()  # every read of this tile's scratch is done before the next tile overwrites it
    tl.store(dw_part_ptr + (pp * C + c[:, None]) * W + taps[None, :], dw, mask=cmask[:, None] & (taps < W)[None, :])


def _straddle(C: int, parts: int, bc: int) -> bool:
    """Whether a tile of ``bc`` channels may hold channels of two parts (``C / 3`` not a multiple of ``bc``)."""
    return parts == 3 and (C // 3) % bc != 0


def conv_fwd(x: torch.Tensor, w: torch.Tensor, parts: int = 1) -> list[torch.Tensor]:
    """``x [B, T, C]`` contiguous, ``w [C, W]`` -> ``y = silu(causal_conv(x, w))`` in x's dtype: ``[y]``
    (``[B, T, C]``) for ``parts = 1``, its three channel groups ``[B, T, C / 3]`` (each contiguous) for 3."""
    B, T, C = x.shape
    if C % parts:
        raise ValueError(f"conv_fwd: {C} channels do not split into {parts} parts")
    ys = [torch.empty_like(x)] if parts == 1 else [x.new_empty(B, T, C // 3) for _ in range(3)]
    bt, bc, warps = TUNING["fwd"]
    grid = (triton.cdiv(T, bt), triton.cdiv(C, bc), B)
    _fwd[grid](x, w, *(ys * 3)[:3], T, C, W=w.shape[1], BT=bt, BC=bc, BIG=x.numel() >= 2**31, PARTS=parts,
               STRADDLE=_straddle(C, parts, bc), num_warps=warps)
    return ys


def bwd_programs(device: torch.device, channel_blocks: int, tiles: int) -> int:
    """Programs per channel block of :func:`conv_bwd`'s persistent grid: ``BWD_PROGRAMS_PER_SM`` per streaming
    multiprocessor over all channel blocks, at most one per ``(sequence, time tile)`` pair; 3 off CUDA, so that the
    interpreter's programs walk their tiles unevenly."""
    per_block = 3 if device.type != "cuda" else -(-gpu.sm_count(device) * BWD_PROGRAMS_PER_SM // channel_blocks)
    return max(1, min(per_block, tiles))


def conv_bwd(x: torch.Tensor, w: torch.Tensor, dys: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Gradients ``(dx [B, T, C] in x's dtype, dw [C, W] in w's dtype)`` of :func:`conv_fwd` from the gradients
    ``dys`` of its outputs (one ``[B, T, C]``, or three contiguous ``[B, T, C / 3]``)."""
    B, T, C = x.shape
    if C % len(dys):
        raise ValueError(f"conv_bwd: {C} channels do not split into {len(dys)} parts")
    W = w.shape[1]
    bt, bc, warps = TUNING["bwd"]
    bh = triton.next_power_of_2(max(W - 1, 1))
    n_c = triton.cdiv(C, bc)
    n_pp = bwd_programs(x.device, n_c, B * triton.cdiv(T, bt))
    scratch = torch.empty(n_c * n_pp * (bt + bh) * bc, device=x.device, dtype=torch.float32)
    dw_part = torch.empty(n_pp, C, W, device=x.device, dtype=torch.float32)
    dx = torch.empty_like(x)
    _conv_bwd[(n_c, n_pp)](x, w, *(dys * 3)[:3], dx, dw_part, scratch, B, T, C, W=W, WP=triton.next_power_of_2(W),
                           BT=bt, BC=bc, BH=bh, BIG=x.numel() >= 2**31, PARTS=len(dys),
                           STRADDLE=_straddle(C, len(dys), bc), num_warps=warps)
    return dx, dw_part.sum(0).to(w.dtype)
