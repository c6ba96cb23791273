"""One copy's routes through neighbour GPUs (links.py says which may lend their link): mechanism only.

Each neighbour gets a lane: SLOTS pieces of its own memory, a stream and an event per slot. A piece for a
neighbour is moved by the neighbour's copy engine between the host and a slot over its own host link, and
between the slot and the process's GPU over NVLink, both on the slot's stream, so the slot is reused in
order. A thread paces the pieces through the lanes as the mover hands them over (a restore's route starts
with the first allocation made, not after the last), waiting for a slot's last piece before reusing it:
at most SLOTS pieces are in flight per lane. The neighbour is looked at again before every piece; a lane
given up (a process appeared there) leaves little behind, and its pieces, like any no lane can take, go
straight over the process's own GPU's link.
"""
from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Iterable

from ..driver import DriverError
from ..vmm import Vmm
from .links import Links, Neighbour

SLOTS = 4    # pieces in flight through one neighbour (its memory while a copy runs: SLOTS x the piece size)

Context = Callable[[int], "tuple[int, list[int]]"]   # ordinal -> the server's (context, streams) there


@dataclass
class Lane:
    nb: Neighbour
    ctx: int = 0
    streams: list[int] = field(default_factory=list)
    slots: list[int] = field(default_factory=list)
    events: list[int] = field(default_factory=list)
    busy: list[bool] = field(default_factory=list)
    turn: int = 0


class Routing:
    """The lanes of one copy (one direction, every GPU of the process) and the thread that feeds them.
    routes / dropped: the caller's tallies, bytes through each neighbour by UUID and the neighbours given
    up mid-copy; filled in by the thread, to be read after finish()."""

    def __init__(self, vmm: Vmm, links: Links, context: Context, devs: set[int], uuids: dict[int, str], out: bool,
                 piece: int, routes: dict[str, int], dropped: list[str]) -> None:
        self.vmm, self.links, self.context, self.out, self.piece = vmm, links, context, out, piece
        self.routes, self.dropped = routes, dropped
        self.lanes = {d: [lane for nb in links.neighbours(d, uuids, devs) for lane in [Lane(nb)] if self._open(lane)]
                      for d in devs}
        self._feed: queue.SimpleQueue | None = queue.SimpleQueue() if self.used() else None
        self._failure: list[BaseException] = []
        self.looks_s = 0.0   # spent asking whether each neighbour is still idle (NVML), read after finish()
        self._thread: threading.Thread | None = None
        if self._feed is not None:
            self._thread = threading.Thread(target=self._run, name="gpucr-server-routes", daemon=True)
            self._thread.start()

    # ---- what the mover asks ----
    def used(self) -> list[int]:
        """The neighbours lending their link to this copy."""
        return sorted({lane.nb.dev for ls in self.lanes.values() for lane in ls})

    def share(self, dev: int) -> int:
        """1 + the lanes of GPU dev: every share-th piece of its memory goes straight."""
        return 1 + len(self.lanes.get(dev, []))

    def access(self, dev: int) -> list[int]:
        """The neighbours whose copy engines must reach GPU dev's mappings."""
        return [lane.nb.dev for lane in self.lanes.get(dev, [])]

    def put(self, dev: int, host: int, va: int, n: int) -> None:
        assert self._feed is not None
        self._feed.put((dev, host, va, n))

    def finish(self, quiet: bool = False) -> None:
        """No more pieces: wait until the thread has queued and completed every one; re-raise what it raised
        (quiet: swallow it, on a path already failing). Safe to call again."""
        if self._thread is not None:
            self._feed.put(None)
            self._thread.join()
            self._thread = None
        if self._failure and not quiet:
            raise self._failure.pop(0)

    def close(self) -> None:
        """The thread stopped, every lane's copies done (errors aside) and its slots and events freed."""
        self.finish(quiet=True)
        for lane in [x for ls in self.lanes.values() for x in ls]:
            self._close(lane)

    # ---- inside ----
    def _run(self) -> None:
        try:
            self._through(iter(self._feed.get, None))
        except BaseException as exc:   # handed to finish(); the pieces still fed are never copied: it fails
            self._failure.append(exc)

    def _through(self, pieces: Iterable[tuple[int, int, int, int]]) -> None:
        active = {d: list(ls) for d, ls in self.lanes.items()}
        turn: dict[int, int] = {}
        for dev, host, va, n in pieces:
            ls = active.get(dev, [])
            j = turn[dev] = turn.get(dev, -1) + 1
            lane = ls[j % len(ls)] if ls else None
            t = time.perf_counter()
            still = lane is None or self.links.idle(lane.nb)
            self.looks_s += time.perf_counter() - t
            if not still:
                self.dropped.append(lane.nb.uuid)
                ls.remove(lane)
                lane = ls[j % len(ls)] if ls else None
            if lane is None:
                ctx, streams = self.context(dev)
                self.vmm.use(ctx)
                s = streams[j % len(streams)]
                (self.vmm.d2h(host, va, n, s) if self.out else self.vmm.h2d(va, host, n, s))
                continue
            self._piece(lane, host, va, n)
            self.routes[lane.nb.uuid] = self.routes.get(lane.nb.uuid, 0) + n
        for lane in [x for ls in self.lanes.values() for x in ls if x.slots]:
            self.vmm.use(lane.ctx)
            for s in lane.streams:
                self.vmm.sync(s)

    def _open(self, lane: Lane) -> bool:
        """The lane's context, streams, slots and events on its neighbour; False (nothing kept) when the
        neighbour cannot give them (no memory left there, say)."""
        try:
            lane.ctx, lane.streams = self.context(lane.nb.dev)
            self.vmm.use(lane.ctx)
            while len(lane.slots) < SLOTS:
                lane.slots.append(self.vmm.alloc(self.piece))
                lane.events.append(self.vmm.event())
                lane.busy.append(False)
            return True
        except DriverError:
            self._close(lane)
            return False

    def _piece(self, lane: Lane, host: int, va: int, n: int) -> None:
        k = lane.turn % SLOTS
        lane.turn += 1
        self.vmm.use(lane.ctx)
        if lane.busy[k]:
            self.vmm.wait_event(lane.events[k])
        slot, s = lane.slots[k], lane.streams[k % len(lane.streams)]
        if self.out:
            self.vmm.d2d(slot, va, n, s)
            self.vmm.d2h(host, slot, n, s)
        else:
            self.vmm.h2d(slot, host, n, s)
            self.vmm.d2d(va, slot, n, s)
        self.vmm.record(lane.events[k], s)
        lane.busy[k] = True

    def _close(self, lane: Lane) -> None:
        if lane.ctx:
            try:
                self.vmm.use(lane.ctx)
                for s in lane.streams:
                    self.vmm.sync(s)
            except DriverError:
                pass
        for slot in lane.slots:
            try:
                self.vmm.free(slot)
            except DriverError:
                pass
        for ev in lane.events:
            try:
                self.vmm.destroy_event(ev)
            except DriverError:
                pass
        lane.slots, lane.events, lane.busy = [], [], []
