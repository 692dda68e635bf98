"""The Makefile's entry points: a recipe name that does not exist is refused before anything installs."""

import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]


@pytest.mark.parametrize("target", ["train", "prepare", "generate", "slurm"])
def test_an_unknown_recipe_is_refused_with_the_list_of_recipes(target, tmp_path):
    # VENV points at a folder that does not exist: were the recipe not checked first, install would build one there
    run = subprocess.run(["make", "-s", "-C", str(ROOT), target, "RECIPE=tinny", f"VENV={tmp_path / 'venv'}"],
                         capture_output=True, text=True, timeout=60)
    assert run.returncode != 0 and not (tmp_path / "venv").exists()
    names = sorted(p.stem for p in (ROOT / "recipes").glob("*.yaml"))
    assert f"make: no recipe 'tinny': RECIPE= takes a file or one of: {' '.join(names)}" in run.stdout
