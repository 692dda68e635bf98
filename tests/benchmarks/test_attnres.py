"""benchmarks/attnres.py's kernel tables on CPU (Triton interpreter): they run and have the rows they promise."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parents[2] / "benchmarks"))
import attnres  # noqa: E402


def test_mix_table_lists_one_pass_and_two_phase_rows(seed):
    table = attnres.run_mix((1, 5, 96), [2, 3], sweep=False)
    one_pass = [line for line in table.splitlines() if line.startswith(("| bf16 |", "| fp32 emb + bf16 |"))]
    assert len(one_pass) == 2 * 2 * 2  # layouts x source counts x paths
    phases = [line.split("|")[1:-1] for line in table.splitlines() if line.startswith(("| 2 |", "| 3 |"))]
    assert [int(r[0]) for r in phases] == [2, 3]
    for row in phases:
        f1, b1, merge, total, one, one_total = map(float, row[1:])
        assert min(f1, b1, merge, one) > 0
        assert abs(total - (f1 + b1 + 3 * merge)) < 5e-3 and abs(one_total - 4 * one) < 5e-3  # printed to 0.001 ms
