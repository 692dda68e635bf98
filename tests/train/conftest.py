"""The built-in corpus (byte tokenizer, val_fraction 0.05) prepared once per test session."""

import pytest

from k3lit.data.prepare import prepare_corpus


@pytest.fixture(scope="session")
def stdlib_cache(tmp_path_factory) -> str:
    """A data cache folder holding the prepared built-in corpus; pass it as ``--data.cache_dir``."""
    cache = tmp_path_factory.mktemp("stdlib_byte_cache")
    prepare_corpus("stdlib", "byte", cache_dir=cache, val_fraction=0.05, verbose=False)
    return str(cache)
