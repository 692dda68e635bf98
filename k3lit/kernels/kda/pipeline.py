"""Pipeline segments of the chunked KDA launchers: a dense batch's chunks cut into segments, each the same range of
chunks of every sequence, whose sequential scans run on a side stream beside another segment's per-chunk
kernels (how many: :func:`k3lit.kernels.kda.plan._segments`). Holds the segment tables, the side streams and the
context managers that order the launches on them.
"""

from __future__ import annotations

import contextlib
import functools

import torch
import triton

from k3lit.kernels.kda.plan import _segments
from k3lit.kernels.streams import cacheable


def _segment_plan(which: str, B: int, H: int, T: int, C: int, cu_seqlens: torch.Tensor | None, cidx: torch.Tensor,
                  NC: int, device: torch.device) -> tuple[torch.Tensor, tuple[tuple[int, int, int, int], ...]]:
    """The chunk table and ``((row_lo, row_hi, it_lo, it_hi), ...)`` segments the ``"fwd"`` or ``"bwd"`` launches
    run over: :func:`_segment_table` for :func:`_segments` > 1, else ``cidx`` whole, its chunks unbounded."""
    P = _segments(which, B, H, T, C, cu_seqlens)
    if P == 1:
        return cidx, ((0, NC, 0, 2**31 - 1),)
    return _segment_table(B, triton.cdiv(T, C), P, device)


@functools.lru_cache(maxsize=64)
def _segment_table_cached(B: int, n_per: int, P: int, device: torch.device
                          ) -> tuple[torch.Tensor, tuple[tuple[int, int, int, int], ...]]:
    """The chunk table of a dense batch of B sequences with ``n_per`` chunks each, ordered by pipeline segment:
    segment s (of ``min(P, n_per)``) covers chunks ``[lo_s, lo_{s+1})`` of every sequence, ``lo_s = s n_per // P``
    (the longer segments last: the first one's per-chunk kernels run before any scan can start). Returns ``(table
    [NC, 2] int32, ((row_lo, row_hi, lo, hi), ...))``: each segment's rows of the table and its chunk range. Cached
    like ``index._dense_meta``."""
    P = min(P, n_per)
    bounds = [s * n_per // P for s in range(P + 1)]
    parts, segs = [], []
    for lo, hi in zip(bounds[:-1], bounds[1:]):
        seq = torch.arange(B, device=device, dtype=torch.int32).repeat_interleave(hi - lo)
        pos = torch.arange(lo, hi, device=device, dtype=torch.int32).repeat(B)
        parts.append(torch.stack([seq, pos], 1))
        row = segs[-1][1] if segs else 0
        segs.append((row, row + B * (hi - lo), lo, hi))
    return torch.cat(parts).contiguous(), tuple(segs)


def _segment_table(B: int, n_per: int, P: int, device: torch.device
                   ) -> tuple[torch.Tensor, tuple[tuple[int, int, int, int], ...]]:
    """:func:`_segment_table_cached`, kept only where ``streams.cacheable`` (built afresh on other streams, as in a
    CUDA graph's capture or warm-up)."""
    if cacheable(device):
        return _segment_table_cached(B, n_per, P, device)
    return _segment_table_cached.__wrapped__(B, n_per, P, device)


@functools.cache
def _side_streams_of(device: torch.device, caller: int) -> tuple[torch.cuda.Stream, torch.cuda.Stream]:
    """The pipeline's two side streams on a CUDA ``device`` for work queued on the stream with handle ``caller``
    (each caller stream its own, so that pipelines on different streams never wait for each other): the state
    scans' and the output kernel's. The scans are
    the pipeline's critical path, so their stream has a higher priority: the block scheduler then places a scan's
    programs before waiting blocks of the per-chunk kernels as SMs free up."""
    return torch.cuda.Stream(device, priority=-1), torch.cuda.Stream(device)  # -1: above the default 0


def _side_streams(device: torch.device) -> tuple[torch.cuda.Stream, torch.cuda.Stream]:
    """:func:`_side_streams_of` the current stream of ``device``."""
    return _side_streams_of(device, torch.cuda.current_stream(device).cuda_stream)


@contextlib.contextmanager
def _pipeline(device: torch.device, segments: int):
    """``(caller's stream, side streams)`` of a pipeline of ``segments`` segments on ``device``, ``(None, None)``
    where nothing runs concurrently (one segment, or not CUDA): the side streams wait for the work queued on the
    caller's stream on entry, and the caller's stream waits for theirs on exit, also when a launch fails (buffers
    the side streams read are freed on the caller's stream, and a CUDA graph capture must join every stream it
    forked)."""
    if device.type != "cuda" or segments < 2:
        yield None, None
        return
    main = torch.cuda.current_stream(device)
    side = _side_streams(device)
    for s in side:
        s.wait_stream(main)
    try:
        yield main, side
    finally:
        for s in side:
            main.wait_stream(s)


@contextlib.contextmanager
def _on(stream: torch.cuda.Stream | None, after: torch.cuda.Stream | None):
    """Launch on ``stream`` once the work queued so far on ``after`` (if any) is done; with no stream, where we
    are."""
    if stream is None:
        yield
        return
    if after is not None:
        stream.wait_event(after.record_event())
    with torch.cuda.stream(stream):
        yield


def _on_inputs_device(launcher):
    """Run ``launcher(q, ...)`` with ``q``'s CUDA device current: Triton launches on the current device's current
    stream, and the pipeline's streams and events belong to ``q``'s device."""
    @functools.wraps(launcher)
    def run(q: torch.Tensor, *args, **kwargs):
        if q.device.type != "cuda":
            return launcher(q, *args, **kwargs)
        with torch.cuda.device(q.device):
            return launcher(q, *args, **kwargs)
    return run
