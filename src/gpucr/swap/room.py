"""Room on a GPU for one app (an allocation that failed, or its resume): others parked by the policy until it fits.

Requests on one GPU are served one at a time, highest priority first (queue.py). A request the policy cannot meet
now but could once an app's --min-resident runs out waits for that, up to its limit: so two apps that take turns
switch no more often than --min-resident allows, and an app sees no out-of-memory that waiting a moment would
have avoided. What is needed counts the server's own memory: a park on a GPU where the server holds no context
yet makes one there (its size measured, not assumed: GpuView.server_cost)."""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable, Protocol

from ..proc import process_ended
from .apps import Apps, SwapApp, now
from .policy import choose, ready_at
from .queue import RoomQueue

ROOM_SLACK = 2 << 20   # room asked beyond what is needed: the driver's granule, so the retry is not short by one
LOOK_EVERY_S = 0.5     # while waiting for a --min-resident: memory may also be freed by an app that ends
FREED_WAIT_S = 1.0     # after its parks, how long a request waits for the memory they gave back to show as free
FREED_LOOK_S = 0.02    # (within ~0.1 s on simcuda): a retry that came too soon would park one app more


class GpuView(Protocol):
    def memory(self, uuid: str) -> tuple[int, int] | None:
        """(free, total) bytes of the GPU as the driver says now; None when unknown."""

    def server_cost(self, uuid: str) -> int:
        """Bytes a park would add on this GPU for the server itself: 0 once its context is there."""

    def process_bytes(self, pid: int, status: dict[str, Any]) -> dict[str, int]:
        """{GPU uuid: bytes} process pid holds as the driver counts them, its context included."""

    def context_bytes(self, uuid: str) -> int:
        """Bytes a process's context takes on this GPU (an app's the driver could not make)."""


@dataclass(frozen=True)
class Ask:
    """What an app asks room for: `want` bytes more than free on GPU `uuid` (at least `at_least` to park, as when
    its resume failed short of what nothing counts: its context), said as `what`; waited for up to `wait_s`."""
    uuid: str
    want: int
    what: str
    wait_s: float
    free_hint: int = 0      # what the asker saw free, where the server cannot read the GPU's memory
    at_least: int = 0


class RoomMaker:
    def __init__(self, apps: Apps, park: Callable[[int, str], bool], log: Callable[[str], None], gpu: GpuView,
                 refresh: Callable[[list[SwapApp]], None] = lambda apps: None) -> None:
        """refresh(apps): their activity read now from their agents (the tick's is up to a second old), before the
        policy orders them by it."""
        self.apps, self._park, self._log, self._gpu, self._refresh = apps, park, log, gpu, refresh
        self.queue = RoomQueue()
        self._refused: dict[int, str] = {}   # pid -> why its last request found no room, as logged (said once)

    def make(self, asker: SwapApp, ask: Ask, switch: Callable[[SwapApp], bool] | None = None) -> bool:
        """Park others on the GPU for the asker, in its turn; False (nobody parked) when the policy finds too little,
        now and within ask.wait_s. Shown as the asker's wait in `gpucr ps` meanwhile. switch(app): where the policy
        parks one app, a two-way switch of it with the asker instead (True: done, the asker resumed; False: parked
        then as before)."""
        before = (asker.waiting, asker.waiting_since)   # (a resume that waits for room waits for its resume)
        asker.wait(f"room: {ask.what} on GPU {ask.uuid}")
        ahead = self.queue.queued(ask.uuid)
        if ahead:
            self._log(f"swap app {asker.name} (pid {asker.pid}) waits for room ({ask.what}) behind "
                      f"{', '.join(ahead)} on GPU {ask.uuid}")
        try:
            with self.queue.turn(ask.uuid, asker.name, asker.priority):
                return self._served(asker, ask, now() + ask.wait_s, switch)
        finally:
            asker.waiting, asker.waiting_since = before

    def short(self, ask: Ask) -> int:
        """Bytes the GPU is short of what is asked, now (<= 0: it fits)."""
        mem = self._gpu.memory(ask.uuid)
        free = mem[0] if mem is not None else ask.free_hint
        return ask.want + ROOM_SLACK - free + self._gpu.server_cost(ask.uuid)

    def _need(self, ask: Ask) -> int:
        return max(ask.at_least, self.short(ask))

    def _served(self, asker: SwapApp, ask: Ask, deadline: float, switch: Callable[[SwapApp], bool] | None) -> bool:
        said = False
        while True:
            if self._ended(asker):
                return False
            need = self._need(ask)
            if need <= 0:
                self._log(f"room for swap app {asker.name} (pid {asker.pid}): {ask.what} on GPU {ask.uuid}: "
                          "fits now, parked nobody")
                return True
            on_gpu = [a for a in self.apps.all() if ask.uuid in a.held or a.pid == asker.pid]
            self._refresh([a for a in on_gpu if a.pid != asker.pid])
            waits = self.queue.waits_on(ask.uuid)
            cands = [a.candidate(ask.uuid, waits.get(a.name, frozenset())) for a in on_gpu]
            me, at = asker.candidate(ask.uuid), now()
            choice = choose(cands, me, need, at)
            if choice.suffices:
                if switch is not None and len(choice.park) == 1 and switch({a.name: a for a in on_gpu}[choice.park[0]]):
                    self._refused.pop(asker.pid, None)
                    self._log(f"room for swap app {asker.name} (pid {asker.pid}): {ask.what} on GPU {ask.uuid}: "
                              f"switched both ways with {choice.park[0]}")
                    return True
                if self._ended(asker):   # (the switch failed as it died: it came in for nobody)
                    return False
                return self._park_chosen(asker, ask, choice.park, {a.name: a for a in on_gpu})
            ready = ready_at(cands, me, need, at)
            if ready is None or ready > deadline:
                self._refuse(asker, f"{ask.what} on GPU {ask.uuid}: {choice.why_not}{self._unparkable(ask.uuid, on_gpu)}")
                return False
            if not said:
                said = True
                self._log(f"swap app {asker.name} (pid {asker.pid}) waits for room ({ask.what}) on GPU {ask.uuid} "
                          f"{ready - at:.1f} s, until an app's --min-resident ends: {choice.why_not}")
            time.sleep(min(max(ready - now(), 0.0), LOOK_EVERY_S))

    def _ended(self, asker: SwapApp) -> bool:
        """The asker ended (killed while it waited): a park for it would free memory for nobody."""
        if not process_ended(asker.pid, asker.start_time):
            return False
        self._log(f"room for swap app {asker.name} (pid {asker.pid}): it ended, parked nobody")
        return True

    def _refuse(self, asker: SwapApp, why: str) -> None:
        """Said once per app and reason: a resume that waits asks again every half second."""
        if self._refused.get(asker.pid) != why:
            self._refused[asker.pid] = why
            self._log(f"no room for swap app {asker.name} (pid {asker.pid}): {why}")

    def _park_chosen(self, asker: SwapApp, ask: Ask, names: tuple[str, ...], by_name: dict[str, SwapApp]) -> bool:
        self._refused.pop(asker.pid, None)
        parked = [n for n in names if self._park(by_name[n].pid, f"room for {asker.name} ({ask.what})")]
        self._log(f"room for swap app {asker.name} (pid {asker.pid}): {ask.what} on GPU {ask.uuid}: "
                  f"parked {', '.join(parked) or 'nobody'}")
        if len(parked) != len(names):
            return False
        deadline = now() + FREED_WAIT_S   # what the parks gave back shows as free a moment later: the retry waits
        while self.short(ask) > 0 and now() < deadline:
            time.sleep(FREED_LOOK_S)
        return True

    def _unparkable(self, uuid: str, on_gpu: list[SwapApp]) -> str:
        """The GPU's memory held by no swap app of this server: its own, other processes', other users' (whose
        servers park them, never this one)."""
        mem = self._gpu.memory(uuid)
        if mem is None:
            return ""
        free, total = mem
        others = total - free - sum(a.held.get(uuid, 0) for a in on_gpu)
        return (f"; {others >> 20} MiB of the GPU are held by what this server cannot park (contexts, its own memory, "
                "processes not under its swap service, other users' among them)") if others > 0 else ""
