"""Finding and vetting a target process before anything is asked of it."""
from __future__ import annotations

import os
import pwd
from dataclasses import dataclass
from pathlib import Path

from . import paths
from .agent import AgentClient
from .errors import GpucrError


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
        return AgentClient(self.socket, self.pid)


def _user(uid: int) -> str:
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return str(uid)


def process_start_time(pid: int) -> int:
    stat = Path(f"/proc/{pid}/stat").read_text()
    return int(stat[stat.rindex(")") + 2:].split()[19])


def command_line(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""


def _socket_candidates(pid: int, uid: int) -> list[Path]:
    cands = []
    if uid == os.getuid():
        cands.append(paths.runtime_dir() / f"{pid}.sock")
    try:  # the target's own settings decide where its agent listens
        raw = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        env = dict(e.decode(errors="replace").split("=", 1) for e in raw if b"=" in e)
        cands.append(paths.runtime_dir(uid, env) / f"{pid}.sock")
    except OSError:
        pass
    cands.append(paths.runtime_dir(uid, {}) / f"{pid}.sock")
    return list(dict.fromkeys(cands))


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
    sock = next((c for c in _socket_candidates(pid, st.st_uid) if c.exists()), None)
    if sock is None:
        raise GpucrError(f"process {pid} is not running under gpucr (no agent socket); start it with "
                         f"'gpucr run -- CMD' or LD_PRELOAD=$(gpucr lib)")
    with AgentClient(sock, pid) as agent:
        hello = agent.call("hello", timeout=5.0)
    if hello.get("pid") != pid:
        raise GpucrError(f"the agent socket of process {pid} answered for process {hello.get('pid')}; "
                         "remove the stale socket and retry")
    return Target(pid, st.st_uid, process_start_time(pid), sock, hello)


def list_sockets() -> list[tuple[int, Path]]:
    """(pid, socket) of every live process under gpucr in this user's runtime dir; stale sockets are removed."""
    found = []
    rdir = paths.runtime_dir()
    if not rdir.is_dir():
        return found
    for sock in sorted(rdir.glob("*.sock")):
        name = sock.name.split(".")[0]
        if not name.isdigit():
            continue
        pid = int(name)
        if Path(f"/proc/{pid}").exists():
            if sock.name == f"{pid}.sock":
                found.append((pid, sock))
        else:
            try:
                sock.unlink()  # left behind by a process that was killed (agent or app-join socket)
            except OSError:
                pass
    return found
