"""The server's swap service: apps register (`gpucr run --swap`); an idle one is parked; a parked one is resumed at
its first demanding call; an allocation short of memory gets room by parking others (room.py), and so does a
resume; one that ends is dropped, its staging let go.

The server lends its own park and resume (its data plane, as `gpucr checkpoint` and `restore` through it); this
module decides when, and keeps the registry (apps.py). Each app is watched through one connection to its agent
(`watch`), answered when a demanding call meets its closed gate, an allocation asks for room, or someone else
opens its gate: no polling, one answer per event (docs/swap.md).
"""
from __future__ import annotations

import os
import threading
import time
import traceback
from pathlib import Path
from typing import Any, Callable

from .. import proc
from .. import target as targets
from ..coordinator import NotTwoWay
from ..errors import GpucrError
from ..levels import LEVELS
from .apps import NAME_MAX, ON_DISK, PARK_DEADLINE_S, PARKED, PARKING, RESIDENT, RESUMING, Apps, SwapApp, now
from .disk import HostThenDisk, ParkDir
from .limits import RateLimit
from .placement import GpuRoom, place
from .room import ROOM_SLACK, Ask, GpuView, RoomMaker
from .stats import (NO_HOST_ROOM, NO_ROOM, PARK, PARK_FAILED, RESUME, RESUME_FAILED, RESUME_RETRIED, Began, SwitchStats,
                    counted_of)

WATCH_FOREVER_S = 10 * 365 * 86400.0   # a watch lasts until its app needs us; the app's end or ours closes it
WATCH_RESTART_S = (0.2, 0.5, 1.0, 2.0, 5.0)   # a watch that ended while its app lives starts again after these
MISSED_DEMAND_S = 1.0   # a parked app's demand no watch acted on for this long is a lost wake: the net resumes it
ROOM_MADE, ROOM_NONE = 1, 2   # the verdict the next watch carries to the agent (gate.c)
ROOM_WAIT_S = 50.0     # the longest a room request waits for a --min-resident to end (the agent waits 60 s)
RESUME_RETRY_S = 0.5   # a resume short of memory with nobody to park: memory just given back may not be free yet
RESUME_GIVE_UP_S = 30.0   # a resume failing for anything but memory is tried again this long, then left to a person
PRIORITY_MAX = 1000
SECONDS_MAX = 30 * 86400   # the longest a --min-resident, --idle-park and the like may be


def _reason(exc: Exception) -> str:
    return str(exc) if isinstance(exc, GpucrError) else f"{type(exc).__name__}: {exc}"


def _log_internal(log: Callable[[str], None], exc: Exception) -> None:
    """An error that is not gpucr's own (GpucrError: said in one line) is a defect: its traceback goes to the log."""
    if not isinstance(exc, GpucrError):
        log("internal error:\n" + "".join(traceback.format_exception(exc)).rstrip())


def _seconds(v: Any, what: str, allow_none: bool = False) -> float | None:
    if v is None and allow_none:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v <= SECONDS_MAX:
        raise ValueError(f"{what} must be a number of seconds from 0 to 30 days, not {v!r}")
    return float(v)


def _priority(v: Any) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or abs(v) > PRIORITY_MAX:
        raise ValueError(f"priority must be a whole number from -{PRIORITY_MAX} to {PRIORITY_MAX}, not {v!r}")
    return v


def _short_of_memory(exc: Exception) -> bool:
    """The restore was short of GPU memory: refused up front by its room check, its context refused by the driver,
    or its data not made ("data in": out of memory), half way. Room is made for each alike."""
    said = str(exc)
    return isinstance(exc, GpucrError) and ("not enough free GPU memory" in said or "OUT_OF_MEMORY" in said
                                            or "out of memory" in said.lower())


def _no_disk(pid: int, image: Path) -> None:
    raise GpucrError("this server writes no images")


class SwapService:
    def __init__(self, park: Callable[[int, float, str], Any], resume: Callable[..., Any], log: Callable[[str], None],
                 gpu: GpuView, let_go: Callable[[int], None] = lambda pid: None,
                 machine: Callable[[], list[tuple[str, str]]] = list, write_image: Callable[[int, Path], Any] = _no_disk,
                 host_budget: int | None = None, park_dir: str | None = None,
                 switch: Callable[..., Any] | None = None) -> None:
        """park(pid, deadline_s, level) / resume(pid, image=, gpu_map=, drop_staging=): the server's checkpoint and restore of
        one process (raise on failure, return the coordinator's result); gpu: the GPUs' memory as the driver says; let_go(pid): the server's hold on an
        ended app's staging dropped; machine(): the machine's GPUs as (UUID, chip name); write_image(pid, dir): the
        server's move of a parked process's data to an image (disk.py), past `host_budget` bytes of parked data in
        host memory. switch(out_pid, in_pid, deadline_s, level, drop_staging): the server's two-way switch (one app
        parked while another resumes, coordinator.switch: (checkpoint result, restore result, its own numbers)), used
        where a resume needs room that parking one app gives; None: every switch is one-way, a park then a resume."""
        self.apps = Apps()
        self._switch = switch
        self._one_way: set[int] = set()   # apps whose two-way switch failed: their next tries park, then resume
        self._park, self._resume, self._log, self._let_go = park, resume, log, let_go
        self._gpu, self._machine = gpu, machine
        self.room = RoomMaker(self.apps, self.park, log, gpu, self._read_now)
        self.limit = RateLimit()
        self.stats = SwitchStats()   # what readers of the service see of its switches (the HTTP API, /metrics, top)
        self._turns: dict[int, threading.Lock] = {}   # per app: one park or resume at a time
        self._turns_lock = threading.Lock()
        self.disk = HostThenDisk(host_budget, ParkDir(park_dir), self.apps, self._turn, write_image, log)
        self._watches: dict[int, Any] = {}             # pid -> the agent connection its watch waits on
        self._stopping = False

    # ---- registration (the server's `swap_register` request) ----

    @staticmethod
    def registration(args: dict[str, Any]) -> SwapApp:
        """A registration's args checked (ValueError: malformed), as the app it registers (its start time unknown)."""
        pid = args["pid"]
        if isinstance(pid, bool) or not isinstance(pid, int) or pid <= 0:
            raise ValueError(f"{pid!r} is not a pid")
        name = args.get("name")
        if not isinstance(name, str) or not 0 < len(name) <= NAME_MAX or not name.isprintable() or " " in name:
            raise ValueError(f"a swap app's name is 1 to {NAME_MAX} printable characters without spaces, not {name!r}")
        priority = _priority(args.get("priority", 0))
        any_gpu = args.get("any_gpu", False)
        if not isinstance(any_gpu, bool):
            raise ValueError(f"any_gpu must be true or false, not {any_gpu!r}")
        level = args.get("park_level", "full")
        if level not in LEVELS:
            raise ValueError(f"a swap app's park level is one of {', '.join(LEVELS)}, not {level!r}")
        if any_gpu and level != "full":   # a move to another GPU is the driver's restore of a full park
            raise ValueError("--any-gpu needs --park-level full: only a full park can come back on another GPU")
        return SwapApp(pid, 0, name, priority, _seconds(args.get("min_resident", 0.0), "--min-resident") or 0.0,
                       _seconds(args.get("idle_park"), "--idle-park", allow_none=True),
                       _seconds(args.get("park_deadline", PARK_DEADLINE_S), "--park-deadline") or PARK_DEADLINE_S,
                       _seconds(args.get("wait_limit"), "--wait-limit", allow_none=True), any_gpu=any_gpu,
                       park_level=level)

    def register(self, app: SwapApp) -> dict[str, Any]:
        """Add the app, resident; GpucrError when its process is gone, another user's, or its name is taken."""
        try:
            app.start_time = proc.process_start_time(app.pid)
            owner = os.stat(f"/proc/{app.pid}").st_uid
        except (OSError, ValueError, IndexError):
            raise GpucrError(f"no process with pid {app.pid} to register as a swap app") from None
        if owner != os.getuid():   # a user's server parks only that user's apps, root's too (docs/security.md)
            raise GpucrError(f"process {app.pid} belongs to uid {owner}: this gpucr server (uid {os.getuid()}) parks "
                             "only its own user's apps; run it under that user's own server")
        self.apps.add(app)
        self._log(f"swap app {app.name} (pid {app.pid}) registered: priority {app.priority}, min-resident "
                  f"{app.min_resident_s:g} s, idle-park {'off' if app.idle_park_s is None else f'{app.idle_park_s:g} s'}, "
                  f"park deadline {app.park_deadline_s:g} s, wait limit "
                  f"{'off' if app.wait_limit_s is None else f'{app.wait_limit_s:g} s'}"
                  + (", on any GPU with room" if app.any_gpu else "")
                  + (f", parked at level {app.park_level}" if app.park_level != "full" else ""))
        return app.row(now())

    # ---- its policy changed while it runs (the server's `swap_set` request) ----

    @staticmethod
    def policy_changes(args: dict[str, Any]) -> dict[str, Any]:
        """A `swap_set` request's changes checked (ValueError: malformed): any of priority, min_resident_s and
        idle_park_s (null: never idle-parked), as the app's row names them."""
        unknown = set(args) - {"name", "priority", "min_resident_s", "idle_park_s"}
        if unknown:
            raise ValueError(f"a swap app's policy is its priority, min_resident_s and idle_park_s, not "
                             f"{', '.join(sorted(unknown))}")
        changes: dict[str, Any] = {}
        if "priority" in args:
            changes["priority"] = _priority(args["priority"])
        if "min_resident_s" in args:
            changes["min_resident_s"] = _seconds(args["min_resident_s"], "min_resident_s")
        if "idle_park_s" in args:
            changes["idle_park_s"] = _seconds(args["idle_park_s"], "idle_park_s", allow_none=True)
        if not changes:
            raise ValueError("nothing to change: give priority, min_resident_s or idle_park_s")
        return changes

    def set_policy(self, pid: int, changes: dict[str, Any], who: str) -> dict[str, Any]:
        """The app's priority, --min-resident or --idle-park changed (policy_changes), from now; its row after."""
        app = self.apps.update(pid, changes)
        if app is None:
            raise GpucrError(f"swap app with pid {pid} ended")
        self._log(f"swap app {app.name} (pid {pid}): " + ", ".join(f"{k} {v}" for k, v in changes.items())
                  + f" (set by {who})")
        return app.row(now())

    # ---- what the server reads anyway ----

    def observe(self, pid: int, status: dict[str, Any]) -> None:
        """A swap app's status, and what the driver counts it holds (its context too: parking frees that as well)."""
        app = self.apps.get(pid)
        if app is None:
            return
        counted: dict[str, int] = {}
        if status.get("state") == "running" and app.state == RESIDENT:
            try:
                counted = self._gpu.process_bytes(pid, status)
            except (OSError, GpucrError):
                pass   # the agent's count alone, this time
        self.apps.observe(pid, status, counted)

    def observe_resident(self) -> None:
        """With nothing else reading the agents each tick (no pinning ahead), the resident apps' status, once, and the
        parked ones' (a demand at their closed gate that their watch missed: the net in tick)."""
        self._read_now(self.apps.all(), (RESIDENT, PARKED, ON_DISK))

    def _read_now(self, apps: list[SwapApp], states: tuple[str, ...] = (RESIDENT,)) -> None:
        """These apps' status read now, those in `states` (by default the resident ones: the others' memory is
        parked, their activity stopped)."""
        for app in apps:
            if app.state not in states:
                continue
            try:
                with targets.resolve(app.pid).connect() as agent:
                    self.observe(app.pid, agent.call("status", timeout=5.0))
            except (OSError, GpucrError):
                pass   # not up yet, or ending: the tick drops it once it has ended

    # ---- the tick: ends and idleness ----

    def tick(self) -> None:
        at = now()
        for app in self.apps.all():
            if proc.process_ended(app.pid, app.start_time):
                self._forget(app, "it ended")
                continue
            if app.cuda and not app.watched:
                app.watched = True
                threading.Thread(target=self._watch, args=(app,), daemon=True, name=f"gpucr-swap-{app.pid}").start()
            if self._missed_demand(app, at):
                self._resume_missed(app, at)
            elif self._idle_for_parking(app, at):
                self.park(app.pid, f"idle {app.idle_s(at):.1f} s (--idle-park {app.idle_park_s:g})")

    @staticmethod
    def _idle_for_parking(app: SwapApp, at: float) -> bool:
        return (app.state == RESIDENT and app.idle_park_s is not None and sum(app.held.values()) > 0
                and app.idle_s(at) >= app.idle_park_s and at - app.resident_since >= app.min_resident_s)

    @staticmethod
    def _missed_demand(app: SwapApp, at: float) -> bool:
        """The net for lost wakes: the status the server reads each second shows a demand at the parked app's closed
        gate (the agent's clock is ours: CLOCK_MONOTONIC) that no watch acted on within MISSED_DEMAND_S."""
        return (app.state in (PARKED, ON_DISK) and app.demand_ns != 0 and app.demand_ns != app.watch_saw_ns
                and at - app.demand_ns / 1e9 >= MISSED_DEMAND_S)

    def _resume_missed(self, app: SwapApp, at: float) -> None:
        """Resume it, said loudly (its watch should have: the next GPU run must tell), beside the tick."""
        app.watch_saw_ns = app.demand_ns   # acted on, once
        app.missed_wakes += 1
        watch = "its watch is connected" if app.pid in self._watches else "no watch is connected to its agent"
        self._log(f"LOST WAKE: swap app {app.name} (pid {app.pid}) has had a demand waiting at its closed gate for "
                  f"{at - app.demand_ns / 1e9:.1f} s that its watch did not act on ({watch}); found in its status, "
                  f"resuming it (missed wakes so far: {app.missed_wakes})")
        threading.Thread(target=self.resume, args=(app.pid, app.demand_ns, "on a demand its watch missed"),
                         daemon=True, name=f"gpucr-swap-net-{app.pid}").start()

    def _forget(self, app: SwapApp, why: str) -> None:
        if self.apps.drop(app.pid) is not None:
            self._log(f"swap app {app.name} (pid {app.pid}) dropped: {why}")
        self._end_watch(app.pid)
        self.limit.forget(app.pid)
        self.stats.forget(app.pid)
        self._let_go(app.pid)   # a parked app's staging is its own memfds: the server's mapping alone would keep them
        self.disk.forget(app)
        with self._turns_lock:
            self._turns.pop(app.pid, None)

    # ---- park, watch, resume ----

    def _turn(self, pid: int) -> threading.Lock:
        with self._turns_lock:
            return self._turns.setdefault(pid, threading.Lock())

    def park(self, pid: int, why: str) -> bool:
        """Park a resident app within the host budget (disk.py: others may go to disk first); False when it stays
        resident. Its room in host memory is made before its turn is taken: moving another to disk takes that one's."""
        app = self.apps.get(pid)
        if app is None or app.state != RESIDENT:
            return False
        if not self.disk.room_for(app):
            app.last_submit = now()   # tried again after another idle period, not every tick
            self.stats.refused(pid, NO_HOST_ROOM)
            return False
        parked = self._park_resident(pid, why)
        self.disk.parked(app, parked)
        return parked

    def _park_resident(self, pid: int, why: str) -> bool:
        """Park a resident app (the server's checkpoint) and watch it for demand; False when it stays resident."""
        with self._turn(pid):
            app = self.apps.get(pid)
            if app is None or app.state != RESIDENT:
                return False
            self.apps.set_state(pid, PARKING)
            began = Began()
            try:
                result = self._park(pid, app.park_deadline_s, app.park_level)
            except Exception as exc:   # noqa: BLE001 - the app stays resident whatever failed; said once per try
                _log_internal(self._log, exc)
                app.last_submit = now()   # tried again after another idle period, not every tick
                self.stats.refused(pid, PARK_FAILED)
                self.apps.set_state(pid, RESIDENT, f"park failed: {_reason(exc)}")
                self._log(f"parking swap app {app.name} (pid {pid}) failed, it stays resident: {_reason(exc)}")
                return False
            app.parks += 1
            self.stats.switched(pid, app.name, PARK, began, result)
            self.apps.set_state(pid, PARKED)
            self.apps.parked_counts(pid, counted_of(result))   # its need, though its memory was never read
            self._log(f"parked swap app {app.name} (pid {pid}): {why}; {began.seconds():.3f} s")
        return True

    def _watch(self, app: SwapApp) -> None:
        """The app's watch, for its life: its agent answers when a demanding call meets its closed gate (resume it),
        when an allocation asks for room (park others, then say so with the next watch), or when someone else
        restored it. No polling: one connection, one answer per event. A watch that ends while the app lives (its
        agent unreachable, its connection failed or ended by the agent) is started again, why it ended logged; a
        demand meanwhile is found by the net (tick)."""
        said, tries = "", 0
        while not self._stopping and self.apps.get(app.pid) is app:
            why, answered = self._watch_once(app)
            if why is None:   # ended by the server itself (the app dropped, or the server stopping)
                return
            if self._ends_soon(app):
                self._forget(app, "it ended")
                return
            if self._stopping or self.apps.get(app.pid) is not app:
                return
            tries = 0 if answered else tries + 1
            delay = WATCH_RESTART_S[min(tries, len(WATCH_RESTART_S) - 1)]
            app.watch_restarts += 1
            if why != said:   # once per reason: an agent that stays unreachable is said once, not every try
                self._log(f"the watch on swap app {app.name} (pid {app.pid}) ended: {why}; watching it again "
                          f"(in {delay:g} s, then on; a demand meanwhile is found in the status the server reads)")
            said = why
            time.sleep(delay)

    def _watch_once(self, app: SwapApp) -> tuple[str | None, bool]:
        """One connection's watches, until it ends: why (None: the server ended it), and whether any was answered."""
        answered = False
        try:
            agent = targets.resolve(app.pid).connect()
        except Exception as exc:   # noqa: BLE001 - whatever failed, the watch is tried again
            return f"its agent could not be reached: {_reason(exc)}", answered
        self._watches[app.pid] = agent
        try:
            verdict = seen = 0
            while not self._stopping:
                ans = agent.call("watch", timeout=WATCH_FOREVER_S, seen=seen, **({"room": verdict} if verdict else {}))
                answered, verdict, seen = True, 0, 0
                woke, demand_ns = ans.get("woke"), int(ans.get("demand_ns") or 0)
                if woke == "demand":
                    app.watch_saw_ns = demand_ns   # acted on: the net leaves it alone
                if woke in ("demand", "room"):
                    self._slowed(app, woke)
                if woke == "demand" and not self.resume(app.pid, demand_ns):
                    seen = demand_ns   # declined (not a park of ours, or its resume failed): the agent notes the
                    #                    next demand of this closed period again
                elif woke == "room":
                    verdict = ROOM_MADE if self.make_room(app, ans) else ROOM_NONE
                elif woke == "opened":   # restored by someone else (`gpucr restore`)
                    self._restored_elsewhere(app)
                elif woke not in ("demand", "room"):   # the server did not hang up: the agent saw its fd end or fail
                    return (None if self._watches.get(app.pid) is not agent
                            else f"its agent answered {woke!r} though the server did not hang up"), answered
            return None, answered
        except Exception as exc:   # noqa: BLE001 - said by the caller, and the watch tried again
            return (None if self._stopping or self._watches.get(app.pid) is not agent else _reason(exc)), answered
        finally:
            if self._watches.get(app.pid) is agent:
                self._watches.pop(app.pid, None)
            agent.close()

    def _restored_elsewhere(self, app: SwapApp) -> None:
        with self._turn(app.pid):   # (our own park or resume holds it: they set the state themselves)
            # and it runs now: a gate our own roll-back opened (a failed switch) may be answered after its next park
            if app.state in (PARKED, ON_DISK) and self._runs(app.pid):
                self.disk.resumed(app)
                self.apps.set_state(app.pid, RESIDENT)
                self._log(f"swap app {app.name} (pid {app.pid}) was restored by someone else: resident")

    @staticmethod
    def _ends_soon(app: SwapApp, within_s: float = 1.0) -> bool:
        """Whether the app has ended, or does within a moment: its agent's channel closes as it exits."""
        deadline = now() + within_s
        while not proc.process_ended(app.pid, app.start_time):
            if now() >= deadline:
                return False
            time.sleep(0.05)
        return True

    def _slowed(self, app: SwapApp, what: str) -> None:
        """The app's room and resume requests kept to its rate (limits.py): one that asks in a loop waits."""
        delay = self.limit.delay(app.pid, now())
        if delay > 0:
            self._log(f"swap app {app.name} (pid {app.pid}) asks for {what} faster than {self.limit.per_s:g} a second "
                      f"(beyond {self.limit.burst} at once): served in {delay:.2f} s")
            time.sleep(delay)

    def make_room(self, asker: SwapApp, ans: dict[str, Any]) -> bool:
        """An allocation of the asker failed for lack of memory: park others on its GPU by the policy until it
        fits. False (the allocation fails as before) when the policy finds nothing enough, said in the log."""
        want, free, ordinal = int(ans.get("bytes") or 0), int(ans.get("free") or 0), int(ans.get("device") or 0)
        # the agent names the GPU (an app that holds no memory yet has no device in its status to learn it from)
        uuid = str(ans.get("uuid") or "") or asker.ordinals.get(ordinal, str(ordinal))
        asker.ordinals.setdefault(ordinal, uuid)
        wait = min(ROOM_WAIT_S, asker.wait_limit_s) if asker.wait_limit_s is not None else ROOM_WAIT_S
        if ans.get("context"):   # one the driver could not make: as large as a context there (the server's own)
            want = self._gpu.context_bytes(uuid)
            ask = Ask(uuid, want, f"a context ({want >> 20} MiB, as the server's own there)", wait)
        else:
            ask = Ask(uuid, want, f"{want} bytes ({free} free)", wait, free_hint=free)
        made = self.room.make(asker, ask)
        if not made:
            self.stats.refused(asker.pid, NO_ROOM)
        return made

    def _end_watch(self, pid: int) -> None:
        agent = self._watches.pop(pid, None)
        if agent is not None:
            agent.hang_up()

    def resume(self, pid: int, demand_ns: int, why: str = "on demand") -> bool:
        """Resume a parked app on its demand (the server's restore); the time from its demanding call to the start
        of the restore is logged and kept. A resume asked for by hand (the HTTP API, `gpucr top`) has no demand_ns
        and says why instead."""
        with self._turn(pid):
            app = self.apps.get(pid)
            if app is None or app.state not in (PARKED, ON_DISK):
                return False
            self.apps.set_state(pid, RESUMING)
            began = Began()
            if demand_ns:
                app.last_wake_ms = round((began.mono * 1e9 - demand_ns) / 1e6, 3)
            waking = (f": {app.last_wake_ms} ms from its demanding call to the start of its restore" if demand_ns else "")
            self._log(f"resuming swap app {app.name} (pid {pid}) {why}{waking}"
                      + (f", from its image {app.image}" if app.image else ""))
            try:
                moves, result, two_way = self._resume_with_room(app)
                self.apps.moved(pid, moves)
            except Exception as exc:   # noqa: BLE001 - said, and left for a person: its callers wait at the gate
                _log_internal(self._log, exc)
                self.stats.refused(pid, RESUME_FAILED)
                self.apps.set_state(pid, ON_DISK if app.image else PARKED, f"resume failed: {_reason(exc)}")
                limit = f"{app.wait_limit_s:g} s" if app.wait_limit_s is not None else "none set"
                self._log(f"resuming swap app {app.name} (pid {pid}) failed: {_reason(exc)}; its allocations waiting at "
                          f"its gate fail with out-of-memory at its --wait-limit ({limit}), its other calls wait until "
                          f"'gpucr restore {f'--image {app.image} ' if app.image else ''}{pid}'")
                return False
            self.disk.resumed(app)
            app.resumes += 1
            self.stats.switched(pid, app.name, RESUME, began, result, two_way)
            app.last_submit = now()
            self.apps.set_state(pid, RESIDENT)
            self._log(f"resumed swap app {app.name} (pid {pid}) in {began.seconds():.3f} s")
        return True

    def _resume_with_room(self, app: SwapApp) -> tuple[dict[str, str], Any, bool]:
        """The restore; while the GPU is short, others are parked for it by the policy (as for an allocation: in its
        turn, waiting for a --min-resident to end) and it is tried again, whichever step was short (its room check,
        its context, its data). It waits as long as it takes, shown in `gpucr ps` and logged once: its app's calls
        wait at the gate anyway (an allocation ends its own wait at --wait-limit, in the agent, with out-of-memory).
        A try that fails otherwise is tried again for RESUME_GIVE_UP_S, then raised. Each try that failed is counted
        (resume_retried). It ends with the app or the server. With nobody to park, the next try waits RESUME_RETRY_S:
        memory given back a moment before is not always free yet (~0.1 s after a park, on simcuda). Returns how its
        GPUs moved ({old UUID: new UUID}, only those that did: --any-gpu, _placement), the restore's result, and
        whether it came back through a two-way switch (_room_first)."""
        start = now()
        try:
            while True:
                try:
                    moves = self._placement(app)
                    switched = self._room_first(app, moves)
                    if switched is not None:
                        return {}, switched, True
                    result = self._resume(app.pid, image=app.image, gpu_map=moves, drop_staging=self.disk.drops_staging)
                    return {old: new for old, new in moves.items() if old != new}, result, False
                except GpucrError as exc:
                    short = _short_of_memory(exc)
                    if self._stopping or proc.process_ended(app.pid, app.start_time) or (
                            not short and now() - start >= RESUME_GIVE_UP_S):
                        raise
                    self.stats.refused(app.pid, RESUME_RETRIED)
                    if not app.waiting:
                        self._log(f"swap app {app.name} (pid {app.pid}) waits for "
                                  f"{'room for ' if short else 'another try of '}its resume: {exc}")
                    app.wait(f"its resume: {exc}")
                if not short or not any(self._room_for_resume(app, uuid, n) for uuid, n in app.parked_bytes.items() if n):
                    time.sleep(RESUME_RETRY_S)
        finally:
            if app.waiting:
                self._log(f"swap app {app.name} (pid {app.pid}) waited {now() - start:.1f} s for its resume")
            app.done_waiting()

    def _placement(self, app: SwapApp) -> dict[str, str]:
        """Where an app of --any-gpu comes back (placement.py): {old UUID: new UUID} for each of its GPUs, or {} on its
        own. Others: always on their own GPUs. What it needs on a GPU: what it held there when parked (its context
        too, as the driver counted it); what a GPU has: its free memory less the server's context, where the server
        holds none yet (its fill makes one)."""
        if not app.any_gpu or not app.parked_bytes:
            return {}
        moves = place({u: n + ROOM_SLACK for u, n in app.parked_bytes.items()},
                      [GpuRoom(u, name, mem[0] - self._gpu.server_cost(u) if (mem := self._gpu.memory(u)) else None)
                       for u, name in self._machine()])
        if any(old != new for old, new in moves.items()):
            self._log(f"swap app {app.name} (pid {app.pid}) comes back on another GPU with room: " + ", ".join(
                f"{old} -> {new}" for old, new in moves.items() if old != new))
        return moves

    def _room_first(self, app: SwapApp, moves: dict[str, str]) -> Any:
        """Room made before the restore on each GPU where what the app is known to need (what it held when parked,
        its context included, plus ROOM_SLACK) does not fit the GPU's free memory (less the server's context where it
        holds none): one restore, instead of one refused for memory, room, then another. Where the policy parks one
        app for it, on its one GPU, from host memory, that app goes out as this one comes in (a two-way switch,
        _two_way): the restore's result then, else None (the restore follows)."""
        box: dict[str, Any] = {}
        two_way = (self._switch is not None and len(app.parked_bytes) == 1 and not app.image and not moves
                   and app.pid not in self._one_way)
        for old, n in app.parked_bytes.items():
            ask = Ask(moves.get(old, old), n, f"its resume, {n} bytes", ROOM_WAIT_S)
            # where the GPU's memory cannot be read, the restore is tried and a refusal makes room (_room_for_resume)
            if n and self._gpu.memory(ask.uuid) is not None and self.room.short(ask) > 0:
                self.room.make(app, ask, (lambda out: self._two_way(out, app, box)) if two_way else None)
        return box.get("result")

    def _two_way(self, out: SwapApp, into: SwapApp, box: dict[str, Any]) -> bool:
        """Park `out` while `into` resumes, at once (the server's two-way switch); False, with `out` as it was, where
        the pair cannot (said in the log: the room then parks it as before). The restore's result lands in box."""
        if not self.disk.room_for(out):
            return False
        ok = False
        try:
            ok = self._two_way_turn(out, into, box)
        finally:
            self.disk.parked(out, ok)   # its host memory as its staging says, or the reservation given back
        return ok

    def _two_way_turn(self, out: SwapApp, into: SwapApp, box: dict[str, Any]) -> bool:
        with self._turn(out.pid):
            if self.apps.get(out.pid) is None or out.state != RESIDENT:
                return False
            self.apps.set_state(out.pid, PARKING)
            began = Began()
            try:
                parked, resumed, info = self._switch(out.pid, into.pid, out.park_deadline_s, out.park_level,
                                                     self.disk.drops_staging)
            except GpucrError as exc:
                return self._two_way_failed(out, into, exc)
            out.parks += 1
            self.stats.switched(out.pid, out.name, PARK, began, parked, two_way=True)
            self.apps.set_state(out.pid, PARKED)
            self.apps.parked_counts(out.pid, counted_of(parked))
            self._log(f"two-way switch: parked swap app {out.name} (pid {out.pid}) while {into.name} (pid {into.pid}) "
                      f"came in: {info['bytes_out'] >> 20} MiB out, {info['bytes_in'] >> 20} MiB in, "
                      f"{info['seconds']:.3f} s ({info['waited_for_room_s']:.3f} s of it waiting for room, "
                      f"{info['made_while_out']} pieces made while the other's were still going out; "
                      f"{info.get('taken_over', 0)} of {into.name}'s pieces were {out.name}'s, taken over)")
        box["result"] = resumed
        return True

    def _two_way_failed(self, out: SwapApp, into: SwapApp, exc: GpucrError) -> bool:
        """The switch did not happen: refused before touching anything (NotTwoWay), or failed and rolled back. `out`
        is resident, or parked and restorable where its roll-back could not finish (its agent says which); `into`
        comes back the one-way path next."""
        if not isinstance(exc, NotTwoWay):
            self._one_way.add(into.pid)
            self.stats.refused(out.pid, PARK_FAILED)
        runs = self._runs(out.pid)
        self.apps.set_state(out.pid, RESIDENT if runs else PARKED,
                            "" if isinstance(exc, NotTwoWay) else f"two-way switch failed: {_reason(exc)}")
        self._log(f"two-way switch of swap apps {out.name} (out) and {into.name} (in): {_reason(exc)}; {out.name} "
                  f"{'stays resident' if runs else 'is parked (restorable)'}, {into.name} comes back one way")
        return False

    @staticmethod
    def _runs(pid: int) -> bool:
        """Whether the process runs resident now, its gate open, as its agent says."""
        try:
            with targets.resolve(pid).connect() as agent:
                st = agent.call("status", timeout=5.0)
        except (OSError, GpucrError):
            return False
        return st.get("state") == "running" and not st.get("gate_closed")

    def _room_for_resume(self, app: SwapApp, uuid: str, held: int) -> bool:
        """What it held when parked plus ROOM_SLACK, less what is free, and at least ROOM_SLACK: the restore was short,
        maybe of its context's memory, which nothing counts."""
        return self.room.make(app, Ask(uuid, held, f"its resume, {held} bytes", ROOM_WAIT_S, at_least=ROOM_SLACK))

    def close(self) -> None:
        self._stopping = True
        for pid in list(self._watches):
            self._end_watch(pid)
