"""Room requests on one GPU, served one at a time in priority order (issue 27, "Room on demand"): the highest
priority first, then the first come. Each GPU has its own queue; a request waits only for those of its GPU."""
from __future__ import annotations

import itertools
import threading
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Iterator


@dataclass(order=True, frozen=True)
class _Ticket:
    order: tuple[int, int]   # (-priority, arrival): the smallest is served next
    name: str = field(compare=False)


class RoomQueue:
    def __init__(self) -> None:
        self._cv = threading.Condition()
        self._queued: dict[str, list[_Ticket]] = {}    # GPU uuid -> requests waiting for their turn
        self._serving: dict[str, _Ticket] = {}          # GPU uuid -> the request being served
        self._arrivals = itertools.count()

    @contextmanager
    def turn(self, uuid: str, name: str, priority: int) -> Iterator[None]:
        """Held while app `name`'s request is served on GPU uuid; entered once every request before it is done."""
        ticket = _Ticket((-priority, next(self._arrivals)), name)
        with self._cv:
            queued = self._queued.setdefault(uuid, [])
            queued.append(ticket)
            self._cv.wait_for(lambda: uuid not in self._serving and min(queued) is ticket)
            queued.remove(ticket)
            self._serving[uuid] = ticket
        try:
            yield
        finally:
            with self._cv:
                del self._serving[uuid]
                self._cv.notify_all()

    def waits_on(self, uuid: str) -> dict[str, frozenset[str]]:
        """For each app whose request waits on GPU uuid: the apps it waits on (the one served and those before it).
        The policy never parks one of them for an app it waits on: that would deadlock the two."""
        with self._cv:
            serving = self._serving.get(uuid)
            queued = sorted(self._queued.get(uuid, []))
            ahead = [serving.name] if serving is not None else []
            out: dict[str, frozenset[str]] = {}
            for t in queued:
                out[t.name] = frozenset(ahead)
                ahead.append(t.name)
            return out

    def queued(self, uuid: str) -> list[str]:
        """The apps whose requests wait on GPU uuid, in the order they will be served."""
        with self._cv:
            return [t.name for t in sorted(self._queued.get(uuid, []))]
