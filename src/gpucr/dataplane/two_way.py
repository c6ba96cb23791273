"""The mover's two-way switch (docs/swap.md): app A's memory copied out and app B's filled in at the same time, over
the one link, each direction on streams of its own. Each of A's allocations is given back as soon as its copy has
landed in staging (the server's mapping, handle and fd of it go, and A's agent closes its own: `give_back`), and
each of B's is made as soon as the GPU holds it (switch_schedule.Room), so B's memory is made and filled as A's is
released, instead of after the whole of A. A piece of A's of the very size, GPU and flags that one of B's needs is
not released at all: once A's agent has let go of it, B takes it over as it is (TakeOver), filled like new memory, so
neither the release nor the make runs beside the driver's checkpoint of A, which such work slowed by 0.35 s on an
H100 (scripts/driver_overlap.py, makes@child)."""
from __future__ import annotations

import os
import queue
import threading
from collections import Counter
from contextlib import suppress
from typing import Any, Callable

from ..driver import DriverError
from ..vmm import Vmm
from ..errors import GpucrError
from ..memory import Managed
from ..switch_schedule import Room, plan
from ..vmm import AllocFlags

OOM = "OUT_OF_MEMORY"
Key = tuple[str, int, AllocFlags]   # a piece's GPU (UUID), bytes and flags: what another must match to stand for it
BATCH = 64 << 20   # A's agent is told at least this often (bytes landed), not only when the copies outrun the thread


def key(m: Managed, size: int) -> Key:
    return (m.uuid, size, m.flags)


def kept_for_b(free: int, slack: int, ahead: int, behind: int, going: list[tuple[int, Key]],
               coming: list[Key]) -> dict[int, Key]:
    """Which of A's pieces (index, key, in copy-out order) B takes over, by index: for each key, as many as B has of
    it. But A's first pieces are released while what is free falls short of `ahead` (B's context, restored beside the
    copies: it must not wait for the end of A), and none is kept where what A releases (and `behind`, its context,
    last) would not make room for what B still makes (switch_schedule.plan on what is left: B's pieces wait for A's
    in order, never the other way)."""
    want = Counter(coming)
    short = ahead + slack - free
    keep: dict[int, Key] = {}
    for idx, k in going:
        if short > 0:
            short -= k[1]
        elif want[k] > 0:
            want[k] -= 1
            keep[idx] = k
    claimed = Counter(keep.values())
    fresh = []
    for k in coming:   # B claims in its fill order, as TakeOver.take does
        if claimed[k] > 0:
            claimed[k] -= 1
        else:
            fresh.append(k[1])
    try:
        plan(free, [k[1] for i, k in going if i not in keep] + [behind], [ahead] + fresh, slack)
    except GpucrError:
        return {}
    return keep


class TakeOver:
    """A's pieces that B takes over as they are (kept_for_b chose them), instead of A's being released and B's made.
    A piece is offered only once A's agent has let go of it (`give_back`): A's roll-back then makes it again from
    staging, never from memory B may have written. B's fill writes every byte of it (copies, and memsets for zero
    chunks) and checks its digests, as for new memory."""

    def __init__(self, vmm: Vmm, keep: dict[int, Key]) -> None:
        self.vmm, self._keep = vmm, keep
        self._slots = Counter(keep.values())
        self._claimed: Counter[Key] = Counter()
        self._ready: dict[Key, list[tuple[int, int]]] = {}   # (handle, fd) given back by A, not taken yet
        self._cv = threading.Condition()
        self._over = False   # A's copy out has ended: no more will come

    def keeps(self, idx: int) -> Key | None:
        """The key A's piece idx is kept under for B, or None: released as before."""
        return self._keep.get(idx)

    def offer(self, k: Key, handle: int, fd: int) -> None:
        with self._cv:
            self._ready.setdefault(k, []).append((handle, fd))
            self._cv.notify_all()

    def take(self, k: Key) -> tuple[int, int] | None:
        """A piece of A's for one of B's with key k (this server's handle of it and an fd of it, both B's now), waited
        for while A goes out; None where none is due (make one) or A's copy out ended without offering it."""
        with self._cv:
            if self._claimed[k] >= self._slots[k]:
                return None
            self._claimed[k] += 1
            while not self._ready.get(k) and not self._over:
                self._cv.wait()
            return self._ready[k].pop(0) if self._ready.get(k) else None

    def over(self) -> None:
        with self._cv:
            self._over = True
            self._cv.notify_all()

    def let_go(self) -> None:
        """Once both directions ended: the pieces offered and not taken (B's fill failed first) go."""
        with self._cv:
            left = [p for ps in self._ready.values() for p in ps]
            self._ready.clear()
        for h, fd in left:
            drop(self.vmm, h, fd)


def drop(vmm: Vmm, handle: int, fd: int | None) -> None:
    """This server's handle and fd of a piece let go (its memory goes once no one else holds it)."""
    with suppress(DriverError):
        vmm.release(handle)
    if fd is not None:
        os.close(fd)


class Landing:
    """The copy out's hooks (Mover._move's `switch`, out): each allocation's copies queued are marked with an event
    per stream; a thread waits for them in order, then lets go of the server's mapping, handle and fd of it, and
    tells A's agent to let go of its own (`give_back(upto)`: every allocation numbered below, batched: whatever has
    landed by then). Each give-back wakes B's waits (room.given). A piece `take_over` keeps is unmapped but not
    released: it is offered to B once A's agent has let go of it."""

    def __init__(self, vmm: Vmm, memory: list[Managed], give_back: Callable[[int], None], room: Room,
                 take_over: TakeOver | None = None) -> None:
        self.vmm, self._give_back, self._room = vmm, give_back, room
        self._take_over = take_over
        self._keeping: list[tuple[Key, int, int]] = []   # landed and kept for B, offered at the next give-back
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
                m = self._fds.get(idx)
                fd = m.fd if m is not None else None
                k = self._take_over.keeps(idx) if self._take_over is not None and fd is not None else None
                if k is not None:
                    self._keeping.append((k, h, fd))
                else:
                    self.vmm.release(h)
                    if fd is not None:
                        os.close(fd)
                self.released.add(h)
                if m is not None:
                    m.fd = None   # closed, or B's once offered
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
        finally:   # kept but never given back by A's agent: A's own again (its fds), so not B's
            for _k, h, fd in self._keeping:
                drop(self.vmm, h, fd)
            self._keeping.clear()

    def _hand(self, idx: int, pieces: int) -> None:
        self._room.leaving(pieces)   # counted gone before its memory can show as free (made_while_out)
        self._give_back(idx + 1)
        if self._take_over is not None:
            for k, h, fd in self._keeping:
                self._take_over.offer(k, h, fd)
            self._keeping.clear()
        self._room.given()

    def kept(self, mapped: list[tuple[int, int, int]]) -> list[tuple[int, int, int]]:
        """The copy out is over (every copy queued done, or it failed): the thread stopped once it has given back
        what landed, and what the server still maps of A, to undo as before (`error`: what the thread met)."""
        self._q.put(None)
        self._thread.join()
        return [m for m in mapped if m[0] not in self.released]


class Making:
    """The fill's hook (Mover._move's `switch`, in): each of B's allocations taken over from A (take_over), else made
    once `room` holds it; one the driver still refuses for memory (what A gave back not free yet) is tried again as
    A gives back more."""

    def __init__(self, room: Room, take_over: TakeOver | None = None) -> None:
        self.room, self.take_over = room, take_over

    def make(self, create: Callable[[], int], k: Key) -> tuple[int, int | None]:
        """(handle, fd): the fd of a piece taken over (B's, as is), None for one made here (to export)."""
        got = self.take_over.take(k) if self.take_over is not None else None
        if got is not None:
            self.room.took_over()
            return got
        return self.room.make(k[1], f"an allocation of {k[1] >> 20} MiB", create,
                              lambda exc: isinstance(exc, DriverError) and OOM in str(exc)), None


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
