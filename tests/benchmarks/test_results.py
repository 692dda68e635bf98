"""benchmarks/results.py, and RESULTS.md against the scripts and stored runs it names."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from benchmarks import balance, kda_accuracy, kda_first_call, moe
from benchmarks.results import (
    add_fit_args_argument,
    check_outputs,
    check_recipes,
    command,
    load_json,
    write_result,
    write_section,
)

ROOT = Path(__file__).parents[2]
RESULTS = ROOT / "benchmarks" / "RESULTS.md"


def sections(text: str) -> dict[str, str]:
    """``{title: body}`` of every ``## title`` section of a RESULTS.md text."""
    return {m[1]: m[2].strip() for m in re.finditer(r"^## ([^\n]+)\n(.*?)(?=^## |\Z)", text, re.S | re.M)}


def test_write_section_replaces_its_own_section_only(tmp_path):
    path = tmp_path / "RESULTS.md"
    write_section("A", "first a", path)
    write_section("B", "first b", path)
    write_section("A", "second a\n\n| x |", path)
    text = path.read_text()
    assert text.startswith("# Benchmark results\n")
    assert sections(text) == {"A": "second a\n\n| x |", "B": "first b"}
    assert text.index("## A") < text.index("## B")


def test_write_section_keeps_the_hand_written_subsections(tmp_path):
    path = tmp_path / "RESULTS.md"
    write_section("A", "table 1", path)
    write_section("B", "first b", path)
    hand = "### Reading\n\nby hand, with #### and ## inside"
    path.write_text(path.read_text().replace("table 1\n", f"table 1\n\n{hand}\n"))
    write_section("A", "table 2", path)
    text = path.read_text()
    assert sections(text) == {"A": f"table 2\n\n{hand}", "B": "first b"}
    write_section("A", "table 3", path)
    assert text.replace("table 2", "table 3") == path.read_text()


def test_write_section_refuses_a_body_with_a_subsection(tmp_path):
    with pytest.raises(ValueError, match="### heading"):
        write_section("A", "table\n\n### by a script", tmp_path / "RESULTS.md")


def test_write_result_writes_the_file_it_is_given_or_none(tmp_path, capsys):
    path = tmp_path / "R.md"
    write_result(str(path), "A (cpu)", "table")
    assert sections(path.read_text()) == {"A (cpu)": "table"} and f"written to {path}" in capsys.readouterr().out
    write_result("none", "B (cpu)", "other")
    assert sections(path.read_text()) == {"A (cpu)": "table"} and "written" not in capsys.readouterr().out


def test_a_bad_from_json_is_one_line(tmp_path):
    with pytest.raises(SystemExit, match=r"^--from_json .*nope\.json: no such file$"):
        load_json(tmp_path / "nope.json", ("runs",))
    (tmp_path / "bad.json").write_text("{")
    with pytest.raises(SystemExit, match=r"^--from_json .*bad\.json: not JSON"):
        load_json(tmp_path / "bad.json", ("runs",))
    (tmp_path / "other.json").write_text('{"rows": []}')
    with pytest.raises(SystemExit, match=r"^--from_json .*other\.json: not a stored run of benchmarks/.* \(it has no "
                                         r"'runs'\); give the file its --json wrote$"):
        load_json(tmp_path / "other.json", ("rows", "runs"))
    assert load_json(tmp_path / "other.json", ("rows",)) == {"rows": []}
    (tmp_path / "list.json").write_text("[]")
    with pytest.raises(SystemExit, match=r"a JSON list, not an object"):
        load_json(tmp_path / "list.json", ())  # scripts that name no key still get an object


def test_fit_args_take_the_rest_of_the_command_line():
    import argparse

    p = argparse.ArgumentParser()
    p.add_argument("--seeds", nargs="+", type=int)
    add_fit_args_argument(p)
    a = p.parse_args(["--seeds", "1", "--fit_args", "--trainer.max_time=null", "--optim.lr", "3e-3"])
    assert a.seeds == [1] and a.fit_args == ["--trainer.max_time=null", "--optim.lr", "3e-3"]
    assert p.parse_args([]).fit_args == []


def test_outputs_into_a_missing_folder_are_refused_before_anything_runs(tmp_path):
    import argparse

    check_outputs(argparse.Namespace(json=str(tmp_path / "r.json"), results="none"))
    for option in ("json", "png", "results"):
        with pytest.raises(SystemExit, match=rf"^--{option} .*: no folder .*nope to write it to$"):
            check_outputs(argparse.Namespace(**{option: str(tmp_path / "nope" / "x")}))


def test_a_missing_recipe_is_named_with_the_shipped_ones(tmp_path):
    check_recipes(["recipes/tiny.yaml"], ROOT)
    with pytest.raises(SystemExit, match=r"^no recipe recipes/nope\.yaml: give a YAML file \(recipes/ has .*tiny"):
        check_recipes(["recipes/tiny.yaml", "recipes/nope.yaml"], ROOT)


def test_command_names_the_script_from_the_repository_root():
    argv = [str(ROOT / "benchmarks" / "moe.py"), "--json", "a b.json"]
    assert command(argv) == "`python benchmarks/moe.py --json 'a b.json'`"


def test_stored_runs_render_their_sections():
    """Each section built from a stored run is what its script's ``--from-json`` writes from that file, so a figure
    in RESULTS.md is the stored run's."""
    have = sections(RESULTS.read_text())

    def load(name: str) -> dict:
        return json.loads((ROOT / "benchmarks" / name).read_text())

    fc = load("kda_first_call_h200.json")
    stored = {
        "KDA first call": kda_first_call.section(fc["versions"], fc["results"], fc["steps"]),
        kda_accuracy.TITLE: kda_accuracy.section(load("kda_accuracy_h200.json")),
        moe.TITLE: moe.section(load("moe_h200.json")),
        balance.TITLE: balance.section(load("balance_cpu.json")),
        balance.COMPARE_TITLE: balance.compare_section(load("balance_compare_cpu.json")),
    }
    for title, body in stored.items():
        assert have[title] == body.strip(), title


def test_named_benchmark_files_exist():
    """Every ``benchmarks/<file>`` that the README, the docs, RESULTS.md and the GPU suite name exists."""
    texts = [ROOT / "README.md", RESULTS, ROOT / "benchmarks" / "gpu_suite.sh", *sorted((ROOT / "docs").glob("*.md"))]
    named = {m for path in texts for m in re.findall(r"benchmarks/([\w.]+\.(?:py|json|sh))", path.read_text())}
    named |= set(re.findall(r"python benchmarks/(\w+\.py)", (ROOT / "benchmarks" / "gpu_suite.sh").read_text()))
    assert {"kda.py", "gpu_suite.sh"} <= named
    missing = sorted(n for n in named if not (ROOT / "benchmarks" / n).exists())
    assert not missing, missing
