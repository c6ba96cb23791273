"""What /proc says of a process: whether it ended or is stopped, when it started, and which files the others hold.
Read by the controller, the server and the driver binding alike, so it depends on nothing else of gpucr."""
from __future__ import annotations

import contextlib
import os
from pathlib import Path

from .errors import GpucrError


def _stat_fields(pid: int) -> list[str]:
    """/proc/PID/stat from field 3 (state) on: the command name before it may hold spaces and parentheses."""
    text = Path(f"/proc/{pid}/stat").read_text()
    return text[text.rindex(")") + 2:].split()


def process_ended(pid: int, start_time: int | None = None) -> bool:
    """Whether a process has ended: gone, a zombie, or another process under its pid (start time)."""
    try:
        fields = _stat_fields(pid)
        return fields[0] in ("Z", "X") or (start_time is not None and int(fields[19]) != start_time)
    except (OSError, ValueError, IndexError):
        return True


def held_files(skip: int) -> set[tuple[int, int]]:
    """The files, as (st_dev, st_ino), that processes other than `skip` hold open or mapped, of those whose /proc this
    process may read: all as root; this user's otherwise, so a file one of this user's processes handed to another
    user's (SCM_RIGHTS) and then closed is not seen. A forked child holds what its parent did, so an app's file is
    free only when no process holds it."""
    held: set[tuple[int, int]] = set()
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit() or int(entry.name) == skip:
            continue
        with contextlib.suppress(OSError):   # ended meanwhile, or not ours to read
            for fd in os.scandir(f"/proc/{entry.name}/fd"):
                with contextlib.suppress(OSError):
                    if os.readlink(fd.path).startswith(("socket:", "pipe:", "anon_inode:", "/dev/")):
                        continue
                    st = os.stat(fd.path)
                    held.add((st.st_dev, st.st_ino))
            for line in Path(f"/proc/{entry.name}/maps").read_text().splitlines():
                fields = line.split(maxsplit=5)   # address perms offset dev inode [path]
                if len(fields) > 4 and fields[4] != "0":
                    major, minor = fields[3].split(":")
                    held.add((os.makedev(int(major, 16), int(minor, 16)), int(fields[4])))
    return held


def process_start_time(pid: int) -> int:
    return int(_stat_fields(pid)[19])


def parent_pid(pid: int) -> int:
    return int(_stat_fields(pid)[1])


def check_not_stopped(pid: int) -> None:
    """Name a stopped process at once: its agent cannot answer until it runs again."""
    try:
        state = _stat_fields(pid)[0]
    except (OSError, IndexError):
        return   # gone: the caller's next step says so
    if state == "T":
        raise GpucrError(f"process {pid} is stopped (SIGSTOP); continue it with kill -CONT {pid}")
    if state == "t":
        raise GpucrError(f"process {pid} is stopped by a debugger (tracing stop); let it continue first")

