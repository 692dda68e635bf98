"""k3lit.kernels.precompile: the launches it plans are the ones a KDA layer makes, and its workers fill the Triton
cache that later launches read."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from triton.runtime.jit import KernelInterface

from k3lit.kernels import aot, precompile
from k3lit.model import ModelConfig
from k3lit.nn.kda import KimiDeltaAttention

ROOT = Path(__file__).resolve().parents[2]


def _describe(launches: list[aot.Launch]) -> set:
    """What decides a launch's compiled kernel, readable without compiling: the kernel, the dtype and shape of each
    tensor argument and every other argument's value."""
    def arg(a):
        return ("tensor", a.dtype, tuple(a.shape)) if isinstance(a, torch.Tensor) else a

    return {(x.name, tuple(arg(a) for a in x.args), tuple(sorted((k, arg(v)) for k, v in x.kwargs.items())))
            for x in launches}


def _layer_launches(layer: KimiDeltaAttention, x: torch.Tensor, backward: bool) -> list[aot.Launch]:
    """Every Triton launch of ``layer`` on ``x`` under bf16 autocast (kernels recorded, not run), with a backward."""
    from k3lit.kernels.kda import chunk_bwd, chunk_fwd
    from k3lit.kernels.short_conv import conv

    modules = (chunk_fwd, chunk_bwd, conv)
    recorders = [aot.record_launches(m, *[n for n, v in vars(m).items() if isinstance(v, KernelInterface)])
                 for m in modules]
    with recorders[0] as a, recorders[1] as b, recorders[2] as c:
        with torch.autocast(x.device.type, dtype=torch.bfloat16), torch.set_grad_enabled(backward):
            y, _ = layer(x)
        if backward:
            y.float().sum().backward()
    return a + b + c


@pytest.mark.parametrize("backward", [True, False], ids=["training", "no-grad"])
def test_planned_launches_are_the_layers(backward):
    """The KDA layer's real launches (fused gate, q/k L2 norm, short convolution; a training step, and a no-grad
    forward as in eager validation) under bf16 autocast equal what :func:`precompile.kda_launches` and
    :func:`precompile.short_conv_launches` record for the same shape: same kernels, dtypes, shapes, integers and
    constexprs."""
    B, T, D, H, K = 2, 96, 64, 2, 32
    layer = KimiDeltaAttention(D, H, K, g_min=-5.0, backend="triton")
    x = torch.randn(B, T, D, requires_grad=backward)
    real = _describe(_layer_launches(layer, x, backward))
    planned = precompile.kda_launches(B, T, H, K, K, torch.bfloat16, -5.0, save=backward, backward=backward)
    planned += precompile.short_conv_launches(B, T, 3 * H * K, 4, torch.bfloat16, backward=backward)
    assert real == _describe(planned)
    assert {x[0] for x in real} >= {"_fwd", "_prep_fwd"}


def test_nothing_to_plan_without_triton_kda_layers():
    plain = ModelConfig(vocab_size=64, dim=32, n_layers=2, layer_pattern="A", n_heads=2, head_dim=16)
    torch_kda = ModelConfig(vocab_size=64, dim=32, n_layers=2, layer_pattern="KA", n_heads=2, head_dim=16,
                            kda_backend="torch")
    assert precompile.plan(plain, 2, 64, torch.bfloat16) == []
    assert precompile.plan(torch_kda, 2, 64, torch.bfloat16) == []


def test_workers_fill_the_cache_later_launches_read(tmp_path):
    """In a process without the interpreter: the plan of a small KDA model holds each distinct kernel once; two
    workers compile it for the H200 into an empty Triton cache; compiling every planned launch again in this
    process then adds nothing to the cache (each is a hit). A stopped job leaves no process or file behind."""
    code = """
import sys, tempfile
from pathlib import Path
import torch
from k3lit.kernels import aot, precompile
from k3lit.model import ModelConfig

cache = Path(sys.argv[1])
c = ModelConfig(vocab_size=64, dim=64, n_layers=2, layer_pattern="KA", n_heads=2, head_dim=32)
items = precompile.plan(c, 2, 128, torch.bfloat16)
keys = [aot.specialization_key(i.launch()) for i in items]
assert len(set(keys)) == len(keys) > 3, keys
names = [i.name for i in items]
assert {"_prep_fwd", "_main_bwd", "_fwd", "_bwd_p", "_bwd_dx"} <= set(names), names
job = precompile.start(items, aot.H200, workers=2)
assert job.workers == 2
job.wait()
entries = sorted(p.name for p in cache.iterdir())
assert len(entries) >= len(items), (entries, names)
for item in items:
    aot.compile_kernel(item.launch())
assert sorted(p.name for p in cache.iterdir()) == entries
assert not list(Path(tempfile.gettempdir()).glob(f"{job.recipe.name}*"))

stopped = precompile.start(items, aot.H200, workers=2)
stopped.close()
assert all(p.poll() is not None for p in stopped.procs)
assert not list(Path(tempfile.gettempdir()).glob(f"{stopped.recipe.name}*"))
print(len(items), "kernels")
"""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path / "cache")
    (tmp_path / "cache").mkdir()
    run = subprocess.run([sys.executable, "-c", code, str(tmp_path / "cache")], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-4000:]
    assert "kernels" in run.stdout


def test_worker_failure_is_raised(tmp_path):
    """A worker that cannot compile (here: the interpreter is on, so there is no compilable kernel) makes wait()
    raise with the worker's output."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    code = """
import torch
from k3lit.kernels import aot, precompile
kwargs = (("B", 1), ("T", 16), ("C", 8), ("width", 4), ("dtype", torch.bfloat16))
item = precompile.Item("short_conv", kwargs, 0, "_fwd")
precompile.start([item], aot.H200, workers=1).wait()
"""
    run = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=300)
    assert run.returncode != 0
    assert "precompile worker exited with 1" in run.stderr and "not a compilable JITFunction" in run.stderr
