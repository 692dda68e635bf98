"""Chunk index tables of the packed layout the KDA launchers work on.

Every launcher works on a packed layout ``[1, T_total, H, X]``; a dense ``[B, T]`` batch is the packed batch
with ``cu_seqlens = [0, T, 2T, ...]``. Chunk metadata: ``chunk_idx [NC, 2]`` = (sequence, chunk in the
sequence) for every chunk, ``chunk_off [N + 1]`` = first global chunk of each sequence. Per-chunk buffers
(states) are allocated with the static upper bound ``T_total // C + N`` rows (:func:`max_chunks`) so that their
shapes never depend on the values of ``cu_seqlens`` (torch.compile's fake tensors need that).
"""

from __future__ import annotations

import functools

import torch
import triton

from k3lit.kernels.streams import cacheable


def chunk_meta(
    cu_seqlens: torch.Tensor | None, B: int, T: int, C: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """Packed-layout chunk metadata.

    Returns ``(cu [N + 1] int64, chunk_idx [NC, 2] int32, chunk_off [N + 1] int32, NC)``. Tables are kept for
    later calls only where :func:`cacheable` (the device's default stream, outside a graph capture), and the kept
    tensors are shared, so callers must only read them. On any other stream (a CUDA graph's capture or warm-up, a
    user's stream) they are built afresh each call: a table made inside a capture holds its values only when the
    graph replays, and one made during a CUDA-graph warm-up lives in the graph's memory pool, which must hold no
    tensor beyond the graph's outputs. A dense batch (``cu_seqlens`` None): built without reading device memory,
    kept per (B, T, C, device). A packed batch: built from its lengths (one read back to the host), kept for the
    latest ``cu_seqlens`` tensor (:data:`_packed_cache`).
    """
    keep = cacheable(device)
    if cu_seqlens is None:
        return _dense_meta(B, T, C, device) if keep else _dense_meta.__wrapped__(B, T, C, device)
    key = (cu_seqlens.data_ptr(), cu_seqlens._version, cu_seqlens.numel(), C, device)
    if keep and _packed_cache and _packed_cache[0][0] == key:
        return _packed_cache[0][2]
    meta = _packed_meta(cu_seqlens, C, device)
    if keep:  # the tensor stays referenced, so no other tensor can take its address while it is kept
        _packed_cache[:] = [(key, cu_seqlens, meta)]
    return meta


#: The latest packed batch's tables, ``[(key, cu_seqlens, meta)]``: every KDA layer of a forward and backward gets the
#: same ``cu_seqlens`` (:class:`k3lit.nn.documents.Documents`), so the lengths are read back to the host once a step
#: instead of once a call. The key holds the tensor's address and version counter (an in-place change misses).
_packed_cache: list[tuple[tuple, torch.Tensor, tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]]] = []


def _packed_meta(cu_seqlens: torch.Tensor, C: int, device: torch.device
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """:func:`chunk_meta` of a packed batch, from its lengths (one read back to the host)."""
    cu = cu_seqlens.to(device=device, dtype=torch.int64)
    n_chunks = (cu[1:] - cu[:-1] + C - 1) // C
    off = torch.cat([n_chunks.new_zeros(1), n_chunks.cumsum(0)]).to(torch.int32)
    nc = int(off[-1].item())
    seq = torch.repeat_interleave(torch.arange(len(n_chunks), device=device, dtype=torch.int32), n_chunks,
                                  output_size=nc)
    pos = torch.arange(nc, device=device, dtype=torch.int32) - off[:-1].long()[seq.long()].to(torch.int32)
    return cu, torch.stack([seq, pos], 1).contiguous(), off, nc


@functools.lru_cache(maxsize=64)
def _dense_meta(B: int, T: int, C: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """:func:`chunk_meta` of a dense batch, built once per (B, T, C, device) where :func:`cacheable`: every KDA call
    of a training step (forward, backward, recomputation) reuses it instead of launching ~10 small kernels. The
    kernels only read it."""
    n_per = triton.cdiv(T, C)
    cu = torch.arange(0, B + 1, device=device, dtype=torch.int64) * T
    seq = torch.arange(B, device=device, dtype=torch.int32).repeat_interleave(n_per)
    pos = torch.arange(n_per, device=device, dtype=torch.int32).repeat(B)
    off = torch.arange(0, B + 1, device=device, dtype=torch.int32) * n_per
    return cu, torch.stack([seq, pos], 1).contiguous(), off, B * n_per


def max_chunks(T_total: int, N: int, C: int) -> int:
    """Static upper bound on the number of chunks of a packed batch (each sequence adds one partial chunk)."""
    return T_total // C + N
