"""Checkpoint and restore of one process: the agent moves the data, the driver the control state.

checkpoint: agent (gate, sync, data out, release) -> driver lock -> driver checkpoint
restore:    driver restore -> driver unlock -> agent (re-create, data in, open gate)
Any failure rolls back to a running process, or leaves it checkpointed and restorable; never between.
"""
from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

from . import manifest
from . import target as targets
from .app import AppChannel
from .driver import CUDA_ERROR_NOT_INITIALIZED, CUDA_ERROR_OUT_OF_MEMORY, Driver, DriverError, ProcessState, device_info, driver_for, gpu_memory
from .errors import GpucrError

LEVELS = ("full", "data")


def _driver(t: targets.Target) -> Driver:
    return driver_for(t.hello.get("libcuda") or "libcuda.so.1")


def _driver_state(drv: Driver, pid: int) -> ProcessState:
    try:
        return drv.state(pid)
    except DriverError as exc:
        if exc.rc == CUDA_ERROR_NOT_INITIALIZED:
            raise GpucrError(f"process {pid} has no CUDA state of its own for the driver to checkpoint (a fork() child "
                             "of a CUDA process inherits none); nothing to checkpoint") from exc
        raise


def _need_cuda(t: targets.Target) -> None:
    if not t.hello.get("cuda"):
        raise GpucrError(f"process {t.pid} has not loaded the CUDA driver: there is nothing to checkpoint")


def _mem(drv: Driver) -> int | None:
    m = gpu_memory(drv)
    return m.used if m else None


def _test_kill_point(point: str) -> None:
    """Fault injection for the test suite: GPUCR_TEST_KILL_AT=<point> makes this controller die
    (SIGKILL, no clean-up) at that point, as a crashed or killed controller would."""
    if os.environ.get("GPUCR_TEST_KILL_AT") == point:
        os.kill(os.getpid(), signal.SIGKILL)


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
        try:
            drv_state = _driver(t).state(pid)
        except DriverError as exc:
            st["driver_state"] = f"unknown: {exc}"
            st["level"] = None
            return st
        st["driver_state"] = drv_state.name.lower()
        if drv_state == ProcessState.CHECKPOINTED:
            st["state"], level = "checkpointed", "full"
        elif drv_state != ProcessState.RUNNING:
            st["state"], level = "checkpointed", "full"
        elif st["state"] == "checkpointed":
            level = "data"
    st["level"] = level
    return st


def _app_channel(t: targets.Target) -> AppChannel | None:
    path = t.socket.with_name(f"{t.pid}.app.sock")
    return AppChannel(str(path)) if path.exists() else None


def _app_prepare(t: targets.Target, timeout: float) -> AppChannel | None:
    """Let an application that joined the cut prepare; abort (it runs on) if it fails or hangs."""
    try:
        app = _app_channel(t)
    except OSError:
        return None
    if app is None:
        return None
    try:
        reply = app.ask("prepare", timeout)
    except (OSError, ValueError) as exc:
        app.close()
        what = "did not finish within the deadline" if isinstance(exc, TimeoutError) else f"failed ({exc})"
        raise GpucrError(f"the application's prepare callback {what}; checkpoint aborted, process {t.pid} runs on") from exc
    if not reply.get("ok"):
        _app_resume(app)
        raise GpucrError(f"the application refused to prepare: {reply.get('error')}; checkpoint aborted, "
                         f"process {t.pid} runs on")
    return app


def _app_resume(app: AppChannel | None) -> None:
    if app is None:
        return
    try:
        app.ask("resume", 60.0)
    except (OSError, ValueError):
        pass
    finally:
        app.close()


def checkpoint(pid: int, level: str = "full", timeout: float = 30.0, image: str | Path | None = None) -> dict[str, Any]:
    """Save the process's GPU memory and give it back; the process stays alive, parked.

    With `image`, the data is also written to that directory (with its manifest) and the host
    staging is released, so host memory is freed too.
    """
    if level not in LEVELS:
        raise GpucrError(f"unknown level '{level}': use one of {', '.join(LEVELS)}")
    if timeout <= 0:
        raise GpucrError("the timeout must be a positive number of seconds")
    t = targets.resolve(pid)
    _need_cuda(t)
    drv = _driver(t)
    dstate = _driver_state(drv, pid)
    if dstate != ProcessState.RUNNING:
        raise GpucrError(f"process {pid} is already checkpointed (driver state {dstate.name.lower()}); "
                         f"restore it with 'gpucr restore {pid}'")
    image_dir = Path(image) if image is not None else None
    if image_dir is not None and image_dir.exists() and any(image_dir.iterdir()):
        raise GpucrError(f"the image directory {image_dir} is not empty; give a new or empty directory")
    timeout_ms = int(timeout * 1000)
    result: dict[str, Any] = {"pid": pid, "level": level, "phases_s": {}}
    before = _mem(drv)
    with t.connect() as agent:
        st = agent.call("status", timeout=10.0)
        if st["state"] != "running":
            raise GpucrError(f"process {pid} is already checkpointed (level data); restore it with 'gpucr restore {pid}'")
        app = _app_prepare(t, timeout)
        epoch = None
        try:
            t0 = time.perf_counter()
            # lease=1: should this controller die before it commits, the agent rolls the process back itself
            out = agent.call("checkpoint", timeout=_reply_timeout(timeout), timeout_ms=timeout_ms, lease=1)
        except GpucrError:
            _app_resume(app)
            raise
        result["phases_s"]["data_out"] = time.perf_counter() - t0
        _test_kill_point("after-data-out")
        cyc = out["last_cycle_ms"]
        result["agent_ms"] = {k: cyc[k] for k in ("staging", "gate", "sync", "copy_out", "release")}
        result["bytes_moved"] = cyc["bytes_out"]
        result["bytes_left_to_driver"] = out["bytes_left_to_driver"]
        result["generation"] = out["generation"]
        if image_dir is not None:
            agent.call("unpin", timeout=60.0)   # its memory goes away once on disk; the driver must not be needed then
        if level == "full":
            t0 = time.perf_counter()
            try:
                drv.lock(pid, timeout_ms)
                result["phases_s"]["driver_lock"] = time.perf_counter() - t0
                _test_kill_point("after-driver-lock")
                t1 = time.perf_counter()
                drv.checkpoint(pid)
                result["phases_s"]["control_out"] = time.perf_counter() - t1
                _test_kill_point("after-driver-checkpoint")
            except DriverError as exc:
                _roll_back(drv, agent, pid)
                _app_resume(app)
                raise GpucrError(f"{exc}; rolled back, process {pid} runs on with its data intact") from exc
            agent.call("note", timeout=10.0, driver_lock_us=result["phases_s"]["driver_lock"] * 1e6,
                       control_out_us=result["phases_s"]["control_out"] * 1e6)
            final = drv.state(pid)
            if final != ProcessState.CHECKPOINTED:
                raise GpucrError(f"process {pid} ended in driver state {final.name.lower()} instead of checkpointed")
        agent.call("commit", timeout=10.0)
        if app is not None:
            try:
                epoch = app.ask("epoch", 5.0).get("epoch")
            except (OSError, ValueError):
                epoch = None
            app.close()
        result["state"] = "checkpointed"
        result["gpu_used_bytes"] = {"before": before, "after": _mem(drv)}
        if image_dir is not None:
            result["image"] = _write_image(t, drv, agent, image_dir, level, out, epoch)
    return result


def _write_image(t: targets.Target, drv: Driver, agent, directory: Path, level: str, status: dict, epoch) -> dict:
    """Write the staged data and its manifest, then let the process give its staging back."""
    from . import image as images   # needs xxhash: only image work pays for importing it
    layout, fds = agent.call_with_fds("layout", timeout=60.0)
    try:
        allocs, stats = images.write(directory, layout, fds)
    finally:
        for fd in fds:
            os.close(fd)
    gpu = device_info(drv)
    m = manifest.build(pid=t.pid, start_time=t.start_time, generation=layout["generation"], level=level, gpu=gpu,
                       driver_version=drv.version(), status=status, allocations=allocs, epoch=epoch,
                       simulated=drv.simulated)
    m["image"] = stats
    manifest.save(directory, m)
    agent.call("drop", timeout=60.0)   # the data is safe on disk: free the host memory too
    return {"dir": str(directory), "id": m["id"], **stats}


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


def restore(pid: int, timeout: float = 30.0, drop_staging: bool = False, image: str | Path | None = None,
            force: bool = False) -> dict[str, Any]:
    """Put every byte back at the same address and let the process carry on.

    `image` restores the data from a checkpoint image (verified against its manifest first);
    `drop_staging` gives the host staging back afterwards (else it stays pinned for the next cycle).
    """
    if timeout <= 0:
        raise GpucrError("the timeout must be a positive number of seconds")
    t = targets.resolve(pid)
    _need_cuda(t)
    drv = _driver(t)
    dstate = _driver_state(drv, pid)
    result: dict[str, Any] = {"pid": pid, "phases_s": {}}
    with t.connect() as agent:
        st = agent.call("status", timeout=10.0)
        if dstate == ProcessState.RUNNING and st["state"] == "running":
            raise GpucrError(f"process {pid} is not checkpointed: nothing to restore")
        entry = None
        if image is not None:
            m = manifest.load(Path(image))
            entry = manifest.check_restore(m, pid=pid, start_time=t.start_time, generation=st["generation"],
                                           gpu=device_info(drv), force=force)
        elif st["state"] == "checkpointed" and not st.get("staged", True):
            raise GpucrError(f"process {pid}'s data was written to an image and is no longer in host memory: "
                             f"restore it with 'gpucr restore --image DIR {pid}'")
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
            _test_kill_point("after-driver-restore")
            dstate = drv.state(pid)
        if dstate == ProcessState.LOCKED:
            t0 = time.perf_counter()
            drv.unlock(pid)
            result["phases_s"]["driver_unlock"] = time.perf_counter() - t0
            ph = result["phases_s"]
            agent.call("note", timeout=10.0, control_in_us=ph.get("control_in", 0) * 1e6,
                       driver_unlock_us=ph["driver_unlock"] * 1e6)
            _test_kill_point("after-driver-unlock")
            # a checkpoint whose controller died before committing rolls itself back once the driver
            # lets go of the process: look again before asking for the data
            st = _settled_status(agent, timeout)
        if entry is not None and st["state"] == "checkpointed":
            from . import image as images
            if st.get("staged"):
                agent.call("drop", timeout=60.0)   # the image is the source now
            t0 = time.perf_counter()
            agent.call("stage", timeout=_reply_timeout(timeout))
            layout, fds = agent.call_with_fds("layout", timeout=60.0)
            result["phases_s"]["stage"] = time.perf_counter() - t0
            t0 = time.perf_counter()
            read_error: list[GpucrError] = []
            # reading overlaps the process's re-mapping and copying: each allocation is announced on a
            # second connection as soon as its chunks are verified, while the restore waits on this one
            with t.connect() as notify:
                def read_all() -> None:
                    try:
                        result["image"] = images.read(Path(image), entry["data"], layout, fds,
                                                      on_ready=lambda va: notify.call("ready", timeout=60.0, va=va))
                    except GpucrError as exc:
                        read_error.append(exc)
                        notify.call("ready_abort", timeout=60.0)
                reader = threading.Thread(target=read_all, name="gpucr-image-read")
                reader.start()
                try:
                    out = agent.call("restore", timeout=_reply_timeout(timeout) + 3600.0,
                                     timeout_ms=int((timeout + 3600.0) * 1000), drop_staging=int(drop_staging),
                                     wait_ready=1)
                except GpucrError as exc:
                    reader.join()
                    agent.call("drop", timeout=60.0)
                    cause = read_error[0] if read_error else exc
                    raise GpucrError(f"{cause}; process {pid} stays checkpointed: restore it from an intact image") from exc
                finally:
                    reader.join()
                    for fd in fds:
                        os.close(fd)
            result["phases_s"]["image_read_and_data_in"] = time.perf_counter() - t0
            result["bytes_moved"] = out["last_cycle_ms"]["bytes_in"]
        elif st["state"] == "checkpointed":
            t0 = time.perf_counter()
            out = agent.call("restore", timeout=_reply_timeout(timeout), timeout_ms=int(timeout * 1000),
                             drop_staging=int(drop_staging))
            result["phases_s"]["data_in"] = time.perf_counter() - t0
            result["bytes_moved"] = out["last_cycle_ms"]["bytes_in"]
    _app_resume(_app_channel_quiet(t))
    result["state"] = "running"
    result["gpu_used_bytes"] = _mem(drv)
    return result


def _settled_status(agent, timeout: float) -> dict[str, Any]:
    """The agent's status once no checkpoint or restore is running in it (e.g. its own roll-back)."""
    deadline = time.monotonic() + _reply_timeout(timeout)
    while True:
        st = agent.call("status", timeout=10.0)
        if not st.get("busy"):
            return st
        if time.monotonic() > deadline:
            raise GpucrError(f"process {agent.pid} stayed busy with another checkpoint or restore; retry later")
        time.sleep(0.05)


def _app_channel_quiet(t: targets.Target) -> AppChannel | None:
    try:
        return _app_channel(t)
    except OSError:
        return None


def ps() -> list[dict[str, Any]]:
    """Every live process under gpucr that this user can see."""
    rows = []
    for pid, sock in targets.list_sockets():
        try:
            rows.append(status(pid))
        except GpucrError as exc:
            rows.append({"pid": pid, "state": "unreachable", "error": str(exc)})
    return rows
