"""A move's own mappings of the process's GPU memory (move.py), made in batches and undone afterwards.

Each GPU's allocations of a move are mapped side by side into one address range reserved for the whole move, and
given access by one cuMemSetAccess per BATCH bytes, not one per allocation: torch's expandable segments hand over
~1,500 allocations of 20 MiB for 30 GiB, whose import and map, one at a time, took 0.75 s of a 0.95 s checkpoint on the
H100 (0.13 s for the same bytes in 128 allocations). Copies of an allocation start once its batch has access, so a
batch is kept small beside the copies. An allocation the range cannot take (its mapping refused there) is mapped
alone, as before."""
from __future__ import annotations

from contextlib import suppress
from dataclasses import dataclass, field
from typing import Iterable

from ..driver import DriverError
from ..vmm import Vmm

BATCH = 256 << 20   # bytes mapped on a GPU before one cuMemSetAccess gives access to all of them


@dataclass
class _Range:
    va: int
    size: int
    used: int = 0          # bytes of the range taken by mappings, from its start
    granted: int = 0       # bytes of it with access given, from its start
    also: tuple[int, ...] = ()
    waiting: list[tuple[object, int, int]] = field(default_factory=list)   # (item, va, bytes) mapped since the
    # last grant, in order


class Mappings:
    """sizes: {GPU: bytes this move maps there}, reserved as one range each on first use."""

    def __init__(self, vmm: Vmm, sizes: dict[int, int]) -> None:
        self.vmm, self._sizes = vmm, sizes
        self._ranges: dict[int, _Range | None] = {}   # GPU -> its range (None: reserving it failed: each alone)
        self._mapped: list[tuple[int, int, int]] = []   # (handle, va, bytes), in order
        self._alone: set[int] = set()                   # the vas of mappings with a range of their own

    def map(self, handle: int, size: int, dev: int, also: Iterable[int], item: object) -> tuple[int, list[object]]:
        """Map `handle` for `dev` (and the GPUs `also`: routes through neighbours). Returns its address, and the
        items (this and earlier ones on `dev`) whose memory is reachable now, in the order mapped; `item` stands for
        this one (what the caller wants back once it is reachable). Call flush(dev) after a GPU's last."""
        r = self._range(dev, tuple(also))
        if r is not None and r.used + size <= r.size:
            va = r.va + r.used
            try:
                self.vmm.map_at(va, handle, size)
            except DriverError:
                r = None   # this one alone, below
            else:
                r.used += size
                self._mapped.append((handle, va, size))
                r.waiting.append((item, va, size))
                return va, self.flush(dev) if r.used - r.granted >= BATCH else []
        va = self.vmm.map(handle, size, dev, also=also)
        self._mapped.append((handle, va, size))
        self._alone.add(va)
        return va, [*self.flush(dev), item]   # any waiting first: the caller gets them in order

    def flush(self, dev: int) -> list[object]:
        """Access given to what was mapped on `dev` since the last grant (one call); those items, in order."""
        r = self._ranges.get(dev)
        if r is None or r.used == r.granted:
            return []
        devs = [dev, *r.also]
        try:
            self.vmm.set_access(r.va + r.granted, r.used - r.granted, devs)
        except DriverError:   # refused over several allocations (unlike properties?): each on its own, as before
            for _item, va, size in r.waiting:
                self.vmm.set_access(va, size, devs)
        r.granted, waiting, r.waiting = r.used, r.waiting, []
        return [item for item, _va, _size in waiting]

    def all(self) -> list[tuple[int, int, int]]:
        """(handle, va, bytes) of each mapping made, in order."""
        return list(self._mapped)

    def unmap_one(self, va: int, size: int) -> None:
        """One mapping gone now (a two-way switch's allocation whose copy landed); its range stays reserved."""
        (self.vmm.unmap if va in self._alone else self.vmm.unmap_only)(va, size)

    def unmap(self, mapped: list[tuple[int, int, int]], release: bool) -> None:
        """`mapped` (of all()) unmapped, each handle released too where `release` (an import's: the fd keeps the
        memory), then the ranges freed; each step whatever the others did."""
        for h, va, size in mapped:
            with suppress(DriverError):
                self.unmap_one(va, size)
            if release:
                with suppress(DriverError):
                    self.vmm.release(h)
        for r in self._ranges.values():
            if r is not None:
                with suppress(DriverError):   # one left mapped (its unmap failed) keeps the range: never reused
                    self.vmm.free_range(r.va, r.size)
        self._ranges.clear()

    def _range(self, dev: int, also: tuple[int, ...]) -> _Range | None:
        if dev not in self._ranges:
            try:
                self._ranges[dev] = _Range(self.vmm.reserve(self._sizes[dev]), self._sizes[dev], also=also)
            except (DriverError, KeyError):
                self._ranges[dev] = None
        return self._ranges[dev]
