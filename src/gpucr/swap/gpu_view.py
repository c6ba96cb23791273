"""The GPUs as the swap service sees them through the server's driver: each one's memory now, and what parking an
app there costs the server itself (room.GpuView).

A park copies through the server's own context on the app's GPU, made at its first copy there. Where it is not
made yet, room must count it: about 520 MiB a GPU on the H200, 64 MiB on simcuda by default. It is measured, once
per GPU, as the driver reports it: the GPU's used memory before and after the server makes its context there (and
lets it go at once; the data plane makes its own when it copies). A context kept between requests costs nothing
more; a server that gives its context back after each request (--give-back-context) pays it at each park."""
from __future__ import annotations

import os
import threading
from typing import Any, Callable

from .. import gpus
from ..driver import Driver, gpu_memory, process_gpu_memory
from ..vmm import NoRoomForServerContext, Vmm


class DriverGpus:
    def __init__(self, drv: Callable[[], Driver], contexts: Callable[[], list[str]],
                 log: Callable[[str], None]) -> None:
        """drv: the server's driver; contexts: the GPUs (uuids) where its data plane holds a context now."""
        self._drv, self._contexts, self._log = drv, contexts, log
        self._cost: dict[str, int] = {}
        self._said: set[str] = set()   # GPUs too full to make the server's context on, said once
        self._lock = threading.Lock()

    def memory(self, uuid: str) -> tuple[int, int] | None:
        drv = self._drv()
        mem = gpus.memory_of(drv, uuid, gpus.machine_gpus(drv))
        return (mem.free, mem.total) if mem is not None else None

    def process_bytes(self, pid: int, status: dict[str, Any]) -> dict[str, int]:
        """Each GPU's bytes process pid holds as the driver counts them (its context included, which a park frees
        too), with what the server made for it at a restore (its agent's status says; the driver charges nobody)."""
        uuids = [str(d.get("uuid", "")) for d in status.get("devices") or []]
        return {u: n.process for u, n in gpus.process_usage(pid, uuids, status).items() if n.process is not None}

    def server_cost(self, uuid: str) -> int:
        if uuid in self._contexts():
            return 0
        with self._lock:
            if uuid not in self._cost:
                cost = self._measure(uuid)
                if cost is None:   # no room to make it: counted as what it may be, measured once there is room
                    return self._guess(uuid)
                self._cost[uuid] = cost
            return self._cost[uuid]

    def context_bytes(self, uuid: str) -> int:
        """What a process's context takes on GPU uuid, for an app whose context the driver could not make: as large
        as the server's own there (measured once, or as the driver counts the server while it holds one)."""
        if self._cost.get(uuid):
            return self._cost[uuid]
        if uuid in self._contexts():
            drv = self._drv()
            gpu = next((g for g in gpus.machine_gpus(drv) if g.uuid == uuid), None)
            held = process_gpu_memory(drv, os.getpid(), gpu.ordinal, uuid) if gpu is not None else None
            if held:
                return held
        return self.server_cost(uuid) or self._guess(uuid)

    def _guess(self, uuid: str) -> int:
        """The server's context on a GPU too full to make it: as large as on another GPU it was measured on, and more
        than what is free there now."""
        mem = self.memory(uuid)
        return max([*self._cost.values(), (mem[0] if mem is not None else 0) + (2 << 20)])

    def _measure(self, uuid: str) -> int | None:
        """The server's context on GPU uuid, in bytes: the GPU's used memory before and after it is made (None: the
        GPU has too little free memory to make it now)."""
        drv = self._drv()
        gpu = next((g for g in gpus.machine_gpus(drv) if g.uuid == uuid), None)
        if gpu is None:
            return 0
        vmm = Vmm(drv)
        before = gpu_memory(drv, gpu.ordinal, uuid)
        try:
            vmm.retain_context(gpu.ordinal)
        except NoRoomForServerContext as exc:
            if uuid not in self._said:
                self._said.add(uuid)
                self._log(f"the server's own context on GPU {uuid} cannot be made to measure it: {exc}; counted in "
                          "room as more than is free there, until it can")
            return None
        try:
            after = gpu_memory(drv, gpu.ordinal, uuid)
        finally:
            vmm.release_context(gpu.ordinal)
        cost = max(0, after.used - before.used) if before is not None and after is not None else 0
        self._log(f"the server's own context on GPU {uuid}: {cost >> 20} MiB (measured; counted in room for a park "
                  "there while the server holds none)")
        return cost
