"""Helpers for tests with real ``torch.distributed`` processes (gloo on CPU, one thread each)."""

from __future__ import annotations

import os
import socket
import traceback
from collections.abc import Callable
from typing import NoReturn

import lightning as L
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from k3lit.parallel.process_exit import exit_process


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def one_process_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """Set, for the duration of a test, the variables Lightning sets and leaves behind when a parallel strategy runs
    one rank in this process. A leftover ``LOCAL_RANK`` would tell a later ``k3lit fit --trainer.devices=2``
    subprocess of this worker that its ranks are started externally: it would wait for a rank nobody starts."""
    for name, value in (("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", str(free_port())), ("NODE_RANK", "0"),
                        ("LOCAL_RANK", "0")):
        monkeypatch.setenv(name, value)


def _entry(rank: int, world: int, store: str, fn: Callable, args: tuple, errfile: str) -> NoReturn:
    # Native (C++) messages, e.g. gloo's before an abort, go to a file the parent shows if this rank dies.
    log = os.open(f"{errfile}.stderr.{rank}", os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(log, 2)
    torch.set_num_threads(1)
    code = 0
    try:
        # A file store, not a TCP port: no race with another test's processes for a freed port.
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
        fn(rank, world, *args)
        dist.barrier()  # no rank tears gloo down while a peer is still inside a collective with it
    except BaseException:
        with open(f"{errfile}.{rank}", "w") as f:
            f.write(traceback.format_exc())
        code = 1
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    # torch's C++ threads are still alive: interpreter finalisation could abort this rank (k3lit.parallel.process_exit)
    exit_process(code)


def peers_equal(t: torch.Tensor, group: dist.ProcessGroup | None = None) -> bool:
    """Whether every rank of ``group`` (default: all) holds the same local values of ``t`` (a DTensor's local
    shard, or a plain tensor)."""
    local = (t.to_local() if hasattr(t, "to_local") else t).contiguous()
    peers = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
    dist.all_gather(peers, local, group=group)
    return all(torch.equal(x, peers[0]) for x in peers)


def run_workers(fn: Callable, world: int, *args, tmp_path) -> None:
    """Run ``fn(rank, world, *args)`` in ``world`` spawned gloo processes; on failure, fail the test with each
    rank's Python traceback, or (a rank killed by a signal) the tail of its native stderr."""
    err = str(tmp_path / "worker_error")
    try:
        mp.spawn(_entry, args=(world, str(tmp_path / "store"), fn, args, err), nprocs=world, join=True)
    except Exception as e:  # noqa: BLE001
        msgs = [open(f"{err}.{r}").read() for r in range(world) if os.path.exists(f"{err}.{r}")]
        if not msgs:
            for r in range(world):
                with open(f"{err}.stderr.{r}", errors="replace") as f:
                    msgs.append(f"rank {r} stderr (tail):\n" + f.read()[-4000:])
        pytest.fail(f"worker failed: {e}\n" + "\n".join(msgs))


class RecordBatches(L.Callback):
    """Saves every training batch of each rank to ``{dirpath}/batches.{rank}.pt`` at the end of training
    (importable by the ``k3lit fit`` worker processes through PYTHONPATH)."""

    def __init__(self, dirpath: str) -> None:
        self.dirpath = dirpath
        self.batches: list[torch.Tensor] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:  # noqa: ANN001
        self.batches.append(batch.detach().cpu().clone())

    def on_train_end(self, trainer, pl_module) -> None:  # noqa: ANN001
        torch.save(self.batches, os.path.join(self.dirpath, f"batches.{trainer.global_rank}.pt"))


class RecordInit(L.Callback):
    """Saves ``{"meta_at_setup", "local_numel", "numel", "shards"}`` of ``pl_module.model`` to
    ``{dirpath}/init.{rank}.pt`` when training starts: whether every parameter was on the meta device at ``setup``
    (before ``configure_model``), the parameter elements this rank holds (its shards) and the model has, and this
    rank's shard of every parameter."""

    def __init__(self, dirpath: str) -> None:
        self.dirpath = dirpath
        self.meta_at_setup = False

    def setup(self, trainer, pl_module, stage) -> None:  # noqa: ANN001
        self.meta_at_setup = all(p.is_meta for p in pl_module.model.parameters())

    def on_train_start(self, trainer, pl_module) -> None:  # noqa: ANN001
        params = list(pl_module.model.parameters())
        local = sum((p.to_local() if hasattr(p, "to_local") else p).numel() for p in params)
        shards = {name: (p.to_local() if hasattr(p, "to_local") else p).detach().clone()
                  for name, p in pl_module.model.named_parameters()}
        record = {"meta_at_setup": self.meta_at_setup, "local_numel": local, "numel": sum(p.numel() for p in params),
                  "shards": shards}
        torch.save(record, os.path.join(self.dirpath, f"init.{trainer.global_rank}.pt"))
