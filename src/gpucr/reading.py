"""What a process under gpucr is now, read and never changed: `gpucr status` and `gpucr ps`, with the live
certificate of a checkpoint held in host memory."""
from __future__ import annotations

import os
from typing import Any

from . import gpus, manifest, shape
from .dataplane import budget
from . import target as targets
from .app import AppChannel
from .driver import ProcessState
from .errors import GpucrError
from .results import SCHEMA_VERSION, ProcessStatus, StatusResult, Unreachable


def status(pid: int) -> ProcessStatus:
    """The live state of a process under gpucr, as the agent and the driver see it, with the memory
    it holds on each of its GPUs."""
    t = targets.resolve(pid)
    st = read(t)
    return shape.process_status(st, gpus.process_usage(t.pid, [d["uuid"] for d in st.get("devices", [])], st))


def read(t: targets.Target) -> dict[str, Any]:
    """The agent's status of `t`, with the driver's view, its level and (checkpointed) its live certificate."""
    pid = t.pid
    with t.connect() as agent:
        st = agent.call("status", timeout=10.0)
    st.pop("ok", None)
    st.update(budget.status_fields(t.socket.parent, pid, st.get("staging_settings") or {}))   # the plane keeps it
    st["start_time"] = t.start_time
    st["cmd"] = targets.command_line(pid)
    level = None
    if st.get("cuda"):
        try:
            drv_state = t.driver().state(pid)
        except GpucrError as exc:   # no CUDA state, a stopped process, a driver that did not answer
            st["driver_state"] = f"unknown: {exc}"
            st["level"], st["committed"] = None, False
            return st
        st["driver_state"] = drv_state.name.lower()
        if drv_state == ProcessState.CHECKPOINTED:
            st["state"], level = "checkpointed", "full"
        elif drv_state != ProcessState.RUNNING:
            st["state"], level = "checkpointed", "full"
        elif st["state"] == "checkpointed":
            level = "data"
    st["level"] = level
    st["committed"] = _committed_as_left(st)
    if level is not None:
        st["certificate"] = _live_certificate(t, st, level)
    return st


def _committed_as_left(st: dict[str, Any]) -> bool:
    """The agent's committed checkpoint, still as its controller left it: the driver holds the process checkpointed
    at level full, running at level data. A restore killed after the driver's steps leaves a full one running with
    its gate closed: stuck, not parked on purpose."""
    as_left = {"full": "checkpointed", "data": "running"}.get(st.pop("committed_level", ""))
    return bool(st.get("committed")) and as_left is not None and st.get("driver_state") == as_left


def _live_certificate(t: targets.Target, st: dict[str, Any], level: str) -> dict[str, Any]:
    """The certificate of a checkpoint held in memory: what it covers, as an image's manifest says it
    (per-chunk digests are computed only when the data is written to an image)."""
    allocs: list[dict[str, Any]] = []
    if st.get("staged"):
        try:
            with t.connect() as agent:
                layout, fds = agent.call_with_fds("layout", timeout=10.0)
            for fd in fds:
                os.close(fd)
            allocs = [{"va": a["va"], "bytes": a["bytes"], "kind": a["kind"]} for a in layout["allocations"]]
        except GpucrError:   # busy with a restore this very moment: the counts below still hold
            pass
    epoch = None
    app = AppChannel.at(t.app_socket())
    if app is not None:
        try:
            epoch = app.ask("epoch", 5.0).get("epoch")
        except (OSError, ValueError):
            pass
        finally:
            app.close()
    drv = t.driver()
    cert = manifest.build(pid=t.pid, start_time=t.start_time, generation=st["generation"], level=level,
                          gpus=gpus.process_gpus(st, gpus.machine_gpus(drv)), driver_version=drv.version(), status=st,
                          allocations=allocs, epoch=epoch, simulated=drv.simulated)
    cert["id"] = "live"
    cert["where"] = "host memory" if st.get("staged") else "an image (restore with --image DIR)"
    return cert


def ps() -> StatusResult:
    """Every live process under gpucr that this user can see; those that cannot be asked apart."""
    out = StatusResult(SCHEMA_VERSION, "ps", [])
    for pid, sock in targets.list_sockets():
        try:
            out.processes.append(status(pid))
        except GpucrError as exc:
            out.unreachable.append(Unreachable(pid, str(exc)))
    return out
