"""The server's requests on its swap service, beside `swap_register`: its view (`swap_view`: apps, GPUs, host memory,
recent switches; `swap_app`: one app), and an app parked, resumed or its policy changed by hand (`swap_park`, `swap_resume`, `swap_set`).
The HTTP API (gpucr.service_http), `gpucr top` and any client of the socket ask these same requests, with the same
checks and the same words.

The view is read from what the server holds: the swap registry, the switch counts, the server's own description and
each GPU's memory as the driver says. It sends no request to any agent: a scrape or a page refresh every second
costs the apps nothing (agents have 8 connection slots).
"""
from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any, Callable

from .. import gpus
from ..driver import controller_driver
from ..errors import GpucrError
from ..swap.apps import ON_DISK, PARKED, RESIDENT, SwapApp, now
from ..swap.stats import RECENT_SWITCHES

if TYPE_CHECKING:
    from .daemon import Server

NO_SUCH_APP = 4   # the error code of a request naming no swap app (HTTP 404)
Run = Callable[[], Any]


def _name(a: dict[str, Any]) -> str:
    name = a["name"]
    if not isinstance(name, str) or not name:
        raise ValueError(f"{name!r} is not a swap app's name")
    return name


def _app(s: Server, name: str) -> SwapApp:
    app = s.swap.apps.by_name(name)
    if app is None:
        raise GpucrError(f"no swap app named {name!r} runs under this gpucr server; 'gpucr ps' lists them",
                         code=NO_SUCH_APP)
    return app


def _who(a: dict[str, Any]) -> str:
    """Who asked, as the log says it: the HTTP API or `gpucr top` name themselves; another client is 'a client'."""
    by = a.get("by", "a client")
    if not isinstance(by, str) or not by.isprintable() or len(by) > 40:
        raise ValueError("by must be a short printable string")
    return by


def app_row(s: Server, app: SwapApp, at: float, wall: float) -> dict[str, Any]:
    """An app as the view shows it: its `gpucr ps` row, where its memory is (on the GPU, parked in host memory, on
    disk), its GPUs, when it last submitted work, and its switch counts."""
    row = app.row(at)
    parked = (app.host_bytes or app.vmm_bytes) if app.state == PARKED else 0
    row.update({"gpus": sorted(set(app.held) | set(app.ordinals.values())),
                "resident_bytes": sum(app.held.values()), "parked_host_bytes": parked,
                "parked_disk_bytes": app.vmm_bytes if app.state == ON_DISK else 0,
                "last_activity_at": round(wall - app.idle_s(at), 3)})
    row.update(s.swap.stats.row(app.pid))
    return row


def gpu_rows(info: dict[str, Any], apps: list[SwapApp]) -> list[dict[str, Any]]:
    """Each GPU of the machine: its memory (total, used) as the driver says, split into the swap apps' (each named),
    the server's own (its context) and the rest (other processes, other users', what nothing counts)."""
    drv = controller_driver()
    server_own = {g["uuid"]: g["process_bytes"] for g in info.get("gpus") or []}
    rows = []
    for g in gpus.machine_gpus(drv):
        mem = gpus.memory_of(drv, g.uuid, [g])
        held = {a.name: a.held.get(g.uuid, 0) for a in apps if a.held.get(g.uuid, 0) > 0}
        own = server_own.get(g.uuid) or 0
        used = mem.used if mem is not None else None
        rows.append({"uuid": g.uuid, "name": g.name, "total_bytes": mem.total if mem is not None else None,
                     "used_bytes": used, "apps_bytes": sum(held.values()), "server_bytes": own,
                     "others_bytes": max(0, used - sum(held.values()) - own) if used is not None else None,
                     "apps": held})
    return rows


def view(s: Server, switches: int = RECENT_SWITCHES) -> dict[str, Any]:
    info = s.info()
    apps = sorted(s.swap.apps.all(), key=lambda a: a.name)
    at, wall = now(), time.time()
    return {"at": round(wall, 3),
            "server": {k: info.get(k) for k in ("pid", "simulated", "up_s", "requests", "in_flight", "driver_version",
                                                "pinned_staging_bytes", "http")},
            "host": {**info["swap_host"], "pinned_bytes": info.get("pinned_staging_bytes", 0)},
            "gpus": gpu_rows(info, apps),
            "apps": [app_row(s, a, at, wall) for a in apps],
            "switches": s.swap.stats.recent(switches)}


def _swap_view(s: Server, a: dict[str, Any]) -> Run:
    n = a.get("switches", RECENT_SWITCHES)
    if isinstance(n, bool) or not isinstance(n, int) or not 0 <= n <= RECENT_SWITCHES:
        raise ValueError(f"switches must be a whole number from 0 to {RECENT_SWITCHES}")
    return lambda: view(s, n)


def _swap_app(s: Server, a: dict[str, Any]) -> Run:
    name = _name(a)
    return lambda: app_row(s, _app(s, name), now(), time.time())


def _swap_park(s: Server, a: dict[str, Any]) -> Run:
    name, who = _name(a), _who(a)

    def run() -> Any:
        app = _app(s, name)
        if app.state != RESIDENT:
            raise GpucrError(f"swap app {name} is {app.state}, not resident: only a resident app can be parked")
        if not s.swap.park(app.pid, f"asked by {who}"):
            raise GpucrError(f"swap app {name} was not parked: {app.why or 'it is ' + app.state}")
        return app_row(s, app, now(), time.time())
    return run


def _swap_resume(s: Server, a: dict[str, Any]) -> Run:
    name, who = _name(a), _who(a)

    def run() -> Any:
        app = _app(s, name)
        if app.state not in (PARKED, ON_DISK):
            raise GpucrError(f"swap app {name} is {app.state}, not parked: only a parked app can be resumed")
        if not s.swap.resume(app.pid, 0, f"asked by {who}"):
            raise GpucrError(f"swap app {name} was not resumed: {app.why or 'it is ' + app.state}")
        return app_row(s, app, now(), time.time())
    return run


def _swap_set(s: Server, a: dict[str, Any]) -> Run:
    name, who = _name(a), _who(a)
    changes = s.swap.policy_changes({k: v for k, v in a.items() if k != "by"})

    def run() -> Any:
        app = _app(s, name)
        s.swap.set_policy(app.pid, changes, who)
        return app_row(s, app, now(), time.time())
    return run


HANDLERS: dict[str, Callable[[Server, dict[str, Any]], Run]] = {
    "swap_view": _swap_view,
    "swap_app": _swap_app,
    "swap_park": _swap_park,
    "swap_resume": _swap_resume,
    "swap_set": _swap_set,
}
LOOKS = ("swap_view", "swap_app")   # a look at the server, as hello is: not counted as a request served
