"""benchmarks/short_conv.py on the CPU (kernels under TRITON_INTERPRET=1): its errors against float64, and that
every tiling its sweep tries computes y and dx to the same bits as the default one."""

from __future__ import annotations

import argparse
import time

from benchmarks import short_conv
from k3lit.kernels.short_conv import conv


def once(fn) -> float:  # noqa: ANN001
    start = time.perf_counter()
    fn()
    return 1e3 * (time.perf_counter() - start)


def test_errors_and_every_tiling_computes_the_same(monkeypatch):
    monkeypatch.setattr(short_conv, "SWEEP", {"bt": (16, 32), "bc": (32, 64), "warps": (4,)})
    default = dict(conv.TUNING)
    a = argparse.Namespace(shapes=[(2, 40, 96)], sweep=True)
    r = short_conv.measure(a, device="cpu", bench=once)
    assert conv.TUNING == default
    (shape,) = r["shapes"]
    assert "fla" not in shape  # fla runs on CUDA only
    err = shape["k3lit"]["err"]
    assert err["y"] < 4e-3 and err["dx"] < 4e-3 and err["dw"] < 4e-3, err  # bf16 outputs, float32 sums
    (sweep,) = r["sweep"]
    assert len(sweep["rows"]) == 3 * 4
    assert all(row["same"] and row["ms"] > 0 for row in sweep["rows"]), sweep["rows"]
    text = short_conv.table(r)
    assert "| 2 x 40 x 96 | k3lit |" in text and text.count("same bits") == 3 * 3
