"""A small pinned ring for a mover that runs without pinned staging: the CLI's, with no server running (and the
server's, for a fill from an image's file or from staging it did not pin itself).

The server pins a process's staging ahead, minutes before a checkpoint. A fresh CLI process cannot: pinning
69 GiB at the time of the checkpoint costs seconds. So the CLI's mover copies through SLOTS slots of its piece,
pinned once per request (at its first copy), and moves each piece between its slot and the staging (mapped
here, pageable) with a host memmove, or, a fill, with one pread of its file (pinned.file_segment), several
pieces at once:

- out: the device copies a piece into a slot, then the slot is copied into its place in staging; to an image,
  the slot is digested and written to its data file (no staging at all);
- in: a piece of staging is copied into a slot, then the device copies the slot into the new memory; from an
  image, the piece is read from its data file into the slot and checked there (no staging at all).

Each slot has a thread of its own, which moves its pieces one after the other; with several slots, one slot's
device copy runs while the others' memmoves do (ctypes.memmove and the driver's calls release the GIL). The
device only ever sees the pinned slots: no copy of the ring is pageable (simcuda counts such copies, and the
tests ask for none). Nothing of it lives in the application, which pins nothing.
"""
from __future__ import annotations

import ctypes
import os
import queue
import threading
import time
from contextlib import suppress
from dataclasses import dataclass
from typing import Callable

from ..driver import DriverError
from ..vmm import Vmm
from ..errors import GpucrError

# pieces in flight, each slot's thread alternating a device copy and a memmove: the memmoves (~10 GB/s a thread)
# must outrun the link together (H200, 16 GiB out: 4 slots 10x the pinned time, 8 slots 5.8x, both before
# _populate). Of the mover's 64 MiB pieces, 512-768 MiB pinned (~20-40 ms of cuMemHostRegister on an H200 host).
SLOTS = max(4, min(12, os.cpu_count() or 1))
_MADV_HUGEPAGE, _MADV_POPULATE_READ = 14, 22   # POPULATE_READ: Linux 5.14; an older kernel says EINVAL and the memmove takes the faults

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_PROT_RW, _MAP_PRIVATE_ANON, _MAP_FAILED = 0x1 | 0x2, 0x02 | 0x20, ctypes.c_void_p(-1).value


@dataclass
class Piece:
    ctx: int     # the mover's context on the GPU the piece is on (each slot's thread makes it current)
    host: int    # where in the staging mapping (pageable)
    dva: int     # where on the GPU (the mover's mapping of the process's memory)
    n: int       # bytes, at most the slot's
    out: bool    # GPU to staging (a checkpoint), else staging to GPU (a restore)
    # a file, not mapped here, the piece moves between instead of staging: file_io(slot, host, n) reads the piece
    # into the slot (in) or writes it from there (out), `host` then being its offset in that file (an image's data
    # file: gpucr.plane.ImageFile.move), or raises
    file_io: Callable[[int, int, int], None] | None = None


class Ring:
    """SLOTS pinned slots and a thread per slot. put() hands a piece to the next free slot (waiting for one),
    drain() waits for every piece put so far and raises the first failure; close() gives back the threads,
    the pinning and the memory."""

    def __init__(self, vmm: Vmm, slot_bytes: int, slots: int | None = None) -> None:
        self.vmm, self.slot_bytes = vmm, slot_bytes
        self.slots = SLOTS if slots is None else slots
        self._base = 0
        self._pinned: list[int] = []                 # slots registered with the driver (unpinned at close)
        self._work: queue.Queue[Piece | None] = queue.Queue(maxsize=self.slots)   # back-pressure: put waits
        self._threads: list[threading.Thread] = []
        self._idle = threading.Condition()
        self._pending = 0
        self._failure: BaseException | None = None
        self.spent = {"device": 0.0, "populate": 0.0, "memmove": 0.0}   # thread-seconds, summed over the slots

    @property
    def pinned_bytes(self) -> int:
        return len(self._pinned) * self.slot_bytes

    def put(self, piece: Piece) -> None:
        """Queue one piece; the ring is made and pinned at the first (in the current context: the registration
        is portable, so every context of this process copies from it)."""
        if piece.n > self.slot_bytes:
            raise GpucrError(f"a piece of {piece.n} bytes does not fit the ring's {self.slot_bytes}-byte slots: "
                             "the mover's own mistake")
        if not self._threads:
            self._start()
        with self._idle:
            self._pending += 1
        self._work.put(piece)

    def drain(self, quiet: bool = False) -> None:
        """Until every piece put so far is done (a failed one too); raises the first failure as GpucrError
        unless `quiet` (a path already failing, which only must know that nothing copies any more)."""
        with self._idle:
            self._idle.wait_for(lambda: self._pending == 0)
            failure, self._failure = self._failure, None
        if failure is not None and not quiet:
            raise GpucrError(f"a copy through the data plane's pinned ring failed: {failure}") from failure

    def close(self) -> None:
        """Stop the threads, unpin and unmap the slots. Safe to call again."""
        for _ in self._threads:
            self._work.put(None)
        for t in self._threads:
            t.join()
        self._threads = []
        for addr in self._pinned:
            try:
                self.vmm.unpin(addr)
            except DriverError:
                pass   # the context that pinned it is gone: the driver let go of the registration with it
        self._pinned = []
        if self._base:
            _libc.munmap(self._base, self.slots * self.slot_bytes)
            self._base = 0

    # ---- inside ----
    def _start(self) -> None:
        size = self.slots * self.slot_bytes
        base = _libc.mmap(None, size, _PROT_RW, _MAP_PRIVATE_ANON, -1, 0)
        if base in (None, _MAP_FAILED):
            raise GpucrError(f"the CLI's copy ring ({size >> 20} MiB of host memory) could not be mapped: "
                             f"{os.strerror(ctypes.get_errno())}")
        self._base = base
        _libc.madvise(base, size, _MADV_HUGEPAGE)   # 2 MiB pages where the kernel allows: fewer to fault and pin
        self._threads = [threading.Thread(target=self._serve, args=(base + k * self.slot_bytes,), name=f"gpucr-ring-{k}",
                                          daemon=True) for k in range(self.slots)]
        for t in self._threads:
            t.start()

    def _serve(self, slot: int) -> None:
        """One slot's thread: it pins its slot at its first piece (so the first copies start once one slot is
        pinned, not all: 12 slots took 0.3 s on the H200), then its pieces one after the other, on a stream of its
        own in each context."""
        streams: dict[int, int] = {}
        pinned = False
        while (piece := self._work.get()) is not None:
            try:
                if self._failure is None:   # after a failure the rest is only drained
                    if not pinned:
                        self._pin(slot, piece.ctx)
                        pinned = True
                    self._move(piece, slot, streams)
            except (DriverError, GpucrError) as exc:
                self._failure = self._failure or exc
            finally:
                with self._idle:
                    self._pending -= 1
                    self._idle.notify_all()
        for ctx, s in streams.items():   # the application's context outlives the ring: its streams must not
            with suppress(DriverError):
                self.vmm.use(ctx)
                self.vmm.destroy_stream(s)

    def _pin(self, slot: int, ctx: int) -> None:
        """Register one slot with the driver (a registration per slot: no copy spans two)."""
        self.vmm.use(ctx)
        try:
            self.vmm.pin(slot, self.slot_bytes)
        except DriverError as exc:
            raise GpucrError(f"pinning the CLI's copy ring ({self.slot_bytes >> 20} MiB a slot) failed: {exc}") from exc
        with self._idle:
            self._pinned.append(slot)

    def _move(self, p: Piece, slot: int, streams: dict[int, int]) -> None:
        self.vmm.use(p.ctx)
        if p.ctx not in streams:
            streams[p.ctx] = self.vmm.stream()
        s = streams[p.ctx]
        t0 = time.perf_counter()
        if p.out:
            self.vmm.d2h(slot, p.dva, p.n, s)
            if p.file_io is None:
                _populate(p.host, p.n)   # while the device copies
            t1 = time.perf_counter()
            self.vmm.sync(s)
            t2 = time.perf_counter()
            if p.file_io is not None:
                p.file_io(slot, p.host, p.n)
            else:
                ctypes.memmove(p.host, slot, p.n)
            t3 = time.perf_counter()
            spent = (t2 - t1, t1 - t0, t3 - t2)
        else:
            if p.file_io is None:
                _populate(p.host, p.n)
            t1 = time.perf_counter()
            if p.file_io is not None:
                p.file_io(slot, p.host, p.n)
            else:
                ctypes.memmove(slot, p.host, p.n)
            t2 = time.perf_counter()
            self.vmm.h2d(p.dva, slot, p.n, s)
            self.vmm.sync(s)
            spent = (time.perf_counter() - t2, t1 - t0, t2 - t1)
        with self._idle:
            for k, v in zip(("device", "populate", "memmove"), spent):
                self.spent[k] += v


def _populate(addr: int, n: int) -> None:
    """Map the staging's pages at [addr, addr + n) here before the memmove touches them. The staging is a file
    the application filled, mapped fresh in this process: a memmove into it took a write fault per 4 KiB page (17M
    faults for 69 GiB). A populating read maps 16 pages a fault (the kernel's fault-around) and, the mapping
    being shared memory with no dirty tracking, maps them writable: here 2 GiB took 0.72 s of memmove alone,
    0.05 s + 0.22 s after this, and 0.09 s + 0.23 s after MADV_POPULATE_WRITE, which faults page by page."""
    page = addr & ~4095
    _libc.madvise(page, addr + n - page, _MADV_POPULATE_READ)
