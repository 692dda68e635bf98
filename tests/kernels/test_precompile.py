"""k3lit.kernels.launches and precompile: the recorded launches are the ones a K3 model makes, and the workers fill
the Triton cache that later launches read."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from triton.runtime.jit import KernelInterface

from k3lit.kernels import aot, launches
from k3lit.model import K3LM, ModelConfig

ROOT = Path(__file__).resolve().parents[2]


def _describe(launches: list[aot.Launch]) -> set:
    """What decides a launch's compiled kernel, readable without compiling: the kernel, the dtype and shape of each
    tensor argument and every other argument's value."""
    def arg(a):
        return ("tensor", a.dtype, tuple(a.shape)) if isinstance(a, torch.Tensor) else a

    return {(x.name, tuple(arg(a) for a in x.args), tuple(sorted((k, arg(v)) for k, v in x.kwargs.items())))
            for x in launches}


def _model_launches(model: K3LM, idx: torch.Tensor, autocast: bool) -> list[aot.Launch]:
    """Every Triton launch (kernels recorded, not run) of a training step of ``model`` on ``idx`` (under bf16
    autocast if ``autocast``), and of a no-grad forward (eager validation)."""
    from k3lit.kernels.attn_res import mix, two_phase
    from k3lit.kernels.kda import chunk_bwd, chunk_fwd
    from k3lit.kernels.short_conv import conv

    recorded = []
    with contextlib.ExitStack() as stack:
        for m in (chunk_fwd, chunk_bwd, conv, mix, two_phase):
            names = [n for n, v in vars(m).items() if isinstance(v, KernelInterface)]
            recorded.append(stack.enter_context(aot.record_launches(m, *names)))
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            model(idx)[0].float().sum().backward()
            with torch.no_grad():
                model(idx)
    return [x for part in recorded for x in part]


@pytest.mark.parametrize("residual,block,checkpointing,precision", [
    ("block_attnres", 3, "none", "bf16-mixed"), ("full_attnres", 4, "none", "bf16-mixed"),
    ("plain", 4, "none", "bf16-mixed"), ("block_attnres", 2, "block", "bf16-mixed"),
    ("block_attnres", 3, "none", "bf16-true")])
def test_recorded_launches_are_the_models(monkeypatch, residual, block, checkpointing, precision):
    """A K3 model's real launches (KDA with its fused gate and q/k L2 norm, the short convolution, the residual
    stream's reads; a training step and a no-grad forward; bf16 autocast over float32 weights, or bf16 weights) equal
    what :func:`launches.recipes` records for its configuration: the same kernels, dtypes, shapes, integers and
    constexprs. The attention residuals take their CUDA path (the Triton kernels) on these CPU tensors, under the
    interpreter."""
    import k3lit.kernels.attn_res as attn_res_kernels
    import k3lit.ops.attn_res as attn_res_ops

    monkeypatch.setattr(attn_res_ops, "_dispatch", lambda backend, first: attn_res_kernels)
    B, T = 2, 96
    c = ModelConfig(vocab_size=64, dim=64, n_layers=2, layer_pattern="KA", n_heads=2, head_dim=32,
                    kda_backend="triton", residual=residual, attnres_block_size=block,
                    activation_checkpointing=checkpointing)
    mixed = precision == "bf16-mixed"
    model = K3LM(c) if mixed else K3LM(c).to(torch.bfloat16)
    real = _describe(_model_launches(model, torch.randint(0, 64, (B, T)), autocast=mixed))
    param_dtype = torch.float32 if mixed else torch.bfloat16
    planned = [x for recorder, kwargs in launches.recipes(c, B, T, torch.bfloat16, param_dtype)
               for x in launches.record(recorder, kwargs)]
    assert real == _describe(planned)
    expected = {"_prep_fwd", "_main_bwd", "_fwd", "_bwd_dx"}
    if residual != "plain":
        expected |= {"_inter_fwd", "_inter_bwd_sources", "_mix_bwd"}
    assert {x[0] for x in real} >= expected


@pytest.mark.parametrize("capacity", [{}, dict(capacity_factor=1.1, capacity_mode="causal"),
                                      dict(capacity_factor=1.25, capacity_mode="quantile")])
def test_recorded_routing_launches_are_the_moe_layers(monkeypatch, capacity):
    """An MoE model's real routing launches (its CUDA path forced on CPU tensors, under the interpreter; a training
    step and a no-grad forward under bf16 autocast) equal what :func:`launches.recipes` records for its
    configuration: the slots' sort always, the causal admission with causal capacity only (the quantile capacity
    routes with torch operations)."""
    import k3lit.ops.permute as permute
    import k3lit.ops.routing as routing
    from k3lit.kernels.routing import capacity as admission
    from k3lit.kernels.routing import sort

    for module in (permute, routing):
        monkeypatch.setattr(module, "use_triton", lambda x, backend: backend != "torch")
    B, T = 2, 48
    c = ModelConfig(vocab_size=64, dim=32, n_layers=2, layer_pattern="A", n_heads=2, head_dim=16, residual="plain",
                    n_experts=4, top_k=2, expert_dim=16, first_dense_layers=1, **capacity)
    model, idx = K3LM(c), torch.randint(0, 64, (B, T))
    with aot.record_launches(admission, *launches.ROUTING_CAPACITY_KERNELS, run=True) as admitted, \
            aot.record_launches(sort, *launches.ROUTING_SORT_KERNELS, run=True) as sorted_slots:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            model(idx)[0].float().sum().backward()
            with torch.no_grad():
                model(idx)
    planned = [x for recorder, kwargs in launches.recipes(c, B, T, torch.bfloat16)
               for x in launches.record(recorder, kwargs)]
    assert _describe(admitted + sorted_slots) == _describe(planned)
    causal = capacity.get("capacity_mode") == "causal"
    assert {x.name for x in planned} == {"_block_counts", "_place"} | ({"_free_choices", "_admit"} if causal else set())
    assert {x[0] for x in launches.recipes(c, B, T, torch.bfloat16)} == {"routing"}


def test_the_gpus_sm_count_sets_the_forward_scans_value_block():
    """One sequence of 8 heads of width 64: the forward's plain scan takes 16-wide value blocks where 32 programs
    of them leave SMs idle (132 SMs), 32-wide ones on a GPU with fewer SMs; the recording follows the count given,
    and leaves the launchers' own count as it was."""
    from k3lit.kernels import gpu

    def value_blocks(sms):
        recorded = launches.kda_launches(1, 64, 8, 64, 64, torch.bfloat16, sm_count=sms)
        return {x.kwargs["BV"] for x in recorded if x.name == "_scan_fwd"}

    before = gpu.sm_count
    assert value_blocks(132) == {16} and value_blocks(16) == {32}
    assert gpu.sm_count is before


def test_nothing_to_record_without_triton_kda_layers_or_attention_residuals():
    def config(**kw):
        return ModelConfig(vocab_size=64, dim=32, n_layers=2, n_heads=2, head_dim=16, **kw)

    assert launches.recipes(config(layer_pattern="A", residual="plain"), 2, 64, torch.bfloat16) == []
    torch_kda = dict(layer_pattern="KA", kda_backend="torch")
    assert launches.recipes(config(**torch_kda, residual="plain"), 2, 64, torch.bfloat16) == []
    assert [r for r, _ in launches.recipes(config(**torch_kda), 2, 64, torch.bfloat16)] == ["attn_res"]


def test_workers_fill_the_cache_later_launches_read(tmp_path):
    """In a process without the interpreter: two workers compile the plan of a small K3 model for the H200 into an
    empty Triton cache; compiling every planned launch again in this process then adds nothing to the cache (each is
    a hit). A stopped job leaves no process or file behind."""
    code = """
import sys
from pathlib import Path
import torch
from k3lit.kernels import aot, precompile
from k3lit.model import ModelConfig

cache = Path(sys.argv[1])
c = ModelConfig(vocab_size=64, dim=64, n_layers=2, layer_pattern="KA", n_heads=2, head_dim=32, n_experts=4,
                expert_dim=32)
items = precompile.plan(c, 2, 128, torch.bfloat16)
names = [i.name for i in items]
assert {"_prep_fwd", "_main_bwd", "_fwd", "_bwd_dx", "_inter_fwd", "_merge_bwd", "_mix_fwd", "_block_counts",
        "_place"} <= set(names), names
job = precompile.start(items, aot.H200, workers=2)
assert job.workers == 2
job.wait()
entries = sorted(p.name for p in cache.iterdir())
assert len(entries) >= len(items), (entries, names)
for item in items:
    aot.compile_kernel(item.launch())
assert sorted(p.name for p in cache.iterdir()) == entries
assert not job.folder.exists()

stopped = precompile.start(items, aot.H200, workers=2)
stopped.close()
assert all(p.poll() is not None for p in stopped.procs)
assert not stopped.folder.exists()
print(len(items), "kernels")
"""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path / "cache")
    (tmp_path / "cache").mkdir()
    run = subprocess.run([sys.executable, "-c", code, str(tmp_path / "cache")], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-4000:]
    assert "kernels" in run.stdout


def test_a_kernel_that_fails_is_reported_and_the_others_compile(tmp_path):
    """A worker given a launch that cannot be recorded (an index past the recorder's launches) and a good one:
    it reports the first, compiles the second into the cache and exits with 1, which wait() raises with the
    worker's log."""
    code = """
import torch
from pathlib import Path
from k3lit.kernels import aot, precompile
kwargs = (("B", 1), ("T", 16), ("C", 12), ("width", 4), ("dtype", torch.bfloat16))
items = [precompile.Item("short_conv", kwargs, 99, "_missing"), precompile.Item("short_conv", kwargs, 0, "_fwd")]
job = precompile.start(items, aot.H200, workers=1)
try:
    job.wait()
except RuntimeError as e:
    print("raised:", e)
assert not job.folder.exists()
"""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path / "cache")
    run = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-4000:]
    assert "raised: k3lit kernel precompile worker 0 exited with 1" in run.stdout
    assert "_missing (short_conv" in run.stdout and "IndexError" in run.stdout
    assert [p.stem for p in (tmp_path / "cache").rglob("*.cubin")] == ["_fwd"]


def test_an_unset_cache_folder_is_pinned_where_the_workers_write(tmp_path):
    """Without TRITON_CACHE_DIR, start() sets it to Triton's folder of the moment (under HOME here), where the
    worker's kernel lands; torch.compile then finds it set and leaves it (it sets an unset one to its own folder)."""
    code = """
import os, torch
from pathlib import Path
from k3lit.kernels import aot, precompile
assert "TRITON_CACHE_DIR" not in os.environ
kwargs = (("B", 1), ("T", 16), ("C", 12), ("width", 4), ("dtype", torch.bfloat16))
precompile.start([precompile.Item("short_conv", kwargs, 0, "_fwd")], aot.H200, workers=1).wait()
folder = Path(os.environ["TRITON_CACHE_DIR"])
assert folder == Path.home() / ".triton" / "cache", folder
assert list(folder.rglob("*.cubin"))
print("pinned")
"""
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "TRITON_CACHE_DIR")}
    env["HOME"] = str(tmp_path)
    run = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-4000:]
    assert "pinned" in run.stdout
