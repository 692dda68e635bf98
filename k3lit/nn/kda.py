"""The Kimi Delta Attention layer (Kimi Linear, arXiv 2510.26692) with the K3 lower-bounded gate."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from k3lit.nn.short_conv import ShortConvolution
from k3lit.ops.kda import bounded_log_decay, check_gate_bound, kda, kda_step, largest_safe_chunk


@dataclass
class KDAState:
    """Decoding state of one KDA layer: conv tails ``[B, C, 3]`` for q, k, v and the ``[B, H, K, V]`` f32 state."""

    conv_q: torch.Tensor
    conv_k: torch.Tensor
    conv_v: torch.Tensor
    recurrent: torch.Tensor


class KimiDeltaAttention(nn.Module):
    """KDA token mixer: q/k/v projections with short conv + SiLU, L2-normalised q/k, per-head beta,
    low-rank per-channel gate ``g = g_min * sigmoid(W_up W_down x + bias)``, gated RMS-normed output.

    Args:
        dim: model width D.
        n_heads: heads H.
        head_dim: key and value width K = V per head.
        g_min: lower bound of the log-decay (negative; default -5).
        conv_width: short-convolution width.
        backend: KDA op backend (``"auto"``, ``"torch"``, ``"triton"``, ``"reference"``).

    ``forward(x [B, T, D], state: KDAState | None) -> (y [B, T, D], KDAState | None)``; the state is returned
    when one is passed in or ``return_state=True`` (prefill and decoding).

    Raises:
        ValueError: when g_min is not negative or too strong for any safe chunk size.
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
        self.q_proj = nn.Linear(dim, inner, bias=False)
        self.k_proj = nn.Linear(dim, inner, bias=False)
        self.v_proj = nn.Linear(dim, inner, bias=False)
        conv_backend = backend if backend in ("auto", "triton") else "torch"
        self.q_conv = ShortConvolution(inner, conv_width, conv_backend)
        self.k_conv = ShortConvolution(inner, conv_width, conv_backend)
        self.v_conv = ShortConvolution(inner, conv_width, conv_backend)
        self.b_proj = nn.Linear(dim, n_heads, bias=False)
        # Low-rank gate (rank = head_dim) plus a per-channel bias.
        self.f_down = nn.Linear(dim, head_dim, bias=False)
        self.f_up = nn.Linear(head_dim, inner, bias=False)
        self.gate_bias = nn.Parameter(torch.zeros(inner))
        # Low-rank sigmoid output gate.
        self.o_down = nn.Linear(dim, head_dim, bias=False)
        self.o_up = nn.Linear(head_dim, inner, bias=True)
        self.o_norm = nn.RMSNorm(head_dim, eps=norm_eps)
        self.o_proj = nn.Linear(inner, dim, bias=False)

    def forward(
        self, x: torch.Tensor, state: KDAState | None = None, return_state: bool = False
    ) -> tuple[torch.Tensor, KDAState | None]:
        B, T, _ = x.shape
        H, K = self.n_heads, self.head_dim
        want_state = return_state or state is not None
        q, cq = self.q_conv(self.q_proj(x), None if state is None else state.conv_q)
        k, ck = self.k_conv(self.k_proj(x), None if state is None else state.conv_k)
        v, cv = self.v_conv(self.v_proj(x), None if state is None else state.conv_v)
        v = v.view(B, T, H, K)
        # L2 norm (autocast runs it in float32), then one dtype for the op's matrix operands
        q = F.normalize(q.view(B, T, H, K), dim=-1).to(v.dtype)  # [B, T, H, K]
        k = F.normalize(k.view(B, T, H, K), dim=-1).to(v.dtype)
        beta = torch.sigmoid(self.b_proj(x).to(torch.promote_types(x.dtype, torch.float32)))  # [B, T, H]
        g = bounded_log_decay(self.f_up(self.f_down(x)) + self.gate_bias, self.g_min).view(B, T, H, K)
        h0 = None if state is None else state.recurrent
        if T == 1 and state is not None:  # decoding: one recurrent step (fused Triton kernel on CUDA)
            o, h = kda_step(q, k, v, g, beta, h0, backend=self.backend)
        else:
            o, h = kda(q, k, v, g, beta, None, h0, want_state, backend=self.backend, g_min=self.g_min)
        o = self.o_norm(o) * torch.sigmoid(self.o_up(self.o_down(x))).view(B, T, H, K)
        y = self.o_proj(o.reshape(B, T, H * K))
        return y, (KDAState(cq, ck, cv, h) if want_state else None)
