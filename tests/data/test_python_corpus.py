"""The built-in ``"python"`` corpus, on small trees in tmp folders (no scan of the real site-packages)."""

import shutil
import sys
from pathlib import Path

import pytest

import k3lit.data.python_corpus as pc
from k3lit.data.corpus import iter_split, resolve_corpus, split_cut, split_of
from k3lit.data.prepare import prepare_corpus
from k3lit.data.python_corpus import (
    MAX_FILE_BYTES,
    MAX_LINE_BYTES,
    SourceRoot,
    python_roots,
    scan_python_sources,
)
from k3lit.data.stdlib_corpus import stdlib_root


def _write(path: Path, data: bytes | str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data.encode() if isinstance(data, str) else data)


def make_install(base: Path) -> list[SourceRoot]:
    """A fake installation: a standard library, two site folders; one file for every rule of the corpus."""
    lib, site1, site2 = base / "lib", base / "env1" / "site-packages", base / "env2" / "site-packages"
    _write(lib / "os.py", "import sys\n")
    _write(lib / "json" / "decoder.py", "class JSONDecoder:\n    pass\n")
    _write(lib / "test" / "test_os.py", "def test_os():\n    assert True\n")  # tests are kept
    _write(lib / "README.rst", "Standard library\n================\n")
    _write(lib / "notes.MD", "# upper-case suffix\n")
    _write(lib / "data.txt", "not a taken suffix\n")
    _write(lib / "empty.py", "")
    _write(lib / "__pycache__" / "os.py", "cached\n")
    _write(lib / ".hidden" / "h.py", "hidden\n")
    _write(lib / "site-packages" / "inner.py", "a site folder inside the standard library\n")
    _write(lib / "test" / "latin1.py", b"# -*- coding: latin-1 -*-\nname = '\xe9'\n")  # not UTF-8
    _write(site1 / "pkg" / "__init__.py", "from pkg.core import run\n")
    _write(site1 / "pkg" / "core.py", "def run():\n    return 1\n")
    _write(site1 / "pkg" / "core.pyi", "def run() -> int: ...\n")
    _write(site1 / "pkg" / "_vendor" / "six.py", "PY3 = True\n")
    _write(site1 / "six.py", "PY3 = True\n")  # same bytes as pkg/_vendor/six.py
    _write(site1 / "pkg" / "blob.py", b"x = 1\n\0\0\0")
    _write(site1 / "pkg" / "table_ok.py", "T = '" + "a" * (MAX_LINE_BYTES - 6) + "'\n")  # a line of exactly the limit
    _write(site1 / "pkg" / "table_long.py", "T = '" + "a" * (MAX_LINE_BYTES - 5) + "'\n")
    line = "# " + "b" * 61 + "\n"  # 64 bytes
    _write(site1 / "pkg" / "big_ok.py", line * (MAX_FILE_BYTES // 64))
    _write(site1 / "pkg" / "big.py", line * (MAX_FILE_BYTES // 64) + "\n")
    _write(site1 / "k3lit" / "__init__.py", "project\n")
    _write(site1 / "k3lit-0.1.0.dist-info" / "README.md", "project\n")
    _write(site1 / "__editable___k3lit_0_1_0_finder.py", "MAPPING = {'k3lit': '/home/me/k3lit'}\n")
    _write(site2 / "pkg" / "core.py", "def run():\n    return 2\n")  # shadowed by site1's
    _write(site2 / "other.py", "import pkg\n")
    return [SourceRoot("stdlib", lib), SourceRoot("site-packages", site1), SourceRoot("site-packages", site2)]


EXPECTED_FILES = [
    "site-packages/other.py",
    "site-packages/pkg/__init__.py",
    "site-packages/pkg/_vendor/six.py",
    "site-packages/pkg/big_ok.py",
    "site-packages/pkg/core.py",
    "site-packages/pkg/core.pyi",
    "site-packages/pkg/table_ok.py",
    "stdlib/README.rst",
    "stdlib/json/decoder.py",
    "stdlib/notes.MD",
    "stdlib/os.py",
    "stdlib/test/test_os.py",
]


def test_filters_dedup_and_exclusions(tmp_path):
    scan = scan_python_sources(make_install(tmp_path), workers=2)
    assert [f.key for f in scan.files] == EXPECTED_FILES
    assert scan.skipped == {
        "project": [
            "site-packages/__editable___k3lit_0_1_0_finder.py",
            "site-packages/k3lit-0.1.0.dist-info/",
            "site-packages/k3lit/",
        ],
        "too_big": ["site-packages/pkg/big.py"],
        "binary": ["site-packages/pkg/blob.py"],
        "not_utf8": ["stdlib/test/latin1.py"],
        "long_line": ["site-packages/pkg/table_long.py"],
        "duplicate": ["site-packages/six.py"],  # the copy with the larger key goes
    }
    core = next(f for f in scan.files if f.key == "site-packages/pkg/core.py")
    assert core.path == (tmp_path / "env1" / "site-packages" / "pkg" / "core.py").resolve()  # first root wins
    assert all(f.kind == "text" and f.size > 0 for f in scan.files)
    assert scan.n_bytes == sum(f.path.stat().st_size for f in scan.files)


def test_same_files_elsewhere_give_the_same_corpus_and_split(tmp_path):
    first = scan_python_sources(make_install(tmp_path / "a"))
    shutil.copytree(tmp_path / "a", tmp_path / "b" / "elsewhere", symlinks=True)
    base = tmp_path / "b" / "elsewhere"
    moved = [
        SourceRoot("stdlib", base / "lib"),
        SourceRoot("site-packages", base / "env1" / "site-packages"),
        SourceRoot("site-packages", base / "env2" / "site-packages"),
    ]
    second = scan_python_sources(moved, workers=1)
    assert [f.key for f in second.files] == [f.key for f in first.files]
    assert second.skipped == first.skipped
    assert [f.path for f in second.files] != [f.path for f in first.files]
    # the split hashes the key only: same train/validation files wherever the installation lives
    assert [split_of(f.key, 0.3) for f in first.files] == [split_of(f.key, 0.3) for f in second.files]
    assert split_cut(first.files, 0.3) == split_cut(second.files, 0.3)
    for split in ("train", "val"):
        cut = split_cut(first.files, 0.3)
        assert list(iter_split(first.files, split, cut)) == list(iter_split(second.files, split, cut))
    assert {split_of(f.key, 0.3) for f in first.files} == {"train", "val"}


def test_duplicate_kept_does_not_depend_on_root_order(tmp_path):
    a, b = tmp_path / "one" / "site-packages", tmp_path / "two" / "site-packages"
    _write(a / "zeta.py", "same = 1\n")
    _write(b / "alpha.py", "same = 1\n")
    for roots in ([SourceRoot("site-packages", a), SourceRoot("site-packages", b)],
                  [SourceRoot("site-packages", b), SourceRoot("site-packages", a)]):
        scan = scan_python_sources(roots)
        assert [f.key for f in scan.files] == ["site-packages/alpha.py"]
        assert scan.skipped == {"duplicate": ["site-packages/zeta.py"]}


def test_missing_root(tmp_path):
    with pytest.raises(ValueError, match="is not a folder"):
        scan_python_sources([SourceRoot("stdlib", tmp_path / "nope")])


def test_roots_are_stdlib_and_site_folders_of_sys_path(tmp_path, monkeypatch):
    site = tmp_path / "venv" / "lib" / "site-packages"
    dist = tmp_path / "usr" / "dist-packages"
    project = tmp_path / "project"
    for d in (site, dist, project):
        d.mkdir(parents=True)
    monkeypatch.setattr(sys, "path", ["", str(project), str(dist), str(site), str(site), str(tmp_path / "gone")])
    roots = python_roots()
    assert roots == [SourceRoot("stdlib", stdlib_root()), SourceRoot("site-packages", dist),
                     SourceRoot("site-packages", site)]


def test_real_roots_hold_the_installed_packages():
    import lightning

    roots = python_roots()
    assert roots[0] == SourceRoot("stdlib", stdlib_root())
    assert Path(lightning.__file__).resolve().parent.parent in [r.path.resolve() for r in roots[1:]]


def test_resolve_and_prepare_the_python_corpus(tmp_path, monkeypatch):
    roots = make_install(tmp_path / "install")
    monkeypatch.setattr(pc, "python_roots", lambda: roots)
    files = resolve_corpus("python")
    assert [f.key for f in files] == EXPECTED_FILES
    p = prepare_corpus("python", "byte", cache_dir=tmp_path / "cache", val_fraction=0.3, verbose=False)
    assert p.meta["corpus"] == "python" and p.meta["n_files"] == len(EXPECTED_FILES)
    splits = p.meta["splits"]
    assert splits["train"]["n_documents"] + splits["val"]["n_documents"] == len(EXPECTED_FILES)
    assert splits["train"]["n_bytes"] + splits["val"]["n_bytes"] == sum(f.size for f in files)


def test_memo_skips_the_reads_until_a_file_changes(tmp_path, monkeypatch):
    roots = make_install(tmp_path / "install")
    memo = tmp_path / "memo"
    first = scan_python_sources(roots, memo_dir=memo)
    assert first == scan_python_sources(roots)  # the memo changes nothing the scan returns
    assert len(list(memo.glob("python-scan-*.json"))) == 1

    def no_reads(path, size):
        raise AssertionError(f"read {path} though no file changed")

    with monkeypatch.context() as m:
        m.setattr(pc, "_inspect", no_reads)
        again = scan_python_sources(roots, memo_dir=memo)
    assert again == first

    core = roots[1].path / "pkg" / "core.py"
    core.write_text("def run():\n    return 10\n")  # one byte more: a new size and modification time
    changed = scan_python_sources(roots, memo_dir=memo)
    assert next(f for f in changed.files if f.key == "site-packages/pkg/core.py").size == core.stat().st_size
    assert changed == scan_python_sources(roots)
    _write(roots[1].path / "pkg" / "six.py", "PY3 = True\n")  # a new candidate, a duplicate of the vendored six
    changed_again = scan_python_sources(roots, memo_dir=memo)
    assert "site-packages/pkg/six.py" in changed_again.skipped["duplicate"]
    assert len(list(memo.glob("python-scan-*.json"))) == 3
    for kept in memo.glob("python-scan-*.json"):
        kept.write_text('{"files": [["/nowhere"')  # a damaged memo is scanned afresh, and rewritten
    assert scan_python_sources(roots, memo_dir=memo) == scan_python_sources(roots)
    with monkeypatch.context() as m:  # the rewritten memo is read back without a scan
        m.setattr(pc, "_inspect", no_reads)
        assert scan_python_sources(roots, memo_dir=memo) == changed_again


def test_prepare_keeps_the_scan_beside_its_entries(tmp_path, monkeypatch):
    roots = make_install(tmp_path / "install")
    monkeypatch.setattr(pc, "python_roots", lambda: roots)
    cache = tmp_path / "cache"
    p = prepare_corpus("python", "byte", cache_dir=cache, val_fraction=0.3, verbose=False)
    assert [m.name.startswith("python-scan-") for m in cache.glob("*.json")] == [True]
    monkeypatch.setattr(pc, "_inspect", lambda path, size: pytest.fail(f"read {path} to find a prepared corpus"))
    assert prepare_corpus("python", "byte", cache_dir=cache, val_fraction=0.3, verbose=False).root == p.root
