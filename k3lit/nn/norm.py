"""RMSNorm that keeps torch's fused kernel when a low-precision input meets a float32 weight (autocast)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.RMSNorm):
    """:class:`torch.nn.RMSNorm` (``x / sqrt(mean(x^2) + eps) * weight`` over the last dims) whose float32 weight
    is cast to a bfloat16 / float16 input's dtype for the call.

    Under autocast a norm's input is often bf16 (the output of an autocast matrix product, or a Block AttnRes
    read) while its weight is float32. torch 2.11 then leaves its fused CUDA kernel for the composite form
    (several elementwise kernels, float32 intermediates saved for backward); later versions list ``rms_norm``
    among autocast's float32 ops and upcast the input instead. Here the norm runs with autocast off and the
    weight in the input's dtype, as FSDP2's ``param_dtype`` makes every weight: the fused kernel (float32
    arithmetic inside) on every torch version, the output in the input's dtype, the weight's gradient cast back
    to float32. Inputs in float32 or float64 take exactly :class:`torch.nn.RMSNorm`'s path.

    Shapes: ``[..., *normalized_shape] -> same``, in the input's dtype.
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight
        if w is None or x.dtype not in (torch.bfloat16, torch.float16) or w.dtype == x.dtype:
            return F.rms_norm(x, self.normalized_shape, w, self.eps)
        with torch.autocast(x.device.type, enabled=False):
            return F.rms_norm(x, self.normalized_shape, w.to(x.dtype), self.eps)
