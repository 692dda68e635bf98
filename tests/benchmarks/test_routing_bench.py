"""benchmarks/routing.py on CPU: a narrowed recipe's routing shape, every routing eager and compiled."""

from __future__ import annotations

import json

import yaml

from benchmarks.results import run_or_load
from benchmarks.routing import measure, parser, table


def test_every_routing_is_timed_and_counted(tmp_path, capsys):
    recipe = tmp_path / "r.yaml"
    recipe.write_text(yaml.safe_dump({"model": {"n_experts": 8, "top_k": 2},
                                      "data": {"seq_len": 64, "batch_size": 4}}))
    a = parser().parse_args(["--recipe", str(recipe), "--capacity_factors", "1.1", "--reps", "3", "--device", "cpu",
                             "--backend", "aot_eager", "--json", str(tmp_path / "r.json"),
                             "--results", str(tmp_path / "RESULTS.md")])
    result = run_or_load(a, measure, "Routing with a capacity limit", table)
    assert json.loads((tmp_path / "r.json").read_text()) == result
    rows = {r["routing"]: r for r in result["rows"]}
    assert list(rows) == ["top-k", "quantile capacity", "causal capacity 1.1", "causal capacity 1.1, torch rounds",
                          "forward capacity 1.1"]
    assert rows["forward capacity 1.1"]["compiled_ms"] is None  # a host loop: eager only
    for r in rows.values():
        assert r["eager_ms"] > 0 and (r["compiled_ms"] is None or r["compiled_ms"] > 0), r
    assert rows["top-k"]["rerouted"] == 0 < rows["causal capacity 1.1"]["rerouted"]  # the skewed router overflows
    assert rows["causal capacity 1.1"]["rerouted"] == rows["causal capacity 1.1, torch rounds"]["rerouted"]
    # causal on CPU: n + 1 = 9 rounds of several ops each, far more than the plain top-k
    assert rows["causal capacity 1.1"]["aten_ops"] > 9 * 5 > rows["top-k"]["aten_ops"]
    text = (tmp_path / "RESULTS.md").read_text()
    assert "## Routing with a capacity limit (CPU" in text and "| forward capacity 1.1 |" in text
    printed = capsys.readouterr().out  # the section in the log too: a device's files may not come back
    section = printed[printed.index("## Routing with a capacity limit (CPU"):printed.index("(section '## ")].strip()
    assert section in text and f"written to {tmp_path / 'RESULTS.md'})" in printed
    assert "m = 256 tokens of sequences of 64, n = 8 experts, top-2" in text
