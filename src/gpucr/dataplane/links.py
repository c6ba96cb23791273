"""Which other GPUs may lend their host link to the gpucr server's copies (issue 13, item 3).

A GPU of the machine qualifies as a neighbour of the process's GPU when the server sees it (so the user
may use it: the server runs as the user, under the user's CUDA_VISIBLE_DEVICES), the process itself is not
on it, NVML reports the two joined by NVLink, their copy engines reach each other's memory, and NVML shows
no compute process on it but the server. The mover then sends part of the data through it: host <-> the
neighbour over its own PCIe link, neighbour <-> the process's GPU over NVLink. `idle` is asked again before
every piece, so a route is dropped as soon as a process appears on that GPU.

Policy only: the copies themselves are the mover's (mover.py).
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass

from ..driver import Driver, DriverError, gpu_processes, nvlinked
from ..vmm import Vmm


LOOK_EVERY_S = 0.002   # the most a neighbour may have been busy, unseen, while a piece still went through it


@dataclass(frozen=True)
class Neighbour:
    dev: int      # the server's ordinal
    uuid: str


class Links:
    def __init__(self, drv: Driver, vmm: Vmm, enabled: bool = True) -> None:
        self.drv, self.vmm, self.enabled = drv, vmm, enabled
        # fault injection for the test suite: GPUCR_TEST_ROUTE_BUSY_AFTER=N, every neighbour looks busy from
        # the N+1-th look on, as if a process started there in the middle of a copy
        self._test_busy_after = int(os.environ.get("GPUCR_TEST_ROUTE_BUSY_AFTER", "-1"))
        self._looks = 0
        self._idle_at: dict[int, float] = {}   # neighbour ordinal -> when NVML last showed it idle

    def neighbours(self, dev: int, uuids: dict[int, str], busy: set[int]) -> list[Neighbour]:
        """The GPUs that may carry part of a copy to or from GPU `dev` now; `uuids`: {ordinal: UUID} of
        every GPU the server sees; `busy`: GPUs the process itself is on (never borrowed)."""
        if not self.enabled:
            return []
        out = []
        for o, uuid in sorted(uuids.items()):
            if o == dev or o in busy:
                continue
            try:
                reach = self.vmm.can_access_peer(o, dev) and self.vmm.can_access_peer(dev, o)
            except DriverError:
                reach = False
            if reach and nvlinked(self.drv, (o, uuid), (dev, uuids.get(dev))) and self.idle(Neighbour(o, uuid)):
                out.append(Neighbour(o, uuid))
        return out

    def idle(self, nb: Neighbour) -> bool:
        """No compute process on the neighbour but this server (unknown counts as not idle). NVML is asked
        at most every LOOK_EVERY_S per neighbour: a piece takes ~1.2 ms on the link, and a process needs far
        longer than that to start before it can use the GPU."""
        self._looks += 1
        if 0 <= self._test_busy_after < self._looks:
            return False
        now = time.monotonic()
        if now - self._idle_at.get(nb.dev, -1.0) < LOOK_EVERY_S:
            return True
        pids = gpu_processes(self.drv, nb.dev, nb.uuid)
        still = pids is not None and all(p == os.getpid() for p in pids)
        if still:
            self._idle_at[nb.dev] = now
        else:
            self._idle_at.pop(nb.dev, None)
        return still
