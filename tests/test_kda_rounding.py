"""``benchmarks/kda_rounding.py`` replays the kernels' chunked forward: with no rounding it must be the float64
recurrence itself (else its attribution of the output's error would measure its own mistakes)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parents[1] / "benchmarks"))

import kda_rounding  # noqa: E402


def test_chunked_replay_without_rounding_is_the_recurrence():
    data = kda_rounding.cases(T=70, K=24, seeds=2)  # T not a multiple of the chunk: a partial last chunk
    assert kda_rounding.mean_error(set(), "bf16", data) < 1e-12


def test_each_rounding_point_changes_the_output():
    data = kda_rounding.cases(T=40, K=16, seeds=1)
    for point in kda_rounding.POINTS:
        assert kda_rounding.mean_error({point}, "bf16", data) > 1e-7, point
    assert kda_rounding.mean_error({"Aq"}, "tf32", data) < kda_rounding.mean_error({"Aq"}, "bf16", data)
