"""Grouped matrix product for stacked expert weights: one call for all experts, jagged token counts.

``out[rows of group e] = x[rows of group e] @ w[e]`` where the rows of ``x`` are sorted by group and
``offsets[e]`` is the (exclusive) end row of group e.

Two paths, same numbers:

* ``torch.nn.functional.grouped_mm`` -- used when the build supports the inputs: CUDA bfloat16 on
  sm80+ (the fast path on H100/H200), and CPU float32/bfloat16 (torch >= 2.9 ships a CPU kernel);
  both need row strides that are multiples of 16 bytes.
* a fallback that loops over the groups with ``torch.matmul`` -- any dtype (float64 for tests), any
  device, any width. It is differentiable through ordinary autograd.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["grouped_mm", "native_grouped_mm_supported"]

_NATIVE = hasattr(F, "grouped_mm")


def _aligned(t: torch.Tensor) -> bool:
    """Unit last stride, all other strides and the data pointer on 16-byte boundaries. Under ``torch.compile`` the
    pointer is unknown while tracing (a fake tensor has none) and only the strides are checked: the compiled graph
    allocates its intermediates on the allocator's 512-byte boundaries, and parameters are whole allocations."""
    if t.stride(-1) != 1 or (not torch.compiler.is_compiling() and t.data_ptr() % 16):
        return False
    elem = t.element_size()
    return all((s * elem) % 16 == 0 for s in t.stride()[:-1])


def native_grouped_mm_supported(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether ``torch.nn.functional.grouped_mm`` runs (and is used) for these operands."""
    if not _NATIVE or x.dtype != w.dtype or x.device != w.device or x.shape[0] == 0:
        return False
    if x.is_cuda:
        if x.dtype != torch.bfloat16 or torch.cuda.get_device_capability(x.device) < (8, 0):
            return False
    elif x.device.type == "cpu":  # float32 runs eagerly, but torch.compile's shape rules accept bfloat16 only
        if x.dtype not in (torch.bfloat16,) + (() if torch.compiler.is_compiling() else (torch.float32,)):
            return False
    else:
        return False
    return _aligned(x) and _aligned(w)


class _ContiguousGrad(torch.autograd.Function):
    """Identity whose backward makes the incoming gradient dense: the native kernel's backward rejects
    expanded (stride-0) gradients such as the one ``out.sum()`` produces."""

    @staticmethod
    def forward(ctx, t: torch.Tensor) -> torch.Tensor:  # noqa: D102
        return t.view_as(t)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:  # noqa: D102
        return grad.contiguous()


def _grouped_mm_loop(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    ends = offsets.tolist()
    starts = [0, *ends[:-1]]
    parts = [x[s:e] @ w[g] for g, (s, e) in enumerate(zip(starts, ends, strict=True)) if e > s]
    if ends and ends[-1] < x.shape[0]:  # rows past the last group belong to no group
        parts.append(x.new_zeros(x.shape[0] - ends[-1], w.shape[-1]))
    return torch.cat(parts) if parts else x.new_zeros(0, w.shape[-1])


def grouped_mm(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor, *, backend: str = "auto") -> torch.Tensor:
    """Grouped matrix product ``out[offsets[e-1]:offsets[e]] = x[offsets[e-1]:offsets[e]] @ w[e]``.

    Args:
        x: ``[M, d]`` rows sorted by group.
        w: ``[E, d, f]`` stacked weights (same dtype as ``x``; under ``torch.autocast`` both are cast to
            the autocast dtype).
        offsets: ``[E]`` int32 (int64 accepted) cumulative ends of the groups, non-decreasing,
            ``offsets[-1] <= M`` (not checked: that would synchronise a GPU). Rows past ``offsets[-1]`` belong to
            no group: their output is unspecified (zeros on the loop path) and they reach no weight gradient.
        backend: ``"auto"`` (native when :func:`native_grouped_mm_supported`, else the loop),
            ``"native"`` or ``"loop"``.

    Returns:
        ``[M, f]`` in the dtype of ``x``; differentiable with respect to ``x`` and ``w``.
    """
    if x.dim() != 2 or w.dim() != 3 or x.shape[1] != w.shape[1]:
        raise ValueError(f"grouped_mm needs x [M, d] and w [E, d, f], got {tuple(x.shape)} and {tuple(w.shape)}")
    if offsets.shape != (w.shape[0],):
        raise ValueError(f"offsets must be [E] = [{w.shape[0]}], got shape {tuple(offsets.shape)}")
    if backend not in ("auto", "native", "loop"):
        raise ValueError(f"backend must be 'auto', 'native' or 'loop', got {backend!r}")
    if torch.is_autocast_enabled(x.device.type):
        dtype = torch.get_autocast_dtype(x.device.type)
        x, w = x.to(dtype), w.to(dtype)
    elif x.dtype != w.dtype:
        raise ValueError(f"x and w must share a dtype outside autocast, got {x.dtype} and {w.dtype}")
    use_native = native_grouped_mm_supported(x, w) if backend == "auto" else backend == "native"
    if not use_native:
        return _grouped_mm_loop(x, w, offsets)
    with torch.autocast(x.device.type, enabled=False):
        out = F.grouped_mm(x, w, offs=offsets.to(device=x.device, dtype=torch.int32))
    return _ContiguousGrad.apply(out)
