"""Helpers shared by the test-suite and the benchmarks (kept in the package so both import it the same way)."""

from __future__ import annotations

import torch


def rel_rms(a: torch.Tensor, b: torch.Tensor) -> float:
    """Relative RMS error ``||a - b||_2 / ||b||_2`` of ``a`` against the reference ``b`` (computed in float64)."""
    a, b = a.double(), b.double()
    return ((a - b).pow(2).mean().sqrt() / b.pow(2).mean().sqrt().clamp_min(1e-300)).item()
