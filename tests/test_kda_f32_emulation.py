"""``benchmarks/kda_f32_emulation.py`` emulates the GPU's float32 arithmetic on the CPU; RESULTS.md quotes what it
finds, so its roundings must be the GPU's: TF32 keeps 10 mantissa bits, ``cvt.rna`` rounds ties away from zero,
the tensor cores' one-pass TF32 product truncates, and 3xTF32 lands between one TF32 product and float32."""

from __future__ import annotations

import numpy as np
import torch

from benchmarks.kda_f32_emulation import (
    bf16_round,
    bf16x6_matmul,
    tf32_matmul,
    tf32_round,
    tf32_truncate,
    tf32x3_matmul,
)


def test_roundings():
    one = np.float32(1.0)
    x = np.array([one + 2.0**-12, one + 2.0**-11, -(one + 2.0**-11), one + 2.0**-11 + 2.0**-23], dtype=np.float32)
    assert tf32_round(x).tolist() == [1.0, 1.0 + 2.0**-10, -(1.0 + 2.0**-10), 1.0 + 2.0**-10]
    assert tf32_truncate(x).tolist() == [1.0, 1.0, -1.0, 1.0]
    assert bf16_round(np.array([1.0 + 2.0**-8, 1.0 + 3 * 2.0**-8], dtype=np.float32)).tolist() == [1.0, 1.0 + 2.0**-6]


def test_split_products_sit_between_tf32_and_float32():
    """Relative RMS error against float64 of a 64 x 64 product: one TF32 pass errs near 2^-11, 3xTF32 within a
    small factor of float32's own (above it: its dropped parts), bf16x6 as float32."""
    rng = np.random.default_rng(0)
    a, b = rng.standard_normal((64, 64)).astype(np.float32), rng.standard_normal((64, 64)).astype(np.float32)
    exact = a.astype(np.float64) @ b.astype(np.float64)

    def err(c):
        return float(np.sqrt(np.mean((c - exact) ** 2) / np.mean(exact**2)))

    f32, x3, x6, one = err(a @ b), err(tf32x3_matmul(a, b)), err(bf16x6_matmul(a, b)), err(tf32_matmul(a, b))
    assert f32 < x3 < 20 * f32 and x6 < 2 * f32 and 100 * x3 < one
    assert torch.finfo(torch.float32).eps < one < 2.0**-9
