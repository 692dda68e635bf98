"""Triton kernels of k3lit, one folder per operator."""

import os

import torch


def runs_on(x: torch.Tensor) -> bool:
    """Whether k3lit's Triton kernels can take ``x``: a CUDA tensor, or any tensor under ``TRITON_INTERPRET=1``
    (the CPU interpreter the tests use). Imports no Triton."""
    return x.is_cuda or os.environ.get("TRITON_INTERPRET") == "1"


def use_triton(x: torch.Tensor, backend: str) -> bool:
    """Whether an op called with ``backend`` runs its Triton kernels on ``x``: ``"auto"`` on CUDA tensors,
    ``"triton"`` wherever :func:`runs_on` allows, ``"torch"`` never.

    Raises:
        ValueError: ``backend`` not ``"auto"``, ``"triton"`` or ``"torch"``, or ``"triton"`` for a tensor no Triton
            kernel runs on.
    """
    if backend not in ("auto", "triton", "torch"):
        raise ValueError(f"backend must be 'auto', 'triton' or 'torch', got {backend!r}")
    if backend == "triton" and not runs_on(x):
        raise ValueError(f"backend='triton' needs CUDA tensors (or TRITON_INTERPRET=1 for CPU tensors); got "
                         f"{x.device} tensors. Use backend='auto' or 'torch'.")
    return backend == "triton" or (backend == "auto" and x.is_cuda)
