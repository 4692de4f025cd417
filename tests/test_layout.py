"""The package boundaries the layout promises (docs/architecture.md), checked in fresh
interpreters so that one test's imports cannot hide another's."""
from __future__ import annotations

import ast
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _run(code: str) -> str:
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def _modules(folder: str) -> list[str]:
    pkg = "enc2dec." + folder.replace("/", ".")
    return [pkg] + [f"{pkg}.{p.stem}" for p in sorted((ROOT / folder).glob("*.py")) if p.stem != "__init__"]


def test_policy_imports_without_torch():
    # The scheduler, block manager, requests and the public config/params types are pure Python.
    mods = _modules("engine/core") + ["enc2dec.engine", "enc2dec.engine.config",
                                      "enc2dec.engine.sampling_params", "enc2dec.engine.outputs"]
    heavy = _run(f"import importlib, sys\nfor m in {mods!r}: importlib.import_module(m)\n"
                 "print(sorted(m for m in ('torch', 'transformers', 'numpy') if m in sys.modules))")
    assert heavy == "[]"


def _imported_by(path: pathlib.Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
        elif isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
    return names


@pytest.mark.parametrize("path", sorted((ROOT / "engine/models").glob("*.py")), ids=lambda p: p.name)
def test_model_files_know_nothing_of_runner_scheduling_or_http(path):
    forbidden = ("enc2dec.engine.runner", "enc2dec.engine.core", "enc2dec.engine.engine_core",
                 "enc2dec.engine.llm", "enc2dec.serve", "enc2dec.bench", "enc2dec.eval", "enc2dec.cli")
    bad = sorted(m for m in _imported_by(path) if m.startswith(forbidden))
    assert not bad, f"{path.name} imports {bad}"


def test_models_package_loads_no_runner_at_run_time():
    loaded = _run("import sys, enc2dec.engine.models\n"
                  "print(sorted(m for m in sys.modules if m.startswith(('enc2dec.engine.runner', "
                  "'enc2dec.engine.core', 'enc2dec.serve'))))")
    assert loaded == "[]"


def test_cli_and_help_import_no_torch():
    # Every CLI module, and `enc2dec --help` / `enc2dec CMD --help`, stay torch-free: --help
    # answers at once on a machine where torch takes seconds to import.
    code = (
        "import importlib, sys\n"
        f"for m in {_modules('cli')!r}: importlib.import_module(m)\n"
        "from typer.testing import CliRunner\n"
        "from enc2dec.cli.main import app\n"
        "for argv in ([], ['bench'], ['eval'], ['transcribe'], ['serve']):\n"
        "    r = CliRunner().invoke(app, argv + ['--help'])\n"
        "    assert r.exit_code == 0 and 'Usage' in r.output, (argv, r.output)\n"
        "print('torch' in sys.modules)\n")
    assert _run(code) == "False"
