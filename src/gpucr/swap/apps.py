"""What the server knows of each app under `gpucr run --swap`, updated on events (its registration, each status
the server reads of it anyway, each park, demand and resume), never by asking its agent on a tick of its own."""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any

from ..errors import GpucrError
from .policy import Candidate

RESIDENT, PARKING, PARKED, RESUMING, ON_DISK = "resident", "parking", "parked", "resuming", "on disk"
STATES = (RESIDENT, PARKING, PARKED, RESUMING, ON_DISK)
NAME_MAX = 64
PARK_DEADLINE_S = 30.0   # default: a park whose gate has not drained by then is given up, the app stays resident


def now() -> float:
    """The server's clock: CLOCK_MONOTONIC, the clock of the agent's gpucr_now_ns too (one clock per host)."""
    return time.monotonic()


@dataclass
class SwapApp:
    pid: int
    start_time: int                  # with pid, names the process (a reused pid is another app)
    name: str
    priority: int = 0
    min_resident_s: float = 0.0
    idle_park_s: float | None = None
    park_deadline_s: float = PARK_DEADLINE_S   # its calls in flight must drain by then, or it stays resident
    wait_limit_s: float | None = None   # its agent ends a wait for room or resume after this (an allocation's OOM)
    state: str = RESIDENT
    held: dict[str, int] = field(default_factory=dict)   # GPU uuid -> bytes held now
    peak: dict[str, int] = field(default_factory=dict)   # GPU uuid -> the most it held
    parked_bytes: dict[str, int] = field(default_factory=dict)   # GPU uuid -> what it held when last parked
    last_submit: float = 0.0         # server clock; its registration until its first submission is seen
    resident_since: float = 0.0
    parks: int = 0
    resumes: int = 0
    last_wake_ms: float | None = None   # from its demanding call to the start of its restore, the last time
    why: str = ""                    # the last refusal or failure, shown beside its state
    waiting: str = ""                # what it waits for now (room, or its resume), shown in `gpucr ps`
    waiting_since: float = 0.0
    cuda: bool = False               # its agent said it has loaded CUDA (it can be parked and watched)
    ordinals: dict[int, str] = field(default_factory=dict)   # its device ordinal -> GPU uuid
    watched: bool = False            # the service keeps a watch on its agent
    any_gpu: bool = False            # it may be resumed on another GPU with room (--any-gpu)
    park_level: str = "full"         # what its park saves (--park-level): full (its context too) or data
    host_bytes: int = 0              # host memory its parked data holds (or a park of it has reserved): the budget's
    vmm_bytes: int = 0               # what its park copies into host memory (its agent's VMM count, all GPUs)
    image: str | None = None         # on disk: the image its data is in
    demand_ns: int = 0               # its agent's last status: a demand waiting at its closed gate since (0: none)
    watch_saw_ns: int = 0            # the last demand its watch (or the net for lost wakes) acted on
    missed_wakes: int = 0            # demands its watch missed, found by the net in the status the server reads
    watch_restarts: int = 0          # its watch ended while it lived, and was started again

    def idle_s(self, at: float) -> float:
        return max(0.0, at - self.last_submit)

    def candidate(self, uuid: str, waits_on: frozenset[str] = frozenset()) -> Candidate:
        """As the policy sees it on one GPU."""
        return Candidate(self.name, self.priority, self.state, self.held.get(uuid, 0), self.last_submit,
                         self.resident_since, self.min_resident_s, waits_on)

    def wait(self, what: str) -> None:
        """It waits for `what` from now (shown until done_waiting)."""
        self.waiting, self.waiting_since = what, now()

    def done_waiting(self) -> None:
        self.waiting, self.waiting_since = "", 0.0

    def row(self, at: float) -> dict[str, Any]:
        """What `gpucr ps` and `serve --status --json` show of it."""
        return {"name": self.name, "pid": self.pid, "priority": self.priority, "state": self.state,
                "held_bytes": dict(self.held), "peak_bytes": dict(self.peak), "idle_s": round(self.idle_s(at), 3),
                "min_resident_s": self.min_resident_s, "idle_park_s": self.idle_park_s, "parks": self.parks,
                "resumes": self.resumes, "last_wake_ms": self.last_wake_ms, "why": self.why,
                "park_deadline_s": self.park_deadline_s, "wait_limit_s": self.wait_limit_s, "waiting": self.waiting,
                "waiting_s": round(at - self.waiting_since, 3) if self.waiting else None, "any_gpu": self.any_gpu,
                "park_level": self.park_level, "host_bytes": self.host_bytes, "image": self.image,
                "missed_wakes": self.missed_wakes, "watch_restarts": self.watch_restarts}


class Apps:
    """The registry, one lock; every change is an event the server saw."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by_pid: dict[int, SwapApp] = {}

    def add(self, app: SwapApp) -> None:
        with self._lock:
            taken = next((a for a in self._by_pid.values() if a.name == app.name and a.pid != app.pid), None)
            if taken is not None:
                raise GpucrError(f"a swap app named {app.name!r} runs already (pid {taken.pid}); give another --name")
            at = now()
            app.last_submit = app.last_submit or at
            app.resident_since = app.resident_since or at
            self._by_pid[app.pid] = app

    def drop(self, pid: int) -> SwapApp | None:
        with self._lock:
            return self._by_pid.pop(pid, None)

    def get(self, pid: int) -> SwapApp | None:
        with self._lock:
            return self._by_pid.get(pid)

    def all(self) -> list[SwapApp]:
        with self._lock:
            return list(self._by_pid.values())

    def rows(self) -> list[dict[str, Any]]:
        at = now()
        with self._lock:
            return [a.row(at) for a in sorted(self._by_pid.values(), key=lambda a: a.name)]

    def by_name(self, name: str) -> SwapApp | None:
        with self._lock:
            return next((a for a in self._by_pid.values() if a.name == name), None)

    def update(self, pid: int, changes: dict[str, Any]) -> SwapApp | None:
        """Some of its policy's fields set (priority, min_resident_s, idle_park_s), under the registry's lock."""
        with self._lock:
            app = self._by_pid.get(pid)
            for k, v in changes.items() if app is not None else ():
                setattr(app, k, v)
            return app

    def set_state(self, pid: int, state: str, why: str = "") -> SwapApp | None:
        with self._lock:
            app = self._by_pid.get(pid)
            if app is not None:
                if state == PARKING:   # a new closed period: a demand read of an earlier one is not this one's
                    app.demand_ns = 0
                app.state, app.why = state, why
                if state == RESIDENT:
                    app.resident_since = now()
                    if not any(app.held.values()):   # back: what it held when parked, until its next status says
                        app.held = dict(app.parked_bytes)
                elif state == PARKED and any(app.held.values()):
                    app.parked_bytes, app.held = dict(app.held), dict.fromkeys(app.held, 0)
            return app

    def parked_counts(self, pid: int, counted: dict[str, int]) -> None:
        """Parked: what its park's own result says it held on each GPU (the driver's count, its context included), where
        that is more than the service had read of it (an app parked before its memory was read held "nothing")."""
        with self._lock:
            app = self._by_pid.get(pid)
            if app is None or app.state != PARKED:
                return
            for uuid, n in counted.items():
                if n > app.parked_bytes.get(uuid, 0):
                    app.parked_bytes[uuid] = n
                    app.held[uuid] = 0
                    app.peak[uuid] = max(app.peak.get(uuid, 0), n)

    def moved(self, pid: int, moves: dict[str, str]) -> None:
        """Its GPUs moved at a resume ({old UUID: new UUID}): what it held on each is now held on the other."""
        with self._lock:
            app = self._by_pid.get(pid)
            if app is not None and moves:
                app.parked_bytes = {moves.get(u, u): n for u, n in app.parked_bytes.items()}
                app.held = {moves.get(u, u): n for u, n in app.held.items()}
                app.ordinals = {d: moves.get(u, u) for d, u in app.ordinals.items()}

    def observe(self, pid: int, status: dict[str, Any], counted: dict[str, int] | None = None) -> None:
        """An agent's status the server read (for any reason): its memory per GPU and its last submission. counted:
        {uuid: bytes} the driver counts the process holds, its context included (the agent counts its allocations)."""
        with self._lock:
            app = self._by_pid.get(pid)
            if app is None:
                return
            swap = status.get("swap") or {}
            last_ns = int(swap.get("last_submit_ns") or 0)
            if last_ns:
                app.last_submit = max(app.last_submit, last_ns / 1e9)
            app.cuda = bool(status.get("cuda"))
            if app.state in (PARKED, ON_DISK):   # the net for lost wakes looks at it (SwapService.tick)
                app.demand_ns = int(swap.get("demand_ns") or 0)
            if status.get("state") != "running" or app.state in (PARKING, PARKED):
                return   # parked: what it held is in host memory; the agent still lists the sizes
            app.vmm_bytes = sum(int(d.get("vmm_bytes") or 0) for d in status.get("devices") or [])
            for d in status.get("devices") or []:
                uuid = str(d.get("uuid", ""))
                app.ordinals[int(d.get("ordinal", 0))] = uuid
                held = max(int(d.get("vmm_bytes") or 0) + int(d.get("driver_bytes") or 0), (counted or {}).get(uuid, 0))
                app.held[uuid] = held
                app.peak[uuid] = max(app.peak.get(uuid, 0), held)
