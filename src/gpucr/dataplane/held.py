"""Each process's staging as one mover holds it: its segments mapped here and, in the server, pinned as far as
copies reached or pinning ahead went, kept for as long as each is the same file of the same size (pinned.py).

The mover's data-plane lock guards this (mover.py); pinning ahead works on a segment outside that lock, marked
busy, and `settled` waits for it to stop at the end of its piece before the segment is used or let go.
"""
from __future__ import annotations

import threading
import time
from typing import Any, Callable, Iterable, Protocol

from ..vmm import Vmm
from ..errors import GpucrError
from ..plane import Stats
from .layout import reach
from .pinned import Segment, drop, open_segment, same_file
from .pinned import pin as pin_segment

Owner = tuple[int, int]   # (pid, start time): a pid reused by another process never meets the dead one's staging


class Lender(Protocol):
    """Where segments made and pinned ahead come from (staging_pool.py): a lent one is adopted, not mapped again."""

    def adopt(self, fd: int, declared: int) -> Segment | None: ...

    def give_back(self, seg: Segment, who: Owner) -> bool: ...


class Held:
    """The segments of each process (by owner), and those let go that the driver did not unpin (stuck)."""

    def __init__(self, vmm: Vmm, wait_s: Callable[[], float], said: Callable[[str], None]) -> None:
        self.vmm = vmm
        self._wait_s = wait_s   # the mover's plane_wait_s, read when a wait starts (tests lower it)
        self._said = said
        self.staging: dict[Owner, dict[int, Segment]] = {}   # process -> segment index -> segment
        self.stuck: list[tuple[Owner, Segment]] = []         # let go, but the driver did not unpin them (drop)
        self.idle = threading.Condition()   # a segment's pinning ahead ended (Segment.busy cleared)
        self.lender: Lender | None = None   # the server's staging pool, when it prepares staging ahead

    def _open(self, seg_fds: list[int], i: int, declared: int) -> Segment:
        """Segment i mapped here: the pool's mapping, pinned already, when it lent that file; else mapped now."""
        fd = segment_fd(seg_fds, i)
        lent = self.lender.adopt(fd, declared) if self.lender is not None else None
        return lent if lent is not None else open_segment(fd, i, declared)

    def holdings(self) -> list[dict[str, Any]]:
        """Mapped and pinned bytes by owner (pid, start time); `stuck`: let go, but the driver did not unpin it."""
        # copies of the dicts (atomic under the GIL): a copy or a pin ahead may change them meanwhile
        held = [(o, s, False) for o, segs in list(self.staging.items()) for s in list(segs.values())]
        held += [(o, s, True) for o, s in list(self.stuck)]
        out: dict[tuple[Owner, bool], dict[str, Any]] = {}
        for (pid, start), seg, stuck in held:
            h = out.setdefault(((pid, start), stuck), {"pid": pid, "start_time": start, "mapped_bytes": 0,
                                                       "pinned_bytes": 0, "stuck": stuck})
            h["mapped_bytes"] += seg.declared
            h["pinned_bytes"] += seg.stuck + seg.bytes   # (a stuck one's pieces: still pinned if never unpinned)
        return list(out.values())

    def map(self, who: Owner, want: dict[int, int], seg_fds: list[int], st: Stats, declared: dict[int, int],
            pin: bool = True) -> dict[int, Segment]:
        """Each segment i of `want` ({index: bytes}) mapped here and, if `pin`, pinned at least that far (in the
        current context); cached segments the process no longer has (not `declared`) are let go."""
        segs = self.staging.setdefault(who, {})
        self.let_go_absent(who, segs, declared)
        out: dict[int, Segment] = {}
        for i, size in want.items():
            have = segs.get(i)
            if have is not None:
                self.settled(have)   # pinned ahead just now: that piece finished (we want the data plane)
            if not is_segment(have, seg_fds, i, declared[i]):
                if have is not None:
                    self.drop(who, segs.pop(i))
                have = segs[i] = self._open(seg_fds, i, declared[i])
            t0 = time.perf_counter()
            if pin and pin_segment(self.vmm, have, size):
                st.pin_s += time.perf_counter() - t0
            out[i] = have
        return out

    def pinned_for(self, who: Owner, plan: list[tuple[int, int, int, int]], seg_fds: list[int],
                   declared: dict[int, int]) -> bool:
        """Whether every segment a copy out needs is mapped and pinned here already, as far as it reaches: the
        same file of the same size (or one the pool lent, pinned whole)."""
        segs = self.staging.get(who, {})
        return all((seg := self._known(segs, seg_fds, i, declared.get(i, -1))) is not None and seg.bytes >= need
                   for i, need in reach(plan).items())

    def _known(self, segs: dict[int, Segment], seg_fds: list[int], i: int, size: int) -> Segment | None:
        """Segment i as mapped here already: in the process's cache, or lent by the pool (a first checkpoint)."""
        if is_segment(segs.get(i), seg_fds, i, size):
            return segs[i]
        if self.lender is None or not 0 <= i < len(seg_fds):
            return None
        return self.lender.adopt(seg_fds[i], size)

    def to_pin_ahead(self, who: Owner, declared: dict[int, int], seg_fds: list[int]) -> tuple[list[Segment], list[Segment]]:
        """For pinning ahead: (segments to let go, segments to pin further, marked busy). Each segment the process
        states is mapped (cheap) and asked pinned whole; one pinned already as far as it was asked is left alone."""
        segs = self.staging.setdefault(who, {})
        stale = [segs.pop(i) for i in [i for i in segs if i not in declared]]
        for i, n in sorted(declared.items()):
            if not is_segment(segs.get(i), seg_fds, i, n):
                fresh = self._open(seg_fds, i, n)
                fresh.want = max(fresh.want, n)
                if i in segs:
                    stale.append(segs.pop(i))
                segs[i] = fresh
        work = [seg for _i, seg in sorted(segs.items()) if seg.bytes < seg.want]
        for seg in work:
            seg.busy = True
        return stale, work

    def done_pinning(self, work: Iterable[Segment]) -> None:
        with self.idle:
            for seg in work:
                seg.busy = False
            self.idle.notify_all()

    def let_go_absent(self, who: Owner, segs: dict[int, Segment], present: Iterable[int]) -> None:
        """Unpin and unmap the cached segments the process no longer has."""
        keep = set(present)
        for i in [i for i in segs if i not in keep]:
            self.drop(who, segs.pop(i))

    def forget(self, who: Owner) -> None:
        """Let go of every segment of `who`, with one deadline for all: a pin ahead that stalls holds each it works on."""
        until = time.monotonic() + self._wait_s()
        for seg in self.staging.pop(who, {}).values():
            self.drop(who, seg, until)

    def settled(self, seg: Segment, until: float | None = None) -> None:
        """Until no pin ahead works on `seg` (it stops at the end of its piece: the caller wants the data plane),
        at most the mover's plane_wait_s or until the monotonic time `until`."""
        wait_s = self._wait_s() if until is None else max(until - time.monotonic(), 0.0)
        with self.idle:
            if not self.idle.wait_for(lambda: not seg.busy, timeout=wait_s):
                raise GpucrError(f"pinning the process's staging ahead did not stop within {self._wait_s():g} s")

    def drop(self, who: Owner, seg: Segment, until: float | None = None) -> None:
        """Unpin and unmap `seg`, once a pin ahead that works on it has stopped, at the end of its piece. One
        that the pin ahead does not leave in time (see settled), or that the driver does not unpin, is said and
        kept (mapped: its address is never reused) among the stuck, so that the server still shows it. One the
        pool lent goes back to it (it frees it, or keeps it for another app)."""
        if self.lender is not None and self.lender.give_back(seg, who):
            return
        seg.abandon = True
        try:
            self.settled(seg, until)
            drop(self.vmm, seg)
        except GpucrError as exc:
            self.stuck.append((who, seg))
            self._said(f"process {who[0]}'s staging: {exc}")


def segment_fd(seg_fds: list[int], i: int) -> int:
    if not 0 <= i < len(seg_fds):
        raise GpucrError(f"the process's staging segment {i} came without its file")
    return seg_fds[i]


def is_segment(have: Segment | None, seg_fds: list[int], i: int, size: int) -> bool:
    """Whether `have` is segment i as the process states it now: its file (fd now), of `size` bytes."""
    return have is not None and 0 <= i < len(seg_fds) and have.declared == size and same_file(have, seg_fds[i])
