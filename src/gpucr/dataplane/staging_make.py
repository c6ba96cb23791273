"""Staging made by the data plane (issue 25: the plane makes, fills, pins and maps staging; each app's agent holds
it). A segment is a memfd sealed against shrinking and growing (staging_file.py's check refuses any other memfd),
on hugetlbfs when enough hugepages are free or asked for, else shared memory; or, with GPUCR_STAGING=file:DIR, an
unlinked file in DIR (the space lives as long as the fd: a killed app leaves nothing behind). The sizes are the
agent's plan (native/agent/staging.c staging_plan_json: the first-fit rule lives with the placing).

The pages are faulted in here, before the agent holds them, by fallocate, one thread per segment. Measured on
the 2-core CI host (2026-12-03, 1 GiB of memfd): fallocate 66-68 ms/GiB with one thread (serialised on the inode:
no faster with 2 or 4 threads on one file), 50-56 ms/GiB with one thread per segment of 2 or 4; touching each
page through a mapping (MADV_POPULATE_WRITE, as the agent's 8 "gpucr-touch" threads did) 257 ms/GiB with one
thread, 193 ms/GiB with four. A file:DIR segment is fallocated too: its blocks are reserved (a full disk is
said now, not in the middle of a copy)."""
from __future__ import annotations

import errno
import fcntl
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from ..errors import GpucrError
from ..plane import MadeStaging, StagingAsk
from ..sizes import budget_bytes
from .budget import Room, admit, settle
from .hostmem import HUGE_PAGE, free_hugepage_bytes

FAULT_THREADS = 8
MIB = 1 << 20
_SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL


def wanted_kind(setting: str, need: int) -> tuple[str, str]:
    """The kind GPUCR_STAGING asks for (auto, hugetlbfs, shm or file:DIR) and the file: staging's DIR; auto:
    hugetlbfs when enough hugepages are free for `need` bytes, else shm."""
    if setting.startswith("file:"):
        return "file", setting[5:]
    if setting in ("shm", "hugetlbfs"):
        return setting, ""
    return ("hugetlbfs" if free_hugepage_bytes() >= need else "shm"), ""


def _round_up(v: int, a: int) -> int:
    return -(-v // a) * a


def sealed_memfd(size: int, huge: bool) -> int:
    """A memfd of `size` bytes whose size can no longer change: the plane maps it, and an app that shrank it
    under a copy would fault the plane."""
    fd = os.memfd_create("gpucr-staging", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING | (os.MFD_HUGETLB if huge else 0))
    try:
        os.ftruncate(fd, size)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, _SEALS)
    except OSError:
        os.close(fd)
        raise
    return fd


def unlinked_file(directory: str, size: int) -> int:
    """A file of `size` bytes in `directory` with no name (O_TMPFILE; where the filesystem lacks it, made and
    unlinked at once)."""
    try:
        fd = os.open(directory, os.O_TMPFILE | os.O_RDWR | os.O_CLOEXEC, 0o600)
    except OSError as exc:
        if exc.errno not in (errno.EOPNOTSUPP, errno.EISDIR, errno.EINVAL):
            raise
        name = os.path.join(directory, f"gpucr-staging-{os.getpid()}-{os.urandom(6).hex()}")
        fd = os.open(name, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
        os.unlink(name)
    try:
        os.ftruncate(fd, size)
    except OSError:
        os.close(fd)
        raise
    return fd


def _fault_in(fds: list[int], sizes: list[int]) -> None:
    """Every page of every segment allocated now, one thread per segment (fallocate is serialised per file)."""
    with ThreadPoolExecutor(max_workers=max(1, min(FAULT_THREADS, len(fds))), thread_name_prefix="gpucr-fault") as pool:
        for done in [pool.submit(os.posix_fallocate, fd, 0, n) for fd, n in zip(fds, sizes)]:
            done.result()


@dataclass
class Segments:
    """Segment files being made; closed unless handed on (take)."""
    fds: list[int] = field(default_factory=list)

    def take(self) -> list[int]:
        out, self.fds = self.fds, []
        return out

    def close(self) -> None:
        for fd in self.take():
            os.close(fd)


def make_segments(kind: str, directory: str, sizes: list[int]) -> list[int]:
    """The segments, made and faulted in; GpucrError (nothing left behind) when the host cannot give them."""
    made = Segments()
    try:
        for n in sizes:
            made.fds.append(unlinked_file(directory, n) if kind == "file" else sealed_memfd(n, kind == "hugetlbfs"))
        _fault_in(made.fds, sizes)
        return made.take()
    except OSError as exc:
        where = f"in {directory}" if kind == "file" else f"of {kind}"
        how = ("; reserve hugepages or use GPUCR_STAGING=shm" if kind == "hugetlbfs" else
               "; free space there" if kind == "file" else "; free host memory and retry")
        raise GpucrError(f"cannot make {sum(sizes) // MIB} MiB of staging {where}: {exc.strerror}{how}") from exc
    finally:
        made.close()


def made_for(ask: StagingAsk, kind: str, directory: str, sizes: list[int]) -> tuple[str, list[int]]:
    """The segments of `sizes` made and faulted in, of `kind`, and that kind: auto's hugetlbfs falls back to shm
    (hugepages taken meanwhile), as the agent did."""
    try:
        return kind, make_segments(kind, directory, sizes)
    except GpucrError:
        if ask.staging != "auto" or kind != "hugetlbfs":
            raise
        return "shm", make_segments("shm", "", sizes)


def make_staging(ask: StagingAsk) -> MadeStaging:
    """The segments `ask` names, admitted against the one host budget before anything is made, then made and
    faulted in; with the app's ledger entry to hold (None for file staging). The caller hands both to the app's
    agent (`hold`) and closes its own fds. GpucrError (one line) when refused or when making fails."""
    need = sum(ask.add)
    kind, directory = wanted_kind(ask.staging, _round_up(need, HUGE_PAGE))
    held = 0 if ask.replace else ask.held_memory
    budget = budget_bytes(ask.host_budget) if ask.host_budget else 0   # the agent kept only a well-formed one
    entry = admit(ask.ledger_dir, ask.entry, ask.pid, need, Room(kind, budget, held, ask.cgroup_root))
    try:
        kind, fds = made_for(ask, kind, directory, ask.add)
    except GpucrError:
        if entry is not None:
            os.close(entry)
            settle(ask.ledger_dir, ask.entry, held)
        raise
    return MadeStaging(fds, entry, kind, made=need)


class StagingMaker:
    """What a data plane does for staging (gpucr.plane.DataPlane.make_staging); needs no driver."""

    def make_staging(self, ask: StagingAsk) -> MadeStaging:
        return make_staging(ask)
