"""The launch plan of the chunked KDA kernels: which kernels run, in which blocks and warps, with which operand
dtypes. No autotuning: every choice is a fixed function of K, V, the dtype, the number of sequence-heads and the
GPU's SM count, never of T, so a new sequence length or batch size reuses the compiled kernels. ``TUNING`` holds
the settings; the rules that ``"auto"`` applies (:func:`_scan_plan`, :func:`_plain_out_fused`, :func:`_segments`)
come from H200 timings (docs/DECISIONS.md, "KDA kernels"); ``benchmarks/kda_tuning.py`` times alternatives side by
side (its section of benchmarks/RESULTS.md, "KDA launch settings (<GPU>)").
"""

from __future__ import annotations

import os

import torch
import triton

from k3lit.kernels import gpu

#: Launch settings; each default is the fastest alternative timed on the H200 (``main_bwd_keep``: on an H100;
#: docs/DECISIONS.md, "KDA kernels"; ``benchmarks/kda_tuning.py`` times alternatives).
#: ``fwd_scan`` / ``bwd_scan``: ``"plain"`` keeps a scan's state as ``[BK, BV]`` (:func:`_scan_fwd` + :func:`_out_fwd`,
#: :func:`_scan_bwd`), ``"transposed"`` as ``[BV, BK]`` (:func:`_scan_fwd_t`, which writes the output itself,
#: :func:`_scan_bwd_t`), ``"auto"`` picks by :func:`_scan_plan`; ``fwd_bv`` / ``bwd_bv``: value columns per scan
#: program (None: by :func:`_scan_plan`); ``*_warps``: warps per program (``scan_warps`` None: 4 for K <= 128, else
#: 8); ``main_bwd_bv``: value block of :func:`_main_bwd` (None: 64, or 32 for V > 128, where 32 is the faster).
#: ``main_bwd_keep``: where :func:`_main_bwd` keeps its key-side results between passes: ``"registers"`` (default)
#: where K fits one key block (K <= 64), so that none of the five ``[B, T, H, K]`` float32 tensors is written or
#: read, else ``"scratch"`` (float32 tensors in memory, read back by the same program; always for K > 64). The same
#: arithmetic either way; compiled for a GPU the two forms round a few float32 results differently (relative RMS
#: 5e-6 at ``small``'s shape); there the registers form's forward + backward is 10% faster on an H100.
#: ``fwd_prep``: ``"fused"`` (default) runs the forward's per-chunk work in one kernel, :func:`_prep_fwd`, on
#: ``prep_warps`` warps (default 1); ``"split"`` runs :func:`_intra_fwd` then :func:`_wy_fwd`. The fused kernel is the
#: faster on 1 warp in 32-wide steps; on 2 or 4 warps it is slower than the split pair, and in 64-wide steps its
#: registers spill.
#: ``inverse_block``: the width of the diagonal blocks that :func:`_inverse` inverts by forward substitution before
#: doubling them up to C with 3xTF32 products (None or >= C: the plain substitution, C - 1 dependent steps). 16 is the
#: fastest of 32 / 16 / 8 / 4 at every shape timed: wider blocks take more dependent steps, and each further
#: doubling's two products cost more than the steps they save.
#: ``intra_bk``, ``wy_bk``, ``wy_bv``: key / value columns per step of :func:`_intra_fwd` and of :func:`_wy_fwd` or
#: :func:`_prep_fwd` (None: 64 split, 32 fused; K / V rounded up to a power of two when smaller).
#: ``fwd_plain_out``: with the plain forward scan, ``"separate"`` forms the output in :func:`_out_fwd` from the stored
#: states, ``"fused"`` in the scan itself (the per-chunk states and Delta are then stored only for the backward),
#: ``"auto"`` (default) by :func:`_plain_out_fused`: fused where no backward follows.
#: ``u_dtype``: the dtype U = M Diag(beta) V is stored in between the per-chunk kernels and the forward scan:
#: ``"float32"``, or ``"work"`` (bf16 for bf16 and fp16 inputs): half U's bytes and a slightly faster forward, but a
#: relative difference of about 1e-3 from float32 U on o and the gradients, so not the default.
#: ``fwd_segments`` / ``bwd_segments``: pipeline segments over a dense batch (1: none; ``"auto"``: by
#: :func:`_segments`). Segment s covers the same range of chunks of every sequence; on CUDA its state scan (and
#: output kernel) runs on side streams as soon as its per-chunk kernels are done, concurrently with the next
#: segment's, so the latency-bound scan does not wait for the whole sequence's per-chunk work. The backward goes
#: last segment first: each segment's reverse scan runs on a side stream and its ``_main_bwd`` on the caller's stream
#: once that scan is done, beside the scan of the segment before it. The outputs are bit-identical for any count
#: (``pipeline.py``).
TUNING: dict = dict(fwd_scan="auto", fwd_bv=None, bwd_scan="auto", bwd_bv=None, scan_warps=None, intra_warps=2,
                    wy_warps=1, out_warps=4, main_bwd_warps=4, main_bwd_bv=None, main_bwd_keep="registers",
                    intra_bk=None, wy_bk=None,
                    wy_bv=None, fwd_segments="auto", bwd_segments="auto", fwd_plain_out="auto",
                    u_dtype="float32", fwd_prep="fused", prep_warps=1, inverse_block=16)


def _pow2(x: int) -> int:
    return max(16, triton.next_power_of_2(x))


def _work_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float32 if dtype == torch.float32 else torch.bfloat16


def _f32_operands(dtype: torch.dtype) -> bool:
    """float32 matrix operands for float32 inputs, and always under the interpreter (which multiplies
    bfloat16 operands in float16, where the rebased exponentials overflow)."""
    return dtype == torch.float32 or os.environ.get("TRITON_INTERPRET") == "1"


def _plain_out_shapes(K: int, V: int, dtype: torch.dtype) -> bool:
    """Where the plain forward scan may write the output under ``"auto"``: K, V <= 128 and bf16 or fp16 inputs.
    There :func:`_out_fwd` takes all keys in one product, as the scan does, so that the two sum alike; elsewhere
    it takes 64-wide key steps: float32 inputs' 3xTF32 products in one 128-wide step spill registers, in 64-wide
    ones they do not (docs/DECISIONS.md)."""
    return max(K, V) <= 128 and dtype != torch.float32


def _plain_out_fused(save: bool, K: int, V: int, dtype: torch.dtype) -> bool:
    """Whether the plain forward scan writes the output itself (``TUNING["fwd_plain_out"]``; ``"auto"``: when no
    backward follows, at :func:`_plain_out_shapes`). Without a backward the fused output saves
    :func:`_out_fwd`'s reading back of every per-chunk state, and the scan then stores neither the states nor
    Delta, a faster forward. With a backward to follow the scan must store them anyway and its longer trips cost
    more than :func:`_out_fwd` saves. Not taken at K or V > 128, where the fused scan needs 255 registers and is
    slower, nor for float32 inputs (not timed). H200 timings: docs/DECISIONS.md, "KDA kernels"."""
    mode = TUNING["fwd_plain_out"]
    if mode == "auto":
        return not save and _plain_out_shapes(K, V, dtype)
    return mode == "fused"


def _scan_plan(which: str, NH: int, K: int, V: int, device: torch.device, F32: bool, save: bool = True
               ) -> tuple[bool, int, int, int, int]:
    """``(transposed, BK, BV, num_warps, num_stages)`` of the ``"fwd"`` or ``"bwd"`` scan over ``NH`` = sequences x
    heads, with float32 matrix operands when ``F32``; ``save=False``: a forward with no backward to follow.

    The scans are latency-bound: one program per (sequence, head, value block) walks all chunks in order. Rule
    from H200 timings (docs/DECISIONS.md, "KDA kernels"): the transposed state in 64-wide value
    blocks (fewer, shorter steps) once there are enough programs for it, NH >= 64 forward and NH >= 96 backward;
    else the plain state in 32-wide blocks, 16-wide for the forward when even 16-wide ones leave SMs idle (B1 H16:
    128 programs on 132 SMs; at B2 H16 the 256 programs of 16-wide blocks share SMs and 32-wide ones are faster).
    The rule holds at K = V = 256 too. Without a backward to follow, at K > 128 the transposed forward takes
    128-wide value blocks (the outputs bit-identical): eight warps over a 64-row state split the products'
    columns, so each chunk the state goes through shared memory to both warpgroups, which both form the same
    [64, C] products (triton 3.6's TTGIR); on 128 rows each warpgroup owns 64. With the states stored for the
    backward the 128-wide blocks are slower, so 64.
    Float32 operands at K > 128 (sm_90a, benchmarks/kernel_resources.py): the transposed scans would need 408 KB of
    shared memory a block (the H200 has 227), so the plain ones, in 2 pipeline stages: at Triton's default 3 the
    plain backward scan needs 272 KB (triton 3.6), the forward 232 (3.8)."""
    wide_f32 = F32 and K > 128
    mode = TUNING[which + "_scan"]
    if mode == "auto":
        mode = "transposed" if NH >= (64 if which == "fwd" else 96) and not wide_f32 else "plain"
    BV = TUNING[which + "_bv"]
    if BV is None:
        if mode == "transposed":
            BV = 128 if which == "fwd" and not save and K > 128 else 64
        elif which == "fwd" and NH * triton.cdiv(V, 16) < gpu.sm_count(device):
            BV = 16
        else:
            BV = 32
    BK = _pow2(K)
    stages = 2 if wide_f32 else 3
    return mode == "transposed", BK, min(_pow2(V), BV), TUNING["scan_warps"] or (4 if BK <= 128 else 8), stages


def _segments(which: str, B: int, H: int, T: int, C: int, cu_seqlens: torch.Tensor | None) -> int:
    """Pipeline segments of the ``"fwd"`` or ``"bwd"`` launches (``TUNING[which + "_segments"]``; ``"auto"``: the
    rule below). Only a dense batch of more than one chunk is cut. ``"auto"`` takes 4 backward segments where the
    reverse scan is one long latency-bound chain beside little other work, B·H <= 16 and at least 512 chunks a
    sequence (T >= 16384 at C = 32), and never forward segments: with the forward scans loading G_last a chunk
    ahead (``common._g_last_of``), the forward without segments is faster or within 1% at every shape timed but
    one, eagerly and replayed from a CUDA graph (H200 timings: docs/DECISIONS.md, "KDA kernels")."""
    P = TUNING[which + "_segments"]
    n = triton.cdiv(T, C)
    if P == "auto":
        P = 4 if which == "bwd" and B * H <= 16 and n >= 512 else 1
    return P if cu_seqlens is None and n > 1 else 1
