"""One move's ranges in one context swept by a table kernel (gpucr_kernels.cu: gpucr_scan_table, gpucr_check_table),
in batches on the context's kernel stream, so the kernels run beside the copies instead of before or after them.

The mover adds each range as it maps it (a part of an allocation: parts.py), and flushes a batch once enough is
added: the batch's slice of the range table (and, for the check, of the checkpoint's digests) goes to the device
on the kernel stream, which then waits for the copy streams' events when the kernel must read what they wrote
(a restore's check), and one launch sweeps every chunk of the batch. All of a sweep lives in one buffer taken from
the kernels' kept ones: the table, then the scan's zero flags and digests or the check's expected digests and its
verdict, mirrored in pinned host memory. The scan writes its results straight into the host's copy (no copy back
that could queue behind a copy out's on the copy engine), read once its batch's event is done; a check sends back
only a mismatch count and the first mismatching chunk, once, at the end.
"""
from __future__ import annotations

import ctypes
import os
import struct
from dataclasses import dataclass
from typing import Sequence

from ..errors import GpucrError
from .chunks import CHUNK, DIGEST_BYTES, chunk_count
from .kernels import ALIGN, MAX_GRID, THREADS, Kernels, _Buffer

RANGE = struct.Struct("<QQQ")   # gpucr_range: base, nbytes, first (the place of its first chunk in the sweep)
VERDICT = struct.Struct("<QQ")  # the check's result: mismatches, the least mismatching place (~0: none)
NONE = (1 << 64) - 1


def _up(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


@dataclass(frozen=True)
class Part:
    """A range of an allocation in a sweep: `size` bytes at `va`, from the allocation's chunk `chunk` on; its first
    chunk is the sweep's chunk `first`."""
    index: int
    chunk: int
    va: int
    size: int
    first: int

    @property
    def chunks(self) -> int:
        return chunk_count(self.size)

    @property
    def at(self) -> int:
        """Its offset in the allocation."""
        return self.chunk * CHUNK


@dataclass
class Batch:
    """A scan's launch over some parts: its results are read once its event is done."""
    parts: list[Part]
    event: int


class Sweep:
    """kind "scan" (zero flags and digests of each chunk, read back per batch) or "check" (each chunk's digest against
    the one given with its part, a verdict at the end), over at most `ranges` parts of `chunks` chunks in all."""

    def __init__(self, kernels: Kernels, ctx: int, stream: int, kind: str, ranges: int, chunks: int) -> None:
        self.vmm, self.ctx, self.stream, self.kind = kernels.vmm, ctx, stream, kind
        self.function = kernels.function(ctx, kind)
        self.capacity = (ranges, chunks)
        table = _up(ranges * RANGE.size)   # the buffer: the table first, then the results at these two offsets
        if kind == "scan":   # flags, then digests
            self.out, end = (table, table + _up(chunks)), table + _up(chunks) + chunks * DIGEST_BYTES
        else:                # expected digests, then the verdict
            self.out, end = (table, table + chunks * DIGEST_BYTES), table + chunks * DIGEST_BYTES + VERDICT.size
        self._buffers = kernels.buffers
        self.buf: _Buffer | None = kernels.buffers.take(ctx, end)
        self.parts: list[Part] = []
        self.chunks = 0      # chunks added
        self._sent = 0       # parts launched
        self._unsent = 0     # bytes of the parts added since (asked after every part: a sum would be quadratic)
        self._waits: dict[int, int] = {}   # copy stream -> its event the kernel stream waits on (re-recorded per batch)
        self._batches: list[Batch] = []    # launched, not read yet
        self._results = 0   # where the kernel writes its results: the scan's straight into the host's copy
        try:
            self.vmm.use(ctx)
            if kind == "scan":   # read by the host as soon as its kernel is done, no copy queued behind copies out
                self._results = self.vmm.mapped(self.buf.host)
            else:   # no mismatch yet, and none first; on the GPU: its atomics stay there
                self._results = self.buf.dev
                self.vmm.memset(self._dev(self.out[1]), 8, stream)
                self.vmm.memset(self._dev(self.out[1] + 8), 8, stream, 0xFF)
        except Exception:
            self.close(failed=True)
            raise

    def _dev(self, off: int) -> int:
        assert self.buf is not None
        return self.buf.dev + off

    def _host(self, off: int) -> int:
        assert self.buf is not None
        return self.buf.host + off

    def add(self, index: int, chunk: int, va: int, size: int, expected: bytes = b"") -> Part:
        """The next part: size bytes at va, the allocation's chunks from `chunk` on; a check's `expected` is their digests
        taken at the checkpoint (16 bytes a chunk)."""
        if va % ALIGN or size <= 0:
            raise GpucrError(f"a sweep's part of {size} bytes at {va:#x}: it must start {ALIGN}-byte aligned and not be empty")
        part = Part(index, chunk, va, size, self.chunks)
        if len(self.parts) >= self.capacity[0] or self.chunks + part.chunks > self.capacity[1]:
            raise GpucrError(f"a sweep made for {self.capacity[0]} parts of {self.capacity[1]} chunks was given more")
        if self.kind == "check" and len(expected) != part.chunks * DIGEST_BYTES:
            raise GpucrError(f"allocation {index}'s part from chunk {chunk} has {part.chunks} chunks but "
                             f"{len(expected) // DIGEST_BYTES} digests were taken")
        entry = RANGE.pack(va, size, part.first)
        ctypes.memmove(self._host(len(self.parts) * RANGE.size), entry, RANGE.size)
        if expected:
            ctypes.memmove(self._host(self.out[0] + part.first * DIGEST_BYTES), expected, len(expected))
        self.parts.append(part)
        self.chunks += part.chunks
        self._unsent += size
        return part

    def queued(self) -> int:
        """Bytes added since the last flush."""
        return self._unsent

    def flush(self, after: Sequence[int] = ()) -> Batch | None:
        """One launch over the parts added since the last flush (None: there were none), queued on the kernel stream
        after the work queued so far on each stream of `after` (a check of what copies on them write)."""
        parts = self.parts[self._sent:]
        if not parts:
            return None
        vmm, s, first, n = self.vmm, self.stream, parts[0].first, sum(p.chunks for p in parts)
        vmm.use(self.ctx)
        at = self._sent * RANGE.size
        vmm.h2d(self._dev(at), self._host(at), len(parts) * RANGE.size, s)
        if self.kind == "check":
            at = self.out[0] + first * DIGEST_BYTES
            vmm.h2d(self._dev(at), self._host(at), n * DIGEST_BYTES, s)
        for copies in after:
            if copies not in self._waits:
                self._waits[copies] = vmm.event()
            vmm.record(self._waits[copies], copies)
            vmm.wait_for(s, self._waits[copies])
        args = [ctypes.c_uint64(self._dev(self._sent * RANGE.size)), ctypes.c_uint64(len(parts)),
                ctypes.c_uint64(self._results + self.out[0]), ctypes.c_uint64(self._results + self.out[1])]
        vmm.launch(self.function, min(n, MAX_GRID), THREADS, s, args)
        self._sent, self._unsent = len(self.parts), 0
        if self.kind == "check":
            return None
        batch = Batch(parts, vmm.event())
        self._batches.append(batch)
        vmm.record(batch.event, s)
        return batch

    def done(self, batch: Batch) -> bool:
        """Whether a scan's batch can be read without waiting."""
        self.vmm.use(self.ctx)
        return self.vmm.done(batch.event)

    def read(self, batch: Batch) -> list[tuple[Part, list[bool], list[bytes]]]:
        """A scan's batch, once its kernel is done: each part with its chunks' zero flags and digests."""
        self.vmm.use(self.ctx)
        self.vmm.wait_event(batch.event)
        self._batches.remove(batch)
        self.vmm.destroy_event(batch.event)
        out = []
        for p in batch.parts:
            flags = ctypes.string_at(self._host(self.out[0] + p.first), p.chunks)
            raw = ctypes.string_at(self._host(self.out[1] + p.first * DIGEST_BYTES), p.chunks * DIGEST_BYTES)
            out.append((p, [f == 1 for f in flags], [raw[k:k + DIGEST_BYTES] for k in range(0, len(raw), DIGEST_BYTES)]))
        return out

    def verdict(self) -> tuple[int, tuple[int, int] | None]:
        """A check's result, every part flushed first: the chunks whose digest differs, and the first of them as
        (allocation index, its chunk), or None."""
        self.flush()
        vmm = self.vmm
        vmm.use(self.ctx)
        vmm.d2h(self._host(self.out[1]), self._dev(self.out[1]), VERDICT.size, self.stream)
        done = vmm.event()
        try:
            vmm.record(done, self.stream)
            vmm.wait_event(done)
        finally:
            vmm.destroy_event(done)
        count, first = VERDICT.unpack(ctypes.string_at(self._host(self.out[1]), VERDICT.size))
        return count, (self.place(first) if count else None)

    def place(self, c: int) -> tuple[int, int]:
        """The sweep's chunk c as (allocation index, its chunk)."""
        lo, hi = 0, len(self.parts)
        while hi - lo > 1:   # the last part whose first is at most c, as the kernel finds it
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if self.parts[mid].first <= c else (lo, mid)
        p = self.parts[lo]
        return p.index, p.chunk + c - p.first

    def close(self, failed: bool = False) -> None:
        """Its events destroyed and its buffer kept for the next sweep; failed: freed instead, as work may still
        write it (after a failure part way)."""
        if self.buf is None:
            return
        self.vmm.use(self.ctx)
        for ev in [*self._waits.values(), *(b.event for b in self._batches)]:
            self.vmm.destroy_event(ev)
        self._waits, self._batches = {}, []
        if failed:
            self._buffers.free(self.ctx, [self.buf])
        else:
            self._buffers.give_back(self.ctx, self.buf)
        self.buf = None


def parts_of(size: int, most: int) -> list[tuple[int, int]]:
    """An allocation of `size` bytes cut into parts of at most `most` bytes (a multiple of CHUNK), as (offset,
    bytes): the unit a copy out's copies wait for their scan, and a fill's check waits for its copies."""
    step = max(CHUNK, most - most % CHUNK)
    return [(at, min(step, size - at)) for at in range(0, size, step)]


# Bytes of a part, and added before a sweep launches: at most this much of a copy out's copies waits for its scan,
# and of a fill's check runs after its copies. ~0.25 ms of a kernel on an H200, ~20 ms of the link.
PART = 1 << 30
STEP_ENV = "GPUCR_TEST_SWEEP_BYTES"   # the test suite's smaller step, so a few MiB make several parts and batches


def step() -> int:
    """The part and batch size of the next move (PART, or the test suite's)."""
    return int(os.environ.get(STEP_ENV) or PART)


def room(sizes: Sequence[tuple[int, int]], most: int) -> dict[int, tuple[int, int]]:
    """{GPU: (parts, chunks)} a move's sweeps need for its allocations, given as (GPU, bytes), in parts of `most`."""
    out: dict[int, tuple[int, int]] = {}
    for dev, size in sizes:
        n, c = out.get(dev, (0, 0))
        out[dev] = (n + len(parts_of(size, most)), c + chunk_count(size))
    return out


class Sweeps:
    """A move's sweeps of one kind, one per context, each made at its GPU's first part with the room counted for
    that GPU; stream_of(ctx) is the context's kernel stream."""

    def __init__(self, kernels: Kernels, kind: str, stream_of, rooms: dict[int, tuple[int, int]]) -> None:
        self.kernels, self.kind, self.stream_of, self.rooms = kernels, kind, stream_of, rooms
        self.by_dev: dict[int, Sweep] = {}

    def of(self, dev: int, ctx: int) -> Sweep:
        if dev not in self.by_dev:
            self.by_dev[dev] = Sweep(self.kernels, ctx, self.stream_of(ctx), self.kind, *self.rooms[dev])
        return self.by_dev[dev]

    def close(self, failed: bool = False) -> None:
        for sweep in self.by_dev.values():
            sweep.close(failed)
