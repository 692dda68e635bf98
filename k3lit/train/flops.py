"""Model FLOPs of one training step of a :class:`~k3lit.model.K3LM`, from its :class:`ModelConfig` alone.

The count is the *model* work (what MFU divides by the chip's peak), not what a kernel happens to execute:
recomputation from activation checkpointing is not counted, and elementwise work (norms, gates, SiLU, the
softmax itself) is left out. A multiply-add is 2 FLOPs. Training = forward + backward = 3 x forward.

Per token, for a sequence of ``T`` tokens (``L`` layers, width ``D``, ``H`` heads of width ``d``):

* **matrix products**: ``6 * N_active`` where ``N_active`` counts the weights a token is multiplied by —
  every projection of the token mixers (KDA: q, k, v, beta, the low-rank gate and output gate, output;
  attention: qkv, output), the dense SwiGLU, and for an MoE layer the router, the ``top_k`` routed experts
  and the shared experts (``n_experts - top_k`` experts sit idle for this token), the depthwise short
  convolutions, and the LM head ``D x V``. The embedding is a lookup (0 FLOPs), whether tied or not.
* **softmax attention** (causal): ``QK^T`` and ``AV`` cost ``2 * 2 * H * d`` per (query, key) pair; the
  ``t``-th token sees ``t`` keys, so the mean is ``(T + 1) / 2`` keys: ``3 * 4 * H * d * (T + 1) / 2`` per
  token and layer. This is FlashAttention's convention; the "full square" one (PaLM, nanoGPT:
  ``12 * L * H * d * T``) is twice this term.
* **KDA** (chunked, chunk ``C`` = :func:`k3lit.ops.kda.largest_safe_chunk`): per chunk and head the WY form
  builds the two ``C x C`` intra-chunk score matrices (``k k^T`` and ``q k^T``, ``2 * 2 C^2 d``), inverts
  the unit-lower-triangular ``C x C`` system (``2 C^3 / 3``), applies it to keys and values (``2 * 2 C^2 d``),
  and does the inter-chunk work with the ``d x d`` state (``u - w S``, ``q S``, ``A v``, the state update:
  ``3 * 2 C d^2 + 2 C^2 d``). Per token: ``8 C d + 6 d^2 + 2 C^2 / 3`` per head, times 3 for training.
  Linear in ``T``: at ``T = 2048`` and ``d = C = 64`` a KDA head costs ~4.4x less than an attention head.
* **attention residuals** (``block_attnres``/``full_attnres``): each sublayer's depth read over ``S``
  sources costs ``4 * D * S`` (logits and weighted sum), times 3.
"""

from __future__ import annotations

import torch

from k3lit.model import ModelConfig
from k3lit.ops.kda import largest_safe_chunk

__all__ = ["active_matmul_params", "training_flops_per_token", "training_flops", "flops_breakdown", "peak_flops",
           "compute_dtype"]

KDA_CONV_WIDTH = 4  # KimiDeltaAttention's default short-convolution width


def _kda_params(c: ModelConfig) -> int:
    d, inner = c.dim, c.n_heads * c.head_dim
    proj = 3 * d * inner + d * c.n_heads  # q, k, v, beta
    gates = 2 * (d * c.head_dim + c.head_dim * inner)  # low-rank decay gate and output gate
    conv = 3 * inner * KDA_CONV_WIDTH
    return proj + gates + conv + inner * d  # + output projection


def _attn_params(c: ModelConfig) -> int:
    inner = c.n_heads * c.head_dim
    return 3 * c.dim * inner + inner * c.dim


def _channel_params(c: ModelConfig, layer: int) -> int:
    if not c.is_moe(layer):
        return 3 * c.dim * c.mlp_hidden
    router = c.dim * c.n_experts
    return router + (c.top_k + c.n_shared_experts) * 3 * c.dim * c.expert_dim


def active_matmul_params(c: ModelConfig) -> int:
    """Weights one token is multiplied by in a forward pass (see the module docstring); needs vocab_size."""
    if c.vocab_size is None:
        raise ValueError("ModelConfig.vocab_size is None: the LM head's FLOPs need it")
    n = c.dim * c.vocab_size  # LM head
    for layer in range(c.n_layers):
        n += _kda_params(c) if c.mixer_type(layer) == "K" else _attn_params(c)
        n += _channel_params(c, layer)
    return n


def _attnres_sources(c: ModelConfig) -> int:
    """Total number of sources read by all depth mixers (every sublayer and the final one)."""
    if c.residual == "plain":
        return 0
    size = 1 if c.residual == "full_attnres" else c.attnres_block_size
    total = 0
    for j in range(2 * c.n_layers + 1):  # sublayer j has j outputs before it; the final mixer is j = 2L
        total += 1 + j // size + (1 if j % size else 0)
    return total


def flops_breakdown(c: ModelConfig, seq_len: int) -> dict[str, float]:
    """Training FLOPs per token by part: ``matmul``, ``attention``, ``kda``, ``attnres``."""
    hd, heads = c.head_dim, c.n_heads
    n_attn = sum(c.mixer_type(i) == "A" for i in range(c.n_layers))
    n_kda = c.n_layers - n_attn
    chunk = largest_safe_chunk(c.kda_g_min)
    kda_fwd = heads * (8 * chunk * hd + 6 * hd * hd + 2 * chunk**2 / 3)
    return {
        "matmul": 6.0 * active_matmul_params(c),
        "attention": 3.0 * n_attn * 4 * heads * hd * (seq_len + 1) / 2,
        "kda": 3.0 * n_kda * kda_fwd,
        "attnres": 3.0 * 4 * c.dim * _attnres_sources(c),
    }


def training_flops_per_token(c: ModelConfig, seq_len: int) -> float:
    """Model FLOPs of forward + backward per token of a ``seq_len``-token sequence."""
    return sum(flops_breakdown(c, seq_len).values())


def training_flops(c: ModelConfig, batch_size: int, seq_len: int) -> float:
    """Model FLOPs of forward + backward of a ``[batch_size, seq_len]`` batch."""
    return batch_size * seq_len * training_flops_per_token(c, seq_len)


# Dense (no 2:4 sparsity) peaks per device from the vendors' datasheets, FLOP/s. Lightning's own table lists
# the *sparse* figures for Hopper (2e15 bf16 for an H200), which would halve every MFU.
_DENSE_PEAK: dict[str, dict[str, float]] = {
    "h100": {"bf16": 989.4e12, "fp16": 989.4e12, "tf32": 494.7e12, "fp32": 66.9e12},
    "h200": {"bf16": 989.4e12, "fp16": 989.4e12, "tf32": 494.7e12, "fp32": 66.9e12},
    "a100": {"bf16": 312e12, "fp16": 312e12, "tf32": 156e12, "fp32": 19.5e12},
}


def compute_dtype(precision: str) -> torch.dtype:
    """The dtype the matrix products run in under a Lightning precision setting (``trainer.precision``):
    ``bf16-mixed``/``bf16-true`` -> bfloat16, ``16-mixed``/``16-true`` -> float16, ``64-true`` -> float64, anything
    else (``32-true``, ``transformer-engine``...) -> float32."""
    precision = str(precision)
    if precision.startswith("bf16"):
        return torch.bfloat16
    if precision.startswith("16"):
        return torch.float16
    if precision.startswith("64"):
        return torch.float64
    return torch.float32


def peak_flops(device: torch.device, dtype: torch.dtype) -> float | None:
    """Dense peak FLOP/s of one ``device`` computing in ``dtype``; None when unknown (e.g. a CPU)."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device).lower()
    for chip, table in _DENSE_PEAK.items():
        if chip in name:
            if dtype in (torch.bfloat16, torch.float16):
                return table["bf16" if dtype == torch.bfloat16 else "fp16"]
            if dtype == torch.float32:
                return table["tf32" if torch.get_float32_matmul_precision() != "highest" else "fp32"]
    from lightning.fabric.utilities.throughput import get_available_flops

    return get_available_flops(device, dtype)
