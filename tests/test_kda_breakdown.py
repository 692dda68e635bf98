"""``benchmarks/kda_breakdown.py --sweep`` runs on a GPU only; what it sweeps must exist on any machine."""

from __future__ import annotations


def test_sweep_entries_name_real_launch_settings():
    from benchmarks.kda_breakdown import BIT_IDENTICAL, SWEEP, VARIANT_GROUPS
    from k3lit.kernels.kda import plan

    assert all(set(group) <= set(SWEEP) for group in VARIANT_GROUPS.values()) and BIT_IDENTICAL <= set(plan.TUNING)
    for label, update in SWEEP.items():
        assert set(update) <= set(plan.TUNING), f"{label}: {set(update) - set(plan.TUNING)} not in plan.TUNING"


def test_table_of_stored_sweeps():
    """``--table`` renders the H200 sweeps stored in benchmarks/ (RESULTS.md's "KDA launch settings" table): one row
    per variant and file, the fastest of each shape in bold, blank where a file lacks a variant's shape."""
    from benchmarks.kda_breakdown import table

    text = table(["benchmarks/kda_sweep_h200_forward.json", "benchmarks/kda_sweep_h200_combined.json"])
    rows = {line.split(" | ")[0][2:]: line.split(" | ")[1:] for line in text.splitlines()[2:]}
    assert text.splitlines()[0].startswith("| variant | B8 T2048 H16 D128 | B1 T65536 H16 D128 |")
    assert rows["default (kda_sweep_h200_forward.json)"][0] == "0.72 / 2.81"
    assert rows["prep fused 1 warp bk32, u work"][0] == "**0.61** / 2.71"  # fastest forward at B8 T2048
    assert rows["prep fused 1 warp bk32, segments 4"][1] == "**4.02** / 14.31"
    assert rows["prep fused 1 warp bk32 (kda_sweep_h200_combined.json)"][0] == "0.63 / **2.71**"  # in both runs
    assert len(rows) == 18 + 12  # 17 variants + default, 11 + default
