"""The Triton launches a K3 model's training makes, recorded on ``meta`` tensors without a GPU.

Which kernels a step launches, and with which argument specialisation (dtypes, integers, constexprs), follows from
the model configuration, the batch shape, the precision and the GPU's SM count. Each recorder runs the launchers
of one operator on ``meta`` tensors inside :func:`k3lit.kernels.aot.record_launches` with the arguments the model's
layers pass them; :func:`recipes` lists the recorder calls of a whole model, :func:`record` runs one. A CPU test
(tests/kernels/test_precompile.py) checks the result against a real model's launches. Used by
:mod:`k3lit.kernels.precompile` (compile them ahead) and ``benchmarks/kernel_resources.py`` (their resources).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from k3lit.kernels import aot, gpu
from k3lit.kernels.gpu import H200_SMS  # the recordings' default
from k3lit.kernels.kda_validate import largest_safe_chunk

__all__ = ["attn_res_launches", "kda_launches", "recipes", "record", "routing_launches", "short_conv_launches"]

META = torch.device("meta")
KDA_FWD_KERNELS = ("_intra_fwd", "_wy_fwd", "_prep_fwd", "_scan_fwd", "_scan_fwd_t", "_out_fwd")
"""The kernels ``k3lit.kernels.kda.chunk_fwd`` launches (which of them run depends on the shape)."""
KDA_BWD_KERNELS = ("_scan_bwd", "_scan_bwd_t", "_main_bwd")
"""The kernels ``k3lit.kernels.kda.chunk_bwd`` launches."""
SHORT_CONV_KERNELS = ("_fwd", "_bwd_p", "_bwd_dx")
"""The kernels ``k3lit.kernels.short_conv.conv`` launches."""
ATTN_RES_TWO_PHASE_KERNELS = ("_inter_fwd", "_inter_bwd_logits", "_inter_bwd_sources", "_merge_fwd", "_merge_bwd")
ATTN_RES_MIX_KERNELS = ("_mix_fwd", "_mix_bwd")
ROUTING_CAPACITY_KERNELS = ("_free_choices", "_admit")
ROUTING_SORT_KERNELS = ("_block_counts", "_place")


def kda_launches(B: int, T: int, H: int, K: int, V: int, dtype: torch.dtype, g_min: float = -5.0,
                 fused_gate: bool = True, qk_l2norm: bool = True, save: bool = True, backward: bool = True,
                 beta_dtype: torch.dtype = torch.float32, bias_dtype: torch.dtype = torch.float32,
                 sm_count: int = H200_SMS) -> list[aot.Launch]:
    """The launches of one chunked KDA op (:func:`k3lit.kernels.kda.kda_triton`) on a dense ``[B, T, H, K]`` batch,
    in launch order (a pipelined launcher launches a kernel once per segment).

    Args:
        B, T, H, K, V: batch, tokens, heads, key and value width per head.
        dtype: dtype of q, k, v (and of the gate pre-activation with ``fused_gate``).
        g_min: the log-decay bound; fixes the chunk size (:func:`largest_safe_chunk`).
        fused_gate: the layer's ``g = g_min * sigmoid(e + bias)`` inside the kernels; otherwise a float32 log-decay.
        qk_l2norm: q and k L2-normalised inside the kernels.
        save: the forward writes what the backward reads (False: no backward can follow).
        backward: also the backward's launches (on what the forward wrote).
        beta_dtype: dtype of beta (the KDA layer's is float32).
        bias_dtype: dtype of the gate bias (the layer's parameter dtype).
        sm_count: the GPU's streaming multiprocessors, by which the launchers pick their scan kernels.
    """
    from k3lit.kernels.kda import chunk_bwd, chunk_fwd

    q, k = torch.empty(B, T, H, K, device=META, dtype=dtype), torch.empty(B, T, H, K, device=META, dtype=dtype)
    v = torch.empty(B, T, H, V, device=META, dtype=dtype)
    g = torch.empty(B, T, H, K, device=META, dtype=dtype if fused_gate else torch.float32)
    beta = torch.empty(B, T, H, device=META, dtype=beta_dtype)
    bias = torch.empty(H * K, device=META, dtype=bias_dtype) if fused_gate else None
    gate_g_min = float(g_min) if fused_gate else None
    C, scale = largest_safe_chunk(g_min), K**-0.5
    sm_of = gpu.sm_count
    gpu.sm_count = lambda device: sm_count  # the GPU's count, not the one meta tensors report
    try:
        with aot.record_launches(chunk_fwd, *KDA_FWD_KERNELS) as fwd, \
                aot.record_launches(chunk_bwd, *KDA_BWD_KERNELS) as bwd:
            out = chunk_fwd.ChunkFwdOut(*chunk_fwd.chunk_fwd(q, k, v, g, beta, scale, None, False, None, C, bias,
                                                             gate_g_min, qk_l2norm, save=save))
            if backward:
                chunk_bwd.chunk_bwd(q, k, v, g if fused_gate else None, beta, *out.saved, torch.empty_like(out.o),
                                    None, False, scale, None, C, bias, gate_g_min, qk_l2norm)
    finally:
        gpu.sm_count = sm_of
    return fwd + bwd


def short_conv_launches(B: int, T: int, C: int, width: int, dtype: torch.dtype, backward: bool = True,
                        parts: int = 3) -> list[aot.Launch]:
    """The launches of the short convolution + SiLU (:func:`k3lit.kernels.short_conv.short_conv_silu_triton`) on
    ``[B, T, C]`` inputs of ``dtype`` with ``width`` taps (cast to ``dtype``, as the layer does), its output in
    ``parts`` channel groups (3: a KDA layer's q, k and v)."""
    from k3lit.kernels.short_conv import conv

    x, w = torch.empty(B, T, C, device=META, dtype=dtype), torch.empty(C, width, device=META, dtype=dtype)
    with aot.record_launches(conv, *SHORT_CONV_KERNELS) as launches:
        ys = conv.conv_fwd(x, w, parts)
        if backward:
            conv.conv_bwd(x, w, [torch.empty_like(y) for y in ys])
    return launches


def attn_res_launches(B: int, T: int, D: int, sublayers: int, block_size: int, dtype: torch.dtype,
                      param_dtype: torch.dtype = torch.float32, eps: float = 1e-6,
                      backward: bool = True) -> list[aot.Launch]:
    """The launches of the attention-residual stream of one training forward (and its backward) over ``sublayers``
    sublayers in blocks of ``block_size`` (1: Full AttnRes), as :class:`k3lit.nn.attn_res.BlockResidualStream`
    makes them: at each block's start a phase-1 read of the N summaries so far for the block's sublayers, a
    phase-2 merge for each sublayer after the block's first, and at the end the one-pass read of every summary and
    the open block's partial sum. The embedding (the first summary) and the queries are in ``param_dtype`` (the
    weights' dtype), the sublayer outputs, partial sums and phase-1 mixes in ``dtype`` (the compute dtype: bf16
    under bf16 autocast over float32 weights)."""
    from k3lit.kernels.attn_res import mix, two_phase

    def x(dt: torch.dtype = dtype) -> torch.Tensor:
        return torch.empty(B, T, D, device=META, dtype=dt)

    blocks, done = [x(param_dtype)], 0
    with aot.record_launches(two_phase, *ATTN_RES_TWO_PHASE_KERNELS) as phases, \
            aot.record_launches(mix, *ATTN_RES_MIX_KERNELS) as final:
        while done < sublayers:
            S = min(block_size, sublayers - done)
            queries = torch.empty(S, D, device=META, dtype=param_dtype)
            mixes, lse, su, r, mz = two_phase.inter_fwd(blocks, queries, eps, dtype)
            partial = x()
            for j in range(1, S):
                two_phase.merge_fwd(mixes[j], lse[j], partial, queries[j], eps)
                if backward:
                    two_phase.merge_bwd(x(), mixes[j], lse[j], partial, queries[j], eps)
            if backward:  # the log-sum-exp has a gradient where a merge read it
                two_phase.inter_bwd(blocks, queries, su, r, mz, [x() for _ in range(S)],
                                    torch.empty_like(lse) if S > 1 else None)
            blocks.append(partial)  # a closed block's summary, or the open block's partial sum
            done += S
        query = torch.empty(D, device=META, dtype=param_dtype)
        out, src_stats, row_stats = mix.mix_fwd(blocks, query, eps)
        if backward:
            mix.mix_bwd(blocks, query, src_stats, row_stats, torch.empty_like(out))
    return phases + final


def routing_launches(m: int, n: int, k: int, seq_len: int, capacity: int | None = None) -> list[aot.Launch]:
    """The routing kernels of one MoE layer's forward (:mod:`k3lit.kernels.routing`) on ``m`` tokens of sequences of
    ``seq_len``, ``n`` experts, top ``k``, as :class:`k3lit.nn.moe.MoE` launches them on CUDA: the causal capacity
    admission when ``capacity`` (tokens an expert takes) is given, then the slots' counting sort by expert. The
    router's scores and the selection bias are float32 (the layer routes in float32 under any autocast)."""
    from k3lit.kernels.routing import capacity as admission
    from k3lit.kernels.routing import sort

    with aot.record_launches(admission, *ROUTING_CAPACITY_KERNELS) as admitted, \
            aot.record_launches(sort, *ROUTING_SORT_KERNELS) as sorted_slots:
        if capacity is not None:
            scores = torch.empty(m, n, device=META, dtype=torch.float32)
            admission.causal_capacity(scores, torch.empty(n, device=META, dtype=torch.float32), k, capacity, seq_len)
        sort.sort_slots(torch.empty(m, k, device=META, dtype=torch.int64), n)
    return admitted + sorted_slots


_RECORDERS: dict[str, Callable[..., list[aot.Launch]]] = {
    "kda": kda_launches, "short_conv": short_conv_launches, "attn_res": attn_res_launches,
    "routing": routing_launches}


def recipes(model_config: Any, batch: int, seq_len: int, dtype: torch.dtype,
            param_dtype: torch.dtype = torch.float32, sm_count: int = H200_SMS) -> list[tuple[str, dict]]:
    """``(recorder, kwargs)`` pairs whose :func:`record` is every Triton launch of training ``model_config``
    (a :class:`k3lit.model.ModelConfig`) on ``[batch, seq_len]`` batches, eager validation included: the KDA op and
    the short convolution (unless the model has no KDA layer or runs it on torch: ``kda_backend`` torch or
    reference), the attention-residual stream (unless ``residual`` is plain) and the MoE layers' routing (causal
    capacity admission, the slots' sort; unless the model has no MoE layer). ``dtype``: the compute dtype
    (bf16 under ``bf16-mixed`` and ``bf16-true``); ``param_dtype``: the weights' (float32 under ``*-mixed``, the
    compute dtype under ``*-true``); ``sm_count``: the GPU's."""
    c, out = model_config, []
    if "K" in c.layer_pattern and c.kda_backend in ("auto", "triton"):
        H, K = c.n_heads, c.head_dim
        kda = dict(B=batch, T=seq_len, H=H, K=K, V=K, dtype=dtype, g_min=float(c.kda_g_min), bias_dtype=param_dtype,
                   sm_count=sm_count)
        out += [
            ("kda", kda),  # a training step
            ("kda", {**kda, "save": False, "backward": False}),  # eager validation, checkpointing's no-grad forward
            ("short_conv", dict(B=batch, T=seq_len, C=3 * H * K, width=4, dtype=dtype)),
        ]
    if c.residual != "plain":
        size = 1 if c.residual == "full_attnres" else c.attnres_block_size
        out.append(("attn_res", dict(B=batch, T=seq_len, D=c.dim, sublayers=2 * c.n_layers, block_size=size,
                                     dtype=dtype, param_dtype=param_dtype, eps=float(c.norm_eps))))
    if any(c.is_moe(i) for i in range(c.n_layers)):
        m = batch * seq_len
        out.append(("routing", dict(m=m, n=c.n_experts, k=c.top_k, seq_len=seq_len, capacity=c.causal_capacity(m))))
    return out


def record(recorder: str, kwargs: dict) -> list[aot.Launch]:
    """The launches recorder ``recorder`` (``kda``, ``short_conv``, ``attn_res``, ``routing``) records with
    ``kwargs``.

    Raises:
        KeyError: an unknown recorder.
    """
    return _RECORDERS[recorder](**kwargs)
