"""Compile the Triton kernels a training run will launch before it launches them, in parallel worker processes.

On an empty Triton cache every kernel compiles at its first launch, one after another, on the training process:
the KDA op alone took 12.8 s before its first result on the H200 host (benchmarks/RESULTS.md, "KDA first call"),
added to the first step's torch.compile time. Which kernels a step launches, and with which argument
specialisation, follows from the model configuration, the batch shape and the compute dtype: :func:`plan` records
them by running the launchers on ``meta`` tensors (:func:`k3lit.kernels.aot.record_launches`), and :func:`start`
compiles each distinct one for the GPU in a pool of spawned processes that write Triton's on-disk cache, while the
training process traces the model. A launch then finds its kernel in the cache. Nothing changes what runs: a kernel
still compiling when it is first launched is compiled by that launch, as it would be without this.

Recorded: the chunked KDA op with the layer's fused gate and q/k L2 norm, forward and backward (a training step)
and forward without backward (eager validation, and the no-grad forward of activation checkpointing), the q|k|v
short convolution, forward and backward, and the attention-residual reads (phase 1, phase 2 and the final
one-pass read, forward and backward). The KDA launchers pick their scan kernels by the GPU's SM count, which on
``meta`` tensors is the H100/H200's 132; on a GPU with another count a scan kernel may differ from the recorded one
and compile at its launch.
"""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from k3lit.kernels import aot
from k3lit.kernels.kda_validate import largest_safe_chunk

__all__ = ["Job", "attn_res_launches", "kda_launches", "plan", "recipes", "record", "short_conv_launches", "start"]

META = torch.device("meta")
KDA_FWD_KERNELS = ("_intra_fwd", "_wy_fwd", "_prep_fwd", "_scan_fwd", "_scan_fwd_t", "_out_fwd")
"""The kernels ``k3lit.kernels.kda.chunk_fwd`` launches (which of them run depends on the shape)."""
KDA_BWD_KERNELS = ("_scan_bwd", "_scan_bwd_t", "_main_bwd")
"""The kernels ``k3lit.kernels.kda.chunk_bwd`` launches."""
SHORT_CONV_KERNELS = ("_fwd", "_bwd_p", "_bwd_dx")
ATTN_RES_TWO_PHASE_KERNELS = ("_inter_fwd", "_inter_bwd_logits", "_inter_bwd_sources", "_merge_fwd", "_merge_bwd")
ATTN_RES_MIX_KERNELS = ("_mix_fwd", "_mix_bwd")


def kda_launches(B: int, T: int, H: int, K: int, V: int, dtype: torch.dtype, g_min: float = -5.0,
                 fused_gate: bool = True, qk_l2norm: bool = True, save: bool = True, backward: bool = True,
                 beta_dtype: torch.dtype = torch.float32) -> list[aot.Launch]:
    """The launches of one chunked KDA op (:func:`k3lit.kernels.kda.kda_triton`) on a dense ``[B, T, H, K]`` batch,
    in launch order (a pipelined launcher launches a kernel once per segment).

    Args:
        B, T, H, K, V: batch, tokens, heads, key and value width per head.
        dtype: dtype of q, k, v (and of the gate pre-activation with ``fused_gate``; the gate bias is float32, as
            the KDA layer passes it).
        g_min: the log-decay bound; fixes the chunk size (:func:`largest_safe_chunk`).
        fused_gate: the layer's ``g = g_min * sigmoid(e + bias)`` inside the kernels; otherwise a float32 log-decay.
        qk_l2norm: q and k L2-normalised inside the kernels.
        save: the forward writes what the backward reads (False: no backward can follow).
        backward: also the backward's launches (on what the forward wrote).
        beta_dtype: dtype of beta (the KDA layer's is float32).
    """
    from k3lit.kernels.kda import chunk_bwd, chunk_fwd

    q, k = torch.empty(B, T, H, K, device=META, dtype=dtype), torch.empty(B, T, H, K, device=META, dtype=dtype)
    v = torch.empty(B, T, H, V, device=META, dtype=dtype)
    g = torch.empty(B, T, H, K, device=META, dtype=dtype if fused_gate else torch.float32)
    beta = torch.empty(B, T, H, device=META, dtype=beta_dtype)
    bias = torch.empty(H * K, device=META) if fused_gate else None
    gate_g_min = float(g_min) if fused_gate else None
    C, scale = largest_safe_chunk(g_min), K**-0.5
    with aot.record_launches(chunk_fwd, *KDA_FWD_KERNELS) as fwd, \
            aot.record_launches(chunk_bwd, *KDA_BWD_KERNELS) as bwd:
        out = chunk_fwd.ChunkFwdOut(*chunk_fwd.chunk_fwd(q, k, v, g, beta, scale, None, False, None, C, bias,
                                                         gate_g_min, qk_l2norm, save=save))
        if backward:
            chunk_bwd.chunk_bwd(q, k, v, g if fused_gate else None, beta, *out.saved, torch.empty_like(out.o), None,
                                False, scale, None, C, bias, gate_g_min, qk_l2norm)
    return fwd + bwd


def short_conv_launches(B: int, T: int, C: int, width: int, dtype: torch.dtype,
                        backward: bool = True) -> list[aot.Launch]:
    """The launches of the short convolution + SiLU (:func:`k3lit.kernels.short_conv.short_conv_silu_triton`) on
    ``[B, T, C]`` inputs of ``dtype`` with ``width`` taps (cast to ``dtype``, as the layer does)."""
    from k3lit.kernels.short_conv import conv

    x, w = torch.empty(B, T, C, device=META, dtype=dtype), torch.empty(C, width, device=META, dtype=dtype)
    with aot.record_launches(conv, *SHORT_CONV_KERNELS) as launches:
        conv.conv_fwd(x, w)
        if backward:
            conv.conv_bwd(x, w, torch.empty_like(x))
    return launches


def attn_res_launches(B: int, T: int, D: int, sublayers: int, block_size: int, dtype: torch.dtype,
                      eps: float = 1e-6, backward: bool = True) -> list[aot.Launch]:
    """The launches of the attention-residual stream of one training forward (and its backward) over ``sublayers``
    sublayers in blocks of ``block_size`` (1: Full AttnRes), as :class:`k3lit.nn.attn_res.BlockResidualStream`
    makes them: at each block's start a phase-1 read of the N summaries so far for the block's sublayers, a
    phase-2 merge for each sublayer after the block's first, and at the end the one-pass read of every summary and
    the open block's partial sum. The embedding (the first summary) and the queries are float32, the sublayer
    outputs, partial sums and phase-1 mixes ``dtype`` (bf16 autocast over float32 weights)."""
    from k3lit.kernels.attn_res import mix, two_phase

    def x(dt: torch.dtype = dtype) -> torch.Tensor:
        return torch.empty(B, T, D, device=META, dtype=dt)

    blocks, done = [x(torch.float32)], 0
    with aot.record_launches(two_phase, *ATTN_RES_TWO_PHASE_KERNELS) as phases, \
            aot.record_launches(mix, *ATTN_RES_MIX_KERNELS) as final:
        while done < sublayers:
            S = min(block_size, sublayers - done)
            queries = torch.empty(S, D, device=META)
            mixes, lse, su, r, mz = two_phase.inter_fwd(blocks, queries, eps, dtype)
            partial = x()
            for j in range(1, S):
                two_phase.merge_fwd(mixes[j], lse[j], partial, queries[j], eps)
                if backward:
                    two_phase.merge_bwd(x(), mixes[j], lse[j], partial, queries[j], eps)
            if backward:  # the log-sum-exp has a gradient where a merge read it
                two_phase.inter_bwd(blocks, queries, su, r, mz, [x() for _ in range(S)],
                                    torch.empty_like(lse) if S > 1 else None)
            blocks.append(partial)  # a closed block's summary, or the open block's partial sum
            done += S
        query = torch.empty(D, device=META)
        out, src_stats, row_stats = mix.mix_fwd(blocks, query, eps)
        if backward:
            mix.mix_bwd(blocks, query, src_stats, row_stats, torch.empty_like(out))
    return phases + final


_RECORDERS: dict[str, Callable[..., list[aot.Launch]]] = {
    "kda": kda_launches, "short_conv": short_conv_launches, "attn_res": attn_res_launches}


@dataclass(frozen=True)
class Item:
    """One kernel to compile: launch ``index`` of what recorder ``recorder`` records with ``kwargs`` (a worker
    records it again: a compiled kernel object does not cross processes, its recipe does)."""

    recorder: str
    kwargs: tuple[tuple[str, object], ...]
    index: int
    name: str

    def launch(self) -> aot.Launch:
        """Record the launches again and return this item's."""
        return record(self.recorder, dict(self.kwargs))[self.index]


def recipes(model_config, batch: int, seq_len: int, dtype: torch.dtype) -> list[tuple[str, dict]]:
    """``(recorder, kwargs)`` pairs whose :func:`record` is every Triton launch of training ``model_config`` on
    ``[batch, seq_len]`` batches in ``dtype`` (the autocast dtype), eager validation included: the KDA op and the
    short convolution (unless the model has no KDA layer or runs it on torch: ``kda_backend`` torch or reference)
    and the attention-residual stream (unless ``residual`` is plain)."""
    c, out = model_config, []
    if "K" in c.layer_pattern and c.kda_backend in ("auto", "triton"):
        H, K = c.n_heads, c.head_dim
        kda = dict(B=batch, T=seq_len, H=H, K=K, V=K, dtype=dtype, g_min=float(c.kda_g_min))
        out += [
            ("kda", kda),  # a training step
            ("kda", {**kda, "save": False, "backward": False}),  # eager validation, checkpointing's no-grad forward
            ("short_conv", dict(B=batch, T=seq_len, C=3 * H * K, width=4, dtype=dtype)),
        ]
    if c.residual != "plain":
        size = 1 if c.residual == "full_attnres" else c.attnres_block_size
        out.append(("attn_res", dict(B=batch, T=seq_len, D=c.dim, sublayers=2 * c.n_layers, block_size=size,
                                     dtype=dtype, eps=float(c.norm_eps))))
    return out


def record(recorder: str, kwargs: dict) -> list[aot.Launch]:
    """The launches recorder ``recorder`` (``kda``, ``short_conv``, ``attn_res``) records with ``kwargs``."""
    return _RECORDERS[recorder](**kwargs)


def plan(model_config, batch: int, seq_len: int, dtype: torch.dtype, target=aot.H200) -> list[Item]:
    """The distinct kernels (by Triton's specialisation for ``target``) among :func:`recipes`' launches, one
    :class:`Item` each; empty when there are none.

    Raises:
        RuntimeError: the kernels were defined under ``TRITON_INTERPRET=1`` (nothing to compile then).
    """
    items, seen = [], set()
    for recorder, kwargs in recipes(model_config, batch, seq_len, dtype):
        for i, launch in enumerate(record(recorder, kwargs)):
            key = aot.specialization_key(launch, target)
            if key not in seen:
                seen.add(key)
                items.append(Item(recorder, tuple(kwargs.items()), i, launch.name))
    return items


class Job:
    """Kernels compiling in worker processes (:func:`start`)."""

    def __init__(self, items: list[Item], procs: list[subprocess.Popen], logs: list[Path], recipe: Path) -> None:
        self.items, self.procs, self.logs, self.recipe = items, procs, logs, recipe

    @property
    def workers(self) -> int:
        """Number of worker processes."""
        return len(self.procs)

    def wait(self) -> None:
        """Block until every worker has exited, then clean up.

        Raises:
            RuntimeError: a worker failed; the message holds the end of its output.
        """
        failed = [(p.wait(), log.read_text()[-3000:]) for p, log in zip(self.procs, self.logs)]
        self._remove()
        for code, tail in failed:
            if code:
                raise RuntimeError(f"k3lit kernel precompile worker exited with {code}:\n{tail}")

    def close(self) -> None:
        """Stop the workers still compiling (Triton writes each cache entry whole, so none is left half-written) and
        clean up."""
        for p in self.procs:
            if p.poll() is None:
                p.terminate()
        for p in self.procs:
            p.wait()
        self._remove()

    def _remove(self) -> None:
        for path in (self.recipe, *self.logs, *self.recipe.parent.glob(f"{self.recipe.name}.claim*")):
            path.unlink(missing_ok=True)


def start(items: list[Item], target, workers: int | None = None) -> Job:
    """Compile ``items`` for ``target`` (e.g. ``triton.runtime.driver.active.get_current_target()``) in
    ``workers`` processes (default: half the CPUs, at most 8, at most one per item); returns at once.

    The workers are fresh interpreters (``python -m k3lit.kernels.precompile``), not forks or multiprocessing
    children: those would copy a process holding a CUDA context, or re-import the caller's ``__main__``. They
    inherit the environment and touch no GPU. Where ``TRITON_CACHE_DIR`` is unset, it is set here to the folder
    Triton uses now, in this process and so in the workers: torch.compile points an unset one at its own folder when
    it first loads a compiled kernel, after which this process would no longer read what the workers wrote.
    """
    from triton import knobs

    os.environ.setdefault("TRITON_CACHE_DIR", knobs.cache.dir)
    if workers is None:
        workers = min(8, max(1, (os.cpu_count() or 2) // 2))
    workers = max(1, min(workers, len(items)))
    fd, name = tempfile.mkstemp(prefix="k3lit-precompile-", suffix=".pkl")
    with os.fdopen(fd, "wb") as f:
        pickle.dump((items, target), f)
    procs, logs = [], []
    for i in range(workers):
        log = Path(f"{name}.{i}.log")
        with open(log, "wb") as out:
            procs.append(subprocess.Popen([sys.executable, "-m", "k3lit.kernels.precompile", name],
                                          stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT))
        logs.append(log)
    return Job(items, procs, logs, Path(name))


def _worker(recipe: str) -> None:
    """``python -m k3lit.kernels.precompile RECIPE``: compile the pickled ``(items, target)``, each item by the
    worker that claims it first (creates ``RECIPE.claim<i>``), so that the workers share them as they come free."""
    with open(recipe, "rb") as f:
        items, target = pickle.load(f)
    for i, item in enumerate(items):
        try:
            os.close(os.open(f"{recipe}.claim{i}", os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        except FileExistsError:
            continue
        aot.compile_kernel(item.launch(), target)


if __name__ == "__main__":
    _worker(sys.argv[1])
