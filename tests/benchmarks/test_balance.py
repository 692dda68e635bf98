"""benchmarks/balance.py's synthetic-router part on CPU, and its section."""

from __future__ import annotations

import torch

from benchmarks.balance import compare_section, compare_summary, fitted_bias, router_runs, section
from k3lit.ops.routing import expert_load, max_violation


def test_quantile_balancing_reaches_the_noise_floor_first():
    runs = router_runs(m=2048, k=2, ns=(16,), max_updates=400, settle=5)
    r = runs[16]
    assert r["quantile"]["updates"] is not None and r["quantile"]["updates"] <= 5, r
    assert r["quantile_hist"]["updates"] is not None and r["quantile_hist"]["updates"] <= 5, r
    assert r["sign"]["updates"] is None or r["sign"]["updates"] > r["quantile"]["updates"], r
    text = section({"date": "d", "torch": "t", "python": "p", "cpu_threads": 2, "steps": 1, "command": "`c`",
                    "seconds": 60.0, "router": runs})
    line = next(row for row in text.splitlines() if row.startswith("| 16 |"))
    assert f"| {r['quantile']['updates']} | {r['quantile_hist']['updates']} | {r['sign']['updates']} |" in line
    assert "CPU, 2 threads" in text and "**A." not in text


def test_compare_summary_takes_the_second_half_and_the_worst_layer():
    record = {"max_vio": [[9.0, 9.0]] * 10 + [[0.1 * i, 0.05] for i in range(10)],  # first half is ignored
              "dropped": [1.0] * 10 + [0.01] * 10, "rerouted": [1.0] * 10 + [0.02] * 10,
              "step_s": [1.0] * 10 + [0.05] * 10, "max_vio_global": [0.3, 0.2], "val_bpb": 2.5,
              "fields": {"balancer": "none"}}
    s = compare_summary(record)
    assert abs(s["vio_mean"] - 0.455) < 1e-6 and abs(s["vio_p95"] - 0.855) < 1e-6
    assert abs(s["dropped"] - 0.01) < 1e-9 and abs(s["rerouted"] - 0.02) < 1e-9 and abs(s["step_ms"] - 50) < 1e-6
    text = compare_section({"date": "d", "torch": "t", "python": "p", "cpu_threads": 1, "steps": 20, "command": "`c`",
                            "seconds": 60.0, "compare": {"7": {"none": record}}})
    assert "| none | 7 | 0.455 | 0.855 | 0.300 / 0.200 | 2.5000 | 0.0100 | 0.0200 | 50 | – | – |" in text
    record["fitted"] = [{"pooled": 0.01, "train": 0.42, "held_out": 0.7}, {"pooled": 0.02, "train": 0.5,
                                                                            "held_out": 0.61}]
    text = compare_section({"date": "d", "torch": "t", "python": "p", "cpu_threads": 1, "steps": 20, "command": "`c`",
                            "seconds": 60.0, "compare": {"7": {"none": record}}})
    assert "| 50 | 0.500 | 0.700 / 0.610 |" in text
    assert "lowest train MaxVio_batch mean is 0.455 (none), against 0.500-0.500 for a bias fitted" in text


def test_fitted_bias_balances_the_pooled_batches_and_sees_a_shifted_held_out_set():
    gen = torch.Generator().manual_seed(0)
    n, k = 16, 2
    offsets = torch.randn(n, generator=gen)

    def draw(m: int, shift: float = 0.0) -> torch.Tensor:
        skew = offsets.clone()
        skew[0] += shift
        return torch.sigmoid(skew + torch.randn(m, n, generator=gen))

    train = [draw(512) for _ in range(16)]
    same, shifted = fitted_bias(train, draw(8192), torch.zeros(n), k), fitted_bias(train, draw(8192, 2.0),
                                                                                     torch.zeros(n), k)
    pooled = torch.cat(train)
    idx = (pooled + same["bias"]).topk(k, dim=-1).indices
    assert abs(max_violation(expert_load(idx, n), k, pooled.shape[0]).item() - same["pooled"]) < 1e-6
    assert same["pooled"] < 0.05  # the ascent balances the pooled sample it ran on
    # a batch of 512 tokens (32 per expert and slot) stays above the pooled residual: sampling noise
    assert same["pooled"] < same["train"] < 0.6
    # the same distribution held out balances about as well as a training batch; a shifted one does not
    assert same["held_out"] < 0.25 and shifted["held_out"] > 1.0
