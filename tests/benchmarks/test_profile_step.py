"""benchmarks/profile_step.py on CPU: the configuration grid, and the counts and tables of a profiled step."""

import dataclasses
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parents[2] / "benchmarks"))
import profile_step  # noqa: E402

from k3lit.model import ModelConfig  # noqa: E402

TINY = ModelConfig(vocab_size=64, dim=32, n_layers=4, layer_pattern="KA", n_heads=2, head_dim=16, mlp_hidden=48,
                   attnres_block_size=2)


def test_grid_is_every_combination():
    assert profile_step.grid(["residual=plain,block_attnres", "activation_checkpointing=none,block"]) == [
        {"residual": r, "activation_checkpointing": p} for r in ("plain", "block_attnres") for p in ("none", "block")]
    assert profile_step.grid([]) == [{}]


def test_profile_counts_ops_and_recomputation():
    """Block AttnRes dispatches more operators than the plain residual; under ``block`` the profile shows one
    reentrant recomputation per step for every segment but the last (8 sublayers in segments of 2: 3)."""
    plain = profile_step.profile_config(dataclasses.replace(TINY, residual="plain"), 1, 16, 1, 40, None)
    block = profile_step.profile_config(dataclasses.replace(TINY, activation_checkpointing="block"), 1, 16, 1, 40,
                                        None)
    assert 0 < plain["summary"]["ops"] < block["summary"]["ops"]
    assert plain["summary"]["sublayers"] == 8 and plain["summary"]["device_ms"] is None  # CPU: no kernels
    rows = [line.split() for line in block["full"].splitlines()]
    assert ["CheckpointFunctionBackward", "3.0"] in [r[:2] for r in rows]
    assert "CheckpointFunctionBackward" not in plain["full"]
    head = profile_step.headline(block["summary"], 1, 16)
    assert head.startswith("== block_attnres / block (S=2)") and "dispatched ops" in head
