"""KernelPrecompile: off where nothing compiles, and on a GPU it fills an empty Triton cache during ``k3lit fit``."""

from __future__ import annotations

import os
import random
import subprocess
import sys
from collections import Counter
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import yaml

from k3lit.model import ModelConfig
from k3lit.train.kernel_precompile import KernelPrecompile

ROOT = Path(__file__).resolve().parents[2]


def test_negative_workers_are_refused():
    with pytest.raises(ValueError, match="workers must be >= 0"):
        KernelPrecompile(workers=-1)


def _fake(monkeypatch, local_rank=0, device="cuda", precision="bf16-mixed", plan=None, job=None):
    """A trainer and module with what setup reads, on a "cuda" device, with the GPU query and the precompile
    module's plan/start replaced (this machine has no GPU); returns them and the calls start received."""
    import k3lit.kernels.precompile as precompile
    import k3lit.train.kernel_precompile as module

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(module, "_gpu", lambda device: ("target", 132))
    calls = []
    monkeypatch.setattr(precompile, "pin_cache_dir", lambda: calls.append("pin"))
    monkeypatch.setattr(precompile, "plan", plan or (lambda *a: ["item"]))
    monkeypatch.setattr(precompile, "start", lambda items, target, workers: calls.append((items, target, workers))
                        or job)
    trainer = SimpleNamespace(strategy=SimpleNamespace(root_device=torch.device(device)), local_rank=local_rank,
                              precision=precision, datamodule=SimpleNamespace(batch_size=2, seq_len=64))
    module_ = SimpleNamespace(model_config=ModelConfig(vocab_size=64, dim=32, n_layers=2, layer_pattern="KA",
                                                       n_heads=2, head_dim=16))
    return trainer, module_, calls


class _Job:
    workers = 3

    def __init__(self, failures=()):
        self.closed, self._failures = 0, list(failures)

    def close(self):
        self.closed += 1
        return self._failures


def test_rank_zero_starts_the_workers_and_teardown_stops_them(monkeypatch):
    job = _Job()
    trainer, module_, calls = _fake(monkeypatch, job=job)
    cb = KernelPrecompile(workers=3)
    cb.setup(trainer, module_, "fit")
    assert calls == ["pin", (["item"], "target", 3)] and cb._job is job
    cb.teardown(trainer, module_, "fit")
    assert job.closed == 1 and cb._job is None


def test_an_exception_in_fit_stops_the_workers(monkeypatch):
    job = _Job()
    trainer, module_, _ = _fake(monkeypatch, job=job)
    cb = KernelPrecompile()
    cb.setup(trainer, module_, "fit")
    cb.on_exception(trainer, module_, KeyboardInterrupt())
    assert job.closed == 1 and cb._job is None


def test_other_ranks_pin_the_cache_folder_only(monkeypatch):
    trainer, module_, calls = _fake(monkeypatch, local_rank=1)
    KernelPrecompile().setup(trainer, module_, "fit")
    assert calls == ["pin"]


@pytest.mark.parametrize("case", ["workers=0", "cpu", "interpreter", "validate"])
def test_nothing_starts_where_nothing_compiles(monkeypatch, case):
    trainer, module_, calls = _fake(monkeypatch, device="cpu" if case == "cpu" else "cuda")
    if case == "interpreter":
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    cb = KernelPrecompile(workers=0 if case == "workers=0" else None)
    cb.setup(trainer, module_, "validate" if case == "validate" else "fit")
    assert calls == [] and cb._job is None


def test_a_failure_to_plan_is_a_warning(monkeypatch):
    def plan(*a):
        raise RuntimeError("no compiler")

    trainer, module_, calls = _fake(monkeypatch, plan=plan)
    cb = KernelPrecompile()
    with pytest.warns(UserWarning, match="no background kernel compilation .RuntimeError: no compiler"):
        cb.setup(trainer, module_, "fit")
    assert cb._job is None and calls == ["pin"]


def test_a_kernel_a_worker_could_not_compile_is_a_warning_at_teardown(monkeypatch):
    trainer, module_, _ = _fake(monkeypatch, job=_Job(failures=["worker 0 exited with 1: IndexError"]))
    cb = KernelPrecompile()
    cb.setup(trainer, module_, "fit")
    with pytest.warns(UserWarning, match="background kernel compilation failed .*IndexError"):
        cb.teardown(trainer, module_, "fit")


def test_true_precisions_record_weights_in_the_compute_dtype(monkeypatch):
    seen = []
    trainer, module_, _ = _fake(monkeypatch, precision="bf16-true",
                                plan=lambda *a: seen.append(a) or ["item"], job=_Job())
    KernelPrecompile().setup(trainer, module_, "fit")
    assert seen[0][1:] == (2, 64, torch.bfloat16, torch.bfloat16, 132, "target")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_fit_on_a_gpu_finds_every_kernel_precompiled(tmp_path):
    """On an empty Triton cache, the kernels :func:`precompile.plan` lists for the tiny recipe's model and batch
    (compiled for this GPU by the workers) are every kernel an eager ``k3lit fit`` of it then launches, validation
    included: the fit adds no compiled kernel to the cache. The fit's own log says how many it sent to workers."""
    rng = random.Random(0)
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i in range(20):
        (corpus / f"d{i}.txt").write_text(" ".join(rng.choice(["alpha", "beta", "gamma"]) for _ in range(3000)))
    cache = tmp_path / "triton"
    env = {**os.environ, "TRITON_CACHE_DIR": str(cache)}
    env.pop("TRITON_INTERPRET", None)
    code = """
import sys, yaml, torch, triton
from k3lit.kernels import precompile
from k3lit.model import ModelConfig
recipe = yaml.safe_load(open(sys.argv[1]))
c = ModelConfig(**{**recipe["model"], "vocab_size": 257})
target = triton.runtime.driver.active.get_current_target()
sms = torch.cuda.get_device_properties(0).multi_processor_count
items = precompile.plan(c, recipe["data"]["batch_size"], recipe["data"]["seq_len"], torch.bfloat16,
                        param_dtype=torch.float32, sm_count=sms, target=target)
precompile.start(items, target).wait()
print(len(items))
"""
    tiny = ROOT / "recipes" / "tiny.yaml"
    pre = subprocess.run([sys.executable, "-c", code, str(tiny)], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=600)
    assert pre.returncode == 0, pre.stderr[-4000:]
    compiled = sorted(p.name for p in cache.rglob("*.cubin"))
    assert len(compiled) >= int(pre.stdout.split()[-1]) > 5
    run = subprocess.run(
        [sys.executable, "-m", "k3lit.cli", "fit", "--config", str(tiny), "--trainer.accelerator=gpu",
         "--trainer.precision=bf16-mixed", "--trainer.max_steps=3", "--trainer.max_time=null",
         "--trainer.val_check_interval=3", "--trainer.limit_val_batches=2", "--compile=false",
         f"--data.corpus={corpus}", "--data.tokenizer=byte", f"--data.cache_dir={tmp_path / 'data'}",
         f"--trainer.default_root_dir={tmp_path / 'run'}"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    out = run.stdout + run.stderr
    assert run.returncode == 0, out[-4000:]
    assert "Triton kernels in" in out, out[-4000:]
    assert sorted(p.name for p in cache.rglob("*.cubin")) == compiled


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_compiled_fit_reads_the_kernels_where_the_workers_wrote_them(tmp_path):
    """A compiled ``k3lit fit`` with TRITON_CACHE_DIR unset (torch.compile would point it at its own folder): each
    kernel the plan lists has exactly one binary, in Triton's default folder, where the workers wrote it and the
    launches found it; none is in torch.compile's folder."""
    rng = random.Random(0)
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i in range(20):
        (corpus / f"d{i}.txt").write_text(" ".join(rng.choice(["alpha", "beta", "gamma"]) for _ in range(3000)))
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "TRITON_CACHE_DIR")}
    env.update(HOME=str(tmp_path / "home"), TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "inductor"))
    run = subprocess.run(
        [sys.executable, "-m", "k3lit.cli", "fit", "--config", str(ROOT / "recipes" / "tiny.yaml"),
         "--trainer.accelerator=gpu", "--trainer.precision=bf16-mixed", "--trainer.max_steps=3",
         "--trainer.max_time=null", "--trainer.limit_val_batches=0", "--compile=true", f"--data.corpus={corpus}",
         "--data.tokenizer=byte", f"--data.cache_dir={tmp_path / 'data'}",
         f"--trainer.default_root_dir={tmp_path / 'run'}"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    out = run.stdout + run.stderr
    assert run.returncode == 0, out[-4000:]
    import triton

    from k3lit.kernels.precompile import plan

    recipe = yaml.safe_load((ROOT / "recipes" / "tiny.yaml").read_text())
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    items = plan(ModelConfig(**{**recipe["model"], "vocab_size": 257}), recipe["data"]["batch_size"],
                 recipe["data"]["seq_len"], torch.bfloat16, torch.float32, sms,
                 triton.runtime.driver.active.get_current_target())
    planned = Counter(i.name for i in items)
    default = Counter(p.stem for p in (tmp_path / "home" / ".triton" / "cache").rglob("*.cubin"))
    inductor = Counter(p.stem for p in (tmp_path / "inductor").rglob("*.cubin"))
    # one binary per planned kernel: a launch that specialised otherwise would have added a second one
    assert {name: default[name] for name in planned} == dict(planned), sorted(default)
    assert not set(planned) & set(inductor), sorted(inductor)
