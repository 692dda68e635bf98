"""Triton kernels of the causal depthwise short convolution + SiLU of KDA layers, in ``[B, T, C]`` layout.

    pre[b, t, c] = Σ_j w[c, j] · x[b, t - (W-1) + j, c]      (x = 0 before t = 0)      y = silu(pre)

Backward, with ``p = dy · silu'(pre)`` and ``silu'(z) = σ(z) (1 + z (1 - σ(z)))``::

    dx[b, s, c] = Σ_j w[c, j] · p[b, s + (W-1) - j, c]      (p = 0 at t >= T)
    dw[c, j]    = Σ_{b, t} p[b, t, c] · x[b, t - (W-1) + j, c]

The forward keeps nothing but its inputs. The backward runs in two passes: the first recomputes ``pre`` once per
position, writes ``p`` (float32) and reduces ``dw`` per program in registers; the second forms ``dx`` from ``W``
shifted reads of ``p``. Recomputing ``pre`` at the ``W`` shifts ``dx`` needs inside one pass would cost ``W²``
tile loads and ``W`` sigmoids per element: the backward would be bound by instructions, not bytes. All sums in
float32; ``p`` goes through memory as float32, so its round trip changes no bit. The
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

TUNING: dict[str, tuple[int, int, int]] = {"fwd": (64, 64, 4), "bwd_p": (64, 64, 4), "bwd_dx": (64, 64, 4)}
"""Per kernel: (time steps, channels) per program and warps. 64 x 64 float32 tiles hold 32 values a thread at 4
warps; 64 x 128 spilled (``benchmarks/kernel_resources.py``). ``benchmarks/short_conv.py --sweep`` times others."""


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
def _bwd_p(x_ptr, w_ptr, dy_ptr, dy1_ptr, dy2_ptr, p_ptr, dw_part_ptr, T, C, W: tl.constexpr, BT: tl.constexpr,
           BC: tl.constexpr, BIG: tl.constexpr, PARTS: tl.constexpr, STRADDLE: tl.constexpr):
    """``p = dy · silu'(pre)`` (float32, stored) and this program's ``dw`` partial ``Σ_s p[s] x[s - (W-1) + j]``."""
    pt, pc, b = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    if BIG:  # B T C >= 2^31: element offsets (b T + t) C in int64 (costs registers, so only then)
        b = b.to(tl.int64)
    s = pt * BT + tl.arange(0, BT)
    c = pc * BC + tl.arange(0, BC)
    cmask = c < C
    m = (s < T)[:, None] & cmask[None, :]
    # dy first: its pointers are dead before pre's are formed (sm_90a, triton 3.6: 160 registers a thread at 64 x 64
    # tiles, 3 blocks an SM, against 188 and 2 with pre first; benchmarks/kernel_resources.py)
    dy = tl.load(_part_ptrs(dy_ptr, dy1_ptr, dy2_ptr, b, s, c, pc * BC, T, C, PARTS, STRADDLE), mask=m,
                 other=0.0).to(tl.float32)
    pre = _pre(x_ptr, w_ptr, b, s, c, T, C, W)
    sig = tl.sigmoid(pre)
    p = dy * sig * (1.0 + pre * (1.0 - sig))
    tl.store(p_ptr + (b * T + s)[:, None] * C + c[None, :], p, mask=m)
    row = (b * tl.num_programs(0) + pt) * C
    for j in tl.static_range(W):
        src = s - (W - 1) + j
        mj = ((src >= 0) & (src < T))[:, None] & cmask[None, :]
        xv = tl.load(x_ptr + (b * T + src)[:, None] * C + c[None, :], mask=mj, other=0.0).to(tl.float32)
        tl.store(dw_part_ptr + (row + c) * W + j, tl.sum(p * xv, axis=0), mask=cmask)


@triton.jit
def _bwd_dx(p_ptr, w_ptr, dx_ptr, T, C, W: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr, BIG: tl.constexpr):
    """``dx[s] = Σ_j w[j] · p[s + (W-1) - j]`` (p = 0 at t >= T)."""
    pt, pc, b = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    if BIG:
        b = b.to(tl.int64)
    s = pt * BT + tl.arange(0, BT)
    c = pc * BC + tl.arange(0, BC)
    cmask = c < C
    dx = tl.zeros((BT, BC), dtype=tl.float32)
    for j in tl.static_range(W):
        wj = tl.load(w_ptr + c * W + j, mask=cmask, other=0.0).to(tl.float32)
        src = s + (W - 1) - j
        mj = (src < T)[:, None] & cmask[None, :]
        dx += wj[None, :] * tl.load(p_ptr + (b * T + src)[:, None] * C + c[None, :], mask=mj, other=0.0)
    m = (s < T)[:, None] & cmask[None, :]
    tl.store(dx_ptr + (b * T + s)[:, None] * C + c[None, :], dx.to(dx_ptr.dtype.element_ty), mask=m)


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


def conv_bwd(x: torch.Tensor, w: torch.Tensor, dys: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Gradients ``(dx [B, T, C] in x's dtype, dw [C, W] in w's dtype)`` of :func:`conv_fwd` from the gradients
    ``dys`` of its outputs (one ``[B, T, C]``, or three contiguous ``[B, T, C / 3]``)."""
    B, T, C = x.shape
    if C % len(dys):
        raise ValueError(f"conv_bwd: {C} channels do not split into {len(dys)} parts")
    W = w.shape[1]
    big = x.numel() >= 2**31
    bt, bc, warps = TUNING["bwd_p"]
    nt = triton.cdiv(T, bt)
    p = torch.empty(B, T, C, device=x.device, dtype=torch.float32)
    dw_part = torch.empty(B * nt, C, W, device=x.device, dtype=torch.float32)
    _bwd_p[(nt, triton.cdiv(C, bc), B)](x, w, *(dys * 3)[:3], p, dw_part, T, C, W=W, BT=bt, BC=bc, BIG=big,
                                        PARTS=len(dys), STRADDLE=_straddle(C, len(dys), bc), num_warps=warps)
    dx = torch.empty_like(x)
    bt, bc, warps = TUNING["bwd_dx"]
    _bwd_dx[(triton.cdiv(T, bt), triton.cdiv(C, bc), B)](p, w, dx, T, C, W=W, BT=bt, BC=bc, BIG=big,
                                                        num_warps=warps)
    return dx, dw_part.sum(0).to(w.dtype)
