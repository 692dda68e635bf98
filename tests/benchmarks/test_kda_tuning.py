"""benchmarks/kda_tuning.py on the CPU (kernels under TRITON_INTERPRET=1): every variant runs the layer's KDA op
with its settings, computes what the default computes, and leaves ``plan.TUNING`` as it found it."""

from __future__ import annotations

import argparse
import time

import pytest

from benchmarks import kda_tuning
from k3lit.kernels.kda import plan


def once(fn) -> float:  # noqa: ANN001
    start = time.perf_counter()
    fn()
    return 1e3 * (time.perf_counter() - start)


def test_variants_are_timed_against_the_default_and_compute_the_same():
    default = dict(plan.TUNING)
    a = argparse.Namespace(shapes=[(1, 40, 2, 16)], variants=[
        "split prep:fwd_prep=split", "16-wide values:main_bwd_bv=16", "bf16 U:u_dtype=work", "bad:main_bwd_bv=7"])
    r = kda_tuning.measure(a, device="cpu", bench=once)
    assert plan.TUNING == default
    rows = r["shapes"][0]["rows"]
    assert [row["label"] for row in rows] == ["default", "split prep", "16-wide values", "bf16 U", "bad"]
    assert all(row["fwd_ms"] > 0 and row["fwd_bwd_ms"] > 0 for row in rows[:4])
    assert rows[1]["diff"] < 1e-6 and rows[2]["diff"] < 1e-6, rows  # other tilings of the same sums
    assert rows[3]["diff"] > 1e-4, rows  # U rounded to bf16: another computation, and the difference shows
    assert "error" in rows[4] and "fwd_ms" not in rows[4]  # value blocks must be powers of two: no kernel
    text = kda_tuning.table(r)
    assert "| 1 x 40 x 2 x 16 | split prep (`fwd_prep=split`) |" in text and "failed:" in text


@pytest.mark.parametrize("spec", ["no label", "x:", "x:warps=8", ":main_bwd_warps=8", "x:main_bwd_warps"])
def test_a_malformed_variant_is_refused_with_the_keys(spec):
    with pytest.raises(SystemExit, match="LABEL:key=value"):
        kda_tuning.parse_variant(spec)


def test_variant_values_are_literals_or_words():
    assert kda_tuning.parse_variant("v:main_bwd_warps=8,fwd_bv=None,fwd_prep=split") == (
        "v", {"main_bwd_warps": 8, "fwd_bv": None, "fwd_prep": "split"})
