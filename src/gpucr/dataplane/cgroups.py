"""The memory cgroups staging counts against: the nearest limit over a process (v2: memory.max and memory.high up
the tree; v1: memory.limit_in_bytes), and the refusal when staging would pass it.

Two are checked (docs/security.md, "Host memory"): the app's, as a policy (an app held to a limit does not get
around it through gpucr's staging, as it could not when its agent made the staging), and the data plane's own,
because the plane faults the pages in and the kernel charges them to its cgroup."""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from ..errors import GpucrError

MIB = 1 << 20
_V1_NONE = 1 << 62   # v1 says "no limit" with ~2^63


@dataclass
class CgroupRoom:
    path: str          # the cgroup directory whose limit binds
    limit_file: str    # "memory.max", "memory.high" or "memory.limit_in_bytes"
    limit_bytes: int
    current_bytes: int

    @property
    def left(self) -> int:
        return max(self.limit_bytes - self.current_bytes, 0)


def _number(path: Path) -> int | None:
    """A cgroup file's number; None for "max", a missing file or anything else."""
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def _walk_up(root: str, top: str, rel: str, files: tuple[str, ...], none_above: int, current: str) -> CgroupRoom | None:
    """The least room (limit - current) among the limits of top/rel and its ancestors up to top."""
    best: CgroupRoom | None = None
    d = Path(top + rel.rstrip("/")) if rel.strip("/") else Path(top)
    while True:
        for name in files:
            lim = _number(d / name)
            if lim is None or lim >= none_above:
                continue
            room = CgroupRoom(str(d)[len(root):], name, lim, _number(d / current) or 0)
            if best is None or room.left < best.left:
                best = room
        if str(d) == top or len(str(d)) <= len(top):
            return best
        d = d.parent


def _memberships(text: str) -> tuple[str | None, str | None]:
    """The v2 path ("0::/path") and v1 memory controller's path ("N:a,memory,b:/path") of a cgroup file."""
    v2 = v1 = None
    for line in text.splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        hid, ctrls, rel = parts
        if hid == "0" and not ctrls:
            v2 = rel
        if "memory" in ctrls.split(","):
            v1 = rel
    return v2, v1


def cgroup_room(pid: int | None, root: str = "") -> CgroupRoom | None:
    """The binding memory cgroup limit over process `pid` (None: this one), or None when it has none. `root`: the
    test suite's stand-in for "/" (GPUCR_TEST_CGROUP_ROOT), whose proc/self/cgroup then names the cgroup."""
    who = "self" if pid is None or root else str(pid)
    try:
        text = Path(f"{root}/proc/{who}/cgroup").read_text()
    except OSError:
        return None
    v2, v1 = _memberships(text)
    if v1 is not None:   # a v1 memory controller wins: then the v2 hierarchy holds no memory controller
        return _walk_up(root, f"{root}/sys/fs/cgroup/memory", v1, ("memory.limit_in_bytes",), _V1_NONE,
                        "memory.usage_in_bytes")
    if v2 is not None:
        top = f"{root}/sys/fs/cgroup"
        if os.path.isdir(f"{top}/unified"):   # hybrid hosts mount v2 there
            top += "/unified"
        return _walk_up(root, top, v2, ("memory.max", "memory.high"), 1 << 64, "memory.current")
    return None


def check_cgroups(pid: int, need: int, app_root: str, on_disk: str) -> None:
    """GpucrError when `need` more bytes of staging would pass the app's memory cgroup or the plane's own."""
    app = cgroup_room(pid, app_root)
    if app is not None and need > app.left:
        raise GpucrError(f"memory cgroup {app.path}: staging needs {need // MIB} MiB more, {app.left // MIB} MiB left "
                         f"({app.limit_file} {app.limit_bytes // MIB} MiB, current {app.current_bytes // MIB} MiB; "
                         f"the process's staging counts against it); raise the limit, free memory in it {on_disk}")
    mine = cgroup_room(None)
    if mine is not None and need > mine.left and (app is None or mine.path != app.path):
        raise GpucrError(f"memory cgroup {mine.path} of gpucr's data plane (process {os.getpid()}, which faults the "
                         f"staging in and is charged for it): staging needs {need // MIB} MiB more, {mine.left // MIB} "
                         f"MiB left ({mine.limit_file} {mine.limit_bytes // MIB} MiB); raise the limit, run the "
                         f"gpucr server where there is room, {on_disk}")
