"""benchmarks/kda_accuracy.py on CPU: its draws run the kernels (under the interpreter) against the float64
reference, and its table counts the draws each implementation wins."""

from __future__ import annotations

from benchmarks.kda import TOL, ours
from benchmarks.kda_accuracy import draw, section, table


def test_draws_have_bf16_level_errors_and_repeat():
    """Every output's error is that of bf16 arithmetic: above zero, far below one (the interpreter rounds otherwise
    than the GPU, so ``kda.py``'s GPU tolerances are not the bound here); the same seed gives the same draw."""
    first = draw({"k3lit": ours}, 2, 64, 2, 32, seed=3, device="cpu")
    assert set(first["k3lit"]) == set(TOL)
    assert all(1e-5 < first["k3lit"][n] < 2e-2 for n in TOL), first
    assert draw({"k3lit": ours}, 2, 64, 2, 32, seed=3, device="cpu") == first


def test_table_means_and_counts():
    runs = [{"k3lit": dict.fromkeys(TOL, 1.0), "fla": dict.fromkeys(TOL, 2.0)},
            {"k3lit": dict.fromkeys(TOL, 3.0), "fla": dict.fromkeys(TOL, 2.0)}]
    lines = table(runs)
    assert lines[2] == "| k3lit | " + " | ".join(["2.000e+00"] * len(TOL)) + " |"
    assert lines[3] == "| fla | " + " | ".join(["2.000e+00"] * len(TOL)) + " |"
    assert lines[4] == "| k3lit lower on | " + " | ".join(["1/2"] * len(TOL)) + " |"
    alone = table([{"k3lit": r["k3lit"]} for r in runs])
    assert len(alone) == 3 and not any("lower on" in line for line in alone)
    text = section({"versions": {"date": "d", "device": "dev", "torch": "t", "triton": "tr"}, "command": "`c`",
                    "shape": [1, 40, 2, 16], "runs": runs})
    assert "B1 T40 H2 D16" in text and "seeds 0-1" in text and "Command: `c`." in text and "fla-core" not in text
