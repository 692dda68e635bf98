"""The MoE layer's slots sorted by expert, as a counting sort in two Triton launches.

Slot ``s = i k + r`` is token i's r-th expert ``e_s`` (-1: dropped, sorted after every expert as group n). The
stable sort by group puts slot s at

    p_s = start[e_s] + #{s' < s : e_s' = e_s},   start[e] = #{s' : e_s' < e},

which is what ``argsort(stable=True)`` returns, computed without comparisons: ``_block_counts`` counts each block
of tokens' slots per group; ``_place`` (one program per block) adds the counts of the blocks before its
own and of the groups below each, and ranks its slots inside the block by a running count down the block. Each
``_place`` program reads every block's counts (``n_blocks x G`` int32: 32 KB at ``small``'s 32,768 tokens of 16
experts), so that read grows with the square of the tokens a call sorts.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

TILE_ELEMENTS = 4096
"""Tokens x groups (padded to a power of two) a program holds: 256 tokens of up to 16 groups, fewer for more
experts (the ``[tokens, groups]`` int32 tiles spill past about 4,096 entries at 4 warps)."""


@triton.jit
def _groups(idx_ptr, tokens, valid, n, slot: tl.constexpr, K: tl.constexpr):
    """Group of slot ``slot`` of the tokens ``tokens`` (n for a dropped slot, -1 past the last token)."""
    e = tl.load(idx_ptr + tokens.to(tl.int64) * K + slot, mask=valid, other=-2)
    return tl.where(e == -1, n, e).to(tl.int32)


@triton.jit
def _slot_counts(idx_ptr, tokens, valid, cols, n, K: tl.constexpr):
    """``[BLOCK, G]`` int32: how many of each token's K slots fall in each group."""
    counts = tl.zeros((tokens.shape[0], cols.shape[0]), tl.int32)
    for slot in tl.static_range(K):
        counts += (cols[None, :] == _groups(idx_ptr, tokens, valid, n, slot, K)[:, None]).to(tl.int32)
    return counts


@triton.jit
def _block_counts(idx_ptr, counts_ptr, m, n, K: tl.constexpr, G: tl.constexpr, BLOCK: tl.constexpr):
    tokens = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    cols = tl.arange(0, G)
    counts = _slot_counts(idx_ptr, tokens, tokens < m, cols, n, K)
    tl.store(counts_ptr + tl.program_id(0) * G + cols, tl.sum(counts, axis=0))


@triton.jit
def _place(idx_ptr, counts_ptr, order_ptr, inverse_ptr, ends_ptr, m, n, n_blocks,
           K: tl.constexpr, G: tl.constexpr, BLOCK: tl.constexpr, BLOCKS: tl.constexpr):
    pid = tl.program_id(0)
    cols = tl.arange(0, G)
    blocks = tl.arange(0, BLOCKS)
    every = tl.zeros((G,), tl.int32)  # slots per group over all blocks, and over the blocks before this one
    before = tl.zeros((G,), tl.int32)
    for first in range(0, n_blocks, BLOCKS):
        b = first + blocks
        c = tl.load(counts_ptr + b[:, None] * G + cols[None, :], mask=(b < n_blocks)[:, None], other=0)
        every += tl.sum(c, axis=0)
        before += tl.sum(tl.where((b < pid)[:, None], c, 0), axis=0)
    ends = tl.cumsum(every, axis=0)
    base = ends - every + before  # where this block's first slot of each group goes
    if pid == 0:
        tl.store(ends_ptr + cols, ends, mask=cols < n)
    tokens = pid * BLOCK + tl.arange(0, BLOCK)
    valid = tokens < m
    counts = _slot_counts(idx_ptr, tokens, valid, cols, n, K)
    place = base[None, :] + tl.cumsum(counts, axis=0) - counts  # [BLOCK, G]: a token's first slot of a group
    for slot in tl.static_range(K):
        e = _groups(idx_ptr, tokens, valid, n, slot, K)
        p = tl.sum(tl.where(cols[None, :] == e[:, None], place, 0), axis=1)
        for earlier in tl.static_range(slot):  # the token's own earlier slots of the same group (dropped ones)
            p += (_groups(idx_ptr, tokens, valid, n, earlier, K) == e).to(tl.int32)
        s = tokens.to(tl.int64) * K + slot
        tl.store(order_ptr + p.to(tl.int64), s, mask=valid)
        tl.store(inverse_ptr + s, p.to(tl.int64), mask=valid)


def sort_slots(expert_idx: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(order [m k] int64, inverse [m k] int64, ends [n] int32)`` of ``expert_idx [m, k]`` (int64 experts, -1 for
    a dropped slot) sorted stably by expert, dropped slots last: ``order[p]`` the slot at sorted position p,
    ``inverse[order[p]] = p``, ``ends[e]`` the end of expert e's rows."""
    m, k = expert_idx.shape
    idx = expert_idx.contiguous()
    dev = idx.device
    order = torch.empty(m * k, dtype=torch.int64, device=dev)
    inverse = torch.empty(m * k, dtype=torch.int64, device=dev)
    if m == 0:
        return order, inverse, torch.zeros(n, dtype=torch.int32, device=dev)
    G = max(16, triton.next_power_of_2(n + 1))
    block = max(16, min(256, TILE_ELEMENTS // G))
    n_blocks = triton.cdiv(m, block)
    counts = torch.empty(n_blocks, G, dtype=torch.int32, device=dev)
    ends = torch.empty(n, dtype=torch.int32, device=dev)
    _block_counts[(n_blocks,)](idx, counts, m, n, K=k, G=G, BLOCK=block, num_warps=4)
    blocks = max(16, min(TILE_ELEMENTS // G, triton.next_power_of_2(n_blocks)))
    _place[(n_blocks,)](idx, counts, order, inverse, ends, m, n, n_blocks, K=k, G=G, BLOCK=block, BLOCKS=blocks,
                        num_warps=4)
    return order, inverse, ends
