"""``benchmarks/kda_breakdown.py --sweep`` runs on a GPU only; what it sweeps must exist on any machine."""

from __future__ import annotations


def test_sweep_entries_name_real_launch_settings():
    from benchmarks.kda_breakdown import BIT_IDENTICAL, FORWARD_VARIANTS, SWEEP
    from k3lit.kernels.kda import chunk

    assert set(FORWARD_VARIANTS) <= set(SWEEP) and BIT_IDENTICAL <= set(chunk.TUNING)
    for label, update in SWEEP.items():
        assert set(update) <= set(chunk.TUNING), f"{label}: {set(update) - set(chunk.TUNING)} not in chunk.TUNING"
