"""Chunk tables of packed (varlen) batches: their values, and one read of the lengths per ``cu_seqlens`` tensor."""

from __future__ import annotations

import torch

from k3lit.kernels.kda import index
from k3lit.ops.kda import kda

DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # CPU: the kernels under TRITON_INTERPRET=1


def test_packed_chunk_tables():
    cu = torch.tensor([0, 5, 45, 46, 64], device=DEV)
    cu64, cidx, coff, nc = index.chunk_meta(cu, 1, 64, 32, DEV)
    assert nc == 5 and cu64.tolist() == cu.tolist()
    assert cidx.tolist() == [[0, 0], [1, 0], [1, 1], [2, 0], [3, 0]]
    assert coff.tolist() == [0, 1, 3, 4, 5]


def test_tables_are_built_once_per_tensor_and_again_after_a_change():
    cu = torch.tensor([0, 40, 64], device=DEV)
    first = index.chunk_meta(cu, 1, 64, 32, DEV)
    assert index.chunk_meta(cu, 1, 64, 32, DEV) is first
    other = index.chunk_meta(torch.tensor([0, 10, 64], device=DEV), 1, 64, 32, DEV)
    assert other[3] == 3 and other[1].tolist() == [[0, 0], [1, 0], [1, 1]]
    cu[1] = 10  # in place: the version counter moves, the tables follow
    assert index.chunk_meta(cu, 1, 64, 32, DEV)[2].tolist() == [0, 1, 3]


def test_forward_and_backward_read_the_lengths_once(monkeypatch, seed):
    calls = []
    build = index._packed_meta
    monkeypatch.setattr(index, "_packed_meta", lambda *a: calls.append(1) or build(*a))
    T, H, K = 70, 2, 16
    q, k = (torch.nn.functional.normalize(torch.randn(1, T, H, K, device=DEV), dim=-1) for _ in range(2))
    v = torch.randn(1, T, H, K, device=DEV, requires_grad=True)
    g = -torch.rand(1, T, H, K, device=DEV) * 2
    beta = torch.rand(1, T, H, device=DEV)
    cu = torch.tensor([0, 33, 34, 70], device=DEV)
    o, _ = kda(q, k, v, g, beta, cu_seqlens=cu, backend="triton", g_min=-2.0)
    o.sum().backward()
    assert v.grad is not None and len(calls) == 1
