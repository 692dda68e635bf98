"""Ahead-of-time compilation of our Triton kernels for an NVIDIA GPU that is not there.

Triton's compiler (Triton IR -> PTX) and the ``ptxas`` it ships (PTX -> SASS) need no GPU and no driver, so a
CPU machine can compile every kernel for the H200 (``sm_90a``) exactly as the GPU machine would, and read the
resources each launch needs: registers per thread, bytes spilled to local memory, shared memory. This catches
what the interpreter (``TRITON_INTERPRET=1``) cannot: a kernel that does not compile for the GPU, or one whose
register tile spills.

Use: run a launcher (e.g. ``k3lit.kernels.kda.chunk_fwd.chunk_fwd``) on ``meta`` tensors of the real shapes inside
:func:`record_launches`, which stands in for the launched kernels and records each launch's arguments; then
:func:`compile_launch` compiles one recorded launch for the target and returns its :class:`Resources`
(:func:`compile_kernel`: the compiled kernel itself, PTX and cubin).
"""

from __future__ import annotations

import re
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from types import ModuleType

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, make_backend
from triton.runtime.jit import JITFunction, create_function_from_signature

H200 = GPUTarget("cuda", 90, 32)


@dataclass
class Launch:
    """One recorded kernel launch: the module attribute it was called through, its positional and keyword
    arguments (tensors may be on ``meta``: only dtype and address alignment are read)."""

    name: str
    kernel: object
    args: tuple
    kwargs: dict


@dataclass
class Resources:
    """What one compiled kernel needs per thread block: registers per thread, spill stores and loads (bytes per
    thread, 0 when the register tile fits), static shared memory (bytes), warps, and the compile time (s)."""

    name: str
    registers: int
    spill_stores: int
    spill_loads: int
    shared_bytes: int
    num_warps: int
    compile_s: float


class _Recorder:
    def __init__(self, name: str, kernel: object, sink: list[Launch], run: bool) -> None:
        self.name, self.kernel, self.sink, self.run = name, kernel, sink, run

    def __getitem__(self, grid: object):
        def launch(*args, **kwargs):
            self.sink.append(Launch(self.name, self.kernel, args, kwargs))
            if self.run:
                self.kernel[grid](*args, **kwargs)
        return launch


@contextmanager
def record_launches(module: ModuleType, *names: str, run: bool = False) -> Iterator[list[Launch]]:
    """Within the block, ``module.<name>[grid](...)`` records a :class:`Launch` instead of running the kernel (and
    runs it too with ``run``, for callers that read what the kernel writes).

    Raises:
        AttributeError: a name that is not an attribute of ``module``.
    """
    launches: list[Launch] = []
    saved = {n: getattr(module, n) for n in names}
    try:
        for n, k in saved.items():
            setattr(module, n, _Recorder(n, k, launches, run))
        yield launches
    finally:
        for n, k in saved.items():
            setattr(module, n, k)


_PTXAS = re.compile(r"Used (\d+) registers")
_SPILL = re.compile(r"(\d+) bytes spill stores, (\d+) bytes spill loads")


def _packed(launch: Launch, target: GPUTarget) -> tuple[dict, dict, dict, object]:
    """``(signature, constexprs, attrs, options)`` of ``launch`` as Triton's launcher packs them for ``target``."""
    fn = launch.kernel
    if not isinstance(fn, JITFunction):
        raise RuntimeError(f"{launch.name} is not a compilable JITFunction ({type(fn).__name__}): the Triton "
                           "interpreter was on when it was defined; compile in a process without TRITON_INTERPRET")
    backend = make_backend(target)
    binder = create_function_from_signature(fn.signature, fn.params, backend)
    bound, specialization, options = binder(*launch.args, **launch.kwargs)
    options, signature, constexprs, attrs = fn._pack_args(backend, launch.kwargs, bound, specialization, options)
    return signature, constexprs, attrs, options


def specialization_key(launch: Launch, target: GPUTarget = H200) -> str:
    """What decides which binary ``launch`` runs on ``target``: the kernel, its argument specialisation and
    compile options. Two launches with equal keys run the same compiled kernel.

    Raises:
        RuntimeError: the kernels were defined under ``TRITON_INTERPRET=1``.
    """
    signature, constexprs, attrs, options = _packed(launch, target)
    fn = launch.kernel.fn
    return repr((f"{fn.__module__}.{fn.__qualname__}", signature, constexprs, attrs, options))


def compile_kernel(launch: Launch, target: GPUTarget = H200):
    """Triton's compiled kernel for ``launch`` on ``target`` (its ``asm`` holds the PTX and the cubin), with the
    argument specialisation a real launch would get (dtypes, 16-byte alignment, integers divisible by 16 or equal
    to 1, constexprs).

    Raises:
        triton.CompilationError: the kernel does not compile for the target.
        RuntimeError: the kernels were defined under ``TRITON_INTERPRET=1`` (import them in a process without it).
    """
    signature, constexprs, attrs, options = _packed(launch, target)
    return triton.compile(ASTSource(launch.kernel, signature, constexprs, attrs), target=target,
                          options=options.__dict__)


def compile_launch(launch: Launch, target: GPUTarget = H200) -> Resources:
    """Compile ``launch`` for ``target`` with the argument specialisation a real launch would get (dtypes,
    16-byte alignment, integers divisible by 16 or equal to 1, constexprs) and read its resources from
    ``ptxas -v``.

    Raises:
        triton.CompilationError: the kernel does not compile for the target.
        RuntimeError: the kernels were defined under ``TRITON_INTERPRET=1`` (import them in a process without
            it), or ptxas fails on the PTX Triton produced.
    """
    t0 = time.perf_counter()
    compiled = compile_kernel(launch, target)
    compile_s = time.perf_counter() - t0
    from triton.backends.nvidia.compiler import get_ptxas

    arch = f"sm_{target.arch}a" if target.arch >= 90 else f"sm_{target.arch}"
    with tempfile.NamedTemporaryFile("w", suffix=".ptx") as src:
        src.write(compiled.asm["ptx"])
        src.flush()
        run = subprocess.run([get_ptxas(target.arch).path, "-v", f"-arch={arch}", src.name, "-o", "/dev/null"],
                             capture_output=True, text=True)
    if run.returncode != 0:
        raise RuntimeError(f"ptxas failed for {launch.name}: {run.stderr[-2000:]}")
    regs = _PTXAS.search(run.stderr)
    spill = _SPILL.search(run.stderr)
    return Resources(launch.name, int(regs.group(1)), int(spill.group(1)), int(spill.group(2)),
                     compiled.metadata.shared, compiled.metadata.num_warps, compile_s)
