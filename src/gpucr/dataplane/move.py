"""One move of one process's GPU memory by the server's data plane (mover.py): a copy out into its staging (or an
image's file), or a fill of new memory from it. Each allocation is imported (out) or made (in) and mapped here, its
copies queued as soon as it is mapped, beside the kernels that scan a copy out or check a fill (sweep.py), over the
GPU's own link or routes through idle neighbours (lanes.py). Nothing of the process changes here: on failure every
mapping and handle of ours goes, and the fds (the agent's or ours) keep the memory."""
from __future__ import annotations

import os
import time
from contextlib import suppress
from typing import TYPE_CHECKING, Any

from ..driver import DriverError
from ..errors import GpucrError
from ..memory import Managed
from ..plane import ImageFile, Stats
from .checked import Checker, Taken, forget_held, note_held, out_runs
from .chunks import Spans, spans, zero_within
from .held import Owner
from .lanes import Routing
from .layout import reach
from .mappings import Mappings
from .pinned import Segment, file_segment
from .ring import Piece, Ring
from .scan import AllocationScan, Scanner
from .sweep import Part, parts_of, step as sweep_step
from .two_way import key

if TYPE_CHECKING:
    from .mover import Mover

CHUNK = 64 << 20   # copies queued in pieces, round-robin over the streams, so the copy engines stay busy


class Move:
    """mover: the server's (or the CLI's) Mover, whose contexts, streams, staging and kernels this move uses.
    taken: what the mover's last copy out of the process took, where it took exactly this plan (else None).
    switch: a two-way switch's hooks (two_way.py): out, each allocation handed to `switch.queued` once all its
    copies are queued (it gives it back as they land); in, each made through `switch.make` (it waits for room)."""

    def __init__(self, mover: Mover, who: Owner, declared: dict[int, int], plan: list[tuple[int, int, int, int]],
                 seg_fds: list[int], memory: list[Managed], out: bool, ring: Ring | None, taken: Taken | None, image: ImageFile | None = None,
                 check: bool = True, scan: bool = True, switch: Any = None) -> None:
        self.mover, self.vmm, self.who, self.seg_fds, self.out = mover, mover.vmm, who, seg_fds, out
        self.ring, self.taken, self.image, self.switch = ring, taken, image, switch
        self.st = Stats()
        self.t0 = time.perf_counter()
        self.declared, self.plan = declared, plan   # the process's layout, checked (layout.checked_plan)
        # zero chunks set on the GPU at a fill: an image's, or those this mover found at the checkpoint; a copy
        # out's are found by its scan as each allocation is mapped (scan.py)
        zeros: Spans = dict(image.zeros) if image is not None else taken.zeros() if taken and not out else {}
        self.zeros = {i: sorted(z) for i, z in zeros.items()}
        self.by_index = {m.index: m for m in memory}
        on = {i: mover.ordinal(self.by_index[i].uuid) for i, *_ in self.plan if i in self.by_index}   # index -> GPU
        per_gpu: dict[int, int] = {}
        for i, size, *_ in self.plan:
            if i in on:
                per_gpu[on[i]] = per_gpu.get(on[i], 0) + size
        self.last_on = {dev: i for i, dev in on.items()}   # each GPU's last allocation (the plan is in order)
        self.maps = Mappings(self.vmm, per_gpu)   # ours, to unmap (and release, out) afterwards
        self.made: list[tuple[int, int]] = []     # (index, handle) of new memory (fill)
        self.fds: list[tuple[int, int]] = []      # (index, fd) of it, exported as it is made
        self.where: dict[int, tuple[int, int, int, int, int]] = {}   # allocation index -> (size, seg, off, va, dev)
        self.handles: dict[int, int] = {}   # allocation index -> its handle here (a switch gives it back)
        self.taken_over: set[int] = set()   # a switch's fill: allocations that are pieces of the app going out
        self.unqueued: dict[int, int] = {}  # allocation index -> its bytes whose copies are not queued yet (a switch's out)
        self.touched: dict[int, set[int]] = {}   # GPU -> the streams that wrote its parts not checked yet (a fill)
        self.turn = 0
        # routes through idle NVLink neighbours of the process's GPUs (lanes.py), chosen before anything is
        # mapped: each mapping must let the neighbours' copy engines reach it
        self.routing = mover.routing(set(per_gpu), out, self.st)
        # the kernels beside the copies (sweep.py), in parts of each allocation: a copy out's scan, a fill's check
        sizes = [(i, on[i], size) for i, size, *_ in self.plan if i in on]
        self.part = sweep_step() if image is None else 1 << 62   # an image's: whole allocations, each piece a chunk of it
        # each on a stream of its own: a two-way switch scans its copy out while it checks its fill
        self.scanner = (Scanner(mover.kernels, lambda c: mover.side(c)[0], sizes, self.part) if out and scan
                        else None)
        self.checker = (Checker(mover.kernels, lambda c: mover.side(c)[2], sizes, taken, self.part)
                        if not out and check and image is None and taken is not None and taken.scanned else None)
        self.staged: dict[int, Segment] | None = None
        self.early = True   # each allocation's copies queued as soon as it is mapped
        self.due: list[Part] = []   # a copy out's parts scanned, their copies not queued yet

    def run(self) -> tuple[Stats, list[tuple[int, int]], Taken | None]:
        """(stats, [(index, fd)] of a fill's new memory, what a copy out took); GpucrError when it failed, after
        undoing all of ours."""
        ok = False
        try:
            self._go()
            ok = True
        except (DriverError, GpucrError) as exc:
            for _idx, fd in self.fds:
                os.close(fd)   # exported before one failed: they would keep that memory on the GPU
            self.routing.close()
            self._sync(quiet=True)   # nothing may still copy into what is unmapped next
            if self.out:   # a copy that did not finish: what the staging holds where is no longer known
                forget_held(list(self.mover.held.staging.get(self.who, {}).values()))
            self._undo(self.switch.kept(self.maps.all()) if self.switch is not None and self.out else self.maps.all())
            raise GpucrError(f"{self.mover.name}'s copy {'out' if self.out else 'in'} failed: {exc}") from exc
        finally:
            self.routing.close()
            for sweeps in (self.scanner, self.checker):
                if sweeps is not None:
                    sweeps.close(failed=not ok)
        mapped = self.maps.all()
        if self.switch is not None and self.out:
            mapped = self.switch.kept(mapped)   # the last pieces given back; what was not stays ours to undo
        self._undo(mapped)   # our mappings go; the fds (theirs or ours) keep the memory
        self.mover.kernels.trim()   # the scans' result buffers: every copy is done, so freeing them waits for none
        if self.switch is not None and self.out and self.switch.error is not None:   # after the undo: nothing ours stays
            raise GpucrError(f"{self.mover.name}'s copy out failed: giving back memory as its copy landed failed: "
                             f"{self.switch.error}")
        self.st.seconds, self.st.taken_over = time.perf_counter() - self.t0, len(self.taken_over)
        return self.st, sorted(self.fds), self.taken

    def _go(self) -> None:
        out, st = self.out, self.st
        # a fill: the staging first (what the server took at the checkpoint, whose sizes the driver checked
        # then), and each allocation's copies queued as soon as it is made, overlapping the making of the next.
        # A copy out likewise when its staging is held pinned already (the cycles after the first): nothing is
        # pinned on the process's word then, so each allocation's copies start once it is imported
        pinned = (self.image is None and self.ring is None
                  and self.mover.held.pinned_for(self.who, self.plan, self.seg_fds, self.declared))
        if not out or pinned:
            self.staged = self._staging()
            if out and self.taken is None:   # another plan: what the staging holds is not known
                forget_held(list(self.staged.values()))
        # a copy out waits for the scan only where it may skip chunks the staging holds from its last copy out:
        # each part's copies are queued once its batch of the scan is read, while the next are scanned (scan.py).
        # Else (a first cycle, or asked not to scan) each allocation's copies start once it is imported, the scan
        # beside them; the CLI's mover, whose staging is mapped after every import, queues them after that
        self.early = not out or (self.staged is not None and self.switch is None
                                 and (self.scanner is None or not any(g.held for g in self.staged.values())))
        for idx, size, seg, off in self.plan:
            self._map(idx, size, seg, off)
        if out:
            self._queue_rest()
        td = time.perf_counter()
        self._sync()
        st.straight_s = time.perf_counter() - self.t0
        st.drain_s = time.perf_counter() - td
        self.routing.finish()   # raises what its thread raised
        st.route_s, st.looks_s = time.perf_counter() - self.t0, self.routing.looks_s
        self._sync()   # the pieces the routes' thread sent straight after giving a route up
        if out and self.image is None:   # what the staging holds now, chunk by chunk (checked.py)
            note_held(self.staged, self.plan, self.taken, self.mover.skip_unchanged)
        if self.checker is not None:
            tc = time.perf_counter()   # before the fds go back: a fill whose bytes differ is undone
            st.digests_compared = self.checker.finish()
            st.checked, st.check_s = True, time.perf_counter() - tc

    def _map(self, idx: int, size: int, seg: int, off: int) -> None:
        """Allocation idx imported (out) or made (in) and mapped here, its copies queued (or its scan started)."""
        m = self.by_index.get(idx)
        if m is None or (self.out and m.fd is None):
            raise GpucrError(f"the process did not hand over its allocation {idx} ({size >> 20} MiB)")
        dev = self.mover.ordinal(m.uuid)
        tm = time.perf_counter()
        ctx, _streams = self.mover.context(dev)
        self.vmm.use(ctx)
        if self.out:
            h = self.vmm.import_fd(m.fd)
        else:   # as the allocation was made; in a switch, once room for it is free, or one of A's taken over
            create = lambda: self.vmm.create(size, dev, flags=m.flags)   # noqa: E731 - made here or in the switch
            h, fd = self.switch.make(create, key(m, size)) if self.switch is not None else (create(), None)
            self.made.append((idx, h))
            if fd is not None:   # its fd for the process already: closed with the others if the fill fails
                self.fds.append((idx, fd))
                self.taken_over.add(idx)
        self.handles[idx] = h
        va, reachable = self.maps.map(h, size, dev, self.routing.access(dev), idx)
        self.where[idx] = (size, seg, off, va, dev)
        if idx == self.last_on.get(dev):
            reachable += self.maps.flush(dev)
        self.st.make_s += time.perf_counter() - tm
        for i in reachable:
            self._reachable(i)

    def _reachable(self, idx: int) -> None:
        """Allocation idx mapped with access: a fill's exported, its copies queued (or its scan started)."""
        size, seg, off, va, dev = self.where[idx]
        ctx = self.mover.context(dev)[0]
        if not self.out and idx not in self.taken_over:
            # exported now, while the copies already queued run, not after the last one drained: the fds
            # reach the process only once this returns, every copy done
            te = time.perf_counter()
            self.fds.append((idx, self.vmm.export_fd(self.handles[idx])))
            self.st.export_s += time.perf_counter() - te
        for lo, n in parts_of(size, self.part):
            if self.early:
                self._enqueue(idx, size, seg, off, va, dev, lo, n)
            if self.checker is not None:   # after this part's copies, beside the next ones
                self.checker.add(dev, ctx, idx, va, lo, n)
                if self.checker.due(dev) and self.ring is None and self.routing.share(dev) == 1:   # else once synced
                    self.checker.launch(dev, sorted(self.touched.pop(dev, ())))   # after what wrote its parts
            if self.scanner is not None:
                self.scanner.add(dev, ctx, idx, va, lo, n)
                if not self.early:
                    self.due += self.scanner.ready()
                    if self.staged is not None:
                        self._queue_scanned()

    def _queue_rest(self) -> None:
        """A copy out's copies not queued yet: every import is mapped first, the driver checking each size against
        the real memory, so the staging pinned next is no more than the process has on the GPU."""
        queued = self.staged is not None and self.early
        if self.staged is None:
            self.staged = self._staging()
            if self.taken is None:
                forget_held(list(self.staged.values()))
        if self.scanner is not None:
            self.due += self.scanner.ready(every=True)
            self.taken = Taken(self.plan, {i: self.scanner.scans[i] for i in self.where})
            st = self.st
            st.scanned, st.scan_s, st.scan = sum(w[0] for w in self.where.values()), self.scanner.wait_s, True
        else:
            self.taken = Taken(self.plan, scanned=False)
        if self.scanner is not None and not queued:
            self._queue_scanned()
        elif not queued:
            for idx, *_rest in self.plan:
                self._enqueue(idx, *self.where[idx])

    def _staging(self) -> dict[int, Segment]:
        if self.image is not None:   # its file, read into the ring's slots: nothing here to map or pin
            return {0: Segment((0, 0), 0, self.image.size, file_io=self.image.move)}
        ts = time.perf_counter()
        # a fill reads the staging's file through the ring; a copy out writes the staging mapped: writes to one file
        # take its inode's lock, so the ring's threads wrote one at a time (16 GiB at 5.4 GB/s on an H100, a CLI
        # checkpoint 9.4x its bound), where their memmoves into the mapping run side by side
        files = self._files() if self.ring is not None and not self.out else None
        if files is not None:
            self.st.stage_s += time.perf_counter() - ts
            return files
        first = self.by_index.get(self.plan[0][0]) if self.plan else None
        if first is not None:   # pinned in a context on the process's GPU (portable: for all)
            self.vmm.use(self.mover.context(self.mover.ordinal(first.uuid))[0])
        staged = self.mover.held.map(self.who, reach(self.plan), self.seg_fds, self.st, self.declared,
                                     pin=self.ring is None)
        self.st.stage_s += time.perf_counter() - ts
        return staged

    def _files(self) -> dict[int, Segment] | None:
        """Each segment the plan reaches as the ring reads it from its file with pread, nothing mapped here; None
        where one must be mapped (hugetlbfs), or has no file handed (held.map refuses it then)."""
        files = {}
        for i in reach(self.plan):
            g = file_segment(self.seg_fds[i], i, self.declared[i]) if i < len(self.seg_fds) else None
            if g is None:
                return None
            files[i] = g
        return files

    def _queue_scanned(self) -> None:
        """A copy out's parts whose scan came back: their copies, zero chunks skipped where staging holds them."""
        assert self.scanner is not None
        for p in self.due:
            size, seg, off, va, dev = self.where[p.index]
            self._enqueue(p.index, size, seg, off, va, dev, p.at, p.size, self.scanner.scans[p.index])
        self.due = []

    def _enqueue(self, idx: int, size: int, seg: int, off: int, va: int, dev: int, lo: int = 0,
                 n: int | None = None, scan: AllocationScan | None = None) -> None:
        """The copies (and memsets) of [lo, lo + n) of allocation idx (default all); scan: a copy out's (checked.py)."""
        out, st = self.out, self.st
        tq = time.perf_counter()
        ctx, streams = self.mover.context(dev)[0], self.mover.streams(dev, out)
        self.vmm.use(ctx)
        assert self.staged is not None
        g = self.staged[seg]
        share = 1 if self.switch is not None else self.routing.share(dev)   # a switch's way is the GPU's own link
        hi = size if n is None else lo + n
        runs = (out_runs(g, off, lo, hi, scan) if scan is not None else
                [(a, b, False, z) for a, b, z in spans(lo, hi, zero_within(self.zeros.get(idx, []), lo, hi))])
        for start, length, held, zero in runs:
            if held:   # the staging holds these bytes already (checked.py)
                st.skipped(length, zero)
                continue
            if zero and not out:   # nothing to carry over the link
                s = self.mover.side(ctx)[1]
                self.vmm.memset(va + start, length, s)
                self.touched.setdefault(dev, set()).add(s)
                st.zeroed += length
                continue
            if self.ring is not None:   # the staging is not pinned here: through the ring, a slot at a time
                step, end = self.ring.slot_bytes, off + start + length
                for k in range(off + start, end, step):
                    self.ring.put(Piece(ctx, g.addr + k, va + k - off, min(step, end - k), out, g.file_io))
                continue
            for k, n in g.cuts(off + start, length, CHUNK):   # never over a pinned piece's end
                host, dva = g.addr + k, va + k - off
                route, self.turn = self.turn % share, self.turn + 1
                if route:
                    self.routing.put(dev, host, dva, n)
                    continue
                s = streams[self.turn % len(streams)]
                if out:
                    self.vmm.d2h(host, dva, n, s)
                else:
                    self.vmm.h2d(dva, host, n, s)
                self.touched.setdefault(dev, set()).add(s)
        st.bytes += hi - lo
        st.allocations += lo == 0
        st.queue_s += time.perf_counter() - tq
        if self.switch is not None and out:
            self.unqueued[idx] = self.unqueued.get(idx, size) - (hi - lo)
            if self.unqueued[idx] == 0:   # given back as soon as all its copies land
                self.switch.queued(idx, self.handles[idx], va, size, ctx, streams, self.maps.unmap_one)

    def _sync(self, quiet: bool = False) -> None:
        """Every straight copy of this direction queued so far on the process's GPUs done (a two-way switch's other
        direction is not waited for); quiet: errors aside, each GPU still waited for (a path already failing: the
        memory the copies touch is unmapped next)."""
        if self.ring is not None:
            self.ring.drain(quiet)
        for dev in {w[4] for w in self.where.values()} & self.mover.contexts_held():
            ctx = self.mover.context(dev)[0]
            side = self.mover.side(ctx)
            try:
                self.vmm.use(ctx)
                # the kernels and zero chunks too: on what is unmapped next
                for s in [*self.mover.streams(dev, self.out), *((side[0],) if self.out else side[1:])]:
                    self.vmm.sync(s)
            except DriverError:
                if not quiet:
                    raise

    def _undo(self, mapped: list[tuple[int, int, int]]) -> None:
        """Our mappings, and the handles of what we imported (out) or made (a fill), gone; each step whatever the
        others did (the fds, theirs or ours, keep the memory)."""
        self.maps.unmap(mapped, release=self.out)
        for _idx, h in self.made:
            with suppress(DriverError):
                self.vmm.release(h)
