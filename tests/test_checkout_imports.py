"""Run from a checkout's root, this tree's folders must not be importable as top-level
packages: kernels/ would shadow the `kernels` distribution that transformers (5.25 and later)
imports when it builds a model, and every model import would fail."""
import importlib.machinery
import os
import runpy
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def _shadowing() -> bool:
    """Whether `import kernels` would now find the checkout's folder (searched on sys.path
    afresh: the distribution may be imported already; a venv may sit inside the checkout)."""
    spec = importlib.machinery.PathFinder.find_spec("kernels", sys.path)
    return spec is not None and spec.origin is not None and Path(spec.origin).resolve() == REPO / "kernels" / "__init__.py"


def test_the_test_session_does_not_import_from_the_checkout_root():
    """`python -m pytest` (the README's command) put the root first on sys.path."""
    assert not _shadowing()


def test_python_dash_m_cli_drops_the_working_directory(monkeypatch):
    monkeypatch.chdir(REPO)
    monkeypatch.setattr(sys, "path", [str(REPO), *sys.path])     # what `python -m` does from the root
    monkeypatch.setattr(sys, "argv", ["enc2dec", "version"])
    assert _shadowing()
    with pytest.raises(SystemExit) as exit_info:
        runpy.run_module("enc2dec.cli.main", run_name="__main__")
    assert exit_info.value.code in (0, None)
    assert os.path.realpath(REPO) not in map(os.path.realpath, sys.path)
    assert not _shadowing()
