"""benchmarks/kernel_compile.py on CPU (no interpreter): a narrowed recipe's kernels timed both ways."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]


def test_a_recipes_kernels_compile_one_after_another_and_in_workers(tmp_path):
    model = dict(dim=64, n_layers=2, layer_pattern="KA", n_heads=2, head_dim=32, mlp_hidden=64)
    recipe = tmp_path / "r.yaml"
    recipe.write_text(yaml.safe_dump({"model": model, "data": {"batch_size": 2, "seq_len": 64}}))
    out = tmp_path / "out.json"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, "benchmarks/kernel_compile.py", "--recipes", str(recipe), "--workers", "2",
                          "--json", str(out), "--results", str(tmp_path / "RESULTS.md")], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-4000:]
    (row,) = json.loads(out.read_text())["rows"]
    assert row["kernels"] > 5 and row["workers"] == 2 and row["serial_s"] > 0 and row["workers_s"] > 0
    text = (tmp_path / "RESULTS.md").read_text()
    assert "## Kernel compile time (" in text and f"| `r` | {row['kernels']} |" in text
