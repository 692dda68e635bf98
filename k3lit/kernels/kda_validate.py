"""Shape, dtype and numeric-range checks shared by every KDA backend: the Triton kernels (``k3lit.kernels.kda``)
and the PyTorch forms (``k3lit.ops.kda``), which import them from here. Imports no Triton, so the PyTorch forms
work where Triton is not installed."""

from __future__ import annotations

import math

import torch

#: The largest rebased exponent |G_i - G_r| allowed (``max_exponent``). exp(x) is finite in float32 and bfloat16
#: for x below about 88.72, and exp(-x) a normal float32 (>= 2^-126) for x below about 87.34: at 87 no rebased
#: factor overflows or is subnormal, so the Triton kernels may take these exponentials with subnormals flushed
#: (``ex2.approx.ftz``, one instruction instead of four) and still give the bits of the unflushed form.
EXP_LIMIT = 87.0


def check_inputs(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor | None,
    cu_seqlens: torch.Tensor | None,
) -> None:
    """Raise ``ValueError`` with the expected layout when the KDA inputs do not fit together."""
    if q.dim() != 4:
        raise ValueError(f"q must be [B, T, H, K], got shape {tuple(q.shape)}")
    B, T, H, K = q.shape
    if k.shape != q.shape or g.shape != q.shape:
        raise ValueError(
            f"q, k and g must share the shape [B, T, H, K]; got q {tuple(q.shape)}, k {tuple(k.shape)}, "
            f"g {tuple(g.shape)}"
        )
    if v.dim() != 4 or v.shape[:3] != q.shape[:3]:
        raise ValueError(f"v must be [B, T, H, V] = [{B}, {T}, {H}, V], got {tuple(v.shape)}")
    if beta.shape != q.shape[:3]:
        raise ValueError(f"beta must be [B, T, H] = [{B}, {T}, {H}], got {tuple(beta.shape)}")
    n_seq = B
    if cu_seqlens is not None:
        if B != 1:
            raise ValueError(f"with cu_seqlens the batch must be packed into B = 1, got B = {B}")
        if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
            raise ValueError("cu_seqlens must be a 1-D tensor [N + 1] of cumulative lengths starting at 0")
        if cu_seqlens.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"cu_seqlens must be int32 or int64, got {cu_seqlens.dtype}")
        if not torch.compiler.is_compiling():  # the values: read on the host, which a compiled graph must not do
            cs = cu_seqlens.tolist()
            if cs[0] != 0 or cs[-1] != T or any(b < a for a, b in zip(cs, cs[1:])):
                raise ValueError(f"cu_seqlens must rise from 0 to T = {T}, got {cs}")
        n_seq = cu_seqlens.numel() - 1
    if initial_state is not None and initial_state.shape != (n_seq, H, K, v.shape[-1]):
        raise ValueError(
            f"initial_state must be [N, H, K, V] = [{n_seq}, {H}, {K}, {v.shape[-1]}], "
            f"got {tuple(initial_state.shape)}"
        )


def check_gate_bias(gate_bias: torch.Tensor | None, use_gate_in_kernel: bool, H: int, K: int) -> None:
    """Raise ``ValueError`` for a gate bias that the fused gate cannot use: given without ``use_gate_in_kernel``
    (it would be silently ignored), or not ``H * K`` values."""
    if gate_bias is None:
        return
    if not use_gate_in_kernel:
        raise ValueError("gate_bias is only used by the fused gate: pass use_gate_in_kernel=True (g is then the "
                         "gate pre-activation) or add the bias yourself before bounded_log_decay")
    if not gate_bias.is_floating_point():
        raise ValueError(f"gate_bias must be a floating-point tensor, got {gate_bias.dtype}")
    if gate_bias.numel() != H * K or gate_bias.shape not in ((H * K,), (H, K)):
        raise ValueError(f"gate_bias must be [H * K] = [{H * K}] or [H, K] = [{H}, {K}], got "
                         f"{tuple(gate_bias.shape)}")


def split_varlen(cu_seqlens: torch.Tensor) -> list[tuple[int, int]]:
    """``[N + 1]`` cumulative lengths -> list of ``(start, end)`` token ranges."""
    cs = cu_seqlens.tolist()
    return list(zip(cs[:-1], cs[1:]))


def rebase_row(chunk_size: int) -> int:
    """Row of a chunk that the cumulative log-decay is rebased on (the middle one)."""
    return (chunk_size - 1) // 2


def max_exponent(g_min: float, chunk_size: int) -> float:
    """Largest ``|G_i - G_r|`` inside a chunk rebased on its middle row r, for log-decay in ``[g_min, 0]``.

    Row r = (C - 1) // 2 is at most ``ceil((C - 1) / 2)`` steps from either end of the chunk, and each
    step changes G by at most ``|g_min|``.
    """
    return abs(g_min) * math.ceil((chunk_size - 1) / 2)


def check_gate_bound(g_min: float, chunk_size: int) -> None:
    """Raise ``ValueError`` when ``exp(±G)`` could overflow float32/bfloat16 for this bound and chunk.

    The dense intra-chunk path forms ``Q ⊙ exp(G - G_r)`` and ``K ⊙ exp(G_r - G)``; it requires
    ``|g_min| * ceil((C - 1) / 2) <= EXP_LIMIT = 87``: exp overflows float32 and bfloat16 just above 88.72, and
    below 87.34 every factor exp(-x) is also a normal float32 (no subnormals, see ``EXP_LIMIT``).
    """
    if not g_min < 0:
        raise ValueError(f"g_min must be negative (the lower bound of the log-decay), got {g_min}")
    if max_exponent(g_min, chunk_size) > EXP_LIMIT:
        safe = EXP_LIMIT / math.ceil((chunk_size - 1) / 2)
        raise ValueError(
            f"log-decay bound g_min={g_min} with chunk_size={chunk_size} lets exp(±G) reach "
            f"exp({max_exponent(g_min, chunk_size):g}), past the limit exp({EXP_LIMIT:g}) (float32 and bfloat16 "
            f"overflow at exp(88.7); exp(-87.3) is the smallest normal float32). "
            f"Use g_min >= {-safe:.3f} or a smaller chunk_size."
        )


def largest_safe_chunk(g_min: float, cap: int = 64) -> int:
    """Largest power-of-two chunk size (at most ``cap``, at least 16: the Triton kernels' smallest) that is
    safe for ``g_min``.

    Raises:
        ValueError: g_min is not negative, or so strong that even C = 16 passes the limit (g_min < -87/8 =
            -10.875).
    """
    if not g_min < 0:
        raise ValueError(f"g_min must be negative (the lower bound of the log-decay), got {g_min}")
    c = cap
    while c > 16 and max_exponent(g_min, c) > EXP_LIMIT:
        c //= 2
    if max_exponent(g_min, c) > EXP_LIMIT:
        raise ValueError(
            f"g_min={g_min} is too strong for every supported chunk size: even chunk_size=16 lets exp(±G) reach "
            f"exp({max_exponent(g_min, 16):g}) (limit exp({EXP_LIMIT:g})). Use g_min >= {-EXP_LIMIT / 8:g} (the "
            "PyTorch backend also takes an explicit chunk_size below 16)."
        )
    return c
