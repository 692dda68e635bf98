"""Triton kernels of k3lit, one folder per operator."""

import os

import torch


def runs_on(x: torch.Tensor) -> bool:
    """Whether k3lit's Triton kernels can take ``x``: a CUDA tensor, or any tensor under ``TRITON_INTERPRET=1``
    (the CPU interpreter the tests use). Imports no Triton."""
    return x.is_cuda or os.environ.get("TRITON_INTERPRET") == "1"
