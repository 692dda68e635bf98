"""benchmarks/throughput.py on the CPU: ``--variant`` rows, step and host times, the ``--lightning`` row."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest
import torch

from benchmarks.throughput import (
    ROOT,
    bench_lightning,
    host_ms_per_step,
    lightning_module,
    recipe_config,
    rows,
    step_times_ms,
    table,
    variant,
)
from k3lit.model import ModelConfig

BASE = ModelConfig(vocab_size=64, dim=32, n_layers=2, n_heads=2, head_dim=16, n_experts=4, top_k=2, expert_dim=16)


def test_fields_are_read_as_yaml_values():
    name, c = variant(BASE, "causal 1.1:capacity_factor=1.1,capacity_mode=causal,quantile_rate=0.1")
    assert name == "same, causal 1.1 (capacity_factor=1.1, capacity_mode=causal, quantile_rate=0.1)"
    assert (c.capacity_factor, c.capacity_mode, c.quantile_rate) == (1.1, "causal", 0.1)
    assert c.dim == BASE.dim and BASE.capacity_factor is None  # the rest as the recipe's, the recipe untouched
    assert variant(BASE, "off:capacity_factor=null")[1].capacity_factor is None


@pytest.mark.parametrize("spec,message", [
    ("no label", "LABEL:field=value"),
    ("x:capacity_factor", "is not field=value"),
    ("x:no_such_field=1", "no_such_field"),
    ("x:top_k=9", "top_k"),
])
def test_bad_variants_say_what_to_change(spec, message):
    with pytest.raises(SystemExit, match=message):
        variant(BASE, spec)


def test_unknown_compile_settings_are_refused_before_any_row(monkeypatch):
    from benchmarks import throughput

    recipe = str(Path(__file__).resolve().parents[2] / "recipes" / "tiny.yaml")
    monkeypatch.setattr(throughput, "bench", lambda *a, **k: pytest.fail("a row ran"))
    monkeypatch.setattr(sys, "argv", ["throughput.py", "--recipe", recipe, "--device", "cpu", "--rows", "recipe",
                                      "--compile", "none,sublayer"])
    with pytest.raises(SystemExit, match=r"--compile: unknown \['sublayer'\]; choose from .*sublayer_graphs"):
        throughput.main()


@pytest.mark.parametrize("args, message", [
    (dict(warmup=1), r"--warmup 1 --steps 3: at least 2 warm-up steps"),
    (dict(steps=0), r"--warmup 2 --steps 0: .* and 1 timed step"),
    (dict(compiles=["none", "cudagraphs"]), r"--compile cudagraphs replays CUDA graphs: it needs --device cuda"),
    (dict(kda_backend="triton"), r"--kda_backend triton needs a CUDA device"),
    (dict(rows=["recipe", "litgpt"]), r"--rows litgpt times litgpt's GPT, which is not installed"),
])
def test_what_cannot_be_timed_here_is_refused_up_front(monkeypatch, args, message):
    from benchmarks import throughput

    monkeypatch.setattr(throughput.importlib.util, "find_spec", lambda name: None)  # as where litgpt is missing
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    kwargs = dict(device="cpu", compiles=["none"], warmup=2, steps=3) | args
    with pytest.raises(SystemExit, match=message):
        throughput.check_run(**kwargs)
    throughput.check_run("cpu", ["none", "sublayers"], 2, 1, "torch", ["recipe", "plain"])  # all of it runs here


def test_a_cuda_device_is_refused_without_one(monkeypatch):
    from benchmarks import throughput

    monkeypatch.setattr(throughput.torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit, match="--device cuda: this machine has no CUDA device; use --device cpu"):
        throughput.check_run("cuda", ["none"], 2, 1)


def test_host_time_is_the_median_of_single_steps_each_on_its_own_batch():
    """Each sample times one call (a step that sleeps 20 ms takes at least that: a bound no load can break), on
    the batches in turn."""
    seen = []

    def step(batch):
        seen.append(batch)
        time.sleep(0.02)

    batches = [torch.tensor(i) for i in range(3)]
    assert host_ms_per_step(step, batches, 5, "cpu") >= 20.0
    assert [int(b) for b in seen] == [0, 1, 2, 0, 1]


def test_step_times_are_each_steps_own_on_the_batches_in_turn():
    """One time per step, in order, each at least the step's own sleep (a bound no load can break): the slow third
    step shows in its own sample only, so the median the rows report is a fast step's."""
    seen = []

    def step(batch):
        seen.append(int(batch))
        time.sleep(0.3 if len(seen) == 3 else 0.02)

    times = step_times_ms(step, [torch.tensor(i) for i in range(4)], 5, "cpu")
    assert [int(b) for b in seen] == [0, 1, 2, 3, 0] and len(times) == 5
    assert times[2] >= 300.0 and all(x >= 20.0 for x in times)


@pytest.mark.parametrize("setting,expected", [
    ("none", (False, None, "sublayers")), ("sublayer_graphs", (True, "reduce-overhead", "sublayers")),
    ("cudagraphs", (True, "reduce-overhead", "model"))])
def test_the_trainer_row_builds_the_bare_rows_setting(setting, expected):
    m = lightning_module(BASE, setting, "muon")
    assert (m.compile_model, m.compile_mode, m.compile_scope) == expected and m.optim_config.name == "muon"


def test_the_trainer_row_trains_and_is_set_against_the_bare_row(tmp_path):
    """``--lightning`` on the CPU: the model trains through ``lightning.Trainer`` with the bare rows' optimizer
    (Muon here); the section sets its logged tokens/s against the bare row of the same compile setting."""
    r = bench_lightning(BASE, 2, 16, 1, 2, str(tmp_path), "none", "muon")
    assert r["compile"] == "none" and r["optim"] == "muon" and r["tokens_per_s"] > 0
    assert (tmp_path / "metrics.csv").is_file()
    bare = {"params_M": 1.0, "active_M": 1.0, "gflop_per_token": 0.1, "ms_per_step": 2.0, "tokens_per_s": 400.0,
            "mfu": None, "correct": True}
    result = {"env": {"date": "d", "device": "cpu", "torch": "t", "triton": "t"}, "compile": ["none"],
              "batch": 2, "seq": 16, "recipe": "r.yaml", "warmup": 1, "steps": 2,
              "rows": {"plain": {"none": {**bare, "tokens_per_s": 900.0}}, "k3lit `r`": {"none": bare}},
              "lightning": {**r, "tokens_per_s": 300.0, "bare_row": "k3lit `r`"}}
    text = table(result)
    assert "compile `none`, muon" in text and "the bare row (none) 400 tokens/s" in text
    assert "runs at 0.75 of it" in text  # against the recipe's own bare row, not the first one
    result["lightning"]["bare_row"] = None  # no recipe row timed: no ratio
    assert "the bare row" not in table(result)
    result["lightning"]["bare_row"] = "k3lit `r`"
    assert "2 timed steps (their mean)" in text  # a stored run from before the per-step times
    result["rows"]["k3lit `r`"]["none"]["step_ms"] = [2.0, 2.0]
    assert "the median of 2 timed steps (CUDA events between steps)" in table(result)


def test_only_the_recipe_row_is_the_recipes_model():
    """main() names the Lightning row's bare row by identity with the recipe's config: no other row may share it."""
    named = rows(BASE, "r", ["plain", "dense", "recipe", "no_balancer"], None)
    assert [name for name, c in named.items() if c is BASE] == [next(n for n in named if n.startswith("k3lit `r`"))]


def test_a_recipe_is_a_file_or_its_name_in_recipes():
    by_name, data = recipe_config(Path("tiny"), None)
    by_file, _ = recipe_config(ROOT / "recipes" / "tiny.yaml", None)
    assert by_name == by_file and data["seq_len"] == 256
    with pytest.raises(SystemExit, match="no recipe 'tinny'.*small_plain, tiny"):
        recipe_config(Path("tinny"), None)
