"""Which parked apps go from host memory to disk so that one more park fits the host budget (`gpucr serve
--host-budget`, issue 27 item 5): a pure function of what the server knows of the apps, no I/O.

The rule: the least recently used parked apps go first (the app that submitted work longest ago), only as many as
make room, and only apps parked in host memory (one being parked or resumed holds its staging, and counts, but
cannot be moved). When moving every one that may be moved would not make room, none is moved and the answer says why.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class InHost:
    """An app's host memory as the budget sees it: staging it holds (or a park has reserved)."""
    name: str
    host_bytes: int
    last_active: float    # the server's monotonic clock: when it last submitted work
    movable: bool = True  # parked in host memory, not being parked or resumed: it may go to disk


@dataclass(frozen=True)
class Spills:
    """The apps to move to disk (least recently used first), or none with the reason."""
    order: tuple[str, ...]
    to_free: int
    why_not: str = ""

    @property
    def suffices(self) -> bool:
        return not self.why_not


def to_disk(in_host: list[InHost], need: int, budget: int) -> Spills:
    """The apps to move to disk so that `need` more bytes fit `budget` beside what `in_host` hold."""
    to_free = sum(a.host_bytes for a in in_host) + need - budget
    if to_free <= 0:
        return Spills((), 0)
    if need > budget:
        return Spills((), to_free, f"it alone needs {need} bytes of host memory, more than --host-budget {budget}")
    chosen: list[str] = []
    freed = 0
    for a in sorted((a for a in in_host if a.movable and a.host_bytes > 0), key=lambda a: (a.last_active, a.name)):
        if freed >= to_free:
            break
        chosen.append(a.name)
        freed += a.host_bytes
    if freed < to_free:
        return Spills((), to_free, f"{to_free} bytes must leave host memory and the parked apps that may go to disk "
                                   f"hold {freed}")
    return Spills(tuple(chosen), to_free)
