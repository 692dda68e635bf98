"""benchmarks/race.py on CPU: two narrowed recipes, a few seconds each, through real `k3lit fit` and `validate`."""

from __future__ import annotations

import math

import pytest
import yaml

from benchmarks.race import continued, parser, plot, race, table
from k3lit.data.prepare import prepare_corpus

MODEL = dict(dim=32, n_layers=2, n_heads=2, head_dim=16, mlp_hidden=64, tie_embeddings=True)


def recipe(path, cache: str, **model) -> str:
    data = dict(corpus="stdlib", tokenizer="byte", seq_len=32, batch_size=2, val_fraction=0.05, cache_dir=cache)
    trainer = dict(accelerator="cpu", devices=1, log_every_n_steps=2, num_sanity_val_steps=0,
                   check_val_every_n_epoch=None, enable_model_summary=False)
    path.write_text(yaml.safe_dump({"model": {**MODEL, **model}, "optim": {"warmup_steps": 2}, "data": data,
                                    "trainer": trainer, "compile": False}))
    return str(path)


def test_two_recipes_race_on_the_same_bytes(tmp_path):
    stdlib_cache = str(tmp_path / "data")
    prepare_corpus("stdlib", "byte", cache_dir=stdlib_cache, val_fraction=0.05, verbose=False)
    k3 = recipe(tmp_path / "k3.yaml", stdlib_cache, layer_pattern="KA", n_experts=4, top_k=2, expert_dim=16)
    plain = recipe(tmp_path / "plain.yaml", stdlib_cache, layer_pattern="A", residual="plain")
    a = parser().parse_args(["--recipes", k3, plain, "--seeds", "7", "--minutes", "0.1", "--val_every", "2",
                             "--val_batches", "2", "--final_batches", "3", "--out", str(tmp_path / "runs"),
                             "--json", str(tmp_path / "race.json"), "--positions", "32", "64", "--positions_blocks",
                             "2"])
    result = race(a)
    ref = result["same_bytes"]
    assert ref["blocks"] == 6 and ref["bytes"] == 6 * 33  # 3 batches of 2 blocks of 33 byte tokens
    assert [r["recipe"] for r in result["runs"]] == [k3, plain]
    for r in result["runs"]:
        seconds = [s for s, _, _ in r["curve"]]
        # the run's clock: a 6 s budget, and a validation starts before it ends
        assert len(seconds) >= 2 and seconds == sorted(seconds) and seconds[-1] < 6 + 5, r["curve"]
        assert r["steps"] > 2 and math.isfinite(r["final_val_loss"])
        assert r["first_step_s"] is not None and r["first_step_s"] >= 0  # read from the summary (0.0 s can happen)
    text = table(result, "race.png")
    assert text.count("| 7 | ") == 6 and "one seed of a recipe so far, so the seed-to-seed spread is not" in text
    second = {**result, "runs": result["runs"] + [{**r, "seed": 8} for r in result["runs"]]}
    assert "than the largest seed-to-seed spread (0.0000)" in table(second, "race.png")
    assert f"{ref['bytes']:,} bytes" in text
    for r in result["runs"]:  # the final weights at the training length and twice it, position by position
        assert [(p["length"], p["blocks"]) for p in r["positions"]] == [(32, 2), (64, 2)]
        assert [b["start"] for b in r["positions"][1]["buckets"]] == [0, 32]
    assert text.count("| 7 | 64 | 2 |") == 2  # a positions row per run and length
    plot(result, tmp_path / "race.png")
    assert (tmp_path / "race.png").stat().st_size > 10_000


def test_appended_runs_join_the_same_race_only():
    ref = {"blocks": 2, "seq_len": 8, "bytes": 40, "gzip -9": 5.0, "xz -9e": 5.5}
    earlier = {"minutes": 6.0, "val_batches": 25, "same_bytes": ref, "seeds": [1], "runs": [{"seed": 1}]}
    now = {"minutes": 6.0, "val_batches": 25, "same_bytes": dict(ref), "seeds": [2], "runs": [], "env": {}}
    merged = continued(earlier, now)
    assert merged["runs"] == [{"seed": 1}] and merged["seeds"] == [1, 2] and merged["env"] == {}
    with pytest.raises(SystemExit, match="minutes 6.0 against 8.0"):
        continued(earlier, {**now, "minutes": 8.0})


def test_first_step_seconds_reads_the_summary_row_not_the_compile_message():
    from benchmarks.race import first_step_seconds

    log = ("model: compiled blocks: the first steps compile it (--compile=false: eager)\n"
           "  first step     77.2 s after training started (compilation included)\n")
    assert first_step_seconds(log) == 77.2
    assert first_step_seconds("the first steps compile it\n") is None
