"""The GPU the Triton launchers size their grids and plans for."""

from __future__ import annotations

import functools

import torch

H200_SMS = 132
"""Streaming multiprocessors of an H100 or H200, the GPU k3lit's launch plans are tuned on."""


@functools.cache
def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA ``device``; :data:`H200_SMS` for any other device (the interpreter,
    ``meta`` tensors when :mod:`k3lit.kernels.launches` records launches), so plans are those of the H200."""
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else H200_SMS
