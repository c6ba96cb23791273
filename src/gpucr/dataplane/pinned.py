"""A process's staging as the gpucr server holds it: each segment mapped here and pinned in pieces.

Pinned in pieces of PIN_PIECE bytes, each its own cuMemHostRegister. One registration of a whole segment
(4 GiB and more) kept the driver busy for all its length, and a checkpoint that came meanwhile was slowed
in every driver call it made (H200, 2026-12-02: pinning a new 4 GiB segment ahead beside a checkpoint made
that checkpoint 1.774 s against 1.45-1.50 s for the four after it). In pieces, pinning ahead stops between
two of them when a copy wants the data plane; what it pinned stays, and is extended later instead of
pinned again.

A copy is never given a host range over two pieces: the driver copies a range it does not find inside one
registration as pageable memory, through its own bounce buffers and far slower, so `cuts` ends every copy
at the end of the piece it starts in. simcuda counts such copies (simcudaPageableAsyncCopies), and the tests ask
for none.
"""
from __future__ import annotations

import ctypes
import os
import stat
from dataclasses import dataclass, field
from typing import Callable, Iterator

from ..driver import DriverError
from ..vmm import Vmm
from ..errors import GpucrError
from ..fileio import read_full, view_at
from .staging_file import refuse_unsealed_memfd

PAGE = 4096
PIN_PIECE = 256 << 20   # ~10-20 ms of cuMemHostRegister on the H200 host (8 GiB took 0.23-0.52 s)

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_PROT_RW, _MAP_SHARED, _MAP_FAILED = 0x1 | 0x2, 0x01, ctypes.c_void_p(-1).value


@dataclass
class Segment:
    """One staging segment of a process, mapped here whole and pinned from its start, piece by piece."""
    ident: tuple[int, int]        # (st_dev, st_ino): the same file as last time, or not
    addr: int
    declared: int                 # its size as the process stated it when mapped (all of it is mapped)
    page: int = PAGE              # its file's page (hugetlbfs: 2 MiB or 1 GiB): every piece starts and ends on one
    want: int = 0                 # how far pinning was asked to go: all of it ahead, as far as allocations reach by a copy
    ends: list[int] = field(default_factory=list)   # where each pinned piece ends, from the start, ascending
    busy: bool = False            # a pin ahead is pinning it, outside the data plane's lock (mover.py)
    abandon: bool = False         # ... and is to stop at the end of its piece: the segment is let go
    stuck: int = 0                # bytes the driver did not unpin when it was let go (kept mapped: drop)
    held: dict[tuple[int, int], bytes] = field(default_factory=dict)   # (offset, bytes) -> the digest of what the
    #                             mover's last copy out left there (checked.py): not copied again while the GPU's is equal
    file_io: Callable[[int, int, int], None] | None = None   # not mapped here: an image's data file, which the ring's
    #                             slots are read from or written to (ring.Piece.file_io); addr is 0, places are its offsets

    @property
    def bytes(self) -> int:
        """Pinned, from the start."""
        return self.ends[-1] if self.ends else 0

    def cuts(self, off: int, size: int, most: int) -> Iterator[tuple[int, int]]:
        """[off, off + size) of the segment as (offset, bytes) pieces of at most `most` bytes, none over the end
        of a pinned piece (the range must be pinned)."""
        k, end = off, off + size
        if end > self.bytes:
            raise GpucrError(f"staging pinned to {self.bytes} bytes, not to {end}: the server's own mistake")
        j = 0
        while k < end:
            while self.ends[j] <= k:
                j += 1
            n = min(most, end - k, self.ends[j] - k)
            yield k, n
            k += n


def same_file(seg: Segment, fd: int) -> bool:
    """Whether `seg` is the file behind `fd` now."""
    fs = os.fstat(fd)
    return seg.ident == (fs.st_dev, fs.st_ino)


def _checked(fd: int, i: int, declared: int) -> os.stat_result:
    fs = os.fstat(fd)
    refuse_unsealed_memfd(fd, i)
    # the process is not trusted: only a plain file as long as it says, or copies could run past it
    if not stat.S_ISREG(fs.st_mode) or declared <= 0 or fs.st_size < declared:
        raise GpucrError(f"the process's staging segment {i} is not a file of {declared} bytes: gpucr's data plane "
                         "will not copy past it")
    return fs


def open_segment(fd: int, i: int, declared: int) -> Segment:
    """Segment i of a process's staging (its file `fd`, of `declared` bytes as it says) mapped here, nothing pinned."""
    fs = _checked(fd, i, declared)
    addr = _libc.mmap(None, declared, _PROT_RW, _MAP_SHARED, fd, 0)
    if addr in (None, _MAP_FAILED):
        raise GpucrError(f"mapping the process's staging ({declared >> 20} MiB) failed: {os.strerror(ctypes.get_errno())}")
    return Segment((fs.st_dev, fs.st_ino), addr, declared, page=file_page(fs.st_blksize))


def file_segment(fd: int, i: int, declared: int) -> Segment | None:
    """Segment i of a process's staging as the ring reads it without mapping it here: each piece read from its file
    with one pread into the ring's slot. None for a file with huge pages (hugetlbfs), mapped then. (Not for a copy
    out: writes to one file are one at a time, 5.4 GB/s from the ring's 12 threads on an H100; mapped, they ran
    side by side, 8.7 GB/s on the H200 when each took a fault per 4 KiB page, since populated ahead: ring.py.)"""
    fs = _checked(fd, i, declared)
    if file_page(fs.st_blksize) != PAGE:
        return None
    return Segment((fs.st_dev, fs.st_ino), 0, declared, file_io=lambda slot, at, n: _read_into(fd, slot, at, n))


def _read_into(fd: int, slot: int, at: int, n: int) -> None:
    try:
        if read_full(fd, view_at(slot, n), at) < n:
            raise OSError(0, "the file ended")
    except OSError as exc:
        raise GpucrError(f"reading {n} bytes at {at:#x} of the process's staging failed: {exc.strerror or exc}") from exc


def file_page(blksize: int) -> int:
    """The page a staging file is mapped in, from its st_blksize: hugetlbfs gives its huge page (2 MiB or
    1 GiB), shared memory and disks 4 KiB. So no piece starts or ends inside a huge page, which two
    registrations would then share."""
    return blksize if PAGE <= blksize <= 1 << 30 and blksize & (blksize - 1) == 0 else PAGE


def pin(vmm: Vmm, seg: Segment, upto: int, stop: Callable[[], bool] = lambda: False) -> int:
    """Pin `seg` from what is pinned of it on, a piece at a time, to `upto` bytes (in whole pages of its file,
    within the segment); `stop` asked before each piece ends it early. Returns the bytes newly pinned; raises GpucrError
    (what was pinned before stays pinned, and in `seg`)."""
    upto = min(-(-upto // seg.page) * seg.page, seg.declared)
    piece = -(-PIN_PIECE // seg.page) * seg.page
    seg.want = max(seg.want, upto)
    start = seg.bytes
    while seg.bytes < upto and not stop():
        k = seg.bytes
        n = min(piece, upto - k)
        try:
            vmm.pin(seg.addr + k, n)
        except DriverError as exc:
            raise GpucrError(f"pinning the process's staging failed: {exc}") from exc
        seg.ends.append(k + n)
    return seg.bytes - start


def drop(vmm: Vmm, seg: Segment) -> None:
    """Unpin every piece of `seg` and unmap it. A piece the driver does not unpin raises GpucrError and
    leaves the segment mapped (its bytes still pinned in `seg.stuck`): unmapped, its address would be mapped
    again and pinned anew over a registration never undone (CUDA error 712, issue 24)."""
    starts = [0, *seg.ends[:-1]] if seg.ends else []
    failed: list[str] = []
    for k, end in zip(starts, seg.ends):
        try:
            vmm.unpin(seg.addr + k)
        except DriverError as exc:
            seg.stuck += end - k
            failed.append(str(exc))
    seg.ends = []
    if failed:
        raise GpucrError(f"unpinning {seg.stuck >> 20} MiB of staging failed ({failed[0]}); it stays mapped, "
                         "never reused")
    _libc.munmap(seg.addr, seg.declared)
