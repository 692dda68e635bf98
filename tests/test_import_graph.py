"""k3lit's imports point down only: no module imports, directly or through others, a module that imports it, and
no floor of the package (``k3lit.cli``, ``k3lit.train``, ``k3lit.data``, ``k3lit.nn``, ...) does either.

Every ``import`` and ``from ... import`` statement of every module counts, wherever it stands: at the top, inside a
function (a lazy import still closes a cycle when it runs) or under ``TYPE_CHECKING``. ``from k3lit.a import b``
points at ``k3lit.a.b`` when that is a module, else at ``k3lit.a``; a package's ``__init__`` is the module named
after the package.
"""

from __future__ import annotations

import ast
from pathlib import Path

import k3lit

PACKAGE_DIR = Path(k3lit.__file__).resolve().parent


def module_names(root: Path) -> dict[str, Path]:
    """Dotted name -> file for every module of the package in ``root`` (``__init__.py`` is the package)."""
    names = {}
    for path in sorted(root.rglob("*.py")):
        parts = list(path.relative_to(root.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        names[".".join(parts)] = path
    return names


def imported_modules(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The package's modules that module ``name`` (source ``path``) imports anywhere in its body."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    targets = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            targets.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: one level is the module's own package
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                targets.add(sub if sub in modules else base)
    found = set()
    for target in targets:
        while target and target not in modules:  # `import k3lit.a.b` of a name below a module: that module
            target = target.rpartition(".")[0]
        if target and target != name:
            found.add(target)
    return found


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of ``graph`` as ``[a, b, ..., a]`` (each imports the next), or None when it has none."""
    state: dict[str, int] = {}  # 1: on the current path, 2: finished
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        path.pop()
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state and (cycle := visit(start)):
            return cycle
    return None


def import_graph() -> dict[str, set[str]]:
    """Module -> the package's modules it imports, for all of k3lit."""
    modules = module_names(PACKAGE_DIR)
    return {name: imported_modules(name, path, modules) for name, path in modules.items()}


def floor_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """``graph`` with each module merged into its floor: the package's direct child it lies in (``k3lit.data`` for
    ``k3lit.data.corpus``); imports within a floor are left out."""
    def floor(name: str) -> str:
        return ".".join(name.split(".")[:2])

    floors: dict[str, set[str]] = {floor(name): set() for name in graph}
    for name, targets in graph.items():
        floors[floor(name)].update(floor(t) for t in targets if floor(t) != floor(name))
    return floors


def test_the_graph_sees_lazy_relative_and_type_checking_imports(tmp_path):
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("from pkg.top import run\n")
    (pkg / "top.py").write_text("def run():\n    from .sub import low\n")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "sub" / "low.py").write_text(
        "from typing import TYPE_CHECKING\nimport os\nif TYPE_CHECKING:\n    from ..top import run\n"
    )
    modules = module_names(pkg)
    graph = {name: imported_modules(name, path, modules) for name, path in modules.items()}
    assert graph == {"pkg": {"pkg.top"}, "pkg.top": {"pkg.sub.low"}, "pkg.sub": set(), "pkg.sub.low": {"pkg.top"}}
    assert find_cycle(graph) == ["pkg.top", "pkg.sub.low", "pkg.top"]
    assert floor_graph(graph) == {"pkg": {"pkg.top"}, "pkg.top": {"pkg.sub"}, "pkg.sub": {"pkg.top"}}


def test_k3lit_imports_have_no_cycle():
    graph = import_graph()
    assert {"k3lit.cli", "k3lit.model", "k3lit.ops.kda.op", "k3lit.kernels.kda.op"} <= graph.keys()
    assert "k3lit.model" in graph["k3lit.cli"]
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_k3lit_floors_have_no_cycle():
    floors = floor_graph(import_graph())
    assert {"k3lit.kernels", "k3lit.ops"} <= floors["k3lit.nn"]
    cycle = find_cycle(floors)
    assert cycle is None, "import cycle between floors: " + " -> ".join(cycle)
