"""benchmarks/startup.py on CPU: a narrowed recipe through real `k3lit prepare` and `k3lit fit`, three cache modes."""

from __future__ import annotations

import argparse
import json

import pytest
import yaml

from benchmarks.startup import MODES, modes, parser, startup, table
from k3lit.train.summary import SETUP_MARKS


def test_three_modes_of_one_recipe(tmp_path):
    model = dict(dim=32, n_layers=2, layer_pattern="KA", n_heads=2, head_dim=16, mlp_hidden=64)
    data = dict(corpus="stdlib", tokenizer="byte", seq_len=32, batch_size=2, val_fraction=0.05,
                cache_dir=str(tmp_path / "data"))
    trainer = dict(accelerator="cpu", devices=1, log_every_n_steps=1, enable_model_summary=False)
    recipe = tmp_path / "r.yaml"
    recipe.write_text(yaml.safe_dump({"model": model, "data": data, "trainer": trainer, "compile": False}))
    a = parser().parse_args(["--recipes", str(recipe), "--steps", "2", "--out", str(tmp_path / "runs"),
                             "--json", str(tmp_path / "r.json")])
    result = startup(a)
    assert json.loads((tmp_path / "r.json").read_text()) == result  # written after every row
    assert [r["mode"] for r in result["rows"]] == list(MODES)
    for r in result["rows"]:
        assert 0 <= r["first_step_s"] < r["process_s"], r
        assert 0 < r["setup_s"] < r["process_s"] - r["first_step_s"], r  # read from the run summary
        assert list(r["setup_parts_s"]) == list(SETUP_MARKS.values()), r  # every mark recorded, in order
        assert abs(sum(r["setup_parts_s"].values()) - r["setup_s"]) <= 0.4, r  # seven parts, each to 0.1 s
        assert 0 <= r["training_s"] < r["process_s"] - r["setup_s"] + 1, r  # the summary's wall time, to the second
    log = (tmp_path / "runs" / "r-cold-no-precompile.log").read_text()
    assert "steps          2" in log
    text = table(result)
    assert text.count("| `r` |") == 3 and "| cold, no precompile |" in text and "| warm |" in text
    warm = result["rows"][2]
    after = max(0.0, warm["process_s"] - warm["setup_s"] - warm["training_s"])  # training_s: whole seconds
    parts = "; ".join(f"{name} {x:.1f}" for name, x in warm["setup_parts_s"].items())
    row = (f"| warm | {warm['setup_s']:.1f} ({parts}) | {warm['first_step_s']:.1f} | {after:.0f} | "
           f"{warm['process_s']:.1f} |")
    assert row in text
    assert "Not measured" not in text
    short = {**warm, "process_s": warm["setup_s"] + warm["training_s"] - 0.3}  # the second rounded up
    assert "| -0 |" not in table({**result, "rows": [short]}) and "| 0 |" in table({**result, "rows": [short]})
    cut = table({**result, "rows": result["rows"][:2]})  # a run that ended before its warm row
    assert cut.count("| `r` |") == 2 and cut.endswith("Not measured (the run ended first): `r` warm.")


def test_modes_are_checked_and_kept_in_table_order():
    assert parser().parse_args(["--modes", "warm, cold"]).modes == ["cold", "warm"]
    assert parser().parse_args(["--modes", "cold-no-precompile"]).modes == ["cold, no precompile"]
    fit = parser().parse_args(["--recipes", "r.yaml", "--fit_args", "--optim.lr=1e-3", "--data.seq_len", "64"])
    assert fit.recipes == ["r.yaml"] and fit.fit_args == ["--optim.lr=1e-3", "--data.seq_len", "64"]
    assert parser().parse_args([]).modes == list(MODES)
    for bad, message in (("hot", "unknown mode"), ("warm", "add cold")):
        with pytest.raises(argparse.ArgumentTypeError, match=message):
            modes(bad)
    row = {"recipe": "r.yaml", "mode": "cold", "first_step_s": 1.0, "process_s": 2.0}
    env = {"date": "d", "device": "cpu", "torch": "t", "triton": "-"}
    text = table({"steps": 2, "modes": ["cold", "warm"], "env": env, "command": "c", "rows": [row]})
    assert text.endswith("Not measured (the run ended first): `r` warm.")  # not the mode it was not asked for
