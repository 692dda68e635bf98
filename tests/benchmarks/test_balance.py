"""benchmarks/balance.py's synthetic-router part on CPU, and its section."""

from __future__ import annotations

from benchmarks.balance import compare_section, compare_summary, router_runs, section


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
              "step_s": [1.0] * 10 + [0.05] * 10, "max_vio_global": [0.3, 0.2], "val_bpb": 2.5}
    s = compare_summary(record)
    assert abs(s["vio_mean"] - 0.455) < 1e-6 and abs(s["vio_p95"] - 0.855) < 1e-6
    assert abs(s["dropped"] - 0.01) < 1e-9 and abs(s["rerouted"] - 0.02) < 1e-9 and abs(s["step_ms"] - 50) < 1e-6
    text = compare_section({"date": "d", "torch": "t", "python": "p", "cpu_threads": 1, "steps": 20, "command": "`c`",
                            "seconds": 60.0, "compare": {"7": {"none": record}}})
    assert "| none | 7 | 0.455 | 0.855 | 0.300 / 0.200 | 2.5000 | 0.0100 | 0.0200 | 50 |" in text
