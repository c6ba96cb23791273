"""`gpucr serve` in the foreground: the server bound, its loops started (pinning ahead, the staging pool, the swap
service), served until `gpucr serve --stop`, SIGTERM or SIGINT, then everything it holds let go."""
from __future__ import annotations

import os
import signal
import threading
from typing import Callable

from .. import sizes
from ..driver import controller_driver
from ..driver_helper import DriverHelper
from ..errors import GpucrError
from ..sizes import pool_target
from . import hugepages
from .daemon import Server, log


def main(idle_exit_s: float | None = None, keep_context: bool = True, routes: bool = True,
         host_budget: str | None = None, park_dir: str | None = None,
         face: Callable[[Server], Callable[[], None]] | None = None, prepare_staging: str = "",
         reserve_hugepages: bool = False, skip_unchanged: bool = False) -> int:
    """Serve until stopped (or, with `idle_exit_s`, that long with no process under gpucr and no request).
    host_budget: 64G or 50% (gpucr.sizes). face(server): another way in, started once the socket is bound (the HTTP
    API); what it returns stops it. reserve_hugepages: prepare_staging's size in hugepages, for as long as it runs.
    skip_unchanged: copies out skip the chunks whose digest did not change since the last (Mover.skip_unchanged)."""
    drv = controller_driver()   # cuInit once, here: a server that cannot reach its driver does not start
    srv = Server(idle_exit_s, keep_context, routes, sizes.budget_bytes(host_budget) if host_budget else None, park_dir)
    srv.skip_unchanged = skip_unchanged
    srv.bind()
    signal.signal(signal.SIGTERM, lambda *_: srv.stopping.set())
    signal.signal(signal.SIGINT, lambda *_: srv.stopping.set())
    log(f"serving uid {os.getuid()} on {srv.path} ({'simcuda' if srv.simulated else 'the system CUDA driver'})")
    hugepages.give_back(hugepages.record_of(srv.path), log, "that a server stopped without giving back left reserved")
    if host_budget:
        disk = srv.swap.disk
        log(f"swap apps park in host memory up to {disk.budget} bytes (--host-budget {host_budget}), then on disk in "
            f"{disk.park_dir.path}" + (f"; for now {why}" if (why := disk.park_dir.problem()) else ""))
    stop_face = None
    drv.helper = _driver_helper()
    try:
        if srv.pins_ahead():
            threading.Thread(target=srv.pin_ahead_loop, daemon=True, name="gpucr-pin-ahead").start()
            prepare, target = pool_target(prepare_staging)   # (issue 28: the first park)
            if prepare and reserve_hugepages and target:   # before the pool, which makes its segments where pages are free
                hugepages.reserve(target, hugepages.record_of(srv.path), log)
            if prepare:
                srv.data_plane().start_pool(target, srv.swap.disk.budget, srv.dir)
                log(f"preparing staging ahead: {'auto' if target is None else f'{target} bytes'}, pinned here")
        threading.Thread(target=srv.swap_loop, daemon=True, name="gpucr-swap").start()
        stop_face = face(srv) if face is not None else None
        srv.serve()
    finally:
        if stop_face is not None:
            stop_face()
        srv.swap.close()
        srv.close()
        if srv._mover is not None:
            srv._mover.close()
        hugepages.give_back(hugepages.record_of(srv.path), log, "reserved for staging made ahead")
        if drv.helper is not None:
            drv.helper.close()
            drv.helper = None
    log("stopped")
    return 0


def _driver_helper() -> DriverHelper | None:
    """The process the driver's calls on apps are made from (driver_helper.py: the server copies beside them);
    without one they are made here, as before, and the log says why."""
    try:
        helper = DriverHelper.start()
    except (GpucrError, OSError) as exc:
        log(f"the driver's calls on processes are made in the server itself, which slows them beside its copies: {exc}")
        return None
    log(f"the driver's calls on processes are made from its helper, process {helper.proc.pid}")
    return helper
