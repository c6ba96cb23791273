"""The one host-memory budget for staging, kept by the data plane that makes it (the server; with no server, the
CLI's mover): before staging grows, the growth must fit the user's budget (GPUCR_HOST_BUDGET, the app's setting,
shared by every process of this user under gpucr), the machine's free memory or hugepages, and the memory
cgroups it counts against. A refusal comes before anything is made, in one line naming the limit, the need, what
is available and what to do.

The ledger: <runtime dir>/<pid>-<pid ns>.staging, the bytes an app's staging holds in host memory. Admission reads
and writes it under one flock (of the runtime dir itself, with a deadline; and a lock within this process, whose
threads share the open file), so two checkpoints started at once are each admitted against what the other
reserved. An entry counts while its APP lives, not while the plane does: the plane writes it with a shared flock
and hands its open file to the app's agent with the staging (`hold`); the agent holds it for as long as it holds
staging, so the entry of a SIGKILLed app is found stale by the first exclusive flock that succeeds, whatever the
pid namespace, and one of a server that died is not.
"""
from __future__ import annotations

import errno
import fcntl
import os
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

from ..errors import GpucrError
from ..paths import LEDGER_SUFFIX
from ..sizes import budget_bytes
from .cgroups import cgroup_room, check_cgroups
from .hostmem import check_free

SUFFIX = LEDGER_SUFFIX   # <pid>-<pid ns>.staging (paths.ledger_entry), as the agent names its own to remove it
# The ways past every host-memory limit, said by each refusal: an image, written from the GPU straight to disk (no
# staging), or staging in a file.
ON_DISK = "or checkpoint to disk, which needs no staging: 'gpucr checkpoint --image DIR', or stage on disk: 'gpucr run --staging file:DIR'"
LEDGER_WAIT_S = 5.0   # the lock is held for microseconds: longer means a holder is stuck
MIB = 1 << 20
_in_process = threading.Lock()   # the flock is the open file's: this orders the threads of this process


def _lock_holder(fd: int) -> int:
    """The pid /proc/locks gives for the flock on the file behind fd (the process that took it: a fork
    child may share it), or 0."""
    st = os.fstat(fd)
    want = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    try:
        lines = Path("/proc/locks").read_text().splitlines()
    except OSError:
        return 0
    for line in lines:   # "1: FLOCK  ADVISORY  WRITE PID MAJ:MIN:INODE 0 EOF"
        f = line.split()
        if len(f) >= 6 and f[1] == "FLOCK" and f[5] == want and f[4].isdigit():
            return int(f[4])
    return 0


def _flock_within(fd: int, wait_s: float) -> bool:
    deadline = time.monotonic() + wait_s
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except OSError as exc:
            if exc.errno not in (errno.EWOULDBLOCK, errno.EINTR) or time.monotonic() > deadline:
                return False
        time.sleep(0.002)


@contextmanager
def locked(ledger_dir: Path, wait_s: float = LEDGER_WAIT_S) -> Iterator[int]:
    """The ledger's lock (the runtime dir's flock), as the dir's fd; GpucrError naming the holder when another
    process holds it past `wait_s`. Unlocked, not only closed, at the end: a child forked meanwhile shares the
    open file until it execs, and would keep a lock that closing our fd alone leaves held."""
    with _in_process:
        fd = os.open(ledger_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            if not _flock_within(fd, wait_s):
                holder = _lock_holder(fd)
                who = f"process {holder} (or a child it forked)" if holder else "another process"
                raise GpucrError(f"the host-memory ledger of {ledger_dir} is held by {who} for more than "
                                 f"{wait_s:g} s; retry, or end that process if it is stopped")
            try:
                yield fd
            finally:
                fcntl.flock(fd, fcntl.LOCK_UN)
        finally:
            os.close(fd)


def others(dirfd: int, mine: str, reap: bool) -> int:
    """Bytes of the entries of live apps other than `mine`; stale entries (no flock held: their app is gone)
    removed when `reap`, which only the ledger's lock holder may do (an entry just made is flocked at once)."""
    total = 0
    for name in os.listdir(dirfd):
        if not name.endswith(SUFFIX) or name.startswith(".") or name == mine:
            continue
        try:
            fd = os.open(name, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK, dir_fd=dirfd)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            total += _entry_bytes(fd)   # held: its app lives
        else:
            if reap:
                os.unlink(name, dir_fd=dirfd)
        finally:
            os.close(fd)
    return total


def _entry_bytes(fd: int) -> int:
    text = os.pread(fd, 32, 0).split(b"\n")[0]
    return int(text) if text.isdigit() else 0   # read while rewritten (status reads without the lock): 0 this time


def used_bytes(ledger_dir: Path, but: str = "") -> int:
    """What all live apps' staging holds in host memory (and the server's pool made ahead), but the entry named
    `but`, read without the lock: a status must answer whoever holds it."""
    try:
        fd = os.open(ledger_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError:
        return 0
    try:
        return others(fd, but, reap=False)
    finally:
        os.close(fd)


def write_entry(dirfd: int, name: str, held: int) -> int:
    """The app's entry saying `held` bytes, as an fd with a shared flock on it (for the app's agent to hold; the
    caller closes its own). Under the ledger's lock: readers never see half of it."""
    fd = os.open(name, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600, dir_fd=dirfd)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH)
        say(fd, held)
    except OSError:
        os.close(fd)
        raise
    return fd


def write_entry_in(ledger_dir: Path, name: str, held: int) -> int:
    """write_entry, taking the ledger's lock: an entry of the server's own (its staging pool's)."""
    with locked(ledger_dir) as dirfd:
        return write_entry(dirfd, name, held)


def remove_entry(ledger_dir: Path, name: str, fd: int) -> None:
    """The entry behind `fd` removed from the ledger (if `name` is still that file), its flock let go, fd closed."""
    try:
        with locked(ledger_dir) as dirfd:
            mine, there = os.fstat(fd), os.stat(name, dir_fd=dirfd, follow_symlinks=False)
            if (mine.st_dev, mine.st_ino) == (there.st_dev, there.st_ino):
                os.unlink(name, dir_fd=dirfd)
    except (OSError, GpucrError):
        pass   # gone already, or the ledger stuck: the entry is stale once our flock goes, and reaped
    finally:
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)


def say(fd: int, held: int) -> None:
    """An entry's bytes rewritten (under the ledger's lock: readers never see half of it)."""
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{held}\n".encode(), 0)


@dataclass
class Room:
    """What the host has for staging of one kind now."""
    kind: str           # "hugetlbfs" | "shm" | "file"
    budget: int         # bytes of the user's budget (0: none)
    held: int           # of the app's own staging in host memory (what it keeps)
    app_cgroup_root: str = ""   # GPUCR_TEST_CGROUP_ROOT: the test suite's stand-in for "/" (the app's setting)


def admit(ledger_dir: Path, entry: str, pid: int, need: int, room: Room, lent: int = 0,
          lender: Callable[[int], None] | None = None) -> int | None:
    """Reserve `need` more bytes of the app's staging in host memory, or raise GpucrError with the one line;
    returns the app's ledger entry (an fd with its shared flock, saying held + need + lent), None for file staging
    (on a filesystem: neither the budget's nor host memory's). `lent`: bytes lent to the app out of the server's
    pool of staging made ahead (staging_pool.py), which its entry in the ledger counts until now: they move to
    the app's entry, `lender(dirfd)` rewriting the pool's under the same lock, so they count exactly once."""
    if room.kind == "file" and not lent:
        return None
    if need:
        check_free(room.kind, need, ON_DISK)
    with locked(ledger_dir) as dirfd:
        held_elsewhere = others(dirfd, entry, reap=True) - lent   # the pool's entry still says the lent bytes
        need += lent
        if room.budget and held_elsewhere + room.held + need > room.budget:
            left = max(room.budget - held_elsewhere - room.held, 0)
            raise GpucrError(f"host-memory budget: staging needs {need // MIB} MiB more, {left // MIB} MiB left of "
                             f"{room.budget // MIB} MiB (other processes hold {held_elsewhere // MIB} MiB); raise "
                             f"GPUCR_HOST_BUDGET, free staging elsewhere (restore --drop-staging) {ON_DISK}")
        if room.kind == "shm" and need > lent:   # hugepages are not charged to a memory cgroup (its hugetlb
            check_cgroups(pid, need - lent, room.app_cgroup_root, ON_DISK)   # controller does); lent: the server's
        fd = write_entry(dirfd, entry, room.held + need)
        if lender is not None:
            lender(dirfd)
        return fd


def settle(ledger_dir: Path, entry: str, held: int) -> None:
    """The entry says `held` again (staging that was reserved and then not made); left alone if it is gone."""
    with locked(ledger_dir) as dirfd:
        try:
            fd = os.open(entry, os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW, dir_fd=dirfd)
        except OSError:
            return
        try:
            say(fd, held)
        finally:
            os.close(fd)


def status_fields(ledger_dir: Path, pid: int, settings: dict[str, object]) -> dict[str, object]:
    """What `gpucr status` says of an app's host budget (its agent's status gives the settings it was started with):
    the budget, what all live apps' staging holds, and the memory cgroup over the app."""
    text = str(settings.get("host_budget", ""))
    room = cgroup_room(pid, str(settings.get("test_cgroup_root", "")))
    out: dict[str, object] = {"host_budget_bytes": budget_bytes(text) if text else 0,
                              "host_budget_used_bytes": used_bytes(ledger_dir)}
    if room is not None:
        out["memory_cgroup"] = {"path": room.path, "limit_file": room.limit_file, "limit_bytes": room.limit_bytes,
                                "current_bytes": room.current_bytes}
    return out
