"""The chunked KDA kernels as a differentiable op: :func:`kda_triton`.

The launchers ``chunk_fwd`` and ``chunk_bwd`` are registered as the torch custom ops ``k3lit::kda_chunk_fwd`` /
``k3lit::kda_chunk_bwd`` with fake (shape-only) implementations, and joined by ``register_autograd``, so that
``torch.compile`` keeps them in one graph. The forward op returns the fields of
:class:`~k3lit.kernels.kda.chunk_fwd.ChunkFwdOut` (torch.library hands its callers a plain tuple), which
:func:`kda_triton` and the autograd context read back by name.
"""

from __future__ import annotations

import torch

from k3lit.kernels.kda.chunk_bwd import chunk_bwd
from k3lit.kernels.kda.chunk_fwd import ChunkFwdOut, chunk_fwd
from k3lit.kernels.kda.index import max_chunks
from k3lit.kernels.kda.plan import _work_dtype
from k3lit.kernels.kda_validate import check_gate_bias, check_gate_bound, check_inputs, largest_safe_chunk

_Opt = torch.Tensor | None


@torch.library.custom_op("k3lit::kda_chunk_fwd", mutates_args=())
def _kda_chunk_fwd(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, scale: float,
    initial_state: _Opt, output_final_state: bool, cu_seqlens: _Opt, chunk_size: int,
    gate_bias: _Opt, gate_g_min: float | None, qk_l2norm: bool, save: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
           torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Returns the :class:`ChunkFwdOut` fields ``(o, ht, Gc, Aq, Mi, W, Kd, Qg, h, D, Rn)``; everything after ht
    is saved for the backward, and written only with ``save`` (False when no input needs a gradient)."""
    return chunk_fwd(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens, chunk_size,
                     gate_bias, gate_g_min, qk_l2norm, save)


@_kda_chunk_fwd.register_fake
def _(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens, chunk_size, gate_bias, gate_g_min,
      qk_l2norm, save):
    B, T, H, K = q.shape
    V = v.shape[-1]
    C = chunk_size
    N = B if cu_seqlens is None else cu_seqlens.shape[0] - 1
    wdt = _work_dtype(q.dtype)
    f32 = torch.float32
    return ChunkFwdOut(
        o=torch.empty_like(v),
        ht=q.new_empty(N, H, K, V, dtype=f32),
        Gc=q.new_empty(B, T, H, K, dtype=f32),
        Aq=q.new_empty(B, T, H, C, dtype=f32),
        Mi=q.new_empty(B, T, H, C, dtype=f32),
        W=q.new_empty(B, T, H, K, dtype=wdt),
        Kd=q.new_empty(B, T, H, K, dtype=wdt),
        Qg=q.new_empty(B, T, H, K, dtype=wdt),
        h=q.new_empty(max_chunks(B * T, N, C), H, K, V, dtype=wdt),
        D=q.new_empty(B, T, H, V, dtype=wdt),
        Rn=q.new_empty((2, B, T, H) if qk_l2norm else (0,), dtype=f32),
    )


@torch.library.custom_op("k3lit::kda_chunk_bwd", mutates_args=())
def _kda_chunk_bwd(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: _Opt, beta: torch.Tensor, Gc: torch.Tensor,
    Aq: torch.Tensor, Mi: torch.Tensor, W: torch.Tensor, Kd: torch.Tensor, Qg: torch.Tensor, h: torch.Tensor,
    D: torch.Tensor, Rn: torch.Tensor, do: torch.Tensor, dht: _Opt, need_dh0: bool, scale: float, cu_seqlens: _Opt,
    chunk_size: int, gate_bias: _Opt, gate_g_min: float | None, qk_l2norm: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Returns ``(dq, dk, dv, dg, dbeta, dh0)``; ``g`` is the gate pre-activation (fused gate) or None."""
    return chunk_bwd(q, k, v, g, beta, Gc, Aq, Mi, W, Kd, Qg, h, D, Rn, do, dht, need_dh0, scale, cu_seqlens,
                     chunk_size, gate_bias, gate_g_min, qk_l2norm)


@_kda_chunk_bwd.register_fake
def _(q, k, v, g, beta, Gc, Aq, Mi, W, Kd, Qg, h, D, Rn, do, dht, need_dh0, scale, cu_seqlens, chunk_size,
      gate_bias, gate_g_min, qk_l2norm):
    B, T, H, K = q.shape
    N = B if cu_seqlens is None else cu_seqlens.shape[0] - 1
    return (torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), q.new_empty(B, T, H, K,
            dtype=torch.float32), torch.empty_like(beta), q.new_empty(N, H, K, v.shape[-1], dtype=torch.float32))


def _setup_context(ctx, inputs, output):
    (q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens, chunk_size, gate_bias, gate_g_min,
     qk_l2norm, _) = inputs
    saved = ChunkFwdOut(*output).saved
    # The saved-only outputs get no gradient: without these two calls autograd would fill a zero gradient for
    # each of them before every backward (GBs at training shapes), and an unused final state would reach the
    # backward as zeros instead of None.
    ctx.mark_non_differentiable(*saved)
    ctx.set_materialize_grads(False)
    fused_gate = gate_g_min is not None
    # the log-decay itself is not needed (Gc holds its cumulative sum); the pre-activation is (dg -> de)
    ctx.save_for_backward(q, k, v, g if fused_gate else None, beta, *saved, cu_seqlens, gate_bias)
    ctx.scale, ctx.chunk_size, ctx.gate_g_min, ctx.qk_l2norm = scale, chunk_size, gate_g_min, qk_l2norm
    ctx.has_h0 = initial_state is not None
    ctx.g_dtype = g.dtype


def _backward(ctx, do, dht, *_unused):
    q, k, v, g, beta, *saved, cu_seqlens, gate_bias = ctx.saved_tensors  # saved: ChunkFwdOut.saved
    if do is None:  # only the final state was used
        do = torch.zeros_like(v)
    dq, dk, dv, dg, dbeta, dh0 = _kda_chunk_bwd(
        q, k, v, g, beta, *saved, do.contiguous(),
        None if dht is None else dht.contiguous(), ctx.has_h0, ctx.scale, cu_seqlens, ctx.chunk_size, gate_bias,
        ctx.gate_g_min, ctx.qk_l2norm)
    dbias = None
    if gate_bias is not None and ctx.needs_input_grad[10]:  # float32 sums of the float32 dg over all tokens
        dbias = dg.reshape(-1, gate_bias.numel()).sum(0).reshape(gate_bias.shape).to(gate_bias.dtype)
    return (dq, dk, dv, dg.to(ctx.g_dtype), dbeta, None, (dh0 if ctx.has_h0 else None), None, None, None, dbias,
            None, None, None)


_kda_chunk_fwd.register_autograd(_backward, setup_context=_setup_context)


def kda_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    *,
    g_min: float = -5.0,
    chunk_size: int | None = None,
    use_gate_in_kernel: bool = False,
    gate_bias: torch.Tensor | None = None,
    use_qk_l2norm_in_kernel: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Chunked Kimi Delta Attention on Triton kernels, differentiable in every tensor input.

    Args:
        q: ``[B, T, H, K]`` queries (bf16, fp16 or fp32), K <= 256; L2-normalised per head by the caller, or by
            the kernel with ``use_qk_l2norm_in_kernel``.
        k: ``[B, T, H, K]`` keys, q's dtype, normalised like q.
        v: ``[B, T, H, V]`` values, q's dtype, V <= 256.
        g: ``[B, T, H, K]`` per-channel log-decay in ``[g_min, 0]`` (float32 preferred); with
            ``use_gate_in_kernel`` the gate pre-activation e (any float dtype), from which the kernel forms
            ``g = g_min * sigmoid(e + gate_bias)`` (docs/MATH.md §1, K3 innovation 1).
        beta: ``[B, T, H]`` write strength in ``(0, 1)``.
        scale: output scale, default ``K ** -0.5``.
        initial_state: ``[N, H, K, V]`` float32 state before the first token (N = B, or the number of
            sequences with ``cu_seqlens``); receives a gradient.
        output_final_state: also return the ``[N, H, K, V]`` float32 state after the last token.
        cu_seqlens: ``[N + 1]`` int64 (or int32) cumulative lengths of a packed batch; then B must be 1.
        g_min: the lower bound the gate guarantees; fixes the chunk size (README.md).
        chunk_size: override (16, 32 or 64); must be safe for g_min.
        use_gate_in_kernel: ``g`` is the gate pre-activation (above); saves the ``[B, T, H, K]`` float32
            log-decay tensor and its elementwise kernels in forward and backward.
        gate_bias: ``[H * K]`` or ``[H, K]`` bias added to e inside the gate (float32 sums); receives a gradient.
            Only with ``use_gate_in_kernel``.
        use_qk_l2norm_in_kernel: L2-normalise q and k per token and head inside the kernels (as
            ``F.normalize(x, dim=-1)``, eps 1e-12), gradients included; the unnormalised q and k are what the
            backward keeps.

    Returns:
        ``(o [B, T, H, V] in v's dtype, final_state [N, H, K, V] float32 or None)``.

    Raises:
        ValueError: mismatched shapes or dtypes, K or V above 256, an unsupported chunk size, a g_min for
            which ``exp(±(G - G_r))`` passes its limit (``|g_min| * ceil((C - 1) / 2) > 87`` even at C = 16), or a
            gate_bias without use_gate_in_kernel / of the wrong size.

    The gate is not checked against g_min on the device (that would synchronise); a g below g_min can
    produce inf/nan. The fused gate cannot leave ``[g_min, 0]``.

    When no backward can follow (grad disabled, or no input requires a gradient) the kernels skip writing what
    only the backward reads (the inverse M; on the transposed scan the per-chunk states and Delta): a saving in
    memory traffic, not in memory, as the buffers are still allocated. The outputs are bit-identical.
    """
    check_inputs(q, k, v, g, beta, initial_state, cu_seqlens)
    C = largest_safe_chunk(g_min) if chunk_size is None else chunk_size
    if C not in (16, 32, 64):
        raise ValueError(f"chunk_size must be 16, 32 or 64, got {C}")
    check_gate_bound(g_min, C)
    K, V = q.shape[-1], v.shape[-1]
    if K > 256 or V > 256:
        raise ValueError(f"kda_triton supports K, V <= 256, got K={K}, V={V}")
    if q.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"q must be bf16, fp16 or fp32, got {q.dtype}")
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(f"q, k, v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    check_gate_bias(gate_bias, use_gate_in_kernel, q.shape[2], K)
    scale = K**-0.5 if scale is None else float(scale)
    q, k, v, g, beta = (x.contiguous() for x in (q, k, v, g, beta))
    if initial_state is not None:
        initial_state = initial_state.to(torch.float32).contiguous()
    # what only the backward reads is written only when a backward can follow
    save = torch.is_grad_enabled() and any(x is not None and x.requires_grad
                                           for x in (q, k, v, g, beta, initial_state, gate_bias))
    out = ChunkFwdOut(*_kda_chunk_fwd(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens, C,
                                      gate_bias, float(g_min) if use_gate_in_kernel else None,
                                      use_qk_l2norm_in_kernel, save))
    return out.o, (out.ht if output_final_state else None)


__all__ = ["kda_triton"]
