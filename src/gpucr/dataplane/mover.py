"""The gpucr server's data plane: it moves a process's GPU memory itself, at the link's speed, while the
driver checkpoints or restores the process's control state (docs/server.md).

Checkpoint: the agent releases its memory but keeps an fd of each allocation, which keeps the memory on
the GPU; the server imports those fds into its own context, maps them, and copies them straight into the
process's staging (the agent's files, mapped here and pinned once in the server's context), while the
driver checkpoints the process, which then holds no pinned memory and no data of its own. Restore: the
server makes new memory of the same sizes on the same GPUs, fills it from staging while the driver
restores the process, and exports each as an fd that the agent maps at the old addresses.

The staging stays the agent's: a server that dies leaves it with the process, so nothing is lost, and
any mover (a new server, or the CLI's own: cli_plane.py) restores from it.
"""
from __future__ import annotations

import os
import threading
import time
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any, Callable, Iterator

from ..driver import Driver, DriverError, process_gpu_memory
from ..vmm import Vmm
from ..errors import GpucrError
from ..proc import process_ended, process_start_time
from .checked import Taken
from .kernels import Kernels
from .lanes import Routing
from .layout import checked_plan as _checked_plan
from .links import Links, Neighbour
from ..memory import Managed
from ..plane import ImageFile, Inputs, Made, MadeStaging, StagingAsk, Stats
from ..switch_schedule import Room
from .two_way import Key, Landing, Making, TakeOver, both, kept_for_b, key
from .held import Held, Owner
from .pinned import Segment, pin as pin_segment
from .move import CHUNK, Move
from .ring import Ring
from .staging_make import StagingMaker
from .staging_pool import StagingPool

# No wait in the server is without end: a copy from a `file:` staging on a stalled filesystem holds the
# data plane as long as the filesystem stalls, and every request behind it would wait as long.
PLANE_WAIT_S = 300.0
STREAMS = 4             # per direction: a two-way switch copies out and in at once, on streams of their own


def owner(pid: int) -> Owner:
    """A live process as the server keys what it holds of it; GpucrError when it has gone."""
    try:
        return pid, process_start_time(pid)
    except (OSError, ValueError, IndexError) as exc:
        raise GpucrError(f"process {pid} has ended") from exc


class Mover(StagingMaker):
    """One per server: a context per GPU it copies on (kept: restores need no new one), and each
    process's staging mapped and pinned once. One copy at a time: the link is the limit anyway.
    pinned_staging=False: the CLI's own mover, for one request with no server running (LaterPlane): the
    staging is only mapped, and every copy goes through a small pinned ring (ring.py)."""
    skip_unchanged = False   # gpucr serve --skip-unchanged: not only zero chunks the staging holds (checked.py)
    # a two-way switch's fill takes over the pieces of the app going out that match its own (two_way.TakeOver);
    # GPUCR_TAKE_OVER=0 in the server's environment: every piece released and made, as before
    take_over = os.environ.get("GPUCR_TAKE_OVER", "1") != "0"

    def __init__(self, drv: Driver, routes: bool = True, keep_context: bool = True,
                 pinned_staging: bool = True) -> None:
        self.keep_context = keep_context
        self.vmm = Vmm(drv)
        self.kernels = Kernels(self.vmm)   # loaded into each context as it is retained (_context), never in a copy
        self.ring = None if pinned_staging else Ring(self.vmm, CHUNK)
        self._spare: Ring | None = None   # the server's, for a fill of what it did not take itself (_ring_for)
        self.links = Links(drv, self.vmm, enabled=routes and pinned_staging)   # a route's pieces need pinned staging
        self._neighbours: set[int] = set()   # GPUs on which the server holds a context only to lend their link
        self._lock = threading.Lock()
        self._holder = ""   # what holds the data plane's lock (said to a wait that gives up)
        self.plane_wait_s = PLANE_WAIT_S
        self._wanting = threading.Lock()   # guards _wanted: copies waiting for or holding the data plane
        self._wanted = 0
        self._ordinals: dict[str, int] | None = None
        self._ctx: dict[int, tuple[int, list[int]]] = {}      # ordinal -> (context, copy streams)
        # context -> the streams a copy out's scan runs on, a fill's zero chunks are set on and its check runs on:
        # none waits for the copies, so a part all zero is set and checked while the copies of others still run
        self._side: dict[int, tuple[int, int, int]] = {}
        self._taken: dict[Owner, Taken] = {}   # process -> what its last copy out took: plan, zero chunks, digests
        self.said: Callable[[str], None] = lambda line: None   # where the server's log lines go
        self.held = Held(self.vmm, lambda: self.plane_wait_s, lambda line: self.said(line))   # each process's staging
        self.pool: StagingPool | None = None   # staging made ahead (`gpucr serve --prepare-staging`)
        self._pool_dev: int | None = None      # the GPU whose context pinned it: kept while the pool lives

    @property
    def plane(self) -> str:
        """Where this data plane runs, as every result records it: the server, or the CLI (no server)."""
        return "server" if self.ring is None else "cli"

    @property
    def name(self) -> str:
        """The mover as its errors name it."""
        return "the gpucr server" if self.ring is None else "the gpucr command's own data plane (no server)"

    # ---- what it holds ----
    def context_uuids(self) -> list[str]:
        """The GPUs on which the server holds a context now."""
        by_ordinal = self.uuids()
        return sorted(by_ordinal.get(d, str(d)) for d in self._ctx)

    def pinned_bytes(self) -> int:
        """Pinned here: each process's staging, and the pool's not lent."""
        pool = self.pool.info()["pinned_bytes"] if self.pool is not None else 0
        return pool + sum(h["pinned_bytes"] for h in self.held.holdings())

    def start_pool(self, target: int | None, host_budget: int | None, ledger_dir: Path) -> StagingPool:
        """Prepare staging ahead (staging_pool.py), pinned in the context on the first GPU, kept from now on."""
        with self._plane("preparing staging ahead"):
            self._pool_dev = 0   # portable registrations: a copy on any GPU finds them pinned
            ctx = self.context(self._pool_dev)[0]
            self._neighbours.discard(self._pool_dev)
            self.pool = StagingPool(self.vmm, ledger_dir, target, host_budget, ctx, lambda: bool(self._wanted),
                                    lambda line: self.said(line))
            self.held.lender = self.pool
        self.pool.start()
        return self.pool

    def make_staging(self, ask: StagingAsk) -> MadeStaging:
        """Lent from the pool where it can, the rest made (staging_pool.py); made as without a pool otherwise."""
        return self.pool.provide(ask) if self.pool is not None else super().make_staging(ask)

    def forget(self, pid: int) -> None:
        """Unpin and unmap a process's staging (it ended, or its staging changed)."""
        with self._plane(f"letting go of process {pid}'s staging"):
            for o in [o for o in self.held.staging if o[0] == pid]:
                self._forget(o)

    def forget_ended(self) -> None:
        """Let go of the staging of every process that has ended (a pid reused since is another process)."""
        with self._plane("letting go of ended processes' staging"):
            self._forget_ended()

    def forget_ended_if_free(self) -> None:
        """forget_ended if the data plane is free now, else left for a later time: a look at the server (hello)
        must answer at once, also beside a long copy (waiting for it, hello outlived its client's 10 s, and
        the server was said to be not running)."""
        if self._lock.acquire(blocking=False):
            with self._held("letting go of ended processes' staging"):
                self._forget_ended()

    def _forget_ended(self) -> None:
        # _taken too: a server that gives its context back keeps no staging between requests, only these records
        for o in [o for o in {*self.held.staging, *self._taken} if process_ended(*o)]:
            self._forget(o)

    def settle(self) -> None:
        """A request's copies are done: give back what the server holds on the GPUs unless it keeps its
        context (`gpucr serve --give-back-context`). Called before the result measures the GPUs, so the
        card's use it reports is what the card shows once the request is answered."""
        if not self.keep_context:
            held = {dev: uuid for dev, uuid in self.uuids().items() if dev in self._ctx}
            self.close()
            self._wait_until_released(held)

    def _wait_until_released(self, devs: dict[int, str], limit_s: float = 1.0) -> None:
        """Until NVML no longer counts this server's memory on `devs` ({ordinal: UUID}), at most limit_s.
        On the H200 a checkpoint's result, measured right after the release, still counted the server's
        0.60 GiB context (gpu_used_after_bytes), while a client asking once the answer came finds the server
        holding nothing (test_a_server_that_gives_back_its_context_leaves_the_card_idle): the count lags the
        release, we infer. Costs nothing where NVML shows the server nothing (simcuda, another pid namespace)."""
        if self.vmm.drv.simulated or not devs:
            return
        deadline, me = time.monotonic() + limit_s, os.getpid()
        while any(process_gpu_memory(self.vmm.drv, me, dev, uuid) for dev, uuid in devs.items()):
            if time.monotonic() > deadline:
                return
            time.sleep(0.02)

    def close(self) -> None:
        with self._plane("the server's stop"):
            for ring in (self.ring, self._spare):
                if ring is not None:
                    ring.close()   # unpinned while its context is still there
            for o in list(self.held.staging):   # what it took stays on record: a restore after this one still fills
                self._forget(o, keep_record=True)
            if self.pool is not None:   # unpinned while its context is still there
                self.pool.close()
                self.held.lender = self.pool = self._pool_dev = None
            for dev in list(self._ctx):
                self._release_context(dev)
            self._ctx.clear()
            self._neighbours.clear()

    # ---- the two directions ----
    def copy_out(self, pid: int, layout: dict[str, Any], seg_fds: list[int], memory: list[Managed],
                 scan: bool = True, image: ImageFile | None = None) -> Stats:
        """Every allocation of `layout` (the agent's, after a handover) copied from the GPU into its place in
        staging, through our fds of the memory (memory, by index), or with `image` through the ring into that image's
        file (its zero chunks found as each is written). Raises GpucrError; nothing here changes the process, which
        the agent takes back on failure. scan=False: no zero scan and no digests (`gpucr checkpoint --no-scan`): every
        byte crosses the link, and the fill of this checkpoint copies every byte and checks nothing."""
        return self._locked(f"the copy out of process {pid}", lambda: self._move(
            owner(pid), layout, seg_fds, memory, out=True, scan=scan and image is None, image=image))[0]

    def fill(self, pid: int, layout: dict[str, Any], seg_fds: list[int], memory: list[Managed],
             image: ImageFile | None = None, check: bool = True) -> tuple[Stats, list[tuple[int, int]]]:
        """New memory for every allocation of `layout`, on its GPU (each Managed's UUID), filled from staging;
        returns [(index, fd)] in index order (the caller hands the fds to the agent, then closes them).
        The layout must be what the server took at the process's checkpoint, or, with `image`, the places in that
        image's data file (checked against its manifest), read through the ring with each chunk checked, its zero
        chunks set to zero on the GPU: no staging is made, mapped or pinned for it. A fill of what this mover took sets
        the zero chunks it found then likewise and, unless not `check`, compares the new memory's digests with
        those taken at the checkpoint before returning its fds (checked.py): GpucrError on a mismatch."""
        return self._locked(f"the fill of process {pid}",
                            lambda: self._move(owner(pid), layout, seg_fds, memory, out=False, image=image, check=check))

    def two_way(self, out_pid: int, out_inputs: Inputs, in_pid: int, in_inputs: Inputs,
                give_back: Callable[[int], None], room: Room, scan: bool = True, check: bool = True) -> tuple[Stats, Made]:
        """DataPlane.two_way: both directions under the data plane's lock, taken once (two_way.py)."""
        def go() -> tuple[Stats, Made]:
            for m in out_inputs[2] + in_inputs[2]:   # contexts made before two threads use them
                if m.uuid:
                    self.context(self.ordinal(m.uuid))
            take = TakeOver(self.vmm, self._kept_for_b(out_inputs, in_inputs, room) if self.take_over else {})
            landing = Landing(self.vmm, out_inputs[2], give_back, room, take)

            def out() -> Stats:
                try:
                    return self._move(owner(out_pid), *out_inputs, out=True, scan=scan, switch=landing)[0]
                finally:
                    take.over()   # B's waits for pieces of A end with A's copy out, whatever became of it
            try:
                return both(out, lambda: self._move(owner(in_pid), *in_inputs, out=False, check=check,
                                                    switch=Making(room, take)), room,
                            let_go=lambda made: [os.close(fd) for _idx, fd in made[1]])
            finally:
                take.let_go()
        return self._locked(f"the two-way switch of processes {out_pid} and {in_pid}", go)

    @staticmethod
    def _kept_for_b(out_inputs: Inputs, in_inputs: Inputs, room: Room) -> dict[int, Key]:
        """A's pieces B takes over (two_way.kept_for_b), from both processes' plans."""
        def keys(inputs: Inputs, with_fd: bool) -> list[tuple[int, Key]]:
            by_index = {m.index: m for m in inputs[2]}
            return [(i, key(by_index[i], size)) for i, size, *_ in _checked_plan(inputs[0])[1]
                    if i in by_index and (by_index[i].fd is not None or not with_fd)]
        return kept_for_b(room.free_now(), room.slack, room.ahead, room.behind, keys(out_inputs, True),
                          [k for _i, k in keys(in_inputs, False)])

    def pin_ahead(self, pid: int, layout: dict[str, Any], seg_fds: list[int], uuid: str) -> int:
        """Map and pin the staging a running process holds (kept from an earlier cycle this server did not make), so
        its next checkpoint through the server pins nothing; returns the bytes newly pinned. `uuid`: a GPU the
        process uses (the server's context there pins it)."""
        # Pinned outside the lock: tens of GiB take seconds, and a checkpoint must not wait for them (under
        # the lock, it held a process, handed over, 10.6 s on the H200). A running process has no allocations
        # in its layout yet (they are placed at its handover), so its segments, sized to its data, are pinned
        # whole; but a segment already pinned here as far as it was asked is left alone, also when a copy
        # pinned it only as far as its allocations reached: pinning those whole again re-pinned 69 GiB beside
        # the next checkpoints, whose copies then took 6-7 s instead of ~1 s (two-H200 host, 2026-12-01).
        # And a piece at a time (pinned.py), stopping as soon as a copy wants the data plane: pinning competes
        # with its copies inside the driver; what is pinned stays, and the rest is pinned next time. The
        # segments stay in the cache meanwhile, marked busy: a copy that needs one waits the piece out and
        # goes on from there, instead of mapping and pinning the segment a second time.
        declared, _plan = _checked_plan(layout)
        who = owner(pid)
        stale: list[Segment] = []
        work: list[Segment] = []
        try:
            with self._plane(f"pinning process {pid}'s staging ahead"):
                dev = self.ordinal(uuid)
                self._neighbours.discard(dev)   # the staging is pinned in this context: never given back as a lender's
                ctx = self.context(dev)[0]
                stale, work = self.held.to_pin_ahead(who, declared, seg_fds)
            before = [seg.bytes for seg in work]
            self.vmm.use(ctx)
            for seg in work:   # each stops before its next piece once a copy wants the data plane
                pin_segment(self.vmm, seg, seg.want, lambda: bool(self._wanted) or seg.abandon)
        finally:
            self.held.done_pinning(work)
            for seg in stale:   # unpinned outside the lock too
                self.held.drop(who, seg)
        return sum(seg.bytes - b for seg, b in zip(work, before) if not seg.abandon)

    @contextmanager
    def wanted(self) -> Iterator[None]:
        """While inside, a copy wants the data plane (or a request that will copy is under way): pinning
        ahead stops at its next piece, within ~PIN_PIECE of pinning."""
        with self._wanting:
            self._wanted += 1
        try:
            yield
        finally:
            with self._wanting:
                self._wanted -= 1

    @contextmanager
    def _plane(self, holder: str) -> Iterator[None]:
        """The data plane's lock, for `holder` (what it does, as said to whoever waits for it behind), waited
        for at most plane_wait_s."""
        if not self._lock.acquire(timeout=self.plane_wait_s):
            raise GpucrError(f"the gpucr server's data plane stayed busy for {self.plane_wait_s:g} s, held by "
                             f"{self._holder} (stalled: its staging file on a stalled filesystem?); see the "
                             "server's log, or retry with --no-server")
        with self._held(holder):
            yield

    @contextmanager
    def _held(self, holder: str) -> Iterator[None]:
        """The data plane's lock, just taken, held for `holder`, and released at the end."""
        self._holder = holder
        try:
            yield
        finally:
            self._lock.release()

    def _locked(self, holder: str, move):
        t0 = time.perf_counter()
        with self.wanted(), self._plane(holder):
            waited = time.perf_counter() - t0
            out = move()
        out[0].wait_s = waited
        return out

    # ---- inside ----
    def _move(self, who: Owner, layout: dict[str, Any], seg_fds: list[int], memory: list[Managed], out: bool,
              image: ImageFile | None = None, check: bool = True, scan: bool = True,
              switch: Any = None) -> tuple[Stats, list[tuple[int, int]]]:
        """One copy out or fill (move.py); switch: a two-way switch's hooks (two_way.py)."""
        declared, plan = _checked_plan(layout)
        taken = self._taken.get(who) if self._took(who, plan) else None
        ring = self._ring_for(who, plan, out, image is not None)
        if not out:
            self._check_fill(who, plan, {m.index: m for m in memory}, image is not None)
        st, fds, took = Move(self, who, declared, plan, seg_fds, memory, out, ring, taken, image=image, check=check,
                             scan=scan, switch=switch).run()
        if out and image is None:   # an image's fill reads the image, never this record
            self._taken[who] = took
        return st, fds

    def routing(self, devs: set[int], out: bool, st: Stats) -> Routing:
        """A move's routes through idle NVLink neighbours of the process's GPUs `devs` (lanes.py), this direction's
        streams only."""
        self._neighbours -= devs   # a process's own GPU now: its context is that process's, kept
        routing = Routing(self.vmm, self.links, lambda d: (self.context(d)[0], self.streams(d, out)), devs,
                          self.uuids(), out, CHUNK, st.routes, st.dropped)
        self._neighbours.update(routing.used())
        return routing

    def _check_fill(self, who: Owner, plan: list[tuple[int, int, int, int]], by_index: dict[int, Managed],
                    from_image: bool) -> None:
        """What a fill may make: what this mover took from the process at its checkpoint; else (the CLI's mover,
        a server that did not take it, an image, whose layout the caller matched to the manifest) each allocation
        must be one the agent lists, released, of the same size. Such a fill pins no staging (_ring_for), and what
        it makes goes to that process alone, which could make as much memory itself."""
        if from_image:   # the image's reader wrote the staging: what this mover's last copy out left there is gone
            self._taken.pop(who, None)
        elif self._took(who, plan):
            return
        for idx, size, _seg, _off in plan:
            m = by_index.get(idx)
            if m is None or not m.released or m.bytes != size:
                raise GpucrError(f"the process's layout names allocation {idx} ({size} bytes), which it does not "
                                 "list as released memory of that size")
            if m.not_exportable:   # it had no room for an fd of it (RLIMIT_NOFILE): nor has it for ours now
                raise GpucrError(f"the process could keep no fd of its allocation {idx}: the mover's memory could "
                                 "not reach it")

    def _ring_for(self, who: Owner, plan: list[tuple[int, int, int, int]], out: bool, from_image: bool) -> Ring | None:
        """The ring a move goes through, None for straight copies from pinned staging: the CLI's always; the
        server's for a move to or from an image's file, or a fill of what it did not take itself (a checkpoint by the CLI's mover,
        or by another server), whose staging it pins nothing of on the process's word."""
        if self.ring is not None or (not from_image and (out or self._took(who, plan))):
            return self.ring
        if self._spare is None:
            self._spare = Ring(self.vmm, CHUNK)
        return self._spare

    def _took(self, who: Owner, plan: list[tuple[int, int, int, int]]) -> bool:
        """Whether this mover's last copy out of the process took exactly `plan`."""
        t = self._taken.get(who)
        return t is not None and t.plan == plan

    def let_go_busy_neighbours(self) -> list[str]:
        """Release the server's context on each neighbour GPU a process now uses (it lent its link while it
        was idle; the context, ~0.5 GiB on an H200, must not stay where someone else now works), unless a
        process the server serves is on it since (its copies use that context, its staging may be pinned
        in it). Returns their UUIDs."""
        gone = []
        with self._plane("giving back a lent GPU's context"):
            uuids = self.uuids()
            for dev in sorted(self._neighbours):
                nb = Neighbour(dev, uuids.get(dev, ""))
                if dev in self._ctx and dev != self._pool_dev and not self.links.idle(nb):
                    self._release_context(dev)
                    del self._ctx[dev]
                    self._neighbours.discard(dev)
                    gone.append(nb.uuid)
        return gone

    def ordinal(self, uuid: str) -> int:
        """This server's number for the GPU a process names by UUID (it may number its GPUs otherwise)."""
        if self._ordinals is None:
            self._ordinals = self.vmm.device_by_uuid()
        if uuid in self._ordinals:
            return self._ordinals[uuid]
        raise GpucrError(f"the process's GPU {uuid or '(unknown)'} is not one {self.name} sees")

    def uuids(self) -> dict[int, str]:   # of the GPUs this server has looked up (all it sees, once it looked up one)
        return {o: u for u, o in (self._ordinals or {}).items()}

    # ---- a GPU's context and streams, made once and kept (for a move: move.py) ----
    def context(self, dev: int) -> tuple[int, list[int]]:
        """(context, copy streams) on `dev`, made the first time; NoRoomForServerContext where the GPU has too little
        free memory for it (a park's copy then waits for the driver to take the process's own context off)."""
        if dev not in self._ctx:
            ctx = self.vmm.retain_context(dev)
            try:
                self.vmm.use(ctx)
                streams = [self.vmm.stream() for _ in range(2 * STREAMS)]   # out, then in
                self._side[ctx] = (self.vmm.stream(), self.vmm.stream(), self.vmm.stream())
                self.kernels.load(ctx)   # here, once per context: a copy never waits for a module to load
            except (DriverError, GpucrError):
                self._side.pop(ctx, None)
                self.vmm.release_context(dev)
                raise
            self._ctx[dev] = (ctx, streams)
        return self._ctx[dev]

    def streams(self, dev: int, out: bool) -> list[int]:
        """The streams of the GPU's context a direction's copies go on: a copy out and a fill never queue behind each
        other (a two-way switch runs both at once)."""
        return self._ctx[dev][1][:STREAMS] if out else self._ctx[dev][1][STREAMS:]

    def side(self, ctx: int) -> tuple[int, int, int]:
        """The streams of a context that a copy out's scan runs on, a fill's zero chunks are set on and its check
        runs on."""
        return self._side[ctx]

    def contexts_held(self) -> set[int]:
        """The GPUs on which the mover holds a context now."""
        return set(self._ctx)

    def _release_context(self, dev: int) -> None:
        """The context on `dev` given back after our kernels and streams in it (an app may hold the context still)."""
        ctx, streams = self._ctx[dev]
        side = self._side.pop(ctx, ())
        with suppress(DriverError):   # each step whatever the one before did
            self.kernels.unload(ctx)
        with suppress(DriverError):
            self.vmm.use(ctx)
            for s in (*streams, *side):
                self.vmm.destroy_stream(s)
        with suppress(DriverError):
            self.vmm.release_context(dev)

    def _forget(self, who: Owner, keep_record: bool = False) -> None:
        if not keep_record:
            self._taken.pop(who, None)
        self.held.forget(who)
