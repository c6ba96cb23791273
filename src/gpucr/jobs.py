"""A job as users start it: a tree of processes (a launcher such as torchrun or a shell script, one
worker per GPU, helpers the workers fork), or the processes of a group (`gpucr run --group NAME`).
Only the processes that hold GPU state join a checkpoint: a CUDA context the driver knows, with
memory or without. The others (the launcher, a shell, DataLoader workers that never touched CUDA)
are left alone and reported, with the reason.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from . import proc
from . import target as targets
from .driver import DriverError, ProcessState, controller_driver
from .errors import GpucrError
from .results import LeftOut


@dataclass(frozen=True)
class Job:
    pids: list[int]              # the processes that hold GPU state, in pid order
    left_out: list[LeftOut]


def children_of(pid: int) -> list[int]:
    """Every descendant of pid, found through the parent links in /proc (any depth), in pid order."""
    kids_of: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            kids_of.setdefault(proc.parent_pid(int(entry)), []).append(int(entry))
        except (OSError, ValueError, IndexError):
            continue   # gone meanwhile
    out, todo = [], [pid]
    while todo:
        kids = kids_of.get(todo.pop(), [])
        out += kids
        todo += kids
    return sorted(out)


def _group_of(pid: int) -> str | None:
    """The GPUCR_GROUP a process was started with (its environment at exec), as a hint: its agent confirms."""
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return None
    for item in raw.split(b"\0"):
        if item.startswith(b"GPUCR_GROUP="):
            return item[len(b"GPUCR_GROUP="):].decode(errors="replace")
    return None


def gpu_state_problem(t: targets.Target) -> str | None:
    """Why this process holds no GPU state the driver could checkpoint; None when it holds some: a
    CUDA context, with memory or without (a process the driver holds has one by definition)."""
    if not t.hello.get("cuda"):
        return "it has not loaded the CUDA driver"
    try:
        state = controller_driver().state(t.pid)
    except DriverError:
        return "it has no CUDA context of its own (a fork() child of a CUDA process)"
    if state != ProcessState.RUNNING:
        return None
    with t.connect() as agent:
        held = agent.call("contexts", timeout=10.0).get("contexts", 0)
    # torchrun's launcher initialises the driver (so the driver knows it) but makes no context
    return None if held else "it holds no CUDA context (a launcher that only initialised the driver)"


def select(pids: list[int], why_considered: str) -> Job:
    """Of these processes, those that run under gpucr and hold GPU state; the rest, with reasons.
    A process under gpucr that cannot be asked is an error: it could hold GPU state."""
    keep, left = [], []
    under = {pid for pid, _ in targets.list_sockets()}
    for pid in sorted(set(pids)):
        cmd = targets.command_line(pid)
        if pid not in under:
            left.append(LeftOut(pid, cmd, f"not running under gpucr ({why_considered})"))
            continue
        proc.check_not_stopped(pid)
        t = targets.resolve(pid)
        problem = gpu_state_problem(t)
        if problem:
            left.append(LeftOut(pid, cmd, problem))
        else:
            keep.append(pid)
    return Job(keep, left)


def of_group(name: str) -> Job:
    """The processes started with `gpucr run --group NAME` that hold GPU state."""
    members = []
    for pid, _sock in targets.list_sockets():
        if _group_of(pid) != name:
            continue
        proc.check_not_stopped(pid)
        if targets.resolve(pid).hello.get("group") == name:
            members.append(pid)
    if not members:
        raise GpucrError(f"no process of group '{name}' is running under gpucr; see 'gpucr ps'")
    job = select(members, "group member")
    if not job.pids:
        raise GpucrError(f"no process of group '{name}' holds GPU state: " + "; ".join(x.line() for x in job.left_out))
    return job


def of_tree(root: int) -> Job:
    """The processes of the tree under `root` (it included) that hold GPU state."""
    if not Path(f"/proc/{root}").exists():
        raise GpucrError(f"no process with pid {root}; check the pid with 'gpucr ps'")
    job = select([root, *children_of(root)], f"in the tree of {root}")
    if not job.pids:
        raise GpucrError(f"no process in the tree of {root} holds GPU state under gpucr: " +
                         "; ".join(x.line() for x in job.left_out))
    return job
