"""benchmarks/long_context.py on CPU: narrowed models, two short lengths at the same tokens a step."""

from __future__ import annotations

import pytest
import yaml

import benchmarks.long_context as lc

MODEL = dict(dim=32, n_layers=2, n_heads=2, head_dim=16, mlp_hidden=64)


def recipe(path, **model) -> str:
    path.write_text(yaml.safe_dump({"model": {**MODEL, **model}, "data": {"tokenizer": "byte"}}))
    return str(path)


def test_every_length_holds_the_same_tokens_and_the_table_compares_the_models(tmp_path):
    k3 = recipe(tmp_path / "k3.yaml", layer_pattern="KA", kda_backend="torch", n_experts=4, top_k=2, expert_dim=16)
    plain = recipe(tmp_path / "plain.yaml", layer_pattern="A", residual="plain", rope_theta=10000.0)
    result = lc.main(["--recipe", k3, "--plain_recipe", plain, "--seqs", "32,64", "--tokens", "128", "--warmup", "2",
                      "--steps", "2", "--compile", "none", "--device", "cpu", "--json", str(tmp_path / "r.json")])
    for rows in result["models"].values():
        assert [rows[s]["batch"] for s in ("32", "64")] == [4, 2] and all(r["correct"] for r in rows.values())
        assert all(r["checkpointing"] == "none" for r in rows.values())
        assert all(r["host_ms_per_step"] > 0 for r in rows.values())  # its arithmetic: test_throughput_variants.py
    text = lc.table(result)
    k3_64, plain_64 = (result["models"][n]["64"]["tokens_per_s"] for n in ("`k3`", "`plain`"))
    row = next(line for line in text.splitlines() if line.startswith("| 64 | 2 |"))
    assert row.startswith(f"| 64 | 2 | {k3_64:,.0f} |") and row.endswith(f"| {k3_64 / plain_64:.2f}x |")


def test_the_verdict_names_the_crossover_and_the_target_at_32k():
    names = ["`small`", "`small_plain`"]
    text = lc.verdict({2048: 0.6, 8192: 0.88, 32768: 1.58, 65536: 2.07}, names)
    assert text == ("`small` overtakes `small_plain` between 8,192 and 32,768 tokens; at 32,768 tokens it trains at "
                    "1.58x the plain model's tokens/s: target (at least 1.5x) **met**.")
    assert "**not met**" in lc.verdict({2048: 0.6, 32768: 1.49}, names)
    assert lc.verdict({2048: 0.6, 8192: 0.9}, names) == "`small` is behind at every length."
    assert lc.verdict({2048: 1.1}, names) == "`small` is ahead at every measured length."


def test_a_length_that_does_not_fit_runs_with_block_checkpointing(monkeypatch):
    calls = []

    def bench(c, batch, seq, *args):
        calls.append(c.activation_checkpointing)
        if c.activation_checkpointing == "none":
            raise lc.torch.OutOfMemoryError("no room")
        return {"tokens_per_s": 1.0, "correct": True}

    monkeypatch.setattr(lc, "bench", bench)
    c = lc.ModelConfig(vocab_size=64, dim=32, n_layers=2, n_heads=2, head_dim=16)
    r = lc.bench_length(c, 64, 256, 1, 1, "cpu", "none")
    assert calls == ["none", "block"] and r["checkpointing"] == "block" and r["batch"] == 4
    with pytest.raises(ValueError, match="not a multiple of the length 48"):
        lc.bench_length(c, 48, 256, 1, 1, "cpu", "none")
