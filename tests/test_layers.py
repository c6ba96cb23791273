"""The Python layers of ../shared/ARCHITECTURE.md hold: import-linter checks the contracts in pyproject.toml
([tool.importlinter]) against the source as it is, in a process of its own (it imports the graph builder,
not gpucr)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def test_the_rooms_import_only_downwards(tmp_path):
    pytest.importorskip("importlinter", reason="import-linter is in the test extra: pip install -e .[test]")
    run = ("import sys; from importlinter.cli import lint_imports; "
           "sys.exit(lint_imports(config_filename='pyproject.toml', no_cache=True, no_logo=True))")
    # the checkout's source, whatever gpucr this Python has installed
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    r = subprocess.run([sys.executable, "-c", run], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "0 broken" in r.stdout, r.stdout


def test_a_broken_layer_is_caught(tmp_path):
    """The contract is live: a module of a lower room that imports a higher one fails it. (A copy of the rooms
    named `fakegpucr`: an installed gpucr, editable ones included, would be found before a `gpucr` here.)"""
    pytest.importorskip("importlinter", reason="import-linter is in the test extra: pip install -e .[test]")
    pkg = tmp_path / "src" / "fakegpucr"
    (pkg / "dataplane").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    for name in ("cli", "bench", "demo", "service_http", "server", "swap", "recover", "coordinator", "reading"):
        (pkg / f"{name}.py").write_text("")
    (pkg / "dataplane" / "__init__.py").write_text("from .. import coordinator\n")
    (tmp_path / "pyproject.toml").write_text((ROOT / "pyproject.toml").read_text().replace("gpucr", "fakegpucr"))
    run = ("import sys; from importlinter.cli import lint_imports; "
           "sys.exit(lint_imports(config_filename='pyproject.toml', no_cache=True, no_logo=True))")
    r = subprocess.run([sys.executable, "-c", run], cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(tmp_path / "src")},
                       capture_output=True, text=True, timeout=300)
    assert r.returncode != 0 and "fakegpucr.dataplane is not allowed to import fakegpucr.coordinator" in r.stdout, r.stdout
