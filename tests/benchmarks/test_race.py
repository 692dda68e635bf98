"""benchmarks/race.py on CPU: two narrowed recipes, a few seconds each, through real `k3lit fit` and `validate`."""

from __future__ import annotations

import json
import math
import re
import sys
from pathlib import Path

import pytest
import yaml

from benchmarks.race import continued, data_args, main, parser, per_step, plot, race, steps_to, table, title
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
                             "2", "--positions_reading", "w8=--attn_window 8", "--variant",
                             f"k3_b4={k3} --data.batch_size=4 --model.capacity_factor=1.0"])
    result = race(a)
    ref = result["same_bytes"]
    assert ref["blocks"] == 6 and ref["bytes"] == 6 * 33  # 3 batches of 2 blocks of 33 byte tokens
    assert [(r["recipe"], r["label"]) for r in result["runs"]] == [(k3, "k3"), (plain, "plain"), (k3, "k3_b4")]
    k3_run, plain_run, variant = result["runs"]
    assert variant["fit_args"] == ["--data.batch_size=4", "--model.capacity_factor=1.0"]
    # the variant trained on batches of 4 sequences, its final pass read the recipe's batches of 2 (the same bytes)
    for r, batch in ((k3_run, 2), (variant, 4)):
        summary = (tmp_path / "runs" / f"{r['label']}-7.fit.log").read_text()
        tokens = int(re.search(r"tokens\s+([0-9,]+) \(this run\)", summary)[1].replace(",", ""))
        assert tokens == r["steps"] * batch * 32
    assert plain_run["expert_load"] is None
    for r in (k3_run, variant):  # one MoE layer (KA, the first dense): train and held-out MaxVio, re-routed share
        e = r["expert_load"]
        assert [len(v) for v in e.values()] == [1, 1, 1, 1] and e["val_max_vio"][0] > 0
        assert e["train_max_vio_p95"][0] >= e["train_max_vio_mean"][0]
    assert k3_run["expert_load"]["rerouted"] == [0.0] and variant["expert_load"]["rerouted"][0] > 0
    for r in result["runs"]:
        seconds = [s for s, _, _ in r["curve"]]
        # the run's clock: a 6 s budget, and a validation starts before it ends
        assert len(seconds) >= 2 and seconds == sorted(seconds) and seconds[-1] < 6 + 5, r["curve"]
        # how many steps fit in the 6 s is the machine's (2 for k3_b4 on a loaded 2-core machine): none is asserted
        assert r["steps"] >= 1 and math.isfinite(r["final_val_loss"])
        assert r["first_step_s"] is not None and r["first_step_s"] >= 0  # read from the summary (0.0 s can happen)
    text = table(result, "race.png")
    # runs, the MoE runs' worst-layer rows and per-layer rows (4 measures each), positions rows, and the per-step
    # rows (which runs' curves crossed is the data's: test_steps_to_a_bpb_interpolate_between_validations)
    crossed = sum(x.startswith("| `") for x in per_step(result["runs"]))
    assert text.count("| 7 | ") == 3 + 2 + 2 * 4 + 6 + 6 + crossed
    assert "| `k3_b4` | 7 | re-routed | " in text and "| `plain` | 7 | p95 |" not in text
    for r in (k3_run, variant):  # the fit's last load heatmap, beside the raw JSON and named in the table
        assert (tmp_path / r["expert_load_png"]).stat().st_size > 1_000 and r["expert_load_png"] in text
    assert "expert_load_png" not in plain_run
    assert "has one seed so far, so their seed-to-seed spread is not measured" in text
    assert "`k3_b4` = `k3` with `--data.batch_size=4 --model.capacity_factor=1.0`" in text
    second = {**result, "runs": result["runs"] + [{**r, "seed": 8} for r in result["runs"]]}
    assert "than the largest seed-to-seed spread (0.0000)" in table(second, "race.png")
    assert f"{ref['bytes']:,} bytes" in text
    for r in result["runs"]:  # the final weights at the training length and twice it, position by position
        assert [(p["length"], p["blocks"]) for p in r["positions"]] == [(32, 2), (64, 2)]
        assert [b["start"] for b in r["positions"][1]["buckets"]] == [0, 32]
    assert text.count("| 7 | 64 | 2 |") == 3 + 3  # a positions row per run and length, as trained and with w8
    for r in result["runs"]:  # the softmax layers through 8-token windows: the same bytes, other scores
        for trained, windowed in zip(r["positions"], r["positions_readings"]["w8"]):
            assert windowed["length"] == trained["length"] and windowed["bpb"] != trained["bpb"]
        w_long = r["positions_readings"]["w8"][1]
        assert f"| `{r['label']}` read with `w8` | 7 | 64 | 2 | {w_long['bpb']:.4f} |" in text
    for r in result["runs"]:  # at twice the training length: the last bucket over the same bytes in 32-token windows
        last = r["positions"][1]["buckets"][-1]
        assert r["positions"][1]["window"] == 32 and last["bpb_window"] > 0
        assert f"| {last['bpb_window']:.4f} | {last['bpb'] / last['bpb_window']:.3f} |" in text
    plot(result, tmp_path / "race.png")
    assert (tmp_path / "race.png").stat().st_size > 10_000


def test_appended_runs_join_the_same_race_only():
    ref = {"blocks": 2, "seq_len": 8, "bytes": 40, "gzip -9": 5.0, "xz -9e": 5.5}
    earlier = {"minutes": 6.0, "val_batches": 25, "same_bytes": ref, "seeds": [1], "runs": [{"seed": 1}]}
    now = {"minutes": 6.0, "val_batches": 25, "same_bytes": dict(ref), "seeds": [2], "runs": [], "env": {}}
    merged = continued(earlier, now)
    assert merged["runs"] == [{"date": None, "command": None, "seed": 1}] and merged["seeds"] == [1, 2]
    assert merged["env"] == {}
    with pytest.raises(SystemExit, match="minutes 6.0 against 8.0"):
        continued(earlier, {**now, "minutes": 8.0})


def test_verdict_ranks_every_label_against_the_seed_spread():
    from benchmarks.race import verdict

    text = verdict({"a": {1: [0.70], 2: [0.72]}, "b": {1: [0.68], 2: [0.69]}, "c": {1: [0.75]}})
    assert text == ("Mean held-out bpb over seeds (a seed run more than once counts as its runs' mean): `b` 0.6850 "
                    "(2 seeds, spread 0.0100), `a` 0.7100 (2 seeds, spread 0.0200), `c` 0.7500 (1 seed): `b` ahead of "
                    "`a` by 0.0250, more than the largest seed-to-seed spread (0.0200).")
    assert "less than the largest seed-to-seed spread (0.0300)" in verdict({"a": {1: [0.70], 2: [0.73]},
                                                                            "b": {1: [0.69], 2: [0.70]}})
    assert verdict({"a": {1: [0.7]}, "b": {1: [0.6], 2: [0.61]}}).endswith("seed-to-seed spread is not measured.")


def test_verdict_counts_a_seed_run_twice_as_one_seed():
    """Two runs of one seed are a repeat, not two seeds: their mean is that seed's bpb, and they give no spread."""
    from benchmarks.race import verdict

    text = verdict({"plain": {1234: [0.5101, 0.5098]}, "k3": {1234: [0.5475], 1235: [0.5499]}})
    assert "`plain` 0.5100 (1 seed, 2 runs)" in text and "`k3` 0.5487 (2 seeds, spread 0.0024)" in text
    assert text.endswith("one of the two has one seed so far, so their seed-to-seed spread is not measured.")


def test_variants_are_labelled_and_checked():
    from benchmarks.race import entrants

    a = parser().parse_args(["--recipes", "r/x.yaml", "--variant", "x_lr=r/x.yaml --optim.lr=1e-3 --data.batch_size=8"])
    assert entrants(a) == [("x", "r/x.yaml", []), ("x_lr", "r/x.yaml", ["--optim.lr=1e-3", "--data.batch_size=8"])]
    with pytest.raises(SystemExit, match="LABEL=RECIPE"):
        entrants(parser().parse_args(["--variant", "no_recipe="]))
    with pytest.raises(SystemExit, match="nothing to run"):
        entrants(parser().parse_args(["--recipes"]))
    assert entrants(parser().parse_args(["--recipes", "--variant", "v=r/x.yaml --optim.lr=1"])) == [
        ("v", "r/x.yaml", ["--optim.lr=1"])]
    with pytest.raises(SystemExit, match="each label once"):
        entrants(parser().parse_args(["--recipes", "r/x.yaml", "--variant", "x=r/x.yaml --optim.lr=1"]))


def test_first_step_seconds_reads_the_summary_row_not_the_compile_message():
    from benchmarks.race import first_step_seconds

    log = ("model: compiled blocks: the first steps compile it (--compile=false: eager)\n"
           "  first step     77.2 s after training started (compilation included)\n")
    assert first_step_seconds(log) == 77.2
    assert first_step_seconds("the first steps compile it\n") is None


def test_a_run_cut_before_its_final_pass_keeps_what_the_fit_logged(tmp_path, monkeypatch):
    import benchmarks.race as race_mod

    def fake_k3lit(*args, log, env=None):
        if args[0] == "validate":
            raise RuntimeError("k3lit validate failed (124)")
        folder = tmp_path / "x-3"
        folder.mkdir()
        (folder / "metrics.csv").write_text("step,train/device/items_per_sec,val/bpb,val/elapsed_s\n"
                                           "19,1000.0,,\n39,3000.0,,\n40,,2.5,9.0\n")
        log.write_text("  first step     4.5 s after training started (compilation included)\n")

    monkeypatch.setattr(race_mod, "k3lit", fake_k3lit)
    saved = []
    a = parser().parse_args(["--recipes", "r/x.yaml"])
    with pytest.raises(RuntimeError, match="validate failed"):
        race_mod.run(("x", "r/x.yaml", []), 3, a, tmp_path, saved.append)
    assert saved == [{"recipe": "r/x.yaml", "label": "x", "fit_args": [], "seed": 3, "steps": 41,
                      "process_s": saved[0]["process_s"], "curve": [(9.0, 40, 2.5)], "expert_load": None,
                      "final_val_loss": None, "median_tokens_per_s": 2000.0, "first_step_s": 4.5, "positions": None}]
    ref = {"blocks": 2, "seq_len": 8, "bytes": 40, "gzip -9": 5.0, "xz -9e": 5.5}
    done = {**saved[0], "label": "y", "final_val_loss": 1.0}
    result = {"env": {"date": "d", "device": "X", "torch": "t", "triton": "tr"}, "command": "c", "minutes": 6.0,
              "same_bytes": ref, "seeds": [3], "val_batches": 2, "runs": [saved[0], done]}
    text = table(result, "r.png")
    assert "| `x` | d | 3 | 41 | 4.5 | 2,000 | 2.5000 | - |" in text
    assert "final held-out pass of `x` seed 3 did not finish" in text
    assert "Mean held-out bpb" not in text  # one finished label: nothing to compare


def test_a_run_saves_after_its_final_pass_and_each_positions_reading(tmp_path, monkeypatch):
    """A device call cut during the extrapolation readings keeps the final pass and the readings already done."""
    import benchmarks.race as race_mod

    def fake_k3lit(*args, log, env=None):
        folder = tmp_path / "x-3"
        if args[0] == "fit":
            folder.mkdir()
            (folder / "metrics.csv").write_text("step,train/device/items_per_sec,val/bpb,val/elapsed_s\n"
                                               "39,3000.0,,\n40,,2.5,9.0\n")
        elif args[0] == "validate":
            (tmp_path / "x-3-val").mkdir()
            (tmp_path / "x-3-val" / "metrics.csv").write_text("step,val/loss,val/bpb\n0,1.25,0.5\n")
        else:  # positions: the reading's own results, told apart by the window argument
            out = Path(args[args.index("--json") + 1])
            out.write_text(json.dumps({"results": [{"window": "--attn_window" in args}]}))
        log.write_text("")

    monkeypatch.setattr(race_mod, "k3lit", fake_k3lit)
    saved = []
    a = parser().parse_args(["--recipes", "r/x.yaml", "--positions", "16", "32",
                             "--positions_reading", "w=--attn_window 16"])
    done = race_mod.run(("x", "r/x.yaml", []), 3, a, tmp_path, saved.append)
    assert [(r["final_val_loss"], r["positions"], r.get("positions_readings")) for r in saved] == [
        (None, None, None), (1.25, None, None), (1.25, [{"window": False}], None),
        (1.25, [{"window": False}], {"w": [{"window": True}]})]
    assert done == saved[-1]


def test_seq_len_races_longer_sequences_at_the_same_tokens_per_step(tmp_path):
    stdlib_cache = str(tmp_path / "data")
    prepare_corpus("stdlib", "byte", cache_dir=stdlib_cache, val_fraction=0.05, verbose=False)
    k3 = recipe(tmp_path / "k3.yaml", stdlib_cache, layer_pattern="KA")
    assert data_args(k3, None) == []
    assert data_args(k3, 64) == ["--data.seq_len=64", "--data.batch_size=1"]  # 2 x 32 tokens a step
    with pytest.raises(SystemExit, match="choose a divisor of it, e.g. 128"):
        data_args(k3, 48)
    a = parser().parse_args(["--recipes", k3, "--seeds", "7", "--minutes", "0.05", "--val_every", "2",
                             "--val_batches", "2", "--final_batches", "3", "--out", str(tmp_path / "runs"),
                             "--seq_len", "64"])
    result = race(a)
    ref = result["same_bytes"]
    assert (ref["blocks"], ref["seq_len"], ref["bytes"]) == (3, 64, 3 * 65)  # 3 batches of 1 block of 65 tokens
    (run,) = result["runs"]
    summary = (tmp_path / "runs" / "k3-7.fit.log").read_text()
    tokens = int(re.search(r"tokens\s+([0-9,]+) \(this run\)", summary)[1].replace(",", ""))
    assert tokens == run["steps"] * 64
    # --val_batches 2 of 1 block of 65 tokens
    assert "on the text of the 2 validation blocks (130 bytes, each block's first token" in summary
    assert math.isfinite(run["final_val_loss"])
    assert title(result) == f"Race at equal wall-clock, 64-token sequences ({result['env']['device']})"
    assert "at 64-token sequences (its batch scaled to the same tokens per step)" in table(result, "race.png")
    with pytest.raises(SystemExit, match="another race"):  # a 2,048-token race's runs are not appended to it
        continued({**result, "same_bytes": {**ref, "seq_len": 32}}, result)


def test_from_json_joins_the_runs_of_several_calls(tmp_path, monkeypatch):
    ref = {"blocks": 2, "seq_len": 8, "bytes": 40, "gzip -9": 5.0, "xz -9e": 5.5}
    env = {"date": "2026-01-01", "device": "NVIDIA H200", "torch": "t", "triton": "3"}

    def call(name: str, seed: int, loss: float | None, date: str) -> Path:
        run = {"recipe": f"recipes/{name}.yaml", "label": name, "fit_args": [], "seed": seed, "steps": 10,
               "process_s": 1.0, "curve": [[1.0, 5, 2.0], [2.0, 10, 1.5]], "expert_load": None,
               "final_val_loss": loss, "median_tokens_per_s": 100.0, "first_step_s": 0.5, "positions": None}
        stored = {"minutes": 6.0, "seeds": [seed], "val_batches": 25, "seq_len": 8, "env": {**env, "date": date},
                  "command": f"race {name}", "json": "", "runs": [run], "same_bytes": ref}
        (tmp_path / f"{name}.json").write_text(json.dumps(stored))
        return tmp_path / f"{name}.json"

    a, b = call("k3", 1, None, "2026-01-01"), call("plain", 1, 1.0, "2026-01-02")
    results = tmp_path / "R.md"
    monkeypatch.setattr(sys, "argv", ["race.py", "--from_json", str(a), str(b), "--json", str(tmp_path / "j.json"),
                                      "--results", str(results)])
    main()
    joined = json.loads((tmp_path / "j.json").read_text())
    assert [r["label"] for r in joined["runs"]] == ["k3", "plain"] and joined["command"] == "race plain"
    (title_, body), = re.findall(r"^## (.+?)\n\n(.*)", results.read_text(), re.S | re.M)
    assert title_ == "Race at equal wall-clock, 8-token sequences (H200)"
    assert "| `plain` | 2026-01-02 | 1 | 10 |" in body
    assert "| `k3` | 2026-01-01 | 1 | 10 | 0.5 | 100 | 1.5000 | - |" in body
    assert [(r["date"], r["command"]) for r in joined["runs"]] == [("2026-01-01", "race k3"),
                                                                    ("2026-01-02", "race plain")]
    assert "2026-01-02 · NVIDIA H200" in body  # the header: the latest invocation's
    assert (tmp_path / "j.png").is_file()
    other = json.loads(b.read_text())
    other["minutes"] = 8.0
    b.write_text(json.dumps(other))
    with pytest.raises(SystemExit, match="another race"):
        main()


def test_steps_to_a_bpb_interpolate_between_validations():
    """A curve reaches 0.7 halfway between its validations at steps 100 (0.8) and 200 (0.6); never 0.5. Per step
    the run whose last bpb another reached later is set against it, runs of other seeds are not."""
    fast = [(10.0, 50, 0.9), (20.0, 100, 0.7)]
    slow = [(10.0, 100, 0.8), (20.0, 200, 0.6), (30.0, 300, 0.55)]
    assert steps_to(slow, 0.7) == pytest.approx(150.0) and steps_to(slow, 0.5) is None
    runs = [{"label": "k3", "seed": 1, "curve": fast}, {"label": "plain", "seed": 1, "curve": slow},
            {"label": "plain", "seed": 2, "curve": [(1.0, 10, 0.1), (2.0, 20, 0.05)]}]
    lines = per_step(runs)
    # only plain reaching k3's 0.70: k3 never reached plain's 0.55, and seed 2 has no other label's run
    assert [x for x in lines if x.startswith("| `")] == ["| `k3` | 1 | 0.7000 | 100 | `plain` | 150 | 1.50 |"]
    assert per_step(runs[1:]) == []


def test_a_malformed_positions_reading_stops_the_race_before_it_starts():
    a = parser().parse_args(["--positions", "64", "--positions_reading", "--attn_window 8"])
    with pytest.raises(SystemExit, match="write LABEL=ARGS"):
        race(a)
    a = parser().parse_args(["--positions", "64", "--positions_reading", "w=--attn_window 8",
                             "--positions_reading", "w=--attn_logn_base 8"])
    with pytest.raises(SystemExit, match="each label once"):
        race(a)


def test_a_missing_recipe_or_a_bad_seq_len_stops_the_race_before_the_corpus_is_prepared(monkeypatch):
    import benchmarks.race as race_module

    monkeypatch.setattr(race_module, "k3lit", lambda *a, **k: pytest.fail("the race started"))
    with pytest.raises(SystemExit, match=r"^no recipe recipes/nope\.yaml"):
        race(parser().parse_args(["--recipes", "recipes/nope.yaml"]))
    with pytest.raises(SystemExit, match=r"--seq_len 1000: recipes/tiny\.yaml reads"):
        race(parser().parse_args(["--recipes", "recipes/tiny.yaml", "--seq_len", "1000"]))


@pytest.mark.parametrize("values, top", [([3.94, 3.93], None), ([4.0, 3.5, 3.02], None), ([9.0, 2.1, 0.8], 3.0)])
def test_the_curve_caps_its_axis_only_over_runs_that_reach_below_it(tmp_path, values, top):
    """A short race whose curve stays above 3 bits per byte keeps its own axis (capping at 3 flipped it, or hid
    every point); a long one's first validations are cut at 3, so the axis shows where the runs end."""
    run = {"recipe": "recipes/a.yaml", "label": "a", "seed": 1, "curve": [[10.0 * i, i, v] for i, v in
                                                                           enumerate(values)]}
    env = {"date": "d", "device": "cpu", "torch": "t", "triton": "-"}
    low, high = plot({"runs": [run], "seeds": [1], "val_batches": 2, "minutes": 1.0, "env": env},
                     tmp_path / "c.png")
    assert (tmp_path / "c.png").stat().st_size > 0 and low < min(values)
    assert high == top if top is not None else high > max(values)
