"""Who shares which GPU memory with whom, found before a checkpoint touches anything.

Processes share VMM memory by passing an exported POSIX fd (NCCL does, with NCCL_CUMEM_ENABLE=1).
On the real driver every such fd is an open of /dev/nvidiactl with the same inode, so no file
attribute names the memory (FACTS: fdident_probe), and NCCL closes its fds once imported, so /proc
cannot say either. What names it is the open file description the exporter made, which the
importer received: each agent keeps a duplicate of every fd it saw exported or imported and hands
them to the controller (`shared`), which compares descriptions here (kcmp, or the F_SETSIG trick
where a seccomp profile forbids kcmp). Each importer is then given its exporter's key (`bind`),
which names the memory for the relink after a restore, in this controller or a later one.

Only processes that can share memory with the checkpoint are asked: those under gpucr that hold
open the device node of a GPU the checkpoint's processes use. One that does not answer refuses the
checkpoint (an unreachable process could be importing the memory about to be released).
"""
from __future__ import annotations

import ctypes
import fcntl
import os
import platform
from dataclasses import dataclass
from typing import Any

from . import gpus
from . import proc
from . import target as targets
from .agent import close_held
from .driver import Driver
from .errors import GpucrError

_KCMP = {"x86_64": 312, "aarch64": 272}.get(platform.machine())
_KCMP_FILE = 0
_F_SETSIG, _F_GETSIG = 10, 11
_libc = ctypes.CDLL(None, use_errno=True)


def same_file(a: int, b: int) -> bool:
    """Whether two fds of this process are one open file description."""
    if _KCMP is not None:
        pid = os.getpid()
        r = _libc.syscall(_KCMP, pid, pid, _KCMP_FILE, a, b)
        if r >= 0:
            return r == 0
    # the signal an fd's owner would get is kept in the description: set it through one, read it
    # through the other (nothing is signalled: O_ASYNC is never set on these)
    old_a, old_b = fcntl.fcntl(a, _F_GETSIG), fcntl.fcntl(b, _F_GETSIG)
    mark = 38 if old_b == 37 else 37
    fcntl.fcntl(a, _F_SETSIG, mark)
    try:
        return fcntl.fcntl(b, _F_GETSIG) == mark
    finally:
        fcntl.fcntl(a, _F_SETSIG, old_a)


@dataclass
class Shared:
    """One shared allocation in one process, as its agent reports it."""
    pid: int
    sid: int            # names it in that process
    role: str           # exporter | importer
    key: int            # names it across processes (an importer's is 0 until bound)
    bytes: int
    fd: int | None      # the agent's duplicate of its fd, received here; None if it kept none
    owner: int = 0      # an importer's exporter, once bound


def gather(pid: int, agent: Any, timeout: float) -> list[Shared]:
    """Every shared allocation of one process, with our copy of its fd (the caller closes them: close_all);
    `timeout` bounds the whole listing."""
    def entry(e: dict[str, Any], fds: list[int]) -> Shared:
        idx = e["fd_index"]
        return Shared(pid, e["sid"], e["role"], e["key"], e["bytes"], fds[idx] if 0 <= idx < len(fds) else None,
                      e.get("owner", 0))
    return agent.call_paged_with_fds("shared", "shared", entry, "list of shared memory", timeout)


close_all = close_held


def _exporter_of(imp: Shared, exporters: list[Shared]) -> Shared | None:
    if imp.fd is not None:
        for e in exporters:
            if e.fd is not None and same_file(imp.fd, e.fd):
                return e
    if imp.key:   # bound by an earlier checkpoint and relinked since: its key still names it
        return next((e for e in exporters if e.key == imp.key), None)
    return None


def candidate_pids(drv: Driver, members: list[int], uuids: set[str]) -> list[int]:
    """Processes under gpucr, outside `members`, that hold a device node of one of these GPUs open:
    the only ones that can share memory with the members."""
    nodes = gpus.device_nodes(drv, uuids)
    out = []
    for pid, _sock in targets.list_sockets():
        if pid in members or pid == os.getpid():
            continue
        try:
            held = {os.readlink(f"/proc/{pid}/fd/{fd}") for fd in os.listdir(f"/proc/{pid}/fd")}
        except OSError:
            continue   # gone, or another user's: it cannot be asked and cannot be checkpointed with these
        if held & nodes:
            out.append(pid)
    return out


def _ask_outsider(pid: int, timeout: float) -> list[Shared]:
    try:
        proc.check_not_stopped(pid)
        t = targets.resolve(pid)
        with t.connect() as agent:
            return gather(pid, agent, timeout)
    except GpucrError as exc:
        raise GpucrError(f"process {pid} is on the same GPU under gpucr and could share memory with this checkpoint, but "
                         f"it cannot be asked ({exc}); the checkpoint is refused: let it run, or name it too") from exc


def check_and_bind(members: dict[int, Any], drv: Driver, uuids: set[str], timeout: float) -> None:
    """Refuse, before anything is touched, a checkpoint that splits processes sharing memory; give
    every importer in it its exporter's key. `members` maps each pid to its agent connection; `timeout`
    bounds each process's listing."""
    objs: dict[int, list[Shared]] = {}
    try:
        for pid, agent in members.items():
            objs[pid] = gather(pid, agent, timeout)
        mine = [o for v in objs.values() for o in v]
        if not mine:
            return   # nothing shared: no one else needs asking
        for pid in candidate_pids(drv, list(members), uuids):
            objs[pid] = _ask_outsider(pid, timeout)
        everyone = [o for v in objs.values() for o in v]
        exporters = [o for o in everyone if o.role == "exporter"]
        for o in everyone:
            if o.role != "importer":
                continue
            e = _exporter_of(o, exporters)
            if o.pid in members:
                if e is None:
                    raise GpucrError(f"process {o.pid} uses GPU memory imported from a process gpucr cannot find (not under "
                                     "gpucr, or gone), which it could not relink after a restore; run every process that "
                                     "shares memory under gpucr and checkpoint them together")
                if e.pid not in members:
                    raise GpucrError(f"process {o.pid} uses GPU memory shared by process {e.pid}, which is not in this "
                                     "checkpoint (its exporter); checkpoint them together (name every pid, or use --group)")
                if o.key != e.key or o.owner != e.pid:
                    members[o.pid].call("bind", timeout=10.0, sid=o.sid, key=e.key, owner=e.pid,
                                        owner_start=proc.process_start_time(e.pid))
                    o.key = e.key
            elif e is not None and e.pid in members:
                raise GpucrError(f"process {e.pid} shares GPU memory with process {o.pid}, which is not in this "
                                 "checkpoint; checkpoint them together (name every pid, or use --group)")
    finally:
        close_all(o for v in objs.values() for o in v)
