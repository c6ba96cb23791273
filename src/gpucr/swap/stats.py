"""What the swap service counts of its switches, for the HTTP API's timeline, /metrics and `gpucr top`: each app's
parks and resumes (their times as a histogram, the bytes they moved and those they skipped, the last one's rate), its
refusals by reason, and the recent switches of every app. Kept as the switches happen, so a reader (a scrape, a page
refresh, a `top` tick) reads these counts and never asks an agent anything. An app's counts go when it does."""
from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

PARK, RESUME = "park", "resume"
DIRECTIONS = (PARK, RESUME)
# why a park or a room request did not happen: the label values of gpucr_app_refusals_total (docs/api.md)
PARK_FAILED, NO_HOST_ROOM, NO_ROOM, RESUME_FAILED = "park_failed", "no_host_room", "no_room", "resume_failed"
RESUME_RETRIED = "resume_retried"   # a try of a resume failed (short of memory, or else) and it was tried again
REFUSALS = (PARK_FAILED, NO_HOST_ROOM, NO_ROOM, RESUME_FAILED, RESUME_RETRIED)
# a switch's time, seconds: from a small app's tens of milliseconds to a card's worth at a slow link
SWITCH_BUCKETS_S = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
RECENT_SWITCHES = 200


@dataclass(frozen=True)
class Switch:
    """One park or resume that happened."""
    app: str
    direction: str
    at: float              # wall clock (seconds since the epoch) when it began
    seconds: float
    bytes_moved: int
    bytes_skipped: int     # of bytes_moved, zero chunks not copied over the link
    control_s: float | None = None   # the driver's part (control out at a park, in at a resume), beside the copy
    two_way: bool = False  # one side of a two-way switch: this app's park and another's resume at once
    phases_s: dict[str, float] = field(default_factory=dict)   # where its time went: its result's phases

    def row(self) -> dict[str, Any]:
        return {"app": self.app, "direction": self.direction, "at": round(self.at, 3), "seconds": round(self.seconds, 4),
                "bytes_moved": self.bytes_moved, "bytes_skipped": self.bytes_skipped,
                "control_s": None if self.control_s is None else round(self.control_s, 4), "two_way": self.two_way,
                "phases_s": {k: round(v, 4) for k, v in self.phases_s.items()},
                "bytes_per_second": round(self.bytes_moved / self.seconds) if self.seconds > 0 else None}


@dataclass
class AppCounts:
    """One app's counts since it registered."""
    switches: dict[str, int] = field(default_factory=lambda: dict.fromkeys(DIRECTIONS, 0))
    seconds: dict[str, float] = field(default_factory=lambda: dict.fromkeys(DIRECTIONS, 0.0))
    buckets: dict[str, list[int]] = field(default_factory=lambda: {d: [0] * len(SWITCH_BUCKETS_S) for d in DIRECTIONS})
    bytes_moved: dict[str, int] = field(default_factory=lambda: dict.fromkeys(DIRECTIONS, 0))
    bytes_skipped: dict[str, int] = field(default_factory=lambda: dict.fromkeys(DIRECTIONS, 0))
    last: dict[str, Switch] = field(default_factory=dict)
    refusals: dict[str, int] = field(default_factory=lambda: dict.fromkeys(REFUSALS, 0))

    def add(self, s: Switch) -> None:
        d = s.direction
        self.switches[d] += 1
        self.seconds[d] += s.seconds
        for i, bound in enumerate(SWITCH_BUCKETS_S):
            if s.seconds <= bound:
                self.buckets[d][i] += 1   # per bucket, not cumulative: the reader adds them up
                break
        self.bytes_moved[d] += s.bytes_moved
        self.bytes_skipped[d] += s.bytes_skipped
        self.last[d] = s

    def row(self) -> dict[str, Any]:
        """As the swap view carries it: the histogram's buckets cumulative, as Prometheus reads them."""
        cumulative = {d: [sum(self.buckets[d][:i + 1]) for i in range(len(SWITCH_BUCKETS_S))] for d in DIRECTIONS}
        return {"switches": dict(self.switches), "switch_seconds_sum": {d: round(v, 6) for d, v in self.seconds.items()},
                "switch_seconds_buckets": cumulative, "bytes_moved": dict(self.bytes_moved),
                "bytes_skipped": dict(self.bytes_skipped), "refusals": dict(self.refusals),
                "last_park_at": _at(self.last.get(PARK)), "last_resume_at": _at(self.last.get(RESUME)),
                "last_bytes_per_second": {d: s.row()["bytes_per_second"] for d, s in self.last.items()}}


def _at(s: Switch | None) -> float | None:
    return round(s.at, 3) if s is not None else None


def _process(result: Any) -> Any:
    """The one process of a park's or resume's result (the coordinator's CheckpointResult or RestoreResult), or None
    for a result that says nothing."""
    procs = getattr(result, "processes", None) or []
    return procs[0] if procs else None


def moved_of(result: Any) -> tuple[int, int]:
    """(bytes moved, bytes skipped) of a park's or resume's result; (0, 0) for a result that says nothing. A resume
    skips what its image held as zero chunks; from host memory the result does not say, and 0 is counted."""
    p = _process(result)
    if p is None:
        return 0, 0
    skipped = getattr(p, "bytes_zero_skipped", None)
    if skipped is not None:   # a park: what the staging held already was not copied either
        skipped += getattr(p, "bytes_unchanged_skipped", 0)
    else:
        image = getattr(p, "image", None)
        skipped = (image.bytes_zeroed or 0) if image is not None else 0
    return int(p.bytes_moved), int(skipped)


def counted_of(result: Any) -> dict[str, int]:
    """{GPU uuid: bytes} the process held on each GPU before a park, as the driver counted it (its context included),
    from the park's own result (the coordinator's CheckpointResult, one process); {} where it does not say."""
    changes = getattr(_process(result), "gpus", None) or []
    return {c.uuid: int(c.process_before_bytes) for c in changes if c.process_before_bytes}


def control_of(result: Any, direction: str) -> float | None:
    """The driver's control time of a park's or resume's result (its phases control_out / control_in, level full;
    a swap bench sets each switch against it), or None where the result does not say."""
    return phases_of(result).get("control_out" if direction == PARK else "control_in")


def phases_of(result: Any) -> dict[str, float]:
    """The seconds of each phase of a park's or resume's result ({} where it does not say)."""
    return dict(getattr(_process(result), "phases_s", None) or {})


@dataclass(frozen=True)
class Began:
    """When a switch began: the wall clock for its timeline (the bench matches it against its requests' arrivals, so
    it is read at the start: the end's wall clock less a monotonic duration drifts by milliseconds while NTP slews)
    and the monotonic clock for its duration."""
    wall: float = field(default_factory=time.time)
    mono: float = field(default_factory=time.monotonic)

    def seconds(self) -> float:
        return time.monotonic() - self.mono


class SwitchStats:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._apps: dict[int, AppCounts] = {}
        self._recent: deque[Switch] = deque(maxlen=RECENT_SWITCHES)

    def switched(self, pid: int, name: str, direction: str, began: Began, result: Any, two_way: bool = False) -> None:
        """A park or resume of app `name` (process pid), begun at `began` and done just now, with the coordinator's
        result; two_way: one side of a two-way switch (its bytes_moved is this side's way)."""
        moved, skipped = moved_of(result)
        s = Switch(name, direction, began.wall, began.seconds(), moved, skipped, control_of(result, direction), two_way,
                   phases_of(result))
        with self._lock:
            self._apps.setdefault(pid, AppCounts()).add(s)
            self._recent.append(s)

    def refused(self, pid: int, reason: str) -> None:
        """A park that did not happen, or room that was not found, for app pid; reason: one of REFUSALS."""
        with self._lock:
            self._apps.setdefault(pid, AppCounts()).refusals[reason] += 1

    def forget(self, pid: int) -> None:
        """The app is gone: its counts with it (its recent switches stay in the timeline)."""
        with self._lock:
            self._apps.pop(pid, None)

    def row(self, pid: int) -> dict[str, Any]:
        with self._lock:
            return (self._apps.get(pid) or AppCounts()).row()

    def recent(self, limit: int = RECENT_SWITCHES) -> list[dict[str, Any]]:
        """The last `limit` switches of every app, oldest first."""
        with self._lock:
            return [s.row() for s in list(self._recent)[-limit:]] if limit > 0 else []
