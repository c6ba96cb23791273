"""The two-way switch's scheduler (docs/swap.md): on one GPU, app A's pieces go out while app B's come in, and
each of B's pieces is made as soon as the memory A gave back (and what was free) holds it.

Two parts, one rule: `plan` says, from the sizes alone, which of A's pieces (in their copy-out order) each of B's
waits for; `Room` applies the same rule as it happens, reading the GPU's free memory as the driver says (A's
pieces leave it only once both A's agent and the server let go of them) and keeping what is taken but not made yet
(its reservations) out of it, so that two takers (B's context at its driver restore, B's data at its fill) never
count the same bytes."""
from __future__ import annotations

import threading
import time
from contextlib import contextmanager
from typing import Callable, Iterator, TypeVar

from .errors import GpucrError

T = TypeVar("T")

LOOK_S = 0.01         # between looks at free memory while waiting (each piece given back also wakes the wait)
FREED_WAIT_S = 2.0    # once A has given back everything, how long memory may take to show as free


def plan(free: int, out: list[int], into: list[int], slack: int) -> list[int]:
    """For each of B's pieces `into` (bytes, in the order they are made), how many of A's pieces `out` (bytes, in
    the order they go out) must be given back before it may be made: the fewest k with free + sum(out[:k]) - (B's
    pieces made before it) >= its bytes + slack. GpucrError when even all of A does not make room for one."""
    waits: list[int] = []
    k, room = 0, free
    for n in into:
        while room < n + slack and k < len(out):
            room += out[k]
            k += 1
        if room < n + slack:
            raise GpucrError(f"a two-way switch cannot fit a piece of {n >> 20} MiB: {room >> 20} MiB would be free "
                             f"once everything of the app going out is given back")
        waits.append(k)
        room -= n
    return waits


class Room:
    """Memory on one GPU as the switch takes it: `taking(n)` waits until the driver's free memory, less what other
    takers hold reserved, holds n + slack, then reserves n while the caller makes it. `given()` wakes the waits (a
    piece of A left); `out_done()` says no more will (then a wait lasts FREED_WAIT_S more at most); `fail(exc)`
    ends every wait with that error (the other direction failed). Nothing is taken before `open()`: the copy out
    first makes what it needs itself (its scan's buffers), which B's pieces must not have taken already."""

    def __init__(self, free: Callable[[], int], slack: int, what: str = "the GPU", ahead: int = 0,
                 behind: int = 0) -> None:
        """ahead: bytes B's context takes at its driver restore, beside the copies; behind: bytes A's context frees at
        the end of its driver checkpoint (two_way.kept_for_b counts both)."""
        self._free, self.slack, self._what, self.ahead, self.behind = free, slack, what, ahead, behind
        self._cv = threading.Condition()
        self._reserved = 0
        self._open = False
        self._out_done_at: float | None = None
        self._failed: BaseException | None = None
        self.waited_s = 0.0   # time the takers spent waiting for A's memory
        self.out = 0          # A's pieces still on the GPU: not given back yet
        self.landing = 0      # bytes of them landed in staging, not given back yet
        self.made_while_out = 0   # B's pieces made while some of A's were still on the GPU: the switch overlapped

    def open(self) -> None:
        with self._cv:
            self._open = True
            self._cv.notify_all()

    def going_out(self, pieces: int) -> None:
        """A holds these pieces on the GPU, to go out."""
        with self._cv:
            self.out += pieces

    def landed_bytes(self, n: int) -> None:
        with self._cv:
            self.landing += n

    def leaving(self, pieces: int) -> None:
        """These pieces of A are being given back now (their memory shows as free from now on)."""
        with self._cv:
            self.out -= pieces
            self.landing = 0

    def given(self) -> None:
        """Memory of A left the GPU (its pieces, or its context): the waits look again."""
        with self._cv:
            self._cv.notify_all()

    def out_done(self) -> None:
        with self._cv:
            self._out_done_at = time.monotonic()
            self._open = True
            self._cv.notify_all()

    def took_over(self) -> None:
        """One of B's pieces is one of A's, taken over as it is (two_way.TakeOver): it overlapped where A's others are
        still out."""
        with self._cv:
            self.made_while_out += self.out > 0

    def fail(self, exc: BaseException) -> None:
        with self._cv:
            self._failed = exc
            self._cv.notify_all()

    def wait_given(self) -> None:
        """Until A gives back more, or a look's time: the driver refused what the count said fits (memory given back
        is not always free at once). GpucrError once everything of A was given back FREED_WAIT_S ago."""
        with self._cv:
            if self._failed is not None:
                raise GpucrError(f"the switch's other direction failed: {self._failed}")
            if self._out_done_at is not None and time.monotonic() - self._out_done_at > FREED_WAIT_S:
                raise GpucrError(f"the driver found no room on {self._what} once everything of the app going out "
                                 "was given back")
            self._cv.wait(LOOK_S)

    def free_now(self) -> int:
        return self._free()

    def short(self, n: int) -> int:
        """Bytes missing for n now (<= 0: it fits), reservations counted."""
        return n + self.slack + self._reserved - self._free()

    @contextmanager
    def taking(self, n: int, what: str, piece: bool = True) -> Iterator[None]:
        """n + slack free (less what others reserved), then n reserved while the caller makes it; `piece`: one of B's
        allocations (counted in made_while_out), not its context."""
        t0 = time.monotonic()
        with self._cv:
            while True:
                if self._failed is not None:
                    raise GpucrError(f"{what} not made: the switch's other direction failed: {self._failed}")
                missing = self.short(n)
                if missing <= 0 and self._open:
                    break
                if self._out_done_at is not None and time.monotonic() - self._out_done_at > FREED_WAIT_S:
                    raise GpucrError(f"{what} does not fit on {self._what}: {missing >> 20} MiB short once everything "
                                     "of the app going out was given back")
                self._cv.wait(LOOK_S)
            self._reserved += n
            self.made_while_out += piece and self.out > 0
        self.waited_s += time.monotonic() - t0
        try:
            yield
        finally:
            with self._cv:
                self._reserved -= n
                self._cv.notify_all()

    def make(self, n: int, what: str, create: Callable[[], T], short: Callable[[Exception], bool],
             piece: bool = True) -> T:
        """create() once n fits (taking), tried again after more of A is given back (wait_given) each time the driver
        refuses it for memory, as short(exc) says: memory given back is not always free at once."""
        while True:
            with self.taking(n, what, piece):
                try:
                    return create()
                except Exception as exc:
                    if not short(exc):
                        raise
            self.wait_given()
