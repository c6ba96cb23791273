"""Staging prepared ahead by the gpucr server (issue 28 item 2: the first park as fast as the others).

An app's first checkpoint used to make its staging then: memfds faulted in (one thread takes 4.7-7.4 s per 8 GiB
of 4 KiB pages on the H200 host) and pinned by the server (cuMemHostRegister, the other half): 3.7-15.8 s for a
park that later takes 0.6-0.8 s. `gpucr serve --prepare-staging SIZE|auto` makes that memory when the server
starts: sealed memfds of a segment each, faulted in with one thread per segment (staging_make.py), mapped here and
pinned in the server's context, piece by piece (pinned.py). When an app's agent asks for staging (make_staging),
each segment it asks for that a pool segment holds is lent from here, whole: it is the app's from then on (its
agent holds the fd, the server its mapping, already pinned: that checkpoint pins nothing). The rest is made as
before. The pool is refilled in the background.

The segment: the agent's own segment target (GPUCR_STAGING_SEGMENT_MIB, 2 GiB by default), so the plan of an app
bigger than one segment asks for exactly pool-sized segments (native/agent/staging.c: every segment after the
first is at least what is held, up to the target), and nothing lent is wasted but the part of one segment past
a smaller app's data (the agent keeps it: it gives staging back only when more than a segment is idle). 2 GiB is
8 registrations of PIN_PIECE and about 60 fds for a whole H200 host. An allocation larger than a segment is
placed whole in one segment (the agent does not split one), so its segment is made at the checkpoint, as before;
the pool remembers that size and makes one ahead for the next app of that shape.

One host budget: the pool's bytes not lent are the pool's entry in the ledger (budget.py), a file whose shared
flock this server holds (a killed server's entry is stale and reaped); a lend moves bytes from the pool's entry
to the app's under the ledger's lock, so they count exactly once. The pool grows only while it, every live app's
staging and one more segment fit the server's --host-budget and leave MARGIN of the memory available; before
staging is made anew for an app, pool segments are freed until that fits too. A segment given back returns
here when its app has ended (nobody else holds it), and is freed when a live app gave it back (its agent may
still hold it, and only it knows); a stopped server frees every segment not lent, and lets go of those lent
(their apps keep them)."""
from __future__ import annotations

import os
import threading
import time
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

from ..agent_tables import SETTINGS
from ..driver import DriverError
from ..vmm import Vmm
from ..errors import GpucrError
from ..plane import MadeStaging, StagingAsk
from ..sizes import budget_bytes
from ..proc import held_files
from . import budget
from .hostmem import meminfo_kib
from .pinned import Segment, drop, open_segment, pin
from .staging_make import FAULT_THREADS, made_for, make_segments, make_staging, wanted_kind

SEGMENT_SETTING = SETTINGS["GPUCR_STAGING_SEGMENT_MIB"]   # the agent's segment target (see above)
MARGIN_MIN = 4 << 30       # auto leaves this much of MemAvailable, or MARGIN_SHARE of MemTotal if more
MARGIN_SHARE = 10
TICK_S = 1.0               # how often a full or refused pool looks again (a lend or a give-back wakes it at once)
LEARNED = 4                # sizes past a segment remembered to be made ahead
WANTED_TICK_S = 0.01       # how often pinning that stopped for a copy asks whether it may go on
HELD_FRESH_S = 0.5         # a scan of who holds which file serves the give-backs of one app's drop
Owner = tuple[int, int]


@dataclass
class Pooled:
    """One segment: the pool's fd of it, and its mapping here, pinned whole once it is ready."""
    fd: int
    seg: Segment
    kind: str   # hugetlbfs | shm

    @property
    def size(self) -> int:
        return self.seg.declared


def segment_bytes(environ: dict[str, str] | None = None) -> int:
    """The pool's segment: GPUCR_STAGING_SEGMENT_MIB as the server's environment sets it, the agent's default
    (2 GiB) otherwise; an app started with the same setting asks for segments of that size."""
    text = (os.environ if environ is None else environ).get(SEGMENT_SETTING.name, "") or SEGMENT_SETTING.default
    if not text.isdigit() or not SEGMENT_SETTING.lo <= int(text) <= SEGMENT_SETTING.hi:
        raise GpucrError(f"{SEGMENT_SETTING.name}={text}: give {SEGMENT_SETTING.accepted} (MiB)")
    return int(text) << 20


def entry_name() -> str:
    """The pool's entry in the ledger: the server's pid and pid namespace, never an app's name (<pid>-<ns>)."""
    return f"pool-{os.getpid()}-{os.stat('/proc/self/ns/pid').st_ino}{budget.SUFFIX}"


def margin() -> int:
    return max(MARGIN_MIN, meminfo_kib("MemTotal") * 1024 // MARGIN_SHARE)


class StagingPool:
    """The server's staging made ahead: `target` bytes of it (None: auto, as the budget and memory allow) within
    `host_budget` (None: none but memory). `ctx`: the context it pins in (the server's, kept until the pool is
    closed: a registration lasts as long as its context); `wanted()` says a copy wants the data plane (pinning
    stops between pieces meanwhile)."""

    def __init__(self, vmm: Vmm, ledger_dir: Path, target: int | None, host_budget: int | None,
                 ctx: int, wanted: Callable[[], bool], said: Callable[[str], None]) -> None:
        self.vmm, self.ledger_dir, self.target, self.host_budget = vmm, ledger_dir, target, host_budget
        self._ctx, self._wanted, self._said = ctx, wanted, said
        self._said_pages = False   # the note that the pool is made on 4 KiB pages, once
        self._held: set[tuple[int, int]] = set()
        self._held_at, self._held_for = float("-inf"), (0, 0)   # when held_files was read, for whose give-back
        self.seg = segment_bytes()
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self.free: list[Pooled] = []              # ready: pinned whole, not lent
        self.lent: dict[tuple[int, int], Pooled] = {}   # by file (st_dev, st_ino): the app holds it
        self.making = 0                           # bytes reserved for segments being made and pinned
        self.reserved = 0                         # bytes being made anew for apps, not yet in their entries
        self.lending = 0                          # bytes picked to lend, not yet in the app's entry
        self.making_sizes: list[int] = []         # the sizes of those being made
        self.lent_total = self.made_total = self.returned_total = 0
        # sizes past a segment that asks could not be lent (an allocation larger than a segment: XLA's regions, a KV
        # cache in one tensor), with how many one ask wanted: made first at each refill, for the next app of that
        # shape (a pool of servers of one model is pre-warmed by loading each and parking it at once)
        self.learned: dict[int, int] = {}
        self._entry = budget.write_entry_in(ledger_dir, entry_name(), 0)
        self._thread = threading.Thread(target=self._run, daemon=True, name="gpucr-staging-pool")

    # ---- what it holds ----
    def start(self) -> None:
        self._thread.start()

    def unlent(self) -> int:
        return sum(p.size for p in self.free) + self.making + self.lending

    def info(self) -> dict[str, Any]:
        """What `gpucr serve --status --json` says of it."""
        with self._lock:
            return {"target_bytes": self.target, "segment_bytes": self.seg, "free_bytes": sum(p.size for p in self.free),
                    "making_bytes": self.making, "lent_bytes": sum(p.size for p in self.lent.values()),
                    "learned_sizes": dict(self.learned),
                    "pinned_bytes": sum(p.seg.bytes for p in self.free), "lent_total_bytes": self.lent_total,
                    "made_total_bytes": self.made_total, "returned_total_bytes": self.returned_total,
                    "host_budget_bytes": self.host_budget}

    # ---- lending ----
    def provide(self, ask: StagingAsk) -> MadeStaging:
        """The staging `ask` names: each segment a pool segment holds lent from here, the rest made (after freeing
        pool segments until it fits the budget and memory); admitted in one step. Raises GpucrError (one line)
        with nothing lent or made."""
        same_ledger = os.path.realpath(ask.ledger_dir) == os.path.realpath(self.ledger_dir)
        picks: list[Pooled | None] = []
        # of the segments lent, the bytes past what was asked: at most one segment's worth an ask (an app whose
        # segment target is below the pool's gets the rest made, not 4x its data lent)
        idle = 0
        with self._lock:
            for n in ask.add:
                fits = [p for p in self.free if (p.kind == ask.staging or ask.staging == "auto") and n <= p.size
                        and idle + p.size - n <= self.seg] if same_ledger else []
                p = min(fits, key=lambda p: p.size) if fits else None
                if p is not None:
                    self.free.remove(p)
                    self.lending += p.size   # still the pool's in the ledger, until the app's entry says them
                    idle += p.size - n
                picks.append(p)
            rest = [n for n, p in zip(ask.add, picks) if p is None]
            if same_ledger and not ask.staging.startswith("file:"):
                self._learn([n for n in rest if n > self.seg])
        lent = [p for p in picks if p is not None]
        try:
            with self.room_for(0 if ask.staging.startswith("file:") else sum(rest)):
                return self._lend(ask, picks, rest) if lent else make_staging(ask)
        except BaseException:
            with self._lock:
                self.free.extend(lent)
                self.lending -= sum(p.size for p in lent)
            with budget.locked(self.ledger_dir):
                budget.say(self._entry, self.unlent())
            raise

    def _lend(self, ask: StagingAsk, picks: list[Pooled | None], rest: list[int]) -> MadeStaging:
        """The picks lent and `rest` made: the app's entry says both, the pool's no more the picks."""
        lent = [p for p in picks if p is not None]
        n_lent = sum(p.size for p in lent)
        kind = wanted_kind(ask.staging, sum(rest))[0] if rest else lent[0].kind
        if kind == "file":   # a pool is never made for file staging, and lends to none
            raise GpucrError("the gpucr server's staging pool lent memory to an app that stages in files")
        held = 0 if ask.replace else ask.held_memory
        room = budget.Room(kind, budget_bytes(ask.host_budget) if ask.host_budget else 0, held, ask.cgroup_root)

        def moved(dirfd: int) -> None:   # under the ledger's lock: the lent bytes leave the pool's entry
            with self._lock:
                self.lending -= n_lent
                for p in lent:
                    self.lent[p.seg.ident] = p
                    self._held_at = float("-inf")   # held now: a scan from before must not say otherwise
            budget.say(self._entry, self.unlent())

        entry = budget.admit(self.ledger_dir, ask.entry, ask.pid, sum(rest), room, lent=n_lent, lender=moved)
        assert entry is not None
        made: list[int] = []
        try:
            kind, made = made_for(ask, kind, "", rest) if rest else (kind, [])
            fresh = iter(made)
            fds = [os.dup(p.fd) if p is not None else next(fresh) for p in picks]
        except BaseException:
            for fd in made:
                os.close(fd)
            os.close(entry)
            with budget.locked(self.ledger_dir):   # picked again (provide returns them): in the pool's entry first
                with self._lock:
                    for p in lent:
                        self.lent.pop(p.seg.ident, None)
                    self.lending += n_lent
                budget.say(self._entry, self.unlent())
            budget.settle(self.ledger_dir, ask.entry, held)
            raise
        with self._lock:
            self.lent_total += n_lent
        self._said(f"lent {n_lent >> 20} MiB of staging made ahead to process {ask.pid}"
                   + (f"; made {sum(rest) >> 20} MiB more for it" if rest else ""))
        return MadeStaging(fds, entry, kind, lent=n_lent, made=sum(rest))

    def adopt(self, fd: int, declared: int) -> Segment | None:
        """The mapping (pinned) of a segment lent from here that a process states as its file `fd` of `declared`
        bytes, or None: not one of ours."""
        st = os.fstat(fd)
        with self._lock:
            p = self.lent.get((st.st_dev, st.st_ino))
        return p.seg if p is not None and p.seg.declared == declared else None

    def give_back(self, seg: Segment, who: Owner) -> bool:
        """A lent segment let go by the server's cache: back in the pool, pinned still, when its app no longer holds
        it (ended, or its agent closed and unmapped it: `restore --drop-staging`, the swap service's drop of a
        resumed app's staging) and the pool has room; else unpinned, unmapped and closed (the app's fd keeps it).
        False: not ours."""
        free_of_it = seg.ident not in self._held_files(who)
        with self._lock:
            p = self.lent.pop(seg.ident, None)
            keep = (p is not None and not self._stop.is_set() and free_of_it
                    and (self.target is None or self.unlent() + p.size <= self.target)
                    and self._budget_left() >= p.size)
            if keep:
                assert p is not None
                seg.held.clear()   # what the mover knew of its bytes was the app's
                seg.abandon = False
                self.free.append(p)
                self.returned_total += p.size
        if p is None:
            return False
        if keep:
            with budget.locked(self.ledger_dir):
                budget.say(self._entry, self.unlent())
        else:
            self._free(p)
        self._wake.set()
        return True

    def _held_files(self, who: Owner) -> set[tuple[int, int]]:
        """held_files, read once for the segments one app gives back together (each is given back on its own): read
        anew for another app, after a lend, or past HELD_FRESH_S."""
        now = time.monotonic()
        if who != self._held_for or now - self._held_at > HELD_FRESH_S:
            self._held, self._held_at, self._held_for = held_files(os.getpid()), now, who
        return self._held

    # ---- the budget ----
    @contextmanager
    def room_for(self, need: int) -> Iterator[None]:
        """While inside, `need` bytes of staging are being made anew for an app: pool segments (not lent) are freed
        until they fit beside the pool (the server's budget, the memory available less the margin), and the pool
        does not grow into them until the app's entry counts them (at the end)."""
        with self._lock:
            self.reserved += need
        try:
            while need:
                with self._lock:
                    if not self.free or self._room() >= 0:
                        break
                    p = self.free.pop()
                self._free(p)
                with budget.locked(self.ledger_dir):
                    budget.say(self._entry, self.unlent())
            yield
        finally:
            with self._lock:
                self.reserved -= need
            self._wake.set()

    def _room(self) -> int:
        """Bytes more the host may hold now: what the budget leaves beside every entry and the pool, and the
        memory available less the margin; less what is being made for apps. Under the pool's lock."""
        return min(meminfo_kib("MemAvailable") * 1024 - margin(), self._budget_left()) - self.reserved

    def _budget_left(self) -> int:
        """What the server's --host-budget leaves beside every live entry and the pool's own bytes as it knows them
        now (not as its entry last said them); unbounded without one."""
        if self.host_budget is None:
            return 1 << 62
        return self.host_budget - budget.used_bytes(self.ledger_dir, but=entry_name()) - self.unlent()

    # ---- making ----
    def _run(self) -> None:
        said = ""
        while not self._stop.is_set():
            try:
                sizes = self._reserve()
                if sizes:
                    self._make(sizes)
                    said = ""
                    continue
            except GpucrError as exc:
                if str(exc) != said:
                    said = str(exc)
                    self._said(f"preparing staging ahead: {said}; trying again")
            self._wake.wait(TICK_S)
            self._wake.clear()

    def _learn(self, sizes: list[int]) -> None:
        """Sizes an ask wanted past a segment, remembered (the last LEARNED of them) to be made ahead. Under the lock."""
        for n in set(sizes):
            self.learned[n] = max(self.learned.pop(n, 0), sizes.count(n))   # the most recent last
        while len(self.learned) > LEARNED:
            self.learned.pop(next(iter(self.learned)))

    def _reserve(self) -> list[int]:
        """The sizes of the segments to make now, reserved in the pool's entry (a few rounds of the fault threads at
        most, so the room is looked at again): learned sizes the pool lacks first, then segments, the room for those
        learned sizes kept for them; none when the pool is full or has no room, or while a copy wants the plane."""
        if self._wanted():
            return []
        given: list[Pooled] = []
        with self._lock:
            room = self._room() if self.target is None else min(self.target - self.unlent(), self._room())
            have = [p.size for p in self.free] + self.making_sizes
            lacking = [n for n, k in self.learned.items() for _ in range(max(0, k - have.count(n)))]
            short = sum(lacking) - max(room, 0)
            plain = [p for p in self.free if p.size == self.seg]
            if 0 < short <= sum(p.size for p in plain):   # a shape seen before goes first: plain segments make way
                while short > 0:
                    given.append(plain.pop())
                    self.free.remove(given[-1])
                    short -= self.seg
                    room += self.seg
            elif short > 0:   # not to be had within the pool's room: plain segments as before
                lacking = []
            sizes = []
            for n in lacking:
                if n <= room and len(sizes) < 4 * FAULT_THREADS:
                    sizes.append(n)
                    room -= n
            room -= sum(lacking) - sum(sizes)   # kept for those learned sizes, made once room comes back
            sizes += [self.seg] * min(4 * FAULT_THREADS - len(sizes), max(0, room // self.seg))
            self.making += sum(sizes)
            self.making_sizes += sizes
        for p in given:
            self._free(p)
        if sizes or given:
            with budget.locked(self.ledger_dir):
                budget.say(self._entry, self.unlent())
        return sizes

    def _make(self, sizes: list[int]) -> None:
        """Segments of these sizes (reserved) made and faulted in, one thread each, FAULT_THREADS at a time; each
        mapped and pinned here as soon as it is faulted in (pinning one while the next ones fault), then ready to
        lend. No segment is started while a copy wants the data plane (faulting competes for the host's memory and
        CPUs), nor once the server stops: their reservations are let go."""
        kind = wanted_kind("auto", sum(sizes))[0]
        if kind == "shm" and not self._said_pages:   # measured on the H200: 3.4 GB/s, a first park 7.6-11.7x a later one
            self._said_pages = True
            self._said(f"preparing staging ahead on 4 KiB pages (too few hugepages free for {sum(sizes) >> 21} of 2 MiB): "
                       "a first park soon after the start waits for it; reserve hugepages for one as fast as the later")
        failed: list[BaseException] = []
        todo, pending = list(sizes), {}
        with ThreadPoolExecutor(max_workers=min(FAULT_THREADS, len(sizes)), thread_name_prefix="gpucr-pool") as faults:
            self.vmm.use(self._ctx)
            while todo or pending:
                while todo and len(pending) < FAULT_THREADS and not self._wanted() and not self._stop.is_set():
                    n = todo.pop(0)
                    pending[faults.submit(make_segments, kind, "", [n])] = n
                if self._stop.is_set() and todo:
                    for n in todo:
                        self._ready(None, n)
                    todo = []
                if not pending:   # a copy wants the plane: the next segment waits for it
                    self._stop.wait(WANTED_TICK_S)
                    continue
                done, _ = wait(list(pending), timeout=WANTED_TICK_S, return_when=FIRST_COMPLETED)
                for f in done:
                    n = pending.pop(f)
                    p: Pooled | None = None
                    try:
                        p = self._mapped(f.result()[0], n, kind)
                        self._pin(p.seg)
                        if self._stop.is_set():
                            raise GpucrError("the server stops")
                    except BaseException as exc:   # the others are still made (and freed if stopping): none is lost
                        failed.append(exc)
                        if p is not None:
                            self._free(p)
                        p = None
                    self._ready(p, n)
        if failed:
            raise failed[0]

    def _mapped(self, fd: int, size: int, kind: str) -> Pooled:
        try:
            return Pooled(fd, open_segment(fd, 0, size), kind)
        except BaseException:
            os.close(fd)
            raise

    def _ready(self, p: Pooled | None, reserved: int) -> None:
        """A segment's reservation of `reserved` bytes let go; `p`, that segment, ready to lend (None: not made)."""
        with self._lock:
            self.making -= reserved
            self.making_sizes.remove(reserved)
            if p is not None:
                self.free.append(p)
                self.made_total += p.size
        with budget.locked(self.ledger_dir):
            budget.say(self._entry, self.unlent())

    def _pin(self, seg: Segment) -> None:
        """Pinned whole, a piece at a time, waiting between pieces while a copy wants the data plane."""
        while seg.bytes < seg.declared and not self._stop.is_set():
            pin(self.vmm, seg, seg.declared, lambda: self._wanted() or self._stop.is_set())
            if seg.bytes < seg.declared:
                self._stop.wait(WANTED_TICK_S)

    def _free(self, p: Pooled) -> None:
        """Unpinned in the pool's context (from whichever thread gives it back: its own context is restored after),
        unmapped and closed."""
        try:
            was = self.vmm.current()
            self.vmm.use(self._ctx)
            try:
                drop(self.vmm, p.seg)
            finally:
                if was and was != self._ctx:
                    self.vmm.use(was)
        except (GpucrError, DriverError) as exc:   # kept mapped, never reused (pinned.drop)
            self._said(f"freeing staging made ahead: {exc}")
        os.close(p.fd)

    def close(self) -> None:
        """The server stops: the refill ends, every segment not lent is freed, those lent are let go (their apps
        hold them), and the pool's entry leaves the ledger."""
        self._stop.set()
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join()
        with self._lock:
            gone, self.free = self.free, []
            lent, self.lent = list(self.lent.values()), {}
        for p in gone + lent:
            self._free(p)
        budget.remove_entry(self.ledger_dir, entry_name(), self._entry)
        self._said(f"freed {sum(p.size for p in gone) >> 20} MiB of staging made ahead; {sum(p.size for p in lent) >> 20} MiB "
                   "lent stays with its apps")
