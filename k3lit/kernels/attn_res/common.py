"""What the Attention-Residuals kernels share: sources passed as a device table of addresses and dtype codes, typed
loads and stores of whole-row tiles, and the row-tile and grid choices.

Sources arrive as separate tensors (stacking them would copy them all): a small int64 table on the device holds
their addresses and a dtype code per source (0 float32, 1 bfloat16, 2 float16, so the float32 embedding and bf16
sublayer outputs mix without a copy), and for outputs or gradients their addresses too. Tables are cached by
content (training reuses the same addresses every step), so a launch usually copies nothing. When every address
is 16-byte aligned (always, for tensors that start their storage) the kernels are told so and load 16 bytes per
access.
"""

from __future__ import annotations

from collections import OrderedDict

import torch
import triton
import triton.language as tl

from k3lit.kernels import gpu
from k3lit.kernels.streams import cacheable

DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
MAX_DIM = 8192  # a whole row per tile: at 8 warps a row, 32 values per thread
# Launch settings: each kernel's warps per 1024 columns (its warp scale in :func:`row_tiles`; a power of two), and
# the warps per SM that the persistent (fixed-grid) backward kernels are launched with. From the H200 sweep
# ``python benchmarks/attnres.py mix --sweep`` (benchmarks/RESULTS.md, "Attention residuals: depth-mix kernel").
TILES = {"mix_fwd": 1, "mix_bwd": 2, "inter_fwd": 1, "inter_bwd_logits": 1, "inter_bwd_sources": 2, "merge_fwd": 2,
         "merge_bwd": 2, "grid_warps_per_sm": 32}


@triton.jit
def typed(addr, DT: tl.constexpr, ALIGNED: tl.constexpr):
    p = addr.to(tl.pointer_type(DT))
    if ALIGNED:  # every address in the table is 16-byte aligned (checked on the host): vector loads
        p = tl.multiple_of(p, 16)
    return p


@triton.jit
def load_f32(addr, code, base, offs, mask, ALIGNED: tl.constexpr):
    """The ``[BT, BD]`` tile at ``addr + base + offs`` (elements) of a tensor of dtype ``code``, as float32 (0
    where masked). ``base`` is the tile's int64 first element, ``offs`` int32 offsets within the tile."""
    if code == 0:
        x = tl.load(typed(addr, tl.float32, ALIGNED) + base + offs, mask=mask, other=0.0)
    elif code == 1:
        x = tl.load(typed(addr, tl.bfloat16, ALIGNED) + base + offs, mask=mask, other=0.0).to(tl.float32)
    else:
        x = tl.load(typed(addr, tl.float16, ALIGNED) + base + offs, mask=mask, other=0.0).to(tl.float32)
    return x


@triton.jit
def store_as(addr, code, base, offs, mask, x, ALIGNED: tl.constexpr):
    """Store the float32 tile ``x`` at ``addr + base + offs`` converted to dtype ``code``."""
    if code == 0:
        tl.store(typed(addr, tl.float32, ALIGNED) + base + offs, x, mask=mask)
    elif code == 1:
        tl.store(typed(addr, tl.bfloat16, ALIGNED) + base + offs, x.to(tl.bfloat16), mask=mask)
    else:
        tl.store(typed(addr, tl.float16, ALIGNED) + base + offs, x.to(tl.float16), mask=mask)


@triton.jit
def row_tile(tile, M, D: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr):
    """Row tile ``tile`` of an ``[M, D]`` tensor taken ``BT`` whole rows at a time: ``(base, rows, m_row, mask,
    offs)``, the tile's int64 first element, its row indices and their mask, the ``[BT, BD]`` element mask and the
    int32 offsets within the tile."""
    row0 = tl.cast(tile, tl.int64) * BT
    rows = row0 + tl.arange(0, BT)
    cols = tl.arange(0, BD)
    m_row = rows < M
    return row0 * D, rows, m_row, m_row[:, None] & (cols < D)[None, :], tl.arange(0, BT)[:, None] * D + cols[None, :]


@triton.jit
def online_mix(
    table, N, u, su_ptr, su_row, r_ptr, store_r, base, offs, mask, rows, m_row, M, eps,
    D: tl.constexpr, ALIGNED: tl.constexpr,
):
    """One query ``u`` (``[BD]`` float32) over the N sources of ``table``, one row tile, in one pass with an online
    softmax (running max ``m`` and sum ``z``; the accumulator rescaled by ``exp(m_old - m_new)``): returns
    ``(acc, m, z)`` with ``acc / z`` the mix. Stores ``s_i·u`` at ``su_ptr + (su_row + i) M + rows`` and, where
    ``store_r``, ``1/rms(s_i)`` at ``r_ptr + i M + rows``, both float32, for the backward."""
    m = tl.full(rows.shape, float("-inf"), tl.float32)
    z = tl.zeros(rows.shape, tl.float32)
    acc = tl.zeros(mask.shape, tl.float32)
    for i in range(N):
        s = load_f32(tl.load(table + i), tl.load(table + N + i), base, offs, mask, ALIGNED)
        r = tl.rsqrt(tl.sum(s * s, axis=1) / D + eps)
        su = tl.sum(s * u[None, :], axis=1)
        l = su * r
        m_new = tl.maximum(m, l)
        rescale = tl.exp(m - m_new)  # 0 at i = 0 (m = -inf)
        p = tl.exp(l - m_new)
        z = z * rescale + p
        acc = acc * rescale[:, None] + p[:, None] * s
        m = m_new
        tl.store(su_ptr + (su_row + i) * M + rows, su, mask=m_row)
        tl.store(r_ptr + i * M + rows, r, mask=m_row & store_r)
    return acc, m, z


@triton.jit
def softmax_weight(su, r, m, inv_z):
    """``a_i = exp(su_i r_i - m) / z`` rebuilt from what :func:`online_mix` stored, as ``exp(·) * (1 / z)``: every
    backward kernel forms the weights with this one expression, so they agree bit for bit."""
    return tl.exp(su * r - m) * inv_z


@triton.jit
def softmax_dot(table, N, g, su_ptr, r_ptr, m, inv_z, base, offs, mask, rows, m_row, M, ALIGNED: tl.constexpr):
    """``Σ_i a_i g·s_i`` (``[BT]``) for one query over the N sources of ``table``, one row tile: the weights
    ``a_i = exp(su_i r_i - m) / z`` rebuilt from what :func:`online_mix` stored (``su_ptr``, ``r_ptr``) and its
    ``m`` and ``inv_z = 1 / z``; ``g`` the ``[BT, BD]`` float32 upstream gradient."""
    total = tl.zeros(rows.shape, tl.float32)
    for i in range(N):
        s = load_f32(tl.load(table + i), tl.load(table + N + i), base, offs, mask, ALIGNED)
        su = tl.load(su_ptr + i * M + rows, mask=m_row, other=0.0)
        r = tl.load(r_ptr + i * M + rows, mask=m_row, other=0.0)
        total += softmax_weight(su, r, m, inv_z) * tl.sum(g * s, axis=1)
    return total


def row_tiles(D: int, kernel: str) -> tuple[int, int, int]:
    """``(BT, BD, num_warps)`` of ``kernel`` (a key of TILES): tiles of ``BT`` whole rows (``BD`` = D rounded up to
    a power of two, masked), 32 values per thread. At warp scale 1, one warp per 1024 columns: at D <= 1024 a
    row's reductions stay inside its warp (shuffles; no shared memory, no barrier) and many small programs keep
    many loads in flight; scale k gives k times the warps and the rows (at most 8 warps). On the H200 at
    D = 1024 one-warp rows run the phase-1 forward faster than 4-warp tiles of 2 rows (benchmarks/RESULTS.md,
    "Attention residuals: depth-mix kernel")."""
    scale = TILES[kernel]
    assert scale > 0 and scale & (scale - 1) == 0, f"TILES[{kernel!r}] = {scale}: warp scales are powers of two"
    BD = triton.next_power_of_2(D)
    warps = min(8, max(1, BD // 1024) * scale)  # 16 warps of 128+ registers would spill
    return max(1, 1024 * warps // BD), BD, warps


# Device copies of recent tables, keyed by (device, content), made and kept only where eager training runs
# (:func:`~k3lit.kernels.streams.cacheable`). Training allocates the same tensors at the same addresses step after
# step, so most launches find their table here and skip a pinned allocation and a host-to-device copy. A table
# holds only addresses and codes, so one equal in content is valid for any tensors at those addresses. 4096
# entries of a few hundred bytes.
TABLES: OrderedDict[tuple, torch.Tensor] = OrderedDict()
TABLES_MAX = 4096
# Pinned host sources of the tables copied inside a CUDA graph capture: the graph's copy reads them again at every
# replay, so they live as long as the process (one per distinct table a captured graph holds).
CAPTURED_SOURCES: dict[tuple, torch.Tensor] = {}


def address_table(columns: list[list[int]], device: torch.device) -> torch.Tensor:
    """The int64 address/code table on ``device``: on the CPU a new tensor; on CUDA a cached copy where
    :func:`~k3lit.kernels.streams.cacheable`, else a fresh asynchronous copy from pinned memory (no host sync),
    whose source is kept for the graph's replays when the stream is capturing."""
    flat = tuple(v for col in columns for v in col)
    if device.type != "cuda":
        return torch.tensor(flat, dtype=torch.int64)
    if not cacheable(device):
        if torch.cuda.is_current_stream_capturing():
            source = CAPTURED_SOURCES.get(flat)
            if source is None:
                source = CAPTURED_SOURCES[flat] = torch.tensor(flat, dtype=torch.int64, pin_memory=True)
        else:
            source = torch.tensor(flat, dtype=torch.int64, pin_memory=True)
        return source.to(device, non_blocking=True)
    key = (device, flat)
    table = TABLES.get(key)
    if table is None:
        table = torch.tensor(flat, dtype=torch.int64, pin_memory=True).to(device, non_blocking=True)
        TABLES[key] = table
        if len(TABLES) > TABLES_MAX:
            TABLES.popitem(last=False)
    else:
        TABLES.move_to_end(key)
    return table


def grid_programs(device: torch.device, warps: int) -> int:
    """Programs of a persistent grid of ``warps``-warp programs: ``TILES["grid_warps_per_sm"]`` warps per SM on CUDA;
    3 under the interpreter, so that tests run the tile loop unevenly."""
    if device.type != "cuda":
        return 3
    return gpu.sm_count(device) * max(1, TILES["grid_warps_per_sm"] // warps)


def aligned(addrs: list[int]) -> bool:
    return all(a % 16 == 0 for a in addrs)
