"""A process that ran torch.distributed ends without interpreter finalisation (k3lit.parallel.process_exit): the
``k3lit`` command and the test workers keep Python's shutdown steps (non-daemon threads joined, ``atexit``
callbacks, flushed output) and the exit status, and finalise nothing; a worker whose work failed still fails."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.parallel._dist import run_workers

ROOT = Path(__file__).parents[2]

# Leaves a file for each shutdown step it sees: "thread" (a non-daemon thread ran to its end), "atexit", and
# "finalised" (a module-level object's __del__: only interpreter finalisation runs it); prints without a newline.
SCRIPT = """
import atexit, sys, threading, time
from pathlib import Path
import torch.distributed as dist

out = Path(sys.argv[1])

class Witness:
    def __del__(self):
        (out / "finalised").touch()

witness = Witness()
atexit.register((out / "atexit").touch)
threading.Thread(target=lambda: (time.sleep(0.5), (out / "thread").touch())).start()
dist.init_process_group("gloo", init_method=f"file://{out / 'store'}", rank=0, world_size=1)
print("unflushed", end="")
"""


def _run(tmp_path: Path, ending: str) -> tuple[subprocess.CompletedProcess, list[str]]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-c", SCRIPT + ending, str(tmp_path)], env=env, capture_output=True,
                         text=True, timeout=120)
    return out, sorted(p.name for p in tmp_path.iterdir() if p.name != "store")


def test_exit_process_keeps_shutdown_steps_and_status_but_not_finalisation(tmp_path):
    out, seen = _run(tmp_path, "from k3lit.parallel.process_exit import exit_process\nexit_process(3)\n")
    assert (out.returncode, out.stdout) == (3, "unflushed"), out.stderr[-2000:]
    assert seen == ["atexit", "thread"]


def test_a_normal_exit_finalises(tmp_path):
    """The witness sees finalisation when it happens: its absence above is exit_process's doing."""
    out, seen = _run(tmp_path, "sys.exit(3)\n")
    assert (out.returncode, out.stdout) == (3, "unflushed"), out.stderr[-2000:]
    assert seen == ["atexit", "finalised", "thread"]


@pytest.mark.parametrize(("command", "code", "want"), [
    ("pass", 0, ["atexit", "thread"]),  # the command ran: no finalisation
    ("raise SystemExit(2)", 2, ["atexit", "finalised", "thread"]),  # an error leaves the usual way
])
def test_the_k3lit_command_ends_without_finalisation(tmp_path, command, code, want):
    ending = f"import k3lit.cli as cli\ndef main():\n    {command}\ncli.main = main\ncli.console_main()\n"
    out, seen = _run(tmp_path, ending)
    assert (out.returncode, out.stdout) == (code, "unflushed"), out.stderr[-2000:]
    assert seen == want


def _fails_on_rank_1(rank: int, world: int) -> None:
    if rank == 1:
        raise ValueError("rank 1 computed the wrong thing")


def _aborts_on_rank_1(rank: int, world: int) -> None:
    if rank == 1:
        os.kill(os.getpid(), signal.SIGABRT)


@pytest.mark.parametrize(("worker", "want"), [
    (_fails_on_rank_1, "ValueError: rank 1 computed the wrong thing"),
    (_aborts_on_rank_1, "terminated with signal SIGABRT"),  # no traceback: the signal, and native stderr
])
def test_a_worker_that_fails_fails_the_test(tmp_path, worker, want):
    with pytest.raises(pytest.fail.Exception, match=want):
        run_workers(worker, 2, tmp_path=tmp_path)
