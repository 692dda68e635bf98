"""The Kimi Delta Attention layer (Kimi Linear, arXiv 2510.26692) with the K3 lower-bounded gate."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from k3lit.nn.documents import Documents
from k3lit.nn.norm import RMSNorm
from k3lit.nn.short_conv import ShortConvolution
from k3lit.ops.kda import check_gate_bound, kda, kda_step, largest_safe_chunk


@dataclass
class KDAState:
    """Decoding state of one KDA layer: the q|k|v conv tail ``[B, 3 H K, 3]`` and the ``[B, H, K, V]`` f32 state."""

    conv: torch.Tensor
    recurrent: torch.Tensor


class KimiDeltaAttention(nn.Module):
    """KDA token mixer: q/k/v projections with short conv + SiLU, L2-normalised q/k, per-head beta,
    low-rank per-channel gate ``g = g_min * sigmoid(W_up W_down x + bias)``, gated RMS-normed output.

    The projections that read ``x`` are fused into two matrix products: ``qkv_proj`` (q | k | v, one short
    convolution over all three) and ``down_proj`` (beta logits | decay-gate down | output-gate down).

    Args:
        dim: model width D.
        n_heads: heads H.
        head_dim: key and value width K = V per head.
        g_min: lower bound of the log-decay (negative; default -5).
        conv_width: short-convolution width.
        backend: KDA op backend (``"auto"``, ``"torch"``, ``"triton"``, ``"reference"``); ``auto`` and
            ``triton`` also select the Triton short convolution.

    ``forward(x [B, T, D], state: KDAState | None, return_state, docs) -> (y [B, T, D], KDAState | None)``; the
    state is returned when one is passed in or ``return_state=True`` (prefill and decoding). With ``docs``
    (:class:`~k3lit.nn.documents.Documents` of the batch) every document starts from a zero state: the batch goes
    through the op as one packed sequence with ``docs.cu_seqlens``, and the short convolution reads no earlier
    document.

    Raises:
        ValueError: when g_min is not negative or too strong for any safe chunk size; ``forward`` with ``docs``
            and a state or ``return_state``.
    """

    def __init__(
        self,
        dim: int,
        n_heads: int,
        head_dim: int,
        g_min: float = -5.0,
        conv_width: int = 4,
        backend: str = "auto",
        norm_eps: float = 1e-6,
    ) -> None:
        super().__init__()
        self.n_heads, self.head_dim, self.g_min, self.backend = n_heads, head_dim, g_min, backend
        self.chunk_size = largest_safe_chunk(g_min)
        check_gate_bound(g_min, self.chunk_size)
        inner = n_heads * head_dim
        self.qkv_proj = nn.Linear(dim, 3 * inner, bias=False)
        self.qkv_conv = ShortConvolution(3 * inner, conv_width, backend if backend in ("auto", "triton") else "torch",
                                         parts=3)
        # beta logits (one per head) | low-rank decay-gate down (rank = head_dim) | low-rank output-gate down
        self.down_proj = nn.Linear(dim, n_heads + 2 * head_dim, bias=False)
        self.f_up = nn.Linear(head_dim, inner, bias=False)
        self.gate_bias = nn.Parameter(torch.empty(inner))
        self.o_up = nn.Linear(head_dim, inner, bias=True)
        self.o_norm = RMSNorm(head_dim, eps=norm_eps)
        self.o_proj = nn.Linear(inner, dim, bias=False)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Zero the decay-gate bias, the one parameter this module owns directly (its submodules reset their
        own)."""
        nn.init.zeros_(self.gate_bias)

    def forward(
        self, x: torch.Tensor, state: KDAState | None = None, return_state: bool = False, docs: Documents | None = None
    ) -> tuple[torch.Tensor, KDAState | None]:
        B, T, _ = x.shape
        H, K = self.n_heads, self.head_dim
        want_state = return_state or state is not None
        if docs is not None and want_state:
            raise ValueError("KimiDeltaAttention: document masking is for training and scoring; decoding takes no docs")
        qkv, conv = self.qkv_conv(self.qkv_proj(x), None if state is None else state.conv,
                                  None if docs is None else docs.pos)
        q, k, v = (t.view(B, T, H, K) for t in qkv)  # contiguous from the Triton kernel, views otherwise
        b_logit, f_low, o_low = self.down_proj(x).split([H, K, K], dim=-1)
        beta = torch.sigmoid(b_logit.to(torch.promote_types(x.dtype, torch.float32)))  # [B, T, H]
        e = self.f_up(f_low).view(B, T, H, K)  # gate pre-activation
        # The op L2-normalises q and k and forms g = g_min * sigmoid(e + gate_bias) (inside the Triton kernels)
        fused = dict(g_min=self.g_min, use_gate_in_kernel=True, gate_bias=self.gate_bias,
                     use_qk_l2norm_in_kernel=True)
        h0 = None if state is None else state.recurrent
        if T == 1 and state is not None:  # decoding: one recurrent step (fused Triton kernel on CUDA)
            o, h = kda_step(q, k, v, e, beta, h0, backend=self.backend, **fused)
        elif docs is not None:  # the batch as one packed sequence of its documents
            packed = (t.reshape(1, B * T, *t.shape[2:]) for t in (q, k, v.contiguous(), e, beta))
            o, h = kda(*packed, None, None, False, docs.cu_seqlens, backend=self.backend, **fused)
            o = o.view(B, T, H, K)
        else:
            o, h = kda(q, k, v.contiguous(), e, beta, None, h0, want_state, backend=self.backend, **fused)
        o = self.o_norm(o) * torch.sigmoid(self.o_up(o_low)).view(B, T, H, K)
        y = self.o_proj(o.reshape(B, T, H * K))
        return y, (KDAState(conv, h) if want_state else None)
