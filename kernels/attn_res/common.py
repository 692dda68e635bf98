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

import functools
from collections import OrderedDict

import torch
import triton
import triton.language as tl

DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
MAX_DIM = 8192  # a whole row per tile: at 16 warps, 16 values per thread and tile
# 16 values per thread and tile (BT * BD = 2048 at 4 warps): sm_90 compiles of the forward / backward then take
# about 64 / 93 registers at D = 1024 (BT = 2), no spills, so 8 / 5 programs share an SM.
ELEMS_PER_THREAD = 16


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


def row_tiles(D: int, block_rows: int | None) -> tuple[int, int, int]:
    """``(BT, BD, num_warps)``: whole rows, at least 4 warps, ELEMS_PER_THREAD values per thread and tile."""
    BD = triton.next_power_of_2(D)
    BT = block_rows or max(1, min(16, 4 * 32 * ELEMS_PER_THREAD // BD))
    return BT, BD, max(4, min(16, BT * BD // (32 * ELEMS_PER_THREAD)))


# Device copies of recent tables, keyed by (device, stream, content). Training allocates the same tensors at the
# same addresses step after step, so most launches find their table here and skip a pinned allocation and a
# host-to-device copy. A table holds only addresses and codes, so one equal in content is valid for any
# tensors at those addresses; the stream in the key keeps a kernel from reading a copy another stream has not
# finished. 4096 entries of a few hundred bytes.
TABLES: OrderedDict[tuple, torch.Tensor] = OrderedDict()
TABLES_MAX = 4096


def address_table(columns: list[list[int]], device: torch.device) -> torch.Tensor:
    """The int64 address/code table on ``device`` (on CUDA a cached copy, or a pinned asynchronous copy: no host
    sync)."""
    flat = tuple(v for col in columns for v in col)
    if device.type != "cuda":
        return torch.tensor(flat, dtype=torch.int64)
    key = (device, torch.cuda.current_stream(device).cuda_stream, flat)
    table = TABLES.get(key)
    if table is None:
        table = torch.tensor(flat, dtype=torch.int64, pin_memory=True).to(device, non_blocking=True)
        TABLES[key] = table
        if len(TABLES) > TABLES_MAX:
            TABLES.popitem(last=False)
    else:
        TABLES.move_to_end(key)
    return table


@functools.cache
def max_programs(device: torch.device) -> int:
    """Backward grid: 4 programs per SM on CUDA; 3 under the interpreter so tests run the tile loop unevenly."""
    if device.type != "cuda":
        return 3
    return 4 * torch.cuda.get_device_properties(device).multi_processor_count


def aligned(addrs: list[int]) -> bool:
    return all(a % 16 == 0 for a in addrs)
