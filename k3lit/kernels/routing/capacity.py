"""Causal capacity routing in two Triton launches (docs/MATH.md §2, capacity modes).

Tokens are admitted in *priority order*, position 0 of every sequence, then position 1, and so on; each takes its
top k of ``s + b`` among the experts that hold fewer than ``c`` tokens. Until the first expert fills, every token
takes its plain top k, so a parallel pass (``_free_choices``, one program per block of ``BLOCK`` tokens) writes
every token's plain top k and each block's per-expert counts. One program (``_admit``) then adds the blocks' counts
up to the first block that would overflow an expert and walks the priority order from there, a block at a time:
with the set of full experts fixed, every token of the block chooses at once (k arg-maxes over its row), a running
count down the block finds the first token that would overflow an expert, the tokens before it are final, the
experts they filled close, and the block resumes from that token. Each pass finalises the rest of the block or
closes at least one expert, so the walk makes at most ``m / BLOCK + n`` passes: no host synchronisation, and
``torch.compile`` sees one opaque op.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

TILE_ELEMENTS = 4096
"""Tokens x experts (padded to a power of two) a pass holds: 256 tokens of 16 experts."""


@triton.jit
def _slot_ranks(key, cols, K: tl.constexpr):
    """``[BLOCK, NP]`` int32: s + 1 where column j is a row's s-th largest of ``key`` (s < K), else 0; columns at
    -inf are never taken, so a row with fewer than K finite entries takes fewer."""
    ranks = tl.zeros(key.shape, tl.int32)
    rest = key
    for s in tl.static_range(K):
        best = tl.max(rest, axis=1)
        at = tl.argmax(rest, axis=1)
        hit = (cols[None, :] == at[:, None]) & (best > float("-inf"))[:, None]
        ranks = tl.where(hit, s + 1, ranks)
        rest = tl.where(hit, float("-inf"), rest)
    return ranks


@triton.jit
def _load_key(scores_ptr, bias, rank, cols, col_ok, m, n, n_seq, seq_len):
    """``(key [BLOCK, NP], row [BLOCK] int64)``: ``s + b`` of the tokens at priority ranks ``rank`` (position ``rank //
    n_seq`` of sequence ``rank % n_seq``), -inf in padded columns, past the last token and for a NaN score (which
    no expert then takes: on the GPU a NaN would make the arg-max pick a padded column)."""
    valid = rank < m
    row = ((rank % n_seq) * seq_len + rank // n_seq).to(tl.int64)
    s = tl.load(scores_ptr + row[:, None] * n + cols[None, :], mask=valid[:, None] & col_ok[None, :],
                other=float("-inf"))
    key = s + bias.to(s.dtype)[None, :]
    return tl.where(key == key, key, float("-inf")), row


@triton.jit
def _store_slots(out_ptr, row, ranks, cols, mask, K: tl.constexpr):
    """Each row's experts in slot order (-1 where a slot has none) from :func:`_slot_ranks`' ranks."""
    for slot in tl.static_range(K):
        expert = tl.max(tl.where(ranks == slot + 1, cols[None, :], -1), axis=1)
        tl.store(out_ptr + row * K + slot, expert.to(tl.int64), mask=mask)


@triton.jit
def _free_choices(scores_ptr, bias_ptr, out_ptr, counts_ptr, dropped_ptr, m, n, n_seq, seq_len,
                  K: tl.constexpr, NP: tl.constexpr, BLOCK: tl.constexpr):
    lanes = tl.arange(0, BLOCK)
    cols = tl.arange(0, NP)
    col_ok = cols < n
    rank = tl.program_id(0) * BLOCK + lanes
    bias = tl.load(bias_ptr + cols, mask=col_ok, other=0.0)
    key, row = _load_key(scores_ptr, bias, rank, cols, col_ok, m, n, n_seq, seq_len)
    ranks = _slot_ranks(key, cols, K)
    _store_slots(out_ptr, row, ranks, cols, rank < m, K)
    taken = (ranks > 0).to(tl.int32)
    tl.store(counts_ptr + tl.program_id(0) * NP + cols, tl.sum(taken, axis=0))
    tl.store(dropped_ptr + tl.program_id(0), tl.sum(tl.where(rank < m, K - tl.sum(taken, axis=1), 0), axis=0))


@triton.jit
def _admit(scores_ptr, bias_ptr, out_ptr, counts_ptr, dropped_ptr, stats_ptr, m, n, n_seq, seq_len, cap,
           K: tl.constexpr, NP: tl.constexpr, BLOCK: tl.constexpr):
    lanes = tl.arange(0, BLOCK)
    cols = tl.arange(0, NP)
    col_ok = cols < n
    bias = tl.load(bias_ptr + cols, mask=col_ok, other=0.0)
    room = tl.where(col_ok, cap, 0)  # padded experts count as full
    # the blocks whose plain choices fit the room left are final as _free_choices wrote them
    n_blocks = tl.cdiv(m, BLOCK)
    block = 0
    dropped = tl.zeros([], tl.int32)  # slots of the skipped blocks with no finite score to take
    go = n_blocks > 0
    while go:
        count = tl.load(counts_ptr + block * NP + cols)
        fits = tl.max((count > room).to(tl.int32), axis=0) == 0
        room = tl.where(fits, room - count, room)
        dropped += tl.where(fits, tl.load(dropped_ptr + block), 0)
        block = tl.where(fits, block + 1, block)
        go = fits & (block < n_blocks)
    rerouted = tl.zeros([], tl.int32)
    for start in range(block * BLOCK, m, BLOCK):
        rank = start + lanes
        valid = rank < m
        key, row = _load_key(scores_ptr, bias, rank, cols, col_ok, m, n, n_seq, seq_len)
        top = _slot_ranks(key, cols, K) > 0  # the first k candidates, for the re-routed count
        done = start
        while done < start + BLOCK:
            ranks = _slot_ranks(tl.where((room > 0)[None, :], key, float("-inf")), cols, K)
            active = valid & (rank >= done)
            taken = ((ranks > 0) & active[:, None]).to(tl.int32)
            over = tl.max((tl.cumsum(taken, axis=0) > room[None, :]).to(tl.int32), axis=1) > 0
            first = tl.min(tl.where(over, lanes, BLOCK))  # the first token that would overflow an expert
            final = active & (lanes < first)
            _store_slots(out_ptr, row, ranks, cols, final, K)
            kept = taken * final[:, None].to(tl.int32)
            room -= tl.sum(kept, axis=0)
            rerouted += tl.sum(tl.sum(tl.where(top, 0, kept), axis=1), axis=0)
            dropped += tl.sum(tl.where(final, K - tl.sum(kept, axis=1), 0), axis=0)
            done = start + first
    tl.store(stats_ptr, rerouted.to(tl.int64))
    tl.store(stats_ptr + 1, dropped.to(tl.int64))


def causal_capacity(scores: torch.Tensor, bias: torch.Tensor, k: int, cap: int,
                    seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Experts of every token under the causal count limit, and the re-routed and dropped slot counts.

    Args:
        scores: ``[m, n]`` router scores, ``m = B · seq_len`` rows sequence-major (float32 or float64; read, not
            differentiated).
        bias: ``[n]`` selection bias (cast to ``scores``' dtype).
        k: experts per token, ``1 <= k <= n``.
        cap: tokens an expert takes, ``1 <= cap``.
        seq_len: T.

    Returns:
        ``(expert_idx [m, k] int64, stats [2] int64)``: per token its experts in the order of ``s + b`` (-1 for a
        slot that found every remaining candidate full); ``stats`` = (re-routed slots, i.e. kept on an expert
        outside the token's first k candidates; dropped slots).
    """
    m, n = scores.shape
    scores = scores.detach().contiguous()
    out = torch.empty(m, k, dtype=torch.int64, device=scores.device)
    stats = torch.zeros(2, dtype=torch.int64, device=scores.device)
    if m == 0:
        return out, stats
    bias = bias.detach().contiguous()
    NP = max(16, triton.next_power_of_2(n))
    block = max(16, min(512, TILE_ELEMENTS // NP))
    n_blocks = triton.cdiv(m, block)
    counts = torch.empty(n_blocks, NP, dtype=torch.int32, device=scores.device)
    dropped = torch.empty(n_blocks, dtype=torch.int32, device=scores.device)
    args = (m, n, m // seq_len, seq_len)
    _free_choices[(n_blocks,)](scores, bias, out, counts, dropped, *args, K=k, NP=NP, BLOCK=block, num_warps=4)
    _admit[(1,)](scores, bias, out, counts, dropped, stats, *args, cap, K=k, NP=NP, BLOCK=block, num_warps=4)
    return out, stats
