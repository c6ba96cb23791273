"""Where gpucr's pieces live: the agent library, the simulated driver, the per-user runtime dir."""
from __future__ import annotations

import os
from pathlib import Path

from .errors import GpucrError

_LIB_DIR = Path(__file__).resolve().parent / "_lib"


def agent_lib() -> Path:
    """Path of libgpucr.so, the agent loaded into applications with LD_PRELOAD."""
    path = _LIB_DIR / "libgpucr.so"
    if not path.exists():
        raise GpucrError(f"the agent library is missing ({path}); reinstall gpucr: python3 -m pip install -e .")
    return path


def simcuda_dir() -> Path:
    """Directory holding simcuda's libcuda.so.1 (the simulated driver, a test double)."""
    path = _LIB_DIR / "simcuda"
    if not (path / "libcuda.so.1").exists():
        raise GpucrError(f"the simulated driver is missing ({path}); reinstall gpucr: python3 -m pip install -e .")
    return path


def runtime_dir(uid: int | None = None, environ: dict[str, str] | None = None) -> Path:
    """The agent's socket directory: the same rule as native/agent/channel.c."""
    env = os.environ if environ is None else environ
    if env.get("GPUCR_RUNTIME_DIR"):
        return Path(env["GPUCR_RUNTIME_DIR"])
    if env.get("XDG_RUNTIME_DIR"):
        return Path(env["XDG_RUNTIME_DIR"]) / "gpucr"
    return Path(f"/tmp/gpucr-{os.getuid() if uid is None else uid}")


def run_env(simulate: bool = False, base: dict[str, str] | None = None) -> dict[str, str]:
    """Environment that starts a command under the agent (on simcuda when `simulate`)."""
    env = dict(os.environ if base is None else base)
    preload = str(agent_lib())
    env["LD_PRELOAD"] = f"{preload}:{env['LD_PRELOAD']}" if env.get("LD_PRELOAD") else preload
    if simulate:
        sim = simcuda_dir()
        env["GPUCR_LIBCUDA"] = str(sim / "libcuda.so.1")
        env["LD_LIBRARY_PATH"] = f"{sim}:{env['LD_LIBRARY_PATH']}" if env.get("LD_LIBRARY_PATH") else str(sim)
    return env
