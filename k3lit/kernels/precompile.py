"""Compile the Triton kernels a training run will launch before it launches them, in parallel worker processes.

On an empty Triton cache every kernel compiles at its first launch, one after another, in the training process:
the KDA op alone took 12.8 s before its first result on the H200 host (benchmarks/RESULTS.md, "KDA first call"),
on top of the first step's torch.compile time. :func:`plan` lists the distinct kernels a run will launch
(:mod:`k3lit.kernels.launches` records them on ``meta`` tensors) and :func:`start` compiles them for the GPU in
worker processes that write Triton's on-disk cache, while the training process traces the model; a launch then
finds its kernel in the cache. Nothing changes what runs: a kernel still compiling when it is first launched is
compiled by that launch, as it would be without this.

    python -m k3lit.kernels.precompile FOLDER     # a worker (start() runs them): compiles FOLDER/items.pkl
"""

from __future__ import annotations

import os
import pickle
import shutil
import subprocess
import sys
import tempfile
import traceback
import weakref
from dataclasses import astuple, dataclass
from pathlib import Path
from typing import Any

import torch
from triton.backends.compiler import GPUTarget

from k3lit.kernels import aot
from k3lit.kernels.gpu import H200_SMS
from k3lit.kernels.launches import recipes, record

__all__ = ["Item", "Job", "pin_cache_dir", "plan", "start"]

_STOP_WAIT_S = 10.0  # seconds a stopped worker gets to exit before it is killed


@dataclass(frozen=True)
class Item:
    """One kernel to compile: launch ``index`` of what :func:`k3lit.kernels.launches.record` records for
    ``recorder`` with ``kwargs`` (a worker records it again: a kernel object does not cross processes, its recipe
    does), and the kernel's ``name``."""

    recorder: str
    kwargs: tuple[tuple[str, object], ...]
    index: int
    name: str

    def launch(self) -> aot.Launch:
        """Record the launches again and return this item's."""
        return record(self.recorder, dict(self.kwargs))[self.index]


def plan(model_config: Any, batch: int, seq_len: int, dtype: torch.dtype,
         param_dtype: torch.dtype = torch.float32, sm_count: int = H200_SMS, target: GPUTarget = aot.H200
         ) -> list[Item]:
    """The distinct kernels (by Triton's specialisation for ``target``) among the launches of
    :func:`k3lit.kernels.launches.recipes` for ``model_config`` (a :class:`k3lit.model.ModelConfig`), ``[batch,
    seq_len]`` batches, compute ``dtype``, weights in ``param_dtype`` and a GPU of ``sm_count`` SMs; one
    :class:`Item` each, the forward kernels first (a step launches them first), then the backward ones, each in
    recording order; empty when there are none.

    Raises:
        RuntimeError: the kernels were defined under ``TRITON_INTERPRET=1`` (nothing to compile then).
    """
    items, seen = [], set()
    for recorder, kwargs in recipes(model_config, batch, seq_len, dtype, param_dtype, sm_count):
        for i, launch in enumerate(record(recorder, kwargs)):
            key = aot.specialization_key(launch, target)
            if key not in seen:
                seen.add(key)
                items.append(Item(recorder, tuple(kwargs.items()), i, launch.name))
    return sorted(items, key=lambda item: "bwd" in item.name)  # stable: recording order within each


def pin_cache_dir() -> str:
    """Set ``TRITON_CACHE_DIR``, where it is unset, to the folder Triton uses now (``~/.triton/cache`` by default), and
    return it. torch.compile points an unset one at its own per-device folder when it first loads a compiled kernel;
    after that a process would no longer read what :func:`start`'s workers wrote. It stays set, so torch.compile's
    own Triton kernels go to that folder too."""
    try:
        from triton import knobs

        folder = knobs.cache.dir
    except (ImportError, AttributeError):  # Triton before knobs: its default
        folder = os.path.join(os.getenv("TRITON_HOME", os.path.expanduser("~")), ".triton", "cache")
    return os.environ.setdefault("TRITON_CACHE_DIR", folder)


def _stop(procs: list[subprocess.Popen], folder: Path) -> None:
    """Terminate the workers still running (killed if they take longer than ``_STOP_WAIT_S``), reap every one and
    remove their folder. Triton writes each cache entry whole, so a stopped worker leaves none half-written."""
    for p in procs:
        if p.poll() is None:
            p.terminate()
    for p in procs:
        try:
            p.wait(timeout=_STOP_WAIT_S)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
    shutil.rmtree(folder, ignore_errors=True)


class Job:
    """Kernels compiling in worker processes (:func:`start`). Its folder (items, worker logs, claim files) and any
    worker still running go when :meth:`close` or :meth:`wait` is called, or when the job is garbage-collected or
    the interpreter exits."""

    def __init__(self, procs: list[subprocess.Popen], folder: Path) -> None:
        self.procs, self.folder = procs, folder
        self._finalize = weakref.finalize(self, _stop, procs, folder)

    @property
    def workers(self) -> int:
        """Number of worker processes."""
        return len(self.procs)

    def failures(self) -> list[str]:
        """The end of the log of every worker that has exited with an error by itself (a kernel that did not
        compile), read before the folder goes."""
        out = []
        for i, p in enumerate(self.procs):
            if p.poll() not in (None, 0) and p.returncode > 0:
                log = self.folder / f"worker{i}.log"
                tail = log.read_text(errors="replace")[-3000:] if log.exists() else "(no log)"
                out.append(f"worker {i} exited with {p.returncode}:\n{tail}")
        return out

    def wait(self) -> None:
        """Block until every worker has exited, then clean up.

        Raises:
            RuntimeError: a worker failed; the message holds the end of its log.
        """
        for p in self.procs:
            p.wait()
        failed = self.failures()
        self._finalize()
        if failed:
            raise RuntimeError("k3lit kernel precompile " + "\n".join(failed))

    def close(self) -> list[str]:
        """Stop the workers still compiling and clean up; :meth:`failures` of those that had already failed."""
        failed = self.failures()
        self._finalize()
        return failed


def start(items: list[Item], target: GPUTarget, workers: int | None = None) -> Job:
    """Compile ``items`` for ``target`` (e.g. ``triton.runtime.driver.active.get_current_target()``) in ``workers``
    processes (default: half the CPUs this process may run on, at most 8; never more than the items); returns at
    once. A worker takes the next item no other worker has claimed, so the items spread as the workers come free.

    The workers are fresh interpreters (``python -m k3lit.kernels.precompile``), not forks or multiprocessing
    children: those would copy a process holding a CUDA context, or re-import the caller's ``__main__``. They touch
    no GPU, run at a lower priority with one OpenMP thread, inherit the environment (with this k3lit on their
    ``PYTHONPATH``) and write the Triton cache this process reads (:func:`pin_cache_dir` runs first).

    Raises:
        ValueError: no items, or ``workers`` < 1.
        OSError: a worker could not be started (those already started are stopped).
    """
    if not items:
        raise ValueError("precompile.start: no items to compile")
    if workers is None:
        cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 2)
        workers = min(8, max(1, cpus // 2))
    if workers < 1:
        raise ValueError(f"precompile.start: workers must be >= 1, got {workers}")
    workers = min(workers, len(items))
    pin_cache_dir()
    folder = Path(tempfile.mkdtemp(prefix="k3lit-precompile-"))
    with open(folder / "items.pkl", "wb") as f:
        pickle.dump(([astuple(i) for i in items], target), f)
    package_root = str(Path(__file__).resolve().parents[2])
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join(p for p in (package_root, os.environ.get("PYTHONPATH")) if p)}
    procs: list[subprocess.Popen] = []
    try:
        for i in range(workers):
            with open(folder / f"worker{i}.log", "wb") as log:
                procs.append(subprocess.Popen([sys.executable, "-m", "k3lit.kernels.precompile", str(folder)],
                                              stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                              env=env))
    except BaseException:
        _stop(procs, folder)
        raise
    return Job(procs, folder)


def _worker(folder: Path) -> int:
    """Compile the items of ``folder/items.pkl``, each one this worker claims first (creates ``claim<i>`` there);
    a kernel that fails is reported on stderr and the next one taken. Returns the exit status: 1 if one failed."""
    if hasattr(os, "nice"):
        os.nice(10)  # behind the training process, its data loaders and torch.compile's workers
    with open(folder / "items.pkl", "rb") as f:
        items, target = pickle.load(f)
    failed = 0
    for i, (recorder, kwargs, index, name) in enumerate(items):
        try:
            os.close(os.open(folder / f"claim{i}", os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        except FileExistsError:
            continue
        try:
            aot.compile_kernel(record(recorder, dict(kwargs))[index], target)
        except Exception:  # noqa: BLE001 - report it and compile the others
            failed = 1
            print(f"k3lit precompile: {name} ({recorder} {dict(kwargs)}) failed:\n{traceback.format_exc()}",
                  file=sys.stderr, flush=True)
    return failed


if __name__ == "__main__":
    sys.exit(_worker(Path(sys.argv[1])))
