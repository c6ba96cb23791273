"""First use (issue 14, items 3 and 5): a small process pays little for staging, and
gets the memory back when its data shrinks; the set-up script's choices, the editable build's
layout, the runnable sample, --version, help texts, doctor's exit status, skip reasons."""
from __future__ import annotations

import argparse
import ast
import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path


import gpucr
from gpucr import cli, doctor, paths
from gpucr.errors import GpucrError

from conftest import ROOT, gpucr_cli

MiB = 1 << 20


# ---- item 3: staging sized to the data ----

def test_a_small_process_pays_little(sim_app):
    # was: 256 MiB of staging and a 128 MiB pinned ring for 16 MiB of data; the mover (here the command's own,
    # with no server) copies through a ring of its own: the application pins nothing
    app = sim_app("--sizes", "16M")
    before = app.ask("digest")
    ck = gpucr.checkpoint(app.pid)
    st = gpucr.status(app.pid)
    moved = st.allocations.tracked_bytes
    assert moved == 16 * MiB and ck.data_plane == "cli"
    assert moved <= st.staging_bytes <= 2 * moved, st.staging_bytes
    assert ck.bytes_moved == moved
    gpucr.restore(app.pid)
    assert app.ask("digest") == before


def test_staging_given_back_when_the_data_shrinks(sim_app):
    # idle staging goes back only past a segment's target (a pool's lent segment is kept): 64 MiB here, so
    # the 300 MiB freed is past it
    app = sim_app("--sizes", "16M", env={**os.environ, "GPUCR_STAGING_SEGMENT_MIB": "64"})
    app.ask(f"alloc {300 * MiB}")
    gpucr.checkpoint(app.pid)
    assert gpucr.status(app.pid).staging_bytes >= 316 * MiB
    gpucr.restore(app.pid)
    app.ask("free 1")                      # the 300 MiB buffer: 16 MiB left to move
    before = app.ask("digest")
    gpucr.checkpoint(app.pid)
    st = gpucr.status(app.pid)
    assert st.staging_bytes <= 32 * MiB, st
    gpucr.restore(app.pid)
    assert app.ask("digest") == before


def test_staging_grows_in_few_segments(sim_app):
    # a process that grows a little before each checkpoint: segments double, never more than
    # about twice the data, and few of them (all their fds go in one message to the controller)
    app = sim_app("--sizes", "16M")
    for i in range(6):
        app.ask(f"alloc {8 * MiB}")
        before = app.ask("digest")
        gpucr.checkpoint(app.pid)
        st = gpucr.status(app.pid)
        data = st.allocations.tracked_bytes
        assert data <= st.staging_bytes <= 2 * data and st.staging_segments <= 4, (i, st)
        gpucr.restore(app.pid)
        assert app.ask("digest") == before


# ---- item 5: first use ----

def _install_script():
    spec = importlib.util.spec_from_file_location("gpucr_install", ROOT / "scripts" / "install.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_install_goes_to_a_venv_where_pip_may_not_install():
    inst = _install_script()
    # Debian's own Python (externally managed, PEP 668), or one without pip: .venv
    assert inst.where(venv_active=False, managed=True, has_pip=True, venv_exists=False) == "venv"
    assert inst.where(venv_active=False, managed=False, has_pip=False, venv_exists=False) == "venv"
    # once made, .venv is used again; an active virtual environment is used as it is
    assert inst.where(venv_active=False, managed=False, has_pip=True, venv_exists=True) == "venv"
    assert inst.where(venv_active=True, managed=True, has_pip=False, venv_exists=True) == "here"
    assert inst.where(venv_active=False, managed=False, has_pip=True, venv_exists=False) == "here"


def test_install_builds_with_the_tools_at_hand():
    inst = _install_script()
    py = Path(sys.executable)
    # installed build tools: no isolated build, so nothing is downloaded (a GPU host with no network)
    assert inst.pip_command(py, "test", tools_here=True)[-1] == "--no-build-isolation"
    assert "--no-build-isolation" not in inst.pip_command(py, None, tools_here=False)
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "install.py"), "test", "--dry-run"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    python = r.stdout.strip().splitlines()[-1]
    assert Path(python).exists() and f"-m pip install -q -e {ROOT}[test]" in r.stderr, (r.stdout, r.stderr)


def test_editable_build_is_not_at_the_root():
    text = (ROOT / "pyproject.toml").read_text()
    assert re.search(r'^build-dir = "build/', text, re.M), "the CMake build must have its own directory"
    assert not re.search(r'^editable\.mode = "inplace"', text, re.M), "an in-place build writes at the root"
    infos = [p for p in ROOT.glob("build/*/.skbuild-info.json")
             if Path(json.loads(p.read_text())["source_dir"]).resolve() == ROOT]
    assert infos, "the editable install was built in build/"
    newest = max(p.stat().st_mtime for p in infos)
    root_info = ROOT / ".skbuild-info.json"   # what an in-place build leaves, with CMakeCache.txt and the rest
    assert not root_info.exists() or root_info.stat().st_mtime < newest, "the last build ran at the root"
    # and the libraries are where gpucr looks for them
    assert paths.agent_lib().is_file() and (paths.simcuda_dir() / "libcuda.so.1").is_file()


def test_version():
    want = re.search(r'^version = "([^"]+)"', (ROOT / "pyproject.toml").read_text(), re.M)[1]
    r = gpucr_cli("--version")
    assert r.returncode == 0 and r.stdout.strip() == f"gpucr {want}" == f"gpucr {gpucr.__version__}"


def test_help_texts():
    sub = next(a for a in cli._parser()._actions if isinstance(a, argparse._SubParsersAction))
    helps = {(cmd, a.dest): a.help or "" for cmd, p in sub.choices.items() for a in p._actions}
    assert helps[("checkpoint", "image")] != helps[("restore", "image")]
    # the agent's staging stays unpinned unless the ring is off: a help that speaks of pinning staging says
    # so, unless it is the server's (its data plane pins the staging in its own context, with no ring)
    wrong = {k: h for k, h in helps.items() if "staging" in h and "pin" in h and "ring" not in h and "server" not in h}
    assert wrong == {}
    ck, rs = gpucr_cli("checkpoint", "--help").stdout, gpucr_cli("restore", "--help").stdout
    assert "also write the data to DIR" in ck and "read the data back from the image in DIR" in rs


def test_doctor_fails_when_something_needed_is_missing(monkeypatch, capsys):
    def missing():
        raise GpucrError("the agent library is missing (test)")
    monkeypatch.setattr(paths, "agent_lib", missing)
    assert doctor.main() == 1
    out = capsys.readouterr().out
    assert "problem: the agent library is missing (test)" in out and "gpucr cannot checkpoint" in out
    monkeypatch.undo()
    # with a driver (here simcuda's, a test double) and the agent, nothing is missing
    env = dict(os.environ, LD_LIBRARY_PATH=str(paths.simcuda_dir()))
    r = gpucr_cli("doctor", "--json", env=env)
    assert r.returncode == 0 and json.loads(r.stdout)["problems"] == [], r.stdout


def _skip_reasons(path: Path) -> list[str]:
    """The reason strings of every pytest skip in a test file."""
    reasons = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", "")) in ("skip", "skipif"):
            args = [k.value for k in node.keywords if k.arg == "reason"] + list(node.args[:1])
            reasons += [ast.unparse(a) for a in args if isinstance(a, (ast.Constant, ast.JoinedStr))]
    return reasons


def test_skip_reasons_say_what_is_missing():
    reasons = {p.name: _skip_reasons(p) for p in (ROOT / "tests").rglob("*.py")}
    assert any(reasons.values()), "no skip reason was found: the scan is broken"
    machine = re.compile(r"h200|nvidia-h|\blent\b|run on", re.I)
    assert {n: [r for r in rs if machine.search(r)] for n, rs in reasons.items() if any(machine.search(r) for r in rs)} == {}
    # each says what is missing, as "needs WHAT" (pytest.importorskip says which module by itself)
    unsaid = {n: [r for r in rs if not re.match(r"f?['\"]needs ", r)] for n, rs in reasons.items()}
    assert {n: rs for n, rs in unsaid.items() if rs} == {}
