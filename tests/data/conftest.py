"""Small corpora written into tmp dirs; one stdlib prepare shared by the session."""

import json
from pathlib import Path

import pytest

from k3lit.data.prepare import prepare_corpus

WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi rho sigma tau".split()


def make_text_corpus(root: Path, n_files: int = 24, lines: int = 40) -> Path:
    """``n_files`` small Python-like text files in nested folders, deterministic content."""
    for i in range(n_files):
        path = root / f"pkg{i % 3}" / f"mod_{i}.py"
        path.parent.mkdir(parents=True, exist_ok=True)
        body = [f"def {WORDS[(i + j) % len(WORDS)]}_{j}(x):\n    return x * {j} + {i}  # héllo\n" for j in range(lines)]
        path.write_text("".join(body), encoding="utf-8")
    return root


@pytest.fixture
def text_corpus(tmp_path: Path) -> Path:
    return make_text_corpus(tmp_path / "corpus")


@pytest.fixture
def jsonl_file(tmp_path: Path) -> Path:
    path = tmp_path / "docs.jsonl"
    with open(path, "w") as f:
        for i in range(50):
            f.write(json.dumps({"text": f"document {i}: " + " ".join(WORDS[: 5 + i % 10]), "id": i}) + "\n")
        f.write("\n")  # blank lines are skipped
    return path


@pytest.fixture(scope="session")
def stdlib_prepared(tmp_path_factory):
    """The built-in corpus prepared once per session (about 2 s) into a session tmp cache."""
    return prepare_corpus("stdlib", "byte", cache_dir=tmp_path_factory.mktemp("stdlib_cache"), verbose=False)
