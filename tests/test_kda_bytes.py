"""``benchmarks/kda_bytes.py``'s byte model of the KDA forward against what Nsight Compute measured (session 7)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import kda_bytes  # noqa: E402


def test_model_of_the_default_forward_matches_the_measured_bytes():
    model = kda_bytes.kernel_bytes(128, 32)
    for name, (_, gb) in kda_bytes.MEASURED.items():  # DRAM throughput x duration, per token and head
        measured = gb * 1e9 / kda_bytes.TOKEN_HEADS
        assert abs(model[name] / measured - 1) < 0.1, (name, model[name], measured)
    # the measured kernels at their own rates give their measured 0.712 ms
    assert abs(kda_bytes.predicted_ms({n: gb * 1e9 / kda_bytes.TOKEN_HEADS for n, (_, gb) in
                                       kda_bytes.MEASURED.items()}) - 0.712) < 1e-9
