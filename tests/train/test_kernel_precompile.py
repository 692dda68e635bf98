"""KernelPrecompile: off where nothing compiles, and on a GPU it fills an empty Triton cache during ``k3lit fit``."""

from __future__ import annotations

import os
import random
import subprocess
import sys
from pathlib import Path

import lightning as L
import pytest
import torch

from k3lit.model import ModelConfig
from k3lit.train.kernel_precompile import KernelPrecompile
from k3lit.train.module import K3LitModule

ROOT = Path(__file__).resolve().parents[2]


def test_negative_workers_are_refused():
    with pytest.raises(ValueError, match="workers must be >= 0"):
        KernelPrecompile(workers=-1)


def test_nothing_starts_on_a_cpu_trainer():
    cb = KernelPrecompile()
    trainer = L.Trainer(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False)
    module = K3LitModule(ModelConfig(vocab_size=64, dim=32, n_layers=2, layer_pattern="KA", n_heads=2, head_dim=16))
    cb.setup(trainer, module, "fit")
    assert cb._job is None


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_fit_on_a_gpu_finds_every_kernel_precompiled(tmp_path):
    """On an empty Triton cache, the kernels :func:`precompile.plan` lists for the tiny recipe's model and batch
    (compiled for this GPU by the workers) are every kernel an eager ``k3lit fit`` of it then launches, validation
    included: the fit adds no compiled kernel to the cache. The fit's own log says how many it sent to workers."""
    rng = random.Random(0)
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i in range(8):
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
items = precompile.plan(c, recipe["data"]["batch_size"], recipe["data"]["seq_len"], torch.bfloat16, target)
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
    """A compiled ``k3lit fit`` with TRITON_CACHE_DIR unset (torch.compile would point it at its own folder): our
    kernels are compiled into Triton's default folder only (by the workers, or by a launch that found them there),
    none into torch.compile's folder."""
    rng = random.Random(0)
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i in range(8):
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
    ours = ("_prep_fwd", "_main_bwd", "_inter_fwd", "_mix_fwd", "_bwd_dx")
    default = [p.stem for p in (tmp_path / "home" / ".triton" / "cache").rglob("*.cubin")]
    inductor = [p.stem for p in (tmp_path / "inductor").rglob("*.cubin")]
    assert set(ours) <= set(default), sorted(default)
    assert not set(ours) & set(inductor), sorted(inductor)
