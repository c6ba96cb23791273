"""Install gpucr from this checkout (editable, building the agent and simcuda) for scripts/demo and
scripts/test; print the Python that has it, on stdout, for them to run.

    python3 scripts/install.py [EXTRA] [--dry-run]     # EXTRA: test, bench (pyproject's extras)

Where: the Python that runs this, unless it is one whose packages the system manages (Debian's and
Ubuntu's, PEP 668: pip refuses with 'externally-managed-environment') or one without pip; then a
virtual environment, .venv in the checkout, made once and used from then on (it also sees the
system's packages, so what apt installed need not be downloaded). An active virtual environment
is always used as it is.

How: when the build tools (scikit-build-core 0.8 or newer, and CMake) are already installed there,
without pip's isolated build, which would download them (and fails on a host with no network);
else with it, and if that fails this says what to install first. Stdlib only, Python 3.8 or newer.
"""
from __future__ import annotations

import argparse
import subprocess
import sys
import sysconfig
from pathlib import Path
from typing import List, Optional

ROOT = Path(__file__).resolve().parent.parent
VENV = ROOT / ".venv"
BUILD_TOOLS = "scikit-build-core>=0.8"

# run by the target Python: whether it can build gpucr without downloading anything
PROBE_TOOLS = """
import shutil, sys
try:
    import scikit_build_core
    v = tuple(int(x) for x in scikit_build_core.__version__.split(".")[:2])
except Exception:
    sys.exit(1)
try:
    import cmake  # the pip package ships its own
    ok = True
except ImportError:
    ok = shutil.which("cmake") is not None
sys.exit(0 if v >= (0, 8) and ok else 1)
"""


def in_venv() -> bool:
    return sys.prefix != sys.base_prefix


def externally_managed() -> bool:
    """PEP 668: the system manages this Python's packages (the marker is ignored in a venv)."""
    return not in_venv() and (Path(sysconfig.get_path("stdlib")) / "EXTERNALLY-MANAGED").exists()


def runs_ok(cmd: List[str]) -> bool:
    return subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL).returncode == 0


def where(venv_active: bool, managed: bool, has_pip: bool, venv_exists: bool) -> str:
    """'here' (this Python), 'venv' (.venv, made if need be)."""
    if venv_active:
        return "here"
    if venv_exists or managed or not has_pip:
        return "venv"
    return "here"


def venv_python() -> Path:
    return VENV / "bin" / "python"


def make_venv(dry_run: bool) -> Path:
    if venv_python().exists():
        return venv_python()
    say(f"this Python is managed by the system (or has no pip): making a virtual environment, {VENV}")
    cmd = [sys.executable, "-m", "venv", "--system-site-packages", str(VENV)]
    if dry_run:
        print(" ".join(cmd), file=sys.stderr)
    elif not runs_ok(cmd):
        fail(f"cannot make a virtual environment with '{' '.join(cmd[:3])}'; on Debian or Ubuntu install it with "
             f"'apt install python3-venv' (as root), then run this again")
    return venv_python()


def pip_command(python: Path, extra: Optional[str], tools_here: bool) -> List[str]:
    target = f"{ROOT}[{extra}]" if extra else str(ROOT)
    cmd = [str(python), "-m", "pip", "install", "-q", "-e", target]
    # the build tools are here: build with them rather than download them again (no network needed)
    return cmd + ["--no-build-isolation"] if tools_here else cmd


def say(msg: str) -> None:
    print(f"gpucr install: {msg}", file=sys.stderr)


def fail(msg: str) -> None:
    print(f"gpucr install: error: {msg}", file=sys.stderr)
    sys.exit(1)


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("extra", nargs="?", help="an extra of pyproject.toml to install too (test, bench)")
    ap.add_argument("--dry-run", action="store_true", help="say what would be run, run nothing")
    a = ap.parse_args(argv)
    here = Path(sys.executable)
    place = where(in_venv(), externally_managed(), runs_ok([sys.executable, "-m", "pip", "--version"]),
                  venv_python().exists())
    python = here if place == "here" else make_venv(a.dry_run)
    tools_here = python.exists() and runs_ok([str(python), "-c", PROBE_TOOLS])
    cmd = pip_command(python, a.extra, tools_here)
    if a.dry_run:
        print(" ".join(cmd), file=sys.stderr)
    elif subprocess.run(cmd, cwd=ROOT, stdout=sys.stderr).returncode != 0:
        fail("pip could not install gpucr (see above)" + ("" if tools_here else
             f". Its isolated build downloads the build tools; on a host with no network install them first, "
             f"from a wheelhouse if need be ({python} -m pip install '{BUILD_TOOLS}' cmake ninja [--no-index "
             f"--find-links DIR]), and run this again: it then builds with --no-build-isolation"))
    print(python)
    return 0


if __name__ == "__main__":
    sys.exit(main())
