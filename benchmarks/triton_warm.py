"""Fill Triton's on-disk cache for autotuned kernels in parallel processes, without timing anything.

A library that autotunes (fla) compiles every candidate config of every kernel at its first call, one after
the other: minutes of compilation on one CPU core per new head size. :func:`compile_only` turns this
process into one of P compile workers: each compiles only its share of the candidate configs (chosen by a
hash of kernel name and config), runs each once instead of timing it, and writes no autotuning result. Run P
workers on the same ``TRITON_CACHE_DIR``, then the process that times: its autotuner still benchmarks every
config on an otherwise idle GPU (the choice is the library's own), and only the compilation comes from the
cache. With ``cache_results`` (fla's default) that process also stores its choices under
``TRITON_CACHE_DIR``, so a later run on the same software reuses them (see benchmarks/kda.py).
"""

from __future__ import annotations

import zlib


def compile_only(worker: int, n_workers: int) -> None:
    """Patch Triton's autotuner in this process: compile (and run once) only this worker's configs.

    Args:
        worker: index in ``[0, n_workers)``.
        n_workers: number of worker processes sharing one ``TRITON_CACHE_DIR``.
    """
    from triton.runtime import autotuner, cache

    bench = autotuner.Autotuner._bench

    def share(self, *args, config, **meta):
        if zlib.crc32(f"{self.base_fn.__name__}|{config}".encode()) % n_workers != worker:
            return [float("inf")] * 3
        self.do_bench = lambda kernel_call, quantiles: (kernel_call(), [1.0] * len(quantiles))[1]
        return bench(self, *args, config=config, **meta)

    put = cache.FileCacheManager.put

    def put_no_choice(self, data, filename, binary=True):
        return None if filename.endswith(".autotune.json") else put(self, data, filename, binary=binary)

    autotuner.Autotuner._bench = share
    cache.FileCacheManager.put = put_no_choice
