"""Finding and vetting a target process before anything is asked of it.

A target is untrusted input (docs/security.md): its socket is looked for only in runtime dirs that pass
the checks of paths.dir_problem for the target's uid, the socket itself must be the target uid's, the
listener must be the target process (SO_PEERCRED, checked before a byte is sent), and its hello is data
to validate: nothing in it is a path to open or a library to load.
"""
from __future__ import annotations

import errno
import fcntl
import os
import pwd
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from . import paths
from .agent import PROTOCOL, AgentClient
from .driver import SIMULATE_ENV, Driver, controller_driver
from .errors import GpucrError
from .proc import check_not_stopped, process_start_time


@dataclass
class Target:
    pid: int
    uid: int
    start_time: int          # clock ticks since boot (/proc/PID/stat field 22): with pid, names one process
    socket: Path
    hello: dict

    @property
    def simulated(self) -> bool:
        return bool(self.hello.get("simulated"))

    def connect(self) -> AgentClient:
        return AgentClient(self.socket, self.pid, uid=self.uid, always_watch=lambda: check_not_stopped(self.pid))

    def app_socket(self) -> Path:
        """Where an application that joined the cut (gpucr.app) listens: beside its agent's socket."""
        return self.socket.with_name(f"{self.pid}.app.sock")

    def driver(self) -> Driver:
        """The controller's own driver (never a library the target names); a target on the other kind is refused."""
        drv = controller_driver()
        if self.simulated != drv.simulated:
            if self.simulated:
                raise GpucrError(f"process {self.pid} runs on simcuda, the simulated driver, and this controller on the "
                                 "system's CUDA driver: give the controller --simulate (or GPUCR_SIMULATE=1)")
            raise GpucrError(f"process {self.pid} runs on the system's CUDA driver and this controller on simcuda, the "
                             f"simulated driver ({SIMULATE_ENV}=1 or --simulate): run gpucr without them")
        return drv


def _user(uid: int) -> str:
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return str(uid)


def pid_namespace(pid: int) -> tuple[int, int]:
    """(pid as the process's own namespace sees it, that pid namespace's inode): what names its agent socket."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
        ino = os.stat(f"/proc/{pid}/ns/pid").st_ino
    except PermissionError:
        raise GpucrError(f"cannot read the pid namespace of process {pid} (permission denied)") from None
    except FileNotFoundError:
        raise GpucrError(f"no process with pid {pid}; check the pid with 'gpucr ps'") from None
    nspid = next((line.split()[-1] for line in status.splitlines() if line.startswith("NSpid:")), str(pid))
    return int(nspid), ino


def command_line(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""


def _environ(pid: int) -> dict[str, str]:
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return {}
    return dict(e.decode(errors="replace").split("=", 1) for e in raw if b"=" in e)


def starting_under_gpucr(pid: int) -> bool:
    """Whether a process is on its way to running under gpucr: its environment preloads the agent, or it is
    `gpucr run` itself, before it execs the command (its own environment is still the shell's then)."""
    return "libgpucr" in _environ(pid).get("LD_PRELOAD", "") or launching(pid)


def launching(pid: int) -> bool:
    """Whether the process is `gpucr run` itself, before it execs the command: on its way, however long it takes."""
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    return any(Path(w.decode(errors="replace")).name in ("gpucr", "gpucr.cli") and argv[i + 1:i + 2] == [b"run"]
               for i, w in enumerate(argv))


def _candidate_dirs(pid: int, uid: int) -> list[Path]:
    """Verified runtime dirs of `uid` where this process's agent may listen. Its environment only suggests
    a dir: each one must pass the same checks (owner, 0700, not a link) as any other."""
    dirs: list[Path] = []
    if uid == os.getuid():
        dirs += paths.agent_dirs(uid)
    dirs += paths.agent_dirs(uid, _environ(pid))
    dirs += paths.agent_dirs(uid, {})
    return list(dict.fromkeys(dirs))


def agent_socket_name(pid: int) -> str:
    """The name of process `pid`'s agent socket in its runtime dir."""
    return paths.socket_name(*pid_namespace(pid))


def _find_socket(pid: int, uid: int) -> Path:
    name = agent_socket_name(pid)
    problems = []
    for d in _candidate_dirs(pid, uid):
        why = paths.socket_problem(d / name, uid)
        if why is None:
            return d / name
        if why != "missing":
            problems.append(why)
    if problems:
        raise GpucrError(f"refusing the agent socket of process {pid}: {problems[0]}")
    if starting_under_gpucr(pid):
        raise GpucrError(f"process {pid} is starting under gpucr and its agent does not answer yet; wait for it "
                         f"with 'gpucr wait {pid}', then retry")
    raise GpucrError(f"process {pid} is not running under gpucr (no agent socket); start it with "
                     f"'gpucr run -- CMD' or LD_PRELOAD=$(gpucr lib)")


def check_hello(hello: Any, pid: int, nspid: int) -> dict[str, Any]:
    """The agent's hello, validated: only the fields the controller uses, each of its type."""
    if not isinstance(hello, dict) or hello.get("agent") != "gpucr":
        raise GpucrError(f"process {pid}'s socket did not answer as gpucr's agent")
    if hello.get("protocol") != PROTOCOL:
        raise GpucrError(f"process {pid} runs a gpucr agent of protocol {hello.get('protocol')!r}, this controller "
                         f"speaks protocol {PROTOCOL}: restart the process under this gpucr (gpucr run / LD_PRELOAD=$(gpucr lib)), "
                         "or use the gpucr it was started with")
    if hello.get("pid") != nspid:
        raise GpucrError(f"the agent socket of process {pid} answered for process {hello.get('pid')}; "
                         "remove the stale socket and retry")
    out = {"agent": "gpucr", "protocol": PROTOCOL, "pid": pid}
    for key, kind in (("cuda", bool), ("simulated", bool), ("group", str)):
        if not isinstance(hello.get(key), kind):
            raise GpucrError(f"process {pid}'s agent sent a malformed hello ({key})")
        out[key] = hello[key]
    return out


def resolve(pid: int) -> Target:
    """Check that `pid` is a live process of this user running gpucr's agent, and say hello to it."""
    if pid <= 0:
        raise GpucrError(f"{pid} is not a process id")
    try:
        st = os.stat(f"/proc/{pid}")
    except FileNotFoundError:
        raise GpucrError(f"no process with pid {pid}; check the pid with 'gpucr ps'") from None
    me = os.getuid()
    if st.st_uid != me and me != 0:
        raise GpucrError(f"process {pid} belongs to user {_user(st.st_uid)}; gpucr acts only on your own processes "
                         "(or run it as root)")
    check_not_stopped(pid)
    nspid, _ = pid_namespace(pid)
    sock = _find_socket(pid, st.st_uid)
    with AgentClient(sock, pid, uid=st.st_uid) as agent:
        hello = check_hello(agent.call("hello", timeout=5.0), pid, nspid)
    return Target(pid, st.st_uid, process_start_time(pid), sock, hello)


def _my_pidns() -> int:
    return os.stat("/proc/self/ns/pid").st_ino


def _host_pids_by_ns() -> dict[tuple[int, int], int]:
    """{(pid namespace inode, pid in it): pid here} for every process this controller can see."""
    out = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                nspid, ino = pid_namespace(int(entry))
            except (GpucrError, OSError, ValueError):
                continue
            out[(ino, nspid)] = int(entry)
    return out


def _listener_gone(path: Path) -> bool:
    """Nothing listens on this socket any more (its process died without removing it)."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(1.0)
    try:
        s.connect(str(path))
    except OSError as exc:
        return exc.errno == errno.ECONNREFUSED
    finally:
        s.close()
    return False


def _process_socket(name: str) -> bool:
    """A socket that a process under gpucr makes: its agent's (paths.socket_name) or its app-join one
    (<pid>.app.sock). Any other, a server's among them, is not probed here: a server takes over a dead one's
    name itself, and one of another namespace refuses the knock (and logs it, each time this runs)."""
    return name.endswith(".sock") and (paths.parse_socket_name(name) is not None or name.split(".")[0].isdigit())


def _own_live_pid(name: str) -> bool:
    """A socket named after a live process of this namespace, other than an agent's (an app-join socket)."""
    head = name.split(".")[0]
    return paths.parse_socket_name(name) is None and head.isdigit() and os.path.exists(f"/proc/{head}")


STAGING_ENTRY = paths.LEDGER_SUFFIX   # an app's entry in the host-memory budget's ledger (gpucr.dataplane.budget)


def _reap_staging_entry(path: Path) -> None:
    """Remove a ledger entry whose process is gone: a live one's agent holds a shared flock on it for as long
    as it holds staging (the data plane reaps these too, at each admission; this keeps `ps` leaving nothing behind)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        return   # held: its process lives
    else:
        path.unlink(missing_ok=True)
    finally:
        os.close(fd)


def list_sockets() -> list[tuple[int, Path]]:
    """(pid, socket) of every live process under gpucr in this user's verified runtime dirs, pid as this
    controller's namespace sees it; sockets nothing listens on any more are removed (only in those dirs)."""
    found = []
    mine, others = _my_pidns(), None
    for rdir in paths.agent_dirs(os.getuid()):
        try:
            names = sorted(os.listdir(rdir))
        except OSError:
            continue
        for name in names:
            ident = paths.parse_socket_name(name)
            pid = None
            if ident is not None:
                nspid, ino = ident
                if ino == mine and os.path.exists(f"/proc/{nspid}"):
                    pid = nspid
                elif ino != mine:
                    others = _host_pids_by_ns() if others is None else others
                    pid = others.get((ino, nspid))
            if pid is not None:
                found.append((pid, rdir / name))
            elif name.endswith(STAGING_ENTRY):
                _reap_staging_entry(rdir / name)
            elif _process_socket(name) and not _own_live_pid(name) and _listener_gone(rdir / name):
                try:
                    (rdir / name).unlink()   # left by a process that was killed (agent or app-join socket)
                except OSError:
                    pass
    return found
