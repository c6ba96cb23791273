"""Checkpoint and restore of one process: the agent moves the data, the driver the control state.

checkpoint: agent (gate, sync, data out, release) -> driver lock -> driver checkpoint
restore:    driver restore -> driver unlock -> agent (re-create, data in, open gate)
Any failure rolls back to a running process, or leaves it checkpointed and restorable; never between.
"""
from __future__ import annotations

import time
from typing import Any

from . import target as targets
from .driver import CUDA_ERROR_OUT_OF_MEMORY, Driver, DriverError, ProcessState, driver_for, gpu_memory
from .errors import GpucrError

LEVELS = ("full", "data")


def _driver(t: targets.Target) -> Driver:
    return driver_for(t.hello.get("libcuda") or "libcuda.so.1")


def _need_cuda(t: targets.Target) -> None:
    if not t.hello.get("cuda"):
        raise GpucrError(f"process {t.pid} has not loaded the CUDA driver: there is nothing to checkpoint")


def _mem(drv: Driver) -> int | None:
    m = gpu_memory(drv)
    return m.used if m else None


def _reply_timeout(timeout: float) -> float:
    # the agent's deadline covers the drain and synchronisation; the copy itself takes what it takes
    return timeout + 600.0


def status(pid: int) -> dict[str, Any]:
    """The live state of a process under gpucr, as the agent and the driver see it."""
    t = targets.resolve(pid)
    with t.connect() as agent:
        st = agent.call("status", timeout=10.0)
    st.pop("ok", None)
    st["start_time"] = t.start_time
    st["cmd"] = targets.command_line(pid)
    level = None
    if st.get("cuda"):
        drv_state = _driver(t).state(pid)
        st["driver_state"] = drv_state.name.lower()
        if drv_state == ProcessState.CHECKPOINTED:
            st["state"], level = "checkpointed", "full"
        elif drv_state != ProcessState.RUNNING:
            st["state"], level = "checkpointed", "full"
        elif st["state"] == "checkpointed":
            level = "data"
    st["level"] = level
    return st


def checkpoint(pid: int, level: str = "full", timeout: float = 30.0) -> dict[str, Any]:
    """Save the process's GPU memory and give it back; the process stays alive, parked."""
    if level not in LEVELS:
        raise GpucrError(f"unknown level '{level}': use one of {', '.join(LEVELS)}")
    if timeout <= 0:
        raise GpucrError("the timeout must be a positive number of seconds")
    t = targets.resolve(pid)
    _need_cuda(t)
    drv = _driver(t)
    dstate = drv.state(pid)
    if dstate != ProcessState.RUNNING:
        raise GpucrError(f"process {pid} is already checkpointed (driver state {dstate.name.lower()}); "
                         f"restore it with 'gpucr restore {pid}'")
    timeout_ms = int(timeout * 1000)
    result: dict[str, Any] = {"pid": pid, "level": level, "phases_s": {}}
    before = _mem(drv)
    with t.connect() as agent:
        st = agent.call("status", timeout=10.0)
        if st["state"] != "running":
            raise GpucrError(f"process {pid} is already checkpointed (level data); restore it with 'gpucr restore {pid}'")
        t0 = time.perf_counter()
        out = agent.call("checkpoint", timeout=_reply_timeout(timeout), timeout_ms=timeout_ms)
        result["phases_s"]["data_out"] = time.perf_counter() - t0
        cyc = out["last_cycle_ms"]
        result["agent_ms"] = {k: cyc[k] for k in ("staging", "gate", "sync", "copy_out", "release")}
        result["bytes_moved"] = cyc["bytes_out"]
        result["bytes_left_to_driver"] = out["bytes_left_to_driver"]
        if level == "full":
            t0 = time.perf_counter()
            try:
                drv.lock(pid, timeout_ms)
                result["phases_s"]["driver_lock"] = time.perf_counter() - t0
                t1 = time.perf_counter()
                drv.checkpoint(pid)
                result["phases_s"]["control_out"] = time.perf_counter() - t1
            except DriverError as exc:
                _roll_back(drv, agent, pid)
                raise GpucrError(f"{exc}; rolled back, process {pid} runs on with its data intact") from exc
            agent.call("note", timeout=10.0, driver_lock_us=result["phases_s"]["driver_lock"] * 1e6,
                       control_out_us=result["phases_s"]["control_out"] * 1e6)
            final = drv.state(pid)
            if final != ProcessState.CHECKPOINTED:
                raise GpucrError(f"process {pid} ended in driver state {final.name.lower()} instead of checkpointed")
    result["state"] = "checkpointed"
    result["gpu_used_bytes"] = {"before": before, "after": _mem(drv)}
    return result


def _roll_back(drv: Driver, agent, pid: int) -> None:
    """Bring a half-checkpointed process back to running: driver first, then the agent's data."""
    try:
        s = drv.state(pid)
        if s == ProcessState.CHECKPOINTED:
            drv.restore(pid)
            s = drv.state(pid)
        if s == ProcessState.LOCKED:
            drv.unlock(pid)
    finally:
        agent.call("restore", timeout=600.0)


def restore(pid: int, timeout: float = 30.0, drop_staging: bool = False) -> dict[str, Any]:
    """Put every byte back at the same address and let the process carry on.

    `drop_staging` gives the host staging back afterwards (else it stays pinned for the next cycle).
    """
    if timeout <= 0:
        raise GpucrError("the timeout must be a positive number of seconds")
    t = targets.resolve(pid)
    _need_cuda(t)
    drv = _driver(t)
    dstate = drv.state(pid)
    result: dict[str, Any] = {"pid": pid, "phases_s": {}}
    with t.connect() as agent:
        st = agent.call("status", timeout=10.0)
        if dstate == ProcessState.RUNNING and st["state"] == "running":
            raise GpucrError(f"process {pid} is not checkpointed: nothing to restore")
        if dstate == ProcessState.CHECKPOINTED:
            need = st["allocations"]["tracked_bytes"] + st["bytes_left_to_driver"]
            mem = gpu_memory(drv)
            if mem is not None and mem.free < need:
                raise GpucrError(f"not enough free GPU memory to restore process {pid}: it needs {need >> 20} MiB, "
                                 f"{mem.free >> 20} MiB are free; free GPU memory and retry (the process stays checkpointed)")
            t0 = time.perf_counter()
            try:
                drv.restore(pid)
            except DriverError as exc:
                if exc.rc == CUDA_ERROR_OUT_OF_MEMORY:
                    raise GpucrError(f"not enough free GPU memory to restore the CUDA context of process {pid}; free GPU "
                                     "memory and retry (the process stays checkpointed)") from exc
                raise GpucrError(f"{exc}; process {pid} stays checkpointed, retry 'gpucr restore {pid}'") from exc
            result["phases_s"]["control_in"] = time.perf_counter() - t0
            dstate = drv.state(pid)
        if dstate == ProcessState.LOCKED:
            t0 = time.perf_counter()
            drv.unlock(pid)
            result["phases_s"]["driver_unlock"] = time.perf_counter() - t0
            ph = result["phases_s"]
            agent.call("note", timeout=10.0, control_in_us=ph.get("control_in", 0) * 1e6,
                       driver_unlock_us=ph["driver_unlock"] * 1e6)
        if st["state"] == "checkpointed":
            t0 = time.perf_counter()
            out = agent.call("restore", timeout=_reply_timeout(timeout), timeout_ms=int(timeout * 1000),
                             drop_staging=int(drop_staging))
            result["phases_s"]["data_in"] = time.perf_counter() - t0
            result["bytes_moved"] = out["last_cycle_ms"]["bytes_in"]
    result["state"] = "running"
    result["gpu_used_bytes"] = _mem(drv)
    return result


def ps() -> list[dict[str, Any]]:
    """Every live process under gpucr that this user can see."""
    rows = []
    for pid, sock in targets.list_sockets():
        try:
            rows.append(status(pid))
        except GpucrError as exc:
            rows.append({"pid": pid, "state": "unreachable", "error": str(exc)})
    return rows
