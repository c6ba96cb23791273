"""The host's free memory and hugepages, as /proc/meminfo says, and the refusal when staging would not fit them."""
from __future__ import annotations

from pathlib import Path

from ..errors import GpucrError

HUGE_PAGE = 2 << 20
MIB = 1 << 20
NR_HUGEPAGES = Path("/proc/sys/vm/nr_hugepages")


def meminfo_kib(key: str) -> int:
    """A /proc/meminfo value, in KiB (0 when absent)."""
    for line in Path("/proc/meminfo").read_text().splitlines():
        name, _, rest = line.partition(":")
        if name == key:
            return int(rest.split()[0])
    return 0


def add_hugepages(n: int) -> int:
    """n more 2 MiB hugepages reserved (root only; OSError else): how many the kernel gave, which can be fewer when
    memory is fragmented."""
    before = int(NR_HUGEPAGES.read_text())
    NR_HUGEPAGES.write_text(str(before + n))
    return int(NR_HUGEPAGES.read_text()) - before


def drop_hugepages(n: int) -> None:
    """n hugepages given back: those still in use become surplus, freed when their last holder lets go."""
    NR_HUGEPAGES.write_text(str(max(0, int(NR_HUGEPAGES.read_text()) - n)))


def free_hugepage_bytes() -> int:
    return meminfo_kib("HugePages_Free") * HUGE_PAGE


def check_free(kind: str, need: int, on_disk: str) -> None:
    """GpucrError when the host has not `need` bytes for staging of `kind` (hugetlbfs: free hugepages; shm: the
    memory available)."""
    if kind == "hugetlbfs":
        free = free_hugepage_bytes()
        if need > free:
            total = meminfo_kib("HugePages_Total") + (need - free) // HUGE_PAGE
            raise GpucrError(f"not enough free hugepages for staging: need {need // MIB} MiB, {free // MIB} MiB free; "
                             f"reserve them with 'echo {total} > /proc/sys/vm/nr_hugepages' (as root) or use "
                             "GPUCR_STAGING=shm")
    elif kind == "shm":
        avail = meminfo_kib("MemAvailable") * 1024
        if need > avail:
            raise GpucrError(f"not enough host memory for staging: need {need // MIB} MiB more, {avail // MIB} MiB "
                             f"available; free host memory and retry {on_disk}")
