"""Whom to park to make room on a GPU: a pure function of what the server knows of the apps on it.

The rules (issue 27, "Room on demand"): lower priority first, then the fewest that make room, the least recently
active first (a park costs a switch each way, whatever its size); never one of
higher priority than the asker, never one inside its --min-resident, never the asker, never one waiting on
the asker (parking it would deadlock the two); only resident apps hold memory that parking frees. When the
apps that may be parked cannot free enough together, nobody is parked and the answer says why.
"""
from __future__ import annotations

from dataclasses import dataclass, field

RESIDENT = "resident"


@dataclass(frozen=True)
class Candidate:
    """One app on the GPU, as the policy sees it. Times are seconds on one clock (the server's monotonic)."""
    name: str
    priority: int
    state: str
    held_bytes: int
    last_active: float
    resident_since: float
    min_resident_s: float = 0.0
    waits_on: frozenset[str] = field(default_factory=frozenset)   # apps this one waits on (for room or resume)

    @property
    def resident_until(self) -> float:
        """When its --min-resident ends: one sum, so that the rule and ready_at's tries agree to the last bit."""
        return self.resident_since + self.min_resident_s


@dataclass(frozen=True)
class Choice:
    """Whom to park (in order), or nobody with the reason."""
    park: tuple[str, ...]
    freed_bytes: int
    why_not: str = ""

    @property
    def suffices(self) -> bool:
        return not self.why_not


def _refusal(c: Candidate, asker: Candidate, now: float) -> str | None:
    """Why c may not be parked for the asker, or None when it may."""
    if c.name == asker.name:
        return "it is the asker"
    if c.state != RESIDENT:
        return f"it is {c.state}"
    if c.held_bytes <= 0:
        return "it holds no GPU memory"
    if c.priority > asker.priority:
        return f"its priority {c.priority} is above the asker's {asker.priority}"
    if now < c.resident_until:
        return f"it is inside its --min-resident of {c.min_resident_s:g} s"
    if asker.name in c.waits_on:
        return "it waits on the asker"
    return None


def _fewest(pool: list[Candidate], need: int) -> list[Candidate]:
    """The fewest of pool (in the order given: the least recently active first) that free need bytes together; of
    the sets that few, the one whose apps come first in that order. pool together frees need or more."""
    k = next(i for i in range(1, len(pool) + 1)
             if sum(sorted((c.held_bytes for c in pool), reverse=True)[:i]) >= need)
    chosen: list[Candidate] = []
    left = need
    for i, c in enumerate(pool):
        slots = k - len(chosen)
        if slots == 0 or left <= 0:
            break
        rest = sorted((d.held_bytes for d in pool[i + 1:]), reverse=True)[:slots - 1]
        if c.held_bytes + sum(rest) >= left:   # with c, the slots left can still make up the rest
            chosen.append(c)
            left -= c.held_bytes
    return chosen


def choose(apps: list[Candidate], asker: Candidate, need_bytes: int, now: float) -> Choice:
    """The apps to park until need_bytes are freed: lower priority first (a priority is touched only when all of
    those below it would not free enough), and of a priority the fewest apps that make room, the least recently
    active first; then any parked app that turns out not to be needed is kept (the fewest in all).
    need_bytes <= 0 parks nobody. Nobody is parked when the apps that may be cannot free enough."""
    if need_bytes <= 0:
        return Choice((), 0)
    allowed = [c for c in apps if _refusal(c, asker, now) is None]
    allowed.sort(key=lambda c: (c.priority, c.last_active, c.name))
    freed = sum(c.held_bytes for c in allowed)
    if freed < need_bytes:
        kept = [f"{c.name} ({why})" for c in apps
                if (why := _refusal(c, asker, now)) is not None and c.name != asker.name]
        why = (f"parking every app that may be parked frees {freed} of the {need_bytes} bytes asked"
               + (f"; not parked: {', '.join(kept)}" if kept else ""))
        return Choice((), 0, why)
    chosen: list[Candidate] = []
    left = need_bytes
    for prio in sorted({c.priority for c in allowed}):
        pool = [c for c in allowed if c.priority == prio]
        if sum(c.held_bytes for c in pool) < left:
            chosen += pool
            left -= sum(c.held_bytes for c in pool)
            continue
        chosen += _fewest(pool, left)
        break
    for c in sorted(chosen, key=lambda c: (-c.priority, -c.last_active, c.name)):   # the last to go, first kept
        if sum(d.held_bytes for d in chosen) - c.held_bytes >= need_bytes:
            chosen.remove(c)
    return Choice(tuple(c.name for c in chosen), sum(c.held_bytes for c in chosen))


def ready_at(apps: list[Candidate], asker: Candidate, need_bytes: int, now: float) -> float | None:
    """The earliest time from `now` at which choose() would find enough, should nothing but time change: only an
    app's --min-resident runs out with time, so only those ends are tried. None when waiting would not help (the
    apps that block are of higher priority, waiting on the asker, not resident, or hold too little)."""
    ends = sorted({now} | {c.resident_until for c in apps if c.resident_until > now})
    return next((t for t in ends if choose(apps, asker, need_bytes, t).suffices), None)
