"""benchmarks/screen.py on CPU: a narrowed MoE recipe and a variant through real `k3lit fit`, and the arithmetic."""

from __future__ import annotations

import json
import re
import sys

import pytest
import yaml

from benchmarks.screen import main, parser, screen, summarize, table, title, variants
from k3lit.data.prepare import prepare_corpus


def recipe(path, cache: str) -> str:
    model = dict(dim=32, n_layers=2, n_heads=2, head_dim=16, mlp_hidden=64, tie_embeddings=True, layer_pattern="KA",
                 n_experts=4, top_k=2, expert_dim=16)
    data = dict(corpus="stdlib", tokenizer="byte", seq_len=32, batch_size=2, val_fraction=0.05, cache_dir=cache)
    trainer = dict(accelerator="cpu", devices=1, log_every_n_steps=2, num_sanity_val_steps=0, gradient_clip_val=1.0,
                   check_val_every_n_epoch=None, enable_model_summary=False)
    path.write_text(yaml.safe_dump({"model": model, "optim": {"warmup_steps": 2}, "data": data, "trainer": trainer,
                                    "compile": False, "seed_everything": 3}))
    return str(path)


def test_the_recipe_and_a_variant_train_the_same_steps_on_the_same_bytes(tmp_path):
    cache = str(tmp_path / "data")
    prepare_corpus("stdlib", "byte", cache_dir=cache, val_fraction=0.05, verbose=False)
    config = recipe(tmp_path / "moe.yaml", cache)
    a = parser().parse_args(["--recipe", config, "--steps", "8", "--steady", "4", "--val_batches", "2", "--out",
                             str(tmp_path / "runs"), "--json", str(tmp_path / "screen.json"),
                             "--variant", "cap=--model.capacity_factor=1.0 --model.capacity_mode=causal"])
    result = screen(a)
    assert json.loads((tmp_path / "screen.json").read_text()) == json.loads(json.dumps(result))
    base, cap = result["runs"]
    assert (base["label"], base["fit_args"]) == ("recipe", [])
    assert cap["fit_args"] == ["--model.capacity_factor=1.0", "--model.capacity_mode=causal"]
    for r in (base, cap):
        assert [step for step, _ in r["val"]] == [4, 8]  # a validation at half the steps and at the end
        assert r["tokens_per_s"] > 0 and r["grad_norm"] > 0 and r["first_step_s"] is not None
        assert r["mfu"] is None  # no peak FLOP/s on the CPU
        assert len(r["max_vio_mean"]) == len(r["max_vio_p95"]) == 1  # KA: one MoE layer (the first is dense)
        log = (tmp_path / "runs" / f"{r['label']}.fit.log").read_text()
        assert "max_steps reached at step 8" in log
    # a capacity of exactly the balanced share caps every logged step's MaxVio_batch at 0; the recipe's does not
    assert cap["max_vio_mean"] == [0.0] and base["max_vio_mean"][0] > 0
    assert cap["rerouted"][0] > 0 and base["rerouted"] == [0.0]  # what the limit moved; nothing without one
    assert len(cap["val_max_vio"]) == len(base["val_max_vio"]) == 1
    text = table(result)
    assert title(result).startswith("Recipe variants (CPU") and title(result).endswith(", 8 steps)")
    assert "| `recipe` | (as shipped) |" in text
    delta = cap["val"][1][1] - base["val"][1][1]
    assert "| `cap` | `--model.capacity_factor=1.0` `--model.capacity_mode=causal` |" in text
    assert f"| {delta:+.4f} |" in text


def test_summarize_reads_medians_from_the_steady_step_and_load_from_the_second_half():
    def row(step: int, **values: float) -> dict[str, str]:
        return {"step": str(step), **{k: str(v) for k, v in values.items()}}

    rows = [row(19, **{"train/device/items_per_sec": 100.0, "train/device/mfu": 0.1, "train/grad_norm": 2.0,
                       "train/max_vio/layer0": 9.0, "train/max_vio/layer1": 9.0}),
            row(39, **{"train/device/items_per_sec": 300.0, "train/device/mfu": 0.3, "train/grad_norm": 1.0,
                       "train/max_vio/layer0": 0.5, "train/max_vio/layer1": 0.1}),
            row(49, **{"val/bpb": 1.5}),
            row(59, **{"train/device/items_per_sec": 500.0, "train/device/mfu": 0.5, "train/grad_norm": 3.0,
                       "train/max_vio/layer0": 0.3, "train/max_vio/layer1": 0.2,
                       "train/reroute_rate/layer0": 0.25, "train/reroute_rate/layer1": 0.5}),
            row(79, **{"train/device/items_per_sec": 200.0, "train/device/mfu": 0.2,
                       "train/max_vio/layer0": 0.1, "train/max_vio/layer1": 0.4,
                       "train/reroute_rate/layer0": 0.75, "train/reroute_rate/layer1": 0.5}),
            row(99, **{"val/bpb": 1.25, "val/max_vio/layer0": 0.0625, "val/max_vio/layer1": 0.125})]
    s = summarize(rows, steps=100, steady=30)
    assert s["val"] == [[50, 1.5], [100, 1.25]]
    assert s["tokens_per_s"] == 300.0 and s["mfu"] == 0.3  # steps 39, 59, 79; step 19 is before --steady
    assert s["grad_norm"] == 2.0
    # steps 50-99 only (59 and 79): the warm-up's 9.0 is not counted
    assert s["max_vio_mean"] == pytest.approx([0.2, 0.3])
    assert s["max_vio_p95"] == pytest.approx([0.1 + 0.95 * 0.2, 0.2 + 0.95 * 0.2])  # between the two, not beyond
    assert s["rerouted"] == [0.5, 0.5] and s["val_max_vio"] == [0.0625, 0.125]  # the last validation's
    empty = summarize([row(9, **{"train/loss": 3.0})], steps=10, steady=0)
    assert empty == {"val": [], "tokens_per_s": None, "mfu": None, "grad_norm": None, "max_vio_mean": [],
                     "max_vio_p95": [], "val_max_vio": [], "rerouted": []}


def test_variants_are_labelled_and_checked():
    assert variants(["lr=--optim.lr=3e-3 --optim.warmup_steps=10"]) == [
        ("recipe", []), ("lr", ["--optim.lr=3e-3", "--optim.warmup_steps=10"])]
    with pytest.raises(SystemExit, match="LABEL=ARG"):
        variants(["--optim.lr=3e-3"])
    with pytest.raises(SystemExit, match="each label once"):
        variants(["recipe=--optim.lr=1"])


@pytest.mark.parametrize("steps", ["1", "7"])
def test_steps_are_even_so_both_validations_run(monkeypatch, steps):
    monkeypatch.setattr(sys, "argv", ["screen.py", "--steps", steps])
    with pytest.raises(SystemExit, match=f"--steps {steps}: an even number"):
        main()


def test_from_json_writes_the_section_against_the_recipe_row(tmp_path, monkeypatch):
    env = {"date": "2026-01-01", "device": "NVIDIA H200", "torch": "t", "triton": "3"}

    def run(label: str, args: list[str], bpb: float, tps: float, vio: list[float]) -> dict:
        return {"label": label, "fit_args": args, "process_s": 1.0, "first_step_s": 0.5, "val": [[5, 2.0], [10, bpb]],
                "tokens_per_s": tps, "mfu": 0.125, "grad_norm": 1.5, "max_vio_mean": vio, "max_vio_p95": vio}

    stored = {"recipe": "recipes/small.yaml", "steps": 10, "steady": 2, "val_batches": 3, "env": env,
              "command": "`screen`", "json": "s.json",
              "runs": [{**run("recipe", [], 1.25, 200.0, [0.5, 0.25]), "val_max_vio": [0.5, 0.75],
                        "rerouted": [0.0, 0.125]}, run("fast", ["--x=1"], 1.5, 300.0, [])]}
    (tmp_path / "s.json").write_text(json.dumps(stored))
    results = tmp_path / "R.md"
    monkeypatch.setattr(sys, "argv", ["screen.py", "--from_json", str(tmp_path / "s.json"), "--results", str(results)])
    main()
    (name, body), = re.findall(r"^## (.+?)\n\n(.*)", results.read_text(), re.S | re.M)
    assert name == "Recipe variants (H200, 10 steps)"
    assert ("| `recipe` | (as shipped) | 2.0000 | **1.2500** | - | 200 | 12.5% | 1.50 | 0.500 / 0.375 | 0.500 | 0.750 "
            "| 0.0625 |") in body
    assert "| `fast` | `--x=1` | 2.0000 | **1.5000** | +0.2500 | 300 (1.500x) | 12.5% | 1.50 | - | - | - | - |" in body
