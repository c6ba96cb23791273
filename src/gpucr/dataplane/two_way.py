"""The mover's two-way switch (docs/swap.md): app A's memory copied out and app B's filled in at the same time, over
the one link, each direction on streams of its own. Each of A's allocations is given back as soon as its copy has
landed in staging (the server's mapping, handle and fd of it go, and A's agent closes its own: `give_back`), and
each of B's is made as soon as the GPU holds it (switch_schedule.Room), so B's memory is made and filled as A's is
released, instead of after the whole of A."""
from __future__ import annotations

import os
import queue
import threading
from typing import Any, Callable

from ..driver import DriverError
from ..vmm import Vmm
from ..errors import GpucrError
from ..memory import Managed
from ..switch_schedule import Room

OOM = "OUT_OF_MEMORY"
BATCH = 64 << 20   # A's agent is told at least this often (bytes landed), not only when the copies outrun the thread


class Landing:
    """The copy out's hooks (Mover._move's `switch`, out): each allocation's copies queued are marked with an event
    per stream; a thread waits for them in order, then lets go of the server's mapping, handle and fd of it, and
    tells A's agent to let go of its own (`give_back(upto)`: every allocation numbered below, batched: whatever has
    landed by then). Each give-back wakes B's waits (room.given)."""

    def __init__(self, vmm: Vmm, memory: list[Managed], give_back: Callable[[int], None], room: Room) -> None:
        self.vmm, self._give_back, self._room = vmm, give_back, room
        self._fds = {m.index: m for m in memory}
        self._q: queue.Queue[tuple[int, int, int, int, int, list[int], Callable[[int, int], None]] | None] = \
            queue.Queue()
        self.released: set[int] = set()   # the server's handles of A let go here (never undone again)
        self.given = 0                    # allocations A's agent let go of
        self.error: BaseException | None = None
        # every allocation of A the copy moves is on the GPU until given back, queued or not: counting only those
        # queued read "none left" between two pieces whenever the landing kept up with the copy (made_while_out
        # said 0); one left to the driver (not movable) is never queued nor given back here
        room.going_out(sum(m.movable for m in memory))
        self._thread = threading.Thread(target=self._run, name="gpucr-switch-landing", daemon=True)
        self._thread.start()

    def queued(self, idx: int, h: int, va: int, size: int, ctx: int, streams: list[int],
               unmap: Callable[[int, int], None]) -> None:
        """unmap(va, size): how the copy out's mapping of it goes (mappings.py)."""
        events = []
        for s in streams:
            e = self.vmm.event()
            self.vmm.record(e, s)
            events.append(e)
        self._q.put((idx, h, va, size, ctx, events, unmap))
        self._room.open()   # the copy out has made all it needs: B's pieces may take what is free

    def _run(self) -> None:
        pending, landed = -1, 0   # the highest index landed but not yet given back by A's agent, and its bytes
        try:
            while True:
                item = self._q.get()
                if item is None:
                    break
                idx, h, va, size, ctx, events, unmap = item
                self.vmm.use(ctx)
                for e in events:
                    self.vmm.wait_event(e)
                    self.vmm.destroy_event(e)
                unmap(va, size)
                self.vmm.release(h)
                self.released.add(h)
                m = self._fds.get(idx)
                if m is not None and m.fd is not None:
                    os.close(m.fd)
                    m.fd = None
                pending, landed = idx, landed + 1
                self._room.landed_bytes(size)
                if self._q.empty() or self._room.landing >= BATCH:   # batched: whatever landed meanwhile
                    self._hand(pending, landed)
                    pending, landed = -1, 0
            if pending >= 0:
                self._hand(pending, landed)
        except (DriverError, GpucrError, OSError) as exc:
            self.error = exc
            self._room.fail(exc)

    def _hand(self, idx: int, pieces: int) -> None:
        self._room.leaving(pieces)   # counted gone before its memory can show as free (made_while_out)
        self._give_back(idx + 1)
        self._room.given()

    def kept(self, mapped: list[tuple[int, int, int]]) -> list[tuple[int, int, int]]:
        """The copy out is over (every copy queued done, or it failed): the thread stopped once it has given back
        what landed, and what the server still maps of A, to undo as before (`error`: what the thread met)."""
        self._q.put(None)
        self._thread.join()
        return [m for m in mapped if m[0] not in self.released]


class Making:
    """The fill's hook (Mover._move's `switch`, in): each of B's allocations made once `room` holds it; one the
    driver still refuses for memory (what A gave back not free yet) is tried again as A gives back more."""

    def __init__(self, room: Room) -> None:
        self.room = room

    def make(self, create: Callable[[], int], size: int) -> int:
        return self.room.make(size, f"an allocation of {size >> 20} MiB", create,
                              lambda exc: isinstance(exc, DriverError) and OOM in str(exc))


def both(out: Callable[[], Any], into: Callable[[], Any], room: Room,
         let_go: Callable[[Any], None] = lambda made: None) -> tuple[Any, Any]:
    """out() and into() at once (out on a thread of its own); each failure ends the other's waits for room. Returns
    both results, or raises the first failure once both have ended, after let_go(what into() made) where into()
    finished: its memory is no one's then (a copy out that failed once all of A was given back let the whole fill
    finish, and its fds were left open: the GPU kept that memory)."""
    got: dict[str, Any] = {}

    def run_out() -> None:
        try:
            got["out"] = out()
        except BaseException as exc:   # noqa: BLE001 - handed to the caller's thread below
            got["out_error"] = exc
            room.fail(exc)
        finally:
            room.out_done()
    t = threading.Thread(target=run_out, name="gpucr-switch-out", daemon=True)
    t.start()
    try:
        got["in"] = into()
    except BaseException as exc:   # noqa: BLE001 - raised once the copy out has ended too
        got["in_error"] = exc
    t.join()
    if "out_error" in got and "in" in got:
        let_go(got["in"])
    for key in ("out_error", "in_error"):
        if key in got:
            raise got[key]
    return got["out"], got["in"]
