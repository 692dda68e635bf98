"""benchmarks/moe.py times on a GPU only; its section renders any record it writes (with or without the experts
table, with or without the larger layer)."""

from __future__ import annotations

from benchmarks.moe import section

SHAPE = {"m": 1024, "d": 64, "f": 32, "n": 8, "k": 2}


def record(**extra) -> dict:
    return {"date": "2026-01-01", "gpu": "GPU", "torch": "t", "python": "p", "command": "`c`", "shape": SHAPE,
            "experts": None,
            "layer": {"ms": {"none": 10.0, "aux_free": 10.1, "quantile": 10.2, "quantile_hist": 10.3},
                      "overhead_vs_none": {"aux_free": 0.01, "quantile": 0.02, "quantile_hist": 0.03}}, **extra}


def rows(text: str) -> dict[str, list[str]]:
    return {cells[0]: cells[1:] for line in text.splitlines() if line.startswith("| ")
            for cells in [[c.strip() for c in line.strip("|").split("|")]]}


def test_layer_table_and_target():
    text = section(record())
    assert "Experts alone" not in text
    got = rows(text)
    assert got["none"] == ["10.00", "-"] and got["quantile_hist (1000-bin histogram, per micro-batch)"] == ["10.30",
                                                                                                         "+3.0%"]
    assert "**met** (largest +3.0%)" in text


def test_larger_layer_column_and_missed_target():
    big = {"ms": {"none": 20.0, "quantile": 22.0}, "overhead_vs_none": {"quantile": 0.10}}
    experts = {"rel_err_native_vs_loop": 0.0, "native_fwd_ms": 1.0, "native_fwd_bwd_ms": 3.0, "loop_fwd_ms": 2.0,
               "loop_fwd_bwd_ms": 30.0, "native_fwd_tflops": 0.0, "speedup_fwd_bwd": 10.0}
    text = section(record(layer_n32=big, experts=experts))
    got = rows(text)
    assert "n = 8: ms | overhead vs none | n = 32: ms | overhead vs none" in text
    assert got["aux_free (sign bias)"] == ["10.10", "+1.0%", "", ""]
    assert got["quantile (exact pooled quantile)"] == ["10.20", "+2.0%", "22.00", "+10.0%"]
    assert got["speed-up"] == ["2.00x", "10.0x", ""]
    assert "**not met** (largest +10.0%)" in text
