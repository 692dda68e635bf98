"""Write one section of ``benchmarks/RESULTS.md`` without touching the others (each script owns a section)."""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import re
import shlex
import sys
from collections.abc import Callable
from pathlib import Path

import torch

RESULTS = Path(__file__).with_name("RESULTS.md")
NO_RESULTS = "none"  # --results value: write no results file


def versions() -> dict[str, str]:
    """``{"date", "device", "torch", "triton"}`` of this process (triton "n/a" when not installed)."""
    try:
        import triton

        triton_v = triton.__version__
    except ImportError:
        triton_v = "n/a"
    if torch.cuda.is_available():
        device = torch.cuda.get_device_name()
    else:
        device = f"CPU ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)"
    return {"date": datetime.date.today().isoformat(), "device": device, "torch": torch.__version__,
            "triton": triton_v}


def environment(v: dict[str, str] | None = None) -> str:
    """One line naming the date, device, torch and triton versions of :func:`versions` ``v`` (default: this
    process's)."""
    v = v or versions()
    return f"{v['date']} · {v['device']} · torch {v['torch']} · triton {v['triton']}"


def command(argv: list[str] | None = None) -> str:
    """The command line that ran this process (``argv``: default ``sys.argv``), as ``python benchmarks/x.py ...``
    in backquotes, for a section to say how it is reproduced."""
    argv = sys.argv if argv is None else argv
    script = Path(argv[0])
    name = f"benchmarks/{script.name}" if script.parent.name == "benchmarks" else str(script)
    return "`" + shlex.join(["python", name, *argv[1:]]) + "`"


def write_section(title: str, body: str, path: Path = RESULTS) -> None:
    """Replace (or append) the ``## title`` section of ``path`` (default RESULTS.md) with ``body``. The old
    section's ``###`` subsections, readings of its figures written by hand, are kept after the new body.

    Raises:
        ValueError: ``body`` holds a ``###`` heading (a script's body has none, so that the hand-written part is
            told apart from it).
    """
    if re.search(r"^### ", body, re.M):
        raise ValueError(f"write_section({title!r}): a ### heading in the body would be kept as hand-written")
    header = "# Benchmark results\n\nEach section is written by the script it names.\n"
    path = Path(path)
    text = path.read_text() if path.exists() else header
    pattern = re.compile(rf"^## {re.escape(title)}\n.*?(?=^## |\Z)", re.S | re.M)
    old = pattern.search(text)
    hand = re.search(r"^### .*", old[0], re.S | re.M) if old else None
    section = f"## {title}\n\n{body.strip()}\n\n" + (f"{hand[0].strip()}\n\n" if hand else "")
    text = text[:old.start()] + section + text[old.end():] if old else text.rstrip() + "\n\n" + section
    path.write_text(text)


def add_shapes_argument(p: argparse.ArgumentParser, default: tuple, dims: str) -> None:
    """``--shapes``: sizes written ``16x2048x2304`` (``dims`` names them, e.g. ``"B x T x C"``), as int tuples."""
    p.add_argument("--shapes", type=lambda s: tuple(int(v) for v in s.split("x")), nargs="+", default=default,
                   help=f"{dims} shapes, e.g. {'x'.join(str(v) for v in default[0])}")


def gpu_run_or_load(a: argparse.Namespace, measure: Callable[[argparse.Namespace], dict], title: str,
                    table: Callable[[dict], str]) -> dict:
    """:func:`run_or_load` for a script that times CUDA kernels.

    Raises:
        SystemExit: no CUDA device and no ``--from_json`` to write the section from.
    """
    if not a.from_json and not torch.cuda.is_available():
        raise SystemExit(f"benchmarks/{Path(sys.argv[0]).name} times CUDA kernels: run it on a GPU (or pass "
                         "--from_json)")
    return run_or_load(a, measure, title, table)


def add_results_argument(p: argparse.ArgumentParser) -> None:
    """``--results``: the results file a script writes its section to (:func:`write_result`)."""
    p.add_argument("--results", default=None,
                   help=f"the results file its section goes to (default benchmarks/RESULTS.md; {NO_RESULTS!r}: print "
                        "the section only, e.g. for a trial run on a laptop)")


def write_result(results: str | None, title: str, body: str) -> None:
    """``write_section(title, body)`` into ``results`` (a ``--results`` value: None for RESULTS.md, ``"none"`` for
    no file), saying where it went."""
    if results == NO_RESULTS:
        return
    path = RESULTS if results is None else Path(results)
    write_section(title, body, path)
    print(f"(section '## {title}' written to {path})", flush=True)


def add_fit_args_argument(p: argparse.ArgumentParser) -> None:
    """``--fit_args``: more ``k3lit fit`` arguments, everything after it on the command line (they start with
    ``--``, which a list option would read as options of its own)."""
    p.add_argument("--fit_args", nargs=argparse.REMAINDER, default=[],
                   help="more `k3lit fit` arguments for every run: the rest of the command line, so put it last "
                        "(e.g. --fit_args --trainer.max_time=null --optim.lr=3e-3)")


def load_json(path: str | Path, keys: tuple[str, ...]) -> dict:
    """The stored run of ``--from_json`` ``path``, which must hold every one of ``keys``.

    Raises:
        SystemExit: no such file, not JSON, or a JSON without one of ``keys`` (another script's file), in one line.
    """
    name = f"benchmarks/{Path(sys.argv[0]).name}"
    try:
        result = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise SystemExit(f"--from_json {path}: no such file") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise SystemExit(f"--from_json {path}: not JSON ({e})") from None
    if not isinstance(result, dict):
        raise SystemExit(f"--from_json {path}: not a stored run of {name} (a JSON {type(result).__name__}, not an "
                         "object); give the file its --json wrote")
    missing = [k for k in keys if k not in result]
    if missing:
        raise SystemExit(f"--from_json {path}: not a stored run of {name} (it has no {missing[0]!r}); give the file "
                         "its --json wrote")
    return result


def check_outputs(a: argparse.Namespace) -> None:
    """Fail in one line, before anything is measured, when an output file of ``a`` (``--json``, ``--png``,
    ``--results``) would go to a folder that does not exist.

    Raises:
        SystemExit: naming the option and the missing folder.
    """
    for option in ("json", "png", "results"):
        value = getattr(a, option, None)
        if value and value != NO_RESULTS and not Path(value).resolve().parent.is_dir():
            raise SystemExit(f"--{option} {value}: no folder {Path(value).resolve().parent} to write it to")


def check_recipes(paths: list[str], root: Path | None = None) -> None:
    """Fail in one line, before anything runs, when a recipe file does not exist (relative paths against ``root``
    when given, else the current folder).

    Raises:
        SystemExit: a missing recipe, naming the recipes that do exist.
    """
    for recipe in paths:
        if not ((root or Path()) / recipe).is_file():
            shipped = ", ".join(sorted(p.name for p in (Path(__file__).parents[1] / "recipes").glob("*.yaml")))
            raise SystemExit(f"no recipe {recipe}: give a YAML file (recipes/ has {shipped})")


def add_output_arguments(p: argparse.ArgumentParser, raw: str) -> None:
    """``--json`` (write ``raw`` there), ``--results`` (the results file) and ``--from_json`` (only write the section
    from a stored run), the arguments :func:`run_or_load` reads."""
    p.add_argument("--json", help=f"write the {raw} here")
    add_results_argument(p)
    p.add_argument("--from_json", help="only write RESULTS.md's section from this file")


def run_or_load(a: argparse.Namespace, measure: Callable[[argparse.Namespace], dict], title: str,
                table: Callable[[dict], str], keys: tuple[str, ...] = ("env",)) -> dict:
    """``measure(a)`` (written to ``a.json`` when given), or the stored result of ``a.from_json``; then the section
    ``title + " (<device>)"`` of ``a.results`` (:func:`write_result`: default RESULTS.md, ``none`` no file) as
    ``table(result)``, also printed (a run on a machine whose files do not come back keeps it in its log). A stored
    run must hold ``keys`` (:func:`load_json`); the output folders are checked first (:func:`check_outputs`).
    Returns the result."""
    check_outputs(a)
    result = load_json(a.from_json, keys) if a.from_json else measure(a)
    if a.json and not a.from_json:
        Path(a.json).write_text(json.dumps(result, indent=1))
    heading, text = f"{title} ({result['env']['device']})", table(result)
    print(f"## {heading}\n\n{text}", flush=True)
    write_result(a.results, heading, text)
    return result
