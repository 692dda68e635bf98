"""``benchmarks/kda_first_call.py`` times compilation on the GPU; here its processes, records and table run on the
CPU (k3lit's kernels under the interpreter), and a process that runs out of time is reported, not lost."""

from __future__ import annotations

from pathlib import Path

STORED = Path(__file__).parents[2] / "benchmarks" / "kda_first_call_h200.json"


def test_first_call_processes_report_every_step():
    from benchmarks.kda_first_call import CPU_STEPS, STEPS, measure, table

    results = measure(["k3lit"], "cpu", {"k3lit": 300})
    for run in ("cold", "cached"):
        r = results["k3lit"][run]
        assert r["stopped"] is None
        assert [s["step"] for s in r["steps"]] == [s[0] for s in CPU_STEPS] == [s[0] for s in STEPS]
        assert [s["shape"] for s in r["steps"]] == [list(s[1:]) for s in CPU_STEPS]
        assert all(s["first_s"] > 0 and s["warm_s"] > 0 for s in r["steps"])
    rows = table(results)[2:]
    assert [row.split(" | ")[:2] for row in rows] == [["| k3lit", "cold"], ["| k3lit", "cached"]]
    assert all("—" not in row for row in rows)


def test_first_call_process_out_of_time_is_reported(tmp_path):
    from benchmarks.kda_first_call import run_child, table

    steps, stopped = run_child("k3lit", "cpu", str(tmp_path), timeout=0.5)
    assert steps == [] and stopped == "timed out after 0 s"
    row = table({"k3lit": {"cold": {"steps": steps, "stopped": stopped}}})[2]
    assert row.startswith("| k3lit | cold (timed out") and row.count("—") == 4


def test_section_of_the_stored_h200_run():
    """``--from-json`` renders RESULTS.md's "KDA first call" table from the stored H200 run: one row per
    implementation and process, ``—`` where fla's first process ran out of time."""
    import json

    from benchmarks.kda_first_call import section

    with open(STORED) as f:
        stored = json.load(f)
    text = section(stored["versions"], stored["results"], stored["steps"])
    rows = {tuple(c.strip() for c in line.split("|")[1:3]): line for line in text.splitlines()
            if line.startswith("| k3lit") or line.startswith("| fla")}
    assert list(rows) == [("k3lit", "cold"), ("k3lit", "cached"), ("fla", "cold (timed out after 240 s)"),
                          ("fla", "cached")]
    assert "| 12.8 / 0.027 | 0.003 / 0.003 | 0.003 / 0.003 | 5.16 / 0.002 |" in rows["k3lit", "cold"]
    assert rows["fla", "cold (timed out after 240 s)"].endswith("| — | — |")
    assert "fla-core 0.6.0" in text and "NVIDIA H200" in text
