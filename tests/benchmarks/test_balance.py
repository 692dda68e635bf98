"""benchmarks/balance.py's synthetic-router part on CPU, and its section."""

from __future__ import annotations

from benchmarks.balance import router_runs, section


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
