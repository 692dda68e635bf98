"""Ending a process that ran torch.distributed: Python's shutdown steps, then ``os._exit`` instead of interpreter
finalisation.

torch's C++ threads outlive ``destroy_process_group``: gloo's work threads (torch itself keeps references to the
process groups, in device meshes and in the default arguments of ``torch.distributed.nn.functional`` when that
module is imported after ``init_process_group``) and the autograd engine's device threads (FSDP2's backward starts
them, on a CPU-only machine too). When such a thread releases a Python object (a tensor a finished collective held),
torch checks that the interpreter is initialised and then takes the GIL; if finalisation begins between the two,
CPython ends the thread with ``pthread_exit``, whose unwinding through a ``noexcept`` C++ frame calls
``std::terminate``: SIGABRT, "terminate called without an active exception", in a process whose work had
succeeded. A process that never finalises has no such window.
"""

from __future__ import annotations

import atexit
import os
import sys
import threading
from typing import NoReturn

__all__ = ["exit_process"]


def exit_process(code: int = 0) -> NoReturn:
    """End this process with exit status ``code`` as Python's shutdown would, short of finalisation: wait for the
    non-daemon threads, run the ``atexit`` callbacks (Lightning's ``destroy_process_group``, logging, multiprocessing
    and temporary-file clean-up), flush stdout and stderr, then ``os._exit(code)``.

    Objects still alive are not finalised (no ``__del__`` runs): files must be closed before.
    """
    current = threading.current_thread()
    for thread in threading.enumerate():
        if thread is not current and thread is not threading.main_thread() and not thread.daemon:
            thread.join()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        if stream is not None:
            stream.flush()
    os._exit(code)
