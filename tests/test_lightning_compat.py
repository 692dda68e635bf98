"""The supported Lightning range is pinned once (pyproject and k3lit.lightning_compat agree), an unsupported Lightning
fails at import with a message saying what to install, and no other k3lit module reaches into Lightning's privates."""

import re
import subprocess
import sys
from pathlib import Path

import lightning
import pytest
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet

from k3lit import lightning_compat as compat

ROOT = Path(__file__).parents[1]


def test_pyproject_pins_the_range_the_module_checks():
    deps = re.findall(r'^\s*"(lightning\b[^"]*)"', (ROOT / "pyproject.toml").read_text(), re.M)  # the dependency lines
    pins = [Requirement(d).specifier for d in deps]
    assert pins == [SpecifierSet(compat.SUPPORTED_LIGHTNING)]
    assert lightning.__version__ in SpecifierSet(compat.SUPPORTED_LIGHTNING)  # the installed one is supported


@pytest.mark.parametrize("version", ["2.4.0", "2.7.0", "3.0.0", "2.7.0rc1"])
def test_unsupported_version_raises_saying_what_to_install(version, monkeypatch):
    monkeypatch.delenv(compat.ENV_ANY_VERSION, raising=False)
    with pytest.raises(ImportError, match=rf"supports lightning>=2\.5,<2\.7 but lightning {re.escape(version)} is "
                                          r"installed: pip install 'lightning>=2\.5,<2\.7'"):
        compat.check_lightning_version(version)
    monkeypatch.setenv(compat.ENV_ANY_VERSION, "1")
    with pytest.warns(UserWarning, match=f"lightning {re.escape(version)} is installed"):
        compat.check_lightning_version(version)


def test_importing_k3lit_under_an_unsupported_lightning_fails_loudly():
    code = "import lightning; lightning.__version__ = '2.7.0'; import k3lit.cli"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode != 0
    assert "ImportError: k3lit supports lightning>=2.5,<2.7 but lightning 2.7.0 is installed" in out.stderr


def test_a_missing_private_method_is_named(monkeypatch):
    compat._check_private_methods()  # all present in the installed Lightning
    monkeypatch.setattr(compat, "PRIVATE_METHODS", compat.PRIVATE_METHODS + ((lightning.Trainer, "_no_such_hook"),))
    with pytest.raises(ImportError, match=r"lacks Trainer\._no_such_hook, which k3lit uses"):
        compat._check_private_methods()


# Private Lightning attributes k3lit code may reach only through k3lit/lightning_compat.py.
PRIVATE_USE = re.compile(r"\b(trainer|strategy|connector|monitor|callback|writer)\._[a-z]|_checkpoint_connector|"
                         r"_logger_connector|_plugin_to_compute_dtype|\._device_mesh\b|_setup_distributed|"
                         r"_determine_device_ids|_save_last_checkpoint|_monitor_candidates|_should_skip_saving|"
                         r"_rewrite_with_new_header|self\._fs\b|self\._experiment\b|self\._throughputs\b|self\._get\(|"
                         r"_instantiate_trainer")


def test_private_lightning_attributes_are_used_only_in_the_compat_module():
    found = [f"{path.relative_to(ROOT)}:{n}: {line.strip()}"
             for path in sorted((ROOT / "k3lit").rglob("*.py")) if path.name != "lightning_compat.py"
             for n, line in enumerate(path.read_text().splitlines(), 1) if PRIVATE_USE.search(line)]
    assert not found, "\n".join(found)
