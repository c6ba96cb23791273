"""`gpucr serve --prepare-staging SIZE --reserve-hugepages`: SIZE in 2 MiB hugepages reserved (as root) when the
server starts, so the staging it prepares ahead is made on hugetlbfs, and given back when it stops.

Why: the first park right after a server start waits for the pool. On the H200 host (2026-12-05) the pool on
hugepages made a first park take 0.84-1.19x the later ones; on 4 KiB pages, which fallocate makes at about
3.4 GB/s, 5-12x. A server killed before giving them back leaves the count in its runtime dir, and the next server
of that user gives them back at its start."""
from __future__ import annotations

from pathlib import Path
from typing import Callable

from ..dataplane.hostmem import HUGE_PAGE, NR_HUGEPAGES, add_hugepages, drop_hugepages
from ..errors import GpucrError


def record_of(socket: Path) -> Path:
    """Where the server on `socket` keeps how many hugepages it reserved and has not given back: beside the socket,
    so a simcuda server and one on the driver, each with its own socket, never give back each other's."""
    return socket.with_suffix(".hugepages")


def reserve(nbytes: int, record: Path, log: Callable[[str], None]) -> None:
    """nbytes of hugepages more (rounded up), with their count in `record`."""
    want = -(-nbytes // HUGE_PAGE)
    try:
        got = add_hugepages(want)
    except (OSError, ValueError) as exc:
        raise GpucrError(f"--reserve-hugepages: cannot write {NR_HUGEPAGES} ({exc}); it needs root", code=2) from exc
    record.write_text(f"{got}\n")
    short = "" if got == want else ("; the kernel had no more (memory fragmented): the rest of the staging is made "
                                    "on 4 KiB pages")
    log(f"reserved {got} of {want} hugepages ({got * HUGE_PAGE >> 20} MiB) for staging made ahead, given back when "
        f"the server stops{short}")


def give_back(record: Path, log: Callable[[str], None], why: str) -> None:
    """The hugepages counted in `record` given back (no record: nothing to do). Those a parked app still holds
    become surplus pages, freed when it lets go."""
    try:
        n = int(record.read_text() or 0)
    except FileNotFoundError:
        return
    except ValueError:
        n = 0
    try:
        drop_hugepages(n)
    except (OSError, ValueError) as exc:
        log(f"could not give back {n} hugepages {why} ({exc}): lower {NR_HUGEPAGES} by {n} as root")
        return
    record.unlink(missing_ok=True)
    log(f"gave back {n} hugepages {why}")
