import os
import sys
from pathlib import Path

import pytest
import torch
from torch.utils._device import _device_constructors

# Spawned worker processes (torch.multiprocessing) import test modules by name (`tests.parallel...`): put the
# repository root on the path of this process and of every child it starts.
ROOT = str(Path(__file__).resolve().parents[1])
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)
os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p)

# Without CUDA the Triton kernels run under the interpreter. Triton reads the flag when a kernel is decorated,
# i.e. when k3lit.kernels is first imported, which any test module may do: set it before all of them.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# `with torch.device("meta")` looks functions up in a set that torch.utils._device caches on first use. Filled
# for the first time while torch.compile traces an interpreted Triton kernel (tests/kernels), it holds stand-ins
# for torch.empty & co., and every later device context in that process is silently ignored (a meta-device
# model is then allocated for real). Fill it now, before any test.
_device_constructors()

# Keep CPU tests on the two cores CI has, one per xdist worker.
torch.set_num_threads(max(1, (os.cpu_count() or 2) // int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))))


@pytest.fixture
def seed() -> int:
    """A fresh seed per test run, printed so a failure can be replayed with K3LIT_SEED."""
    s = int(os.environ.get("K3LIT_SEED", torch.seed() % 2**31))
    torch.manual_seed(s)
    print(f"K3LIT_SEED={s}")
    return s
