"""Where gpucr's pieces live: the agent library, the simulated driver, the per-user runtime dir."""
from __future__ import annotations

import os
import stat
from pathlib import Path

from .agent_tables import RUNTIME_DIR_DEFAULT, RUNTIME_DIRS
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


# Where an agent listens, by the agent's rules (agent_tables, from native/agent/rules.h): the first rule whose
# setting is set names the dir; a dir not private to the process's user (owner, mode 0700, not a link) is
# refused, except the default one, a name anyone can take first: there the agent falls back to a private dir
# beside it that it makes itself (mkdtemp), named after it, and the controller looks in those it can verify.
def runtime_rule(uid: int | None = None, environ: dict[str, str] | None = None) -> tuple[Path, bool]:
    """The dir the rules name for this user and environment, and whether a private fallback is allowed."""
    env = os.environ if environ is None else environ
    for setting, suffix in RUNTIME_DIRS:
        if env.get(setting):
            return Path(env[setting] + suffix), False
    return default_runtime_dir(os.getuid() if uid is None else uid), True


def default_runtime_dir(uid: int) -> Path:
    """The dir the rules name when no setting is: anyone may take its name first (fallback_dirs)."""
    parent, name = RUNTIME_DIR_DEFAULT
    return Path(parent) / (name % uid)


def fallback_prefix(uid: int) -> Path:
    """What the private dirs made in place of a taken default dir begin with: its path and a dot."""
    default = default_runtime_dir(uid)
    return default.with_name(default.name + ".")


def runtime_dir(uid: int | None = None, environ: dict[str, str] | None = None) -> Path:
    """The agent's socket directory as the rules name it (runtime_rule)."""
    return runtime_rule(uid, environ)[0]


def dir_problem(path: Path, uid: int) -> str | None:
    """Why `path` is not a private runtime dir of `uid` (checked with lstat: a link is never followed), or None."""
    try:
        st = os.lstat(path)
    except OSError as exc:
        return f"{path}: {exc.strerror}"
    if stat.S_ISLNK(st.st_mode):
        return f"{path} is a symbolic link"
    if not stat.S_ISDIR(st.st_mode):
        return f"{path} is not a directory"
    if st.st_uid != uid:
        return f"{path} belongs to uid {st.st_uid}, not {uid}"
    if st.st_mode & 0o077:
        return f"{path} has mode {stat.S_IMODE(st.st_mode):04o}, not 0700"
    return None


def socket_problem(path: Path, uid: int) -> str | None:
    """Why `path` is not a socket of `uid` (lstat: a link is never followed), "missing", or None."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return "missing"
    except OSError as exc:
        return exc.strerror
    if not stat.S_ISSOCK(st.st_mode):
        return f"{path} is not a socket"
    if st.st_uid != uid:
        return f"{path} belongs to uid {st.st_uid}, not {uid}"
    return None


def state_dir(environ: dict[str, str] | None = None) -> Path:
    """gpucr's per-user state that outlives a boot (the runtime dir may be memory): $XDG_STATE_HOME/gpucr, else
    ~/.local/state/gpucr."""
    env = os.environ if environ is None else environ
    base = env.get("XDG_STATE_HOME") or str(Path(env.get("HOME") or Path.home()) / ".local" / "state")
    return Path(base) / "gpucr"


def fallback_dirs(uid: int) -> list[Path]:
    """The private dirs agents of `uid` made for themselves because the default dir was taken."""
    prefix = fallback_prefix(uid)
    try:
        names = sorted(n for n in os.listdir(prefix.parent) if n.startswith(prefix.name))
    except OSError:
        return []
    return [prefix.parent / n for n in names if dir_problem(prefix.parent / n, uid) is None]


def agent_dirs(uid: int | None = None, environ: dict[str, str] | None = None) -> list[Path]:
    """The verified dirs where an agent of `uid` with this environment may listen (the rules, then the checks)."""
    uid = os.getuid() if uid is None else uid
    named, fallback = runtime_rule(uid, environ)
    if dir_problem(named, uid) is None:
        return [named]
    return fallback_dirs(uid) if fallback else []


def socket_name(pid_in_ns: int, pidns_inode: int) -> str:
    """An agent's socket: its pid as its own namespace sees it, and that namespace (pids repeat across namespaces)."""
    return f"{pid_in_ns}-{pidns_inode}.sock"


def parse_socket_name(name: str) -> tuple[int, int] | None:
    """(pid in its namespace, pid namespace inode) of an agent socket's name, or None for any other name."""
    stem, dot, ext = name.partition(".")
    pid, dash, ino = stem.partition("-")
    if ext != "sock" or not dash or not pid.isdigit() or not ino.isdigit():
        return None
    return int(pid), int(ino)


LEDGER_SUFFIX = ".staging"   # an app's entry in the host budget's ledger, in its runtime dir (dataplane/budget.py)


def ledger_entry(socket_name: str) -> str | None:
    """The name of an app's entry in the host budget's ledger, as its agent names it (by its pid and pid namespace,
    as its socket is named: <pid>-<pid ns>.staging), or None for a name that is no agent's socket."""
    ident = parse_socket_name(socket_name)
    return None if ident is None else f"{ident[0]}-{ident[1]}{LEDGER_SUFFIX}"


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
