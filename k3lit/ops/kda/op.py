"""The public KDA ops, :func:`kda` (chunked, any T) and :func:`kda_step` (one decoding step): input checks, then
the backend (the Triton kernels, the chunked PyTorch form or the token-by-token reference)."""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from k3lit.kernels import runs_on
from k3lit.kernels.kda_validate import check_gate_bias, check_gate_bound, check_inputs, largest_safe_chunk
from k3lit.ops.kda.chunk import kda_chunk
from k3lit.ops.kda.gate import bounded_log_decay
from k3lit.ops.kda.reference import kda_reference

BACKENDS = ("auto", "torch", "reference", "triton")


def triton_available() -> bool:
    """True when the Triton KDA kernels can be imported and a CUDA device (or the interpreter) exists."""
    try:
        import k3lit.kernels.kda  # noqa: F401
    except ImportError:
        return False
    return torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"


def fuse_inputs(
    q: torch.Tensor,
    k: torch.Tensor,
    g: torch.Tensor,
    g_min: float,
    use_gate_in_kernel: bool = False,
    gate_bias: torch.Tensor | None = None,
    use_qk_l2norm_in_kernel: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """In PyTorch, what the Triton kernels fuse: ``(F.normalize(q), F.normalize(k))`` over the head dimension (in
    q's dtype) with ``use_qk_l2norm_in_kernel``, and ``g = g_min * sigmoid(e + gate_bias)`` (float32, e = ``g``)
    with ``use_gate_in_kernel``; inputs pass through unchanged otherwise. Shapes as :func:`kda`.

    Raises:
        ValueError: a gate_bias without use_gate_in_kernel, or not ``[H * K]`` / ``[H, K]``.
    """
    H, K = q.shape[-2:]
    check_gate_bias(gate_bias, use_gate_in_kernel, H, K)
    if use_qk_l2norm_in_kernel:
        q = F.normalize(q, dim=-1).to(q.dtype)
        k = F.normalize(k, dim=-1).to(k.dtype)
    if use_gate_in_kernel:
        g = bounded_log_decay(g if gate_bias is None else g + gate_bias.view(H, K), g_min)
    return q, k, g


def kda(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    backend: str = "auto",
    *,
    g_min: float = -5.0,
    chunk_size: int | None = None,
    use_gate_in_kernel: bool = False,
    gate_bias: torch.Tensor | None = None,
    use_qk_l2norm_in_kernel: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Kimi Delta Attention (gated delta rule with per-channel decay), chunked.

    Args:
        q, k: ``[B, T, H, K]`` queries and keys, any float dtype, L2-normalised over K (by the caller, or here
            with ``use_qk_l2norm_in_kernel``).
        v: ``[B, T, H, V]`` values.
        g: ``[B, T, H, K]`` per-channel log-decay in ``[g_min, 0]`` (natural-log units), e.g. from
            :func:`k3lit.ops.bounded_log_decay`.
        beta: ``[B, T, H]`` write strength in ``(0, 1)``.
        scale: output scale, default ``K ** -0.5``.
        initial_state: ``[N, H, K, V]`` float32 state (N = B, or number of sequences with cu_seqlens).
        output_final_state: also return the ``[N, H, K, V]`` float32 state after the last token.
        cu_seqlens: ``[N + 1]`` int64 cumulative lengths of a packed batch (B = 1).
        backend: ``"auto"`` (Triton on CUDA, chunked PyTorch elsewhere), ``"torch"``, ``"reference"``
            (token-by-token recurrence) or ``"triton"``.
        g_min: the lower bound the gate guarantees; with ``chunk_size`` it fixes the largest exponent.
        chunk_size: tokens per chunk; default: the largest power of two <= 64 that is safe for g_min.
        use_gate_in_kernel: ``g`` holds the gate pre-activation e; the op forms ``g_min * sigmoid(e + gate_bias)``
            (inside the Triton kernels; in PyTorch for the other backends, see :func:`fuse_inputs`).
        gate_bias: ``[H * K]`` or ``[H, K]`` bias of the fused gate; receives a gradient.
        use_qk_l2norm_in_kernel: L2-normalise q and k here (inside the Triton kernels), gradients included.

    Returns:
        ``(o [B, T, H, V] in v's dtype, final_state [N, H, K, V] float32 or None)``.

    Raises:
        ValueError: mismatched shapes, an unknown backend, a g_min / chunk_size pair whose
            ``exp(±G)`` could overflow float32/bfloat16 (see :func:`check_gate_bound`), a gate_bias without
            use_gate_in_kernel, or ``backend="triton"`` for tensors no Triton kernel can run on (CPU tensors
            without ``TRITON_INTERPRET=1``).
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    check_inputs(q, k, v, g, beta, initial_state, cu_seqlens)
    chunk_size = largest_safe_chunk(g_min) if chunk_size is None else chunk_size
    check_gate_bound(g_min, chunk_size)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    if backend == "auto":
        backend = "triton" if q.is_cuda and triton_available() else "torch"
    if backend == "triton":
        if not runs_on(q) or not triton_available():
            raise ValueError(f"backend='triton' needs CUDA tensors with Triton installed (or TRITON_INTERPRET=1 "
                             f"for CPU tensors, slow); got {q.device} tensors. Use backend='auto' or 'torch'.")
        from k3lit.kernels.kda import kda_triton

        return kda_triton(
            q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens, g_min=g_min, chunk_size=chunk_size,
            use_gate_in_kernel=use_gate_in_kernel, gate_bias=gate_bias, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
        )
    q, k, g = fuse_inputs(q, k, g, g_min, use_gate_in_kernel, gate_bias, use_qk_l2norm_in_kernel)
    if backend == "reference":
        return kda_reference(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens)
    if not use_gate_in_kernel and not q.is_cuda and g.numel() and (g.min() < g_min - 1e-6 or g.max() > 0):
        raise ValueError(
            f"g must lie in [g_min, 0] = [{g_min}, 0], got [{g.min().item():.4g}, {g.max().item():.4g}]; "
            "produce it with bounded_log_decay or pass the bound your gate guarantees as g_min"
        )
    return kda_chunk(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens, chunk_size)


def kda_step(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    scale: float | None = None,
    backend: str = "auto",
    *,
    g_min: float = -5.0,
    use_gate_in_kernel: bool = False,
    gate_bias: torch.Tensor | None = None,
    use_qk_l2norm_in_kernel: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One recurrent KDA step for decoding: the fused Triton kernel on CUDA, the recurrence elsewhere.

    Args:
        q, k, g: ``[B, 1, H, K]``; v: ``[B, 1, H, V]``; beta: ``[B, 1, H]`` (one new token).
        state: ``[B, H, K, V]`` float32 state before the token. The Triton path updates it in place.
        scale: default ``K ** -0.5``.
        backend: as :func:`kda`; ``"auto"`` and ``"triton"`` use the kernel when a CUDA device has it.
        g_min, use_gate_in_kernel, gate_bias, use_qk_l2norm_in_kernel: as :func:`kda` (applied in PyTorch
            before the step: one token's worth of work).

    Returns:
        ``(o [B, 1, H, V] in v's dtype, state after the token [B, H, K, V] float32)``.
    """
    if q.shape[1] != 1:
        raise ValueError(f"kda_step decodes one token, got T = {q.shape[1]}")
    q, k, g = fuse_inputs(q, k, g, g_min, use_gate_in_kernel, gate_bias, use_qk_l2norm_in_kernel)
    if backend in ("auto", "triton") and q.is_cuda and triton_available():
        from k3lit.kernels.kda import kda_decode_triton

        return kda_decode_triton(q, k, v, g, beta, state.float().contiguous(), scale)
    return kda_reference(q, k, v, g, beta, scale, state, True)

