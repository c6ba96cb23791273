"""One process's steps, each a request to its agent or a call of the driver: vetting, quiesce, the driver's lock,
checkpoint, restore and unlock, and their undoing. The data itself moves through gpucr.plane (through_plane.py)."""
from __future__ import annotations

import contextlib
import os
import time
from pathlib import Path
from typing import Any, Iterator

from .. import gpus, manifest
from .. import imagefs
from . import context_share
from .. import proc
from .. import target as targets
from ..driver import CUDA_ERROR_OUT_OF_MEMORY, DriverError, DriverSilent, ProcessState
from ..errors import GpucrError
from .members import (STALL_GRACE_S, _Member, _app_prepare, _driver_state, _need_cuda, _settled_status,
                      _test_kill_point, _test_kill_target, _watched_call)


def _vetting_status(m: _Member, timeout: float) -> dict[str, Any]:
    """The agent's status before anything is touched, within the request's own deadline: a process busy
    starting up (loading gigabytes) may answer late."""
    try:
        return m.agent.call("status", timeout=timeout, controller=1)   # (the agent keeps a controller's connection)
    except GpucrError as exc:
        m.close()
        raise GpucrError(f"{exc} (--timeout); nothing was touched. Is it still starting up? Wait until it is up "
                         f"('gpucr wait {m.pid}' and its own output), or give a longer --timeout, then retry") from exc


def _vet_for_checkpoint(pid: int, image_dir: Path | None, timeout: float) -> _Member:
    t = targets.resolve(pid)
    _need_cuda(t)
    drv = t.driver()
    dstate = _driver_state(drv, pid)
    m = _Member(t, drv, image_dir=image_dir, result={"pid": pid, "phases_s": {}})
    m.agent = t.connect()
    if dstate != ProcessState.RUNNING:
        st = _status_if_any(m)
        m.close()
        raise GpucrError(f"process {pid} is already checkpointed (driver state {dstate.name.lower()}); "
                         f"{_restore_hint(pid, st)}")
    if image_dir is not None:
        try:
            _check_image_dir(image_dir, imagefs.owner_for(t.uid, pid))
        except GpucrError:
            m.close()
            raise
    m.status = _vetting_status(m, timeout)
    if m.status["state"] != "running":
        m.close()
        raise GpucrError(f"process {pid} is already checkpointed (level data); {_restore_hint(pid, m.status)}")
    if m.status.get("refusal"):   # the agent's rule (dp_preflight), said before staging is made for it
        m.close()
        raise GpucrError(f"process {pid}: refused before touching the process: {m.status['refusal']}")
    return m


def _status_if_any(m: _Member) -> dict[str, Any] | None:
    try:
        return m.agent.call("status", timeout=5.0)
    except GpucrError:
        return None


def _restore_hint(pid: int, status: dict[str, Any] | None) -> str:
    """How to bring back a process found checkpointed: from its image where its data is no longer in host memory."""
    if (status and status.get("state") == "checkpointed" and not status.get("staged", True)
            and status.get("checkpoint_phase") != "handed"):
        return f"its data was written to an image: restore it with 'gpucr restore --image DIR {pid}'"
    return f"restore it with 'gpucr restore {pid}'"


def _check_image_dir(d: Path, owner: imagefs.Owner | None) -> None:
    """An image goes to a new or empty directory that the process's user can write (root acting for
    another user writes as that user): known before anything is touched."""
    with imagefs.fs_identity(owner):
        if d.is_symlink():
            raise GpucrError(f"the image directory {d} is a symbolic link; give the directory itself")
        if d.exists() and not d.is_dir():
            raise GpucrError(f"{d} is not a directory; give a new or empty directory for the image")
        if d.exists() and any(d.iterdir()):
            raise GpucrError(f"the image directory {d} is not empty; give a new or empty directory")
        parent = d if d.exists() else next((p for p in d.absolute().parents if p.exists()), Path("/"))
        # effective_ids: checked with this thread's file-system identity, the one the image is written with
        if not parent.is_dir() or not os.access(parent, os.W_OK | os.X_OK, effective_ids=True):
            who = f" as uid {owner[0]}, the process's user" if owner else ""
            raise GpucrError(f"cannot write the image under {parent}{who}: permission denied or not a directory")


def _prepare(m: _Member, timeout: float) -> None:
    m.app = _app_prepare(m.t, timeout)


def _quiesce(m: _Member, timeout: float) -> None:
    """First phase of a checkpoint of several processes: staging ready, gate closed, device still;
    nothing copied or released (an "abort" undoes it). lease=1: should this controller die before it commits,
    the agent undoes it itself."""
    m.data_out_t0 = time.perf_counter()
    _watched_call(m, "quiesce", timeout + STALL_GRACE_S, timeout_ms=int(timeout * 1000), lease=1)
    m.held = True


def _data_out_done(m: _Member, out: dict[str, Any]) -> None:
    m.held = False
    r = m.result
    r["phases_s"]["data_out"] = time.perf_counter() - m.data_out_t0
    cyc = out["last_cycle_ms"]
    r["agent_ms"] = {k: cyc[k] for k in ("gate", "sync", "release")}   # staging: the plane's (phases_s)
    r["bytes_moved"] = cyc["bytes_out"]
    r["bytes_left_to_driver"] = out["bytes_left_to_driver"]
    r["coverage"] = out.get("coverage")
    r["generation"] = out["generation"]
    m.status = out
    _test_kill_point("after-data-out")


@contextlib.contextmanager
def _silent_driver_holds(m: _Member) -> Iterator[None]:
    """A driver that did not answer a step may still take it: the process is then left to it, not rolled back."""
    try:
        yield
    except DriverSilent:
        m.left_held = "once the driver answers for it again"
        raise


def _driver_lock(m: _Member, timeout: float) -> None:
    _test_kill_target(m.pid, "driver-lock")
    t0 = time.perf_counter()
    m.asked_driver = True
    with _silent_driver_holds(m):
        m.drv.lock(m.pid, int(timeout * 1000))
    m.locked = True
    m.result["phases_s"]["driver_lock"] = time.perf_counter() - t0
    _test_kill_point("after-driver-lock")


def _driver_checkpoint(m: _Member) -> None:
    uuids = [str(d.get("uuid", "")) for d in m.status.get("devices") or []]
    machine = gpus.machine_gpus(m.drv)   # once: the GPUs are read before and after
    before = context_share.used(m.drv, uuids, machine)   # read outside control_out: it is not the driver's time
    t0 = time.perf_counter()
    _test_kill_target(m.pid, "driver-checkpoint")
    with _silent_driver_holds(m):
        m.drv.checkpoint(m.pid)
    m.checkpointed = True
    m.result["phases_s"]["control_out"] = time.perf_counter() - t0
    # what it freed beside the data (its context): its restore's room check counts it (context_share). Several
    # processes checkpointed at once free memory together: each is bounded by what the driver counted it held
    vmm = {str(d.get("uuid", "")): int(d.get("vmm_bytes") or 0) for d in m.status.get("devices") or []}
    bound = {u: b.process - vmm.get(u, 0) for u, b in m.gpu_before.items() if b.process is not None}
    context_share.record(m.pid, m.t.start_time, before, context_share.used(m.drv, uuids, machine), bound)
    _test_kill_point("after-driver-checkpoint")
    final = m.drv.state(m.pid)
    if final != ProcessState.CHECKPOINTED:
        raise GpucrError(f"the driver left it in state {final.name.lower()} instead of checkpointed")


def _warnings(m: _Member) -> list[str]:
    """What the checkpoint did less well than it claims by default: shared memory whose POSIX fd is
    still open in the process stays allocated in the driver (the fd holds it), so it is not given back
    while checkpointed."""
    try:
        st = m.agent.call("status", timeout=10.0)
    except GpucrError:
        return []
    return [f"{s['bytes'] >> 20} MiB of memory it {'exported' if s['role'] == 'exporter' else 'imported'} stays on "
           f"the GPU while checkpointed: process {m.pid} still holds {s['open_fds']} open file descriptor(s) of it; "
           "close them once the memory is imported (as NCCL does)" for s in st.get("shared", []) if s.get("open_fds")]


def _roll_back_driver(m: _Member) -> None:
    """Undo the driver's steps for this process; never raises (the process may be gone)."""
    try:
        if m.left_held or proc.process_ended(m.pid, m.t.start_time):
            return
        try:
            proc.check_not_stopped(m.pid)   # a stopped process cannot answer the driver: left restorable
        except GpucrError:
            if m.asked_driver or m.locked or m.checkpointed:
                m.left_held = f"once it runs again (kill -CONT {m.pid})"
            return
        s = m.drv.state(m.pid)
        if s == ProcessState.CHECKPOINTED:
            m.drv.restore(m.pid)
            s = m.drv.state(m.pid)
        if s == ProcessState.LOCKED:
            m.drv.unlock(m.pid)
    except GpucrError:
        pass


def _abort_held(m: _Member) -> None:
    """A process quiesced, or handed over and not committed: its agent reopens the gate, mapping its memory again
    from its own fds if it was released (the memory never left the GPU): no copy. Not one the driver was left
    holding: its agent undoes it by itself once the driver lets go (its lease ends with this controller)."""
    if m.held and not m.left_held and not proc.process_ended(m.pid, m.t.start_time):
        try:
            m.agent.call("abort", timeout=60.0)
        except GpucrError:
            pass   # its lease ends with this connection and the agent aborts by itself
        m.held = False


def _vet_for_restore(pid: int, image_dir: Path | None, force: bool, gpu_map: dict[str, str]) -> _Member:
    t = targets.resolve(pid)
    _need_cuda(t)
    drv = t.driver()
    dstate = _driver_state(drv, pid)
    m = _Member(t, drv, image_dir=image_dir, result={"pid": pid, "phases_s": {}})
    m.agent = t.connect()
    unlocked_here = False
    try:
        # controller=1: the agent keeps this connection however long the fill before its `adopt` takes (it dropped
        # a connection silent for 30 s, and evicted one idle for 0.5 s when a ninth client came)
        m.status = m.agent.call("status", timeout=10.0, controller=1)
    except GpucrError:
        if dstate != ProcessState.LOCKED:
            m.close()
            raise
        # locked, never checkpointed (a lock the driver took after its controller gave up on a stopped process):
        # the lock holds calls, its agent's status among them (simcuda's reads graph memory through the driver),
        # so it is let go first, losing nothing, and the agent asked again
        m.close()
        drv.unlock(pid)
        dstate, unlocked_here = _driver_state(drv, pid), True
        m.agent = t.connect()
        m.status = m.agent.call("status", timeout=10.0, controller=1)
    if m.status.get("rolling_back") and dstate == ProcessState.RUNNING:
        # its checkpoint's controller died after data out: the agent is undoing it alone, wait for that
        # (with the driver holding the process, the roll-back waits for this restore instead)
        m.status = _settled_status(m.agent, 60.0)
    st = m.status
    if dstate == ProcessState.RUNNING and st["state"] == "running" and not st.get("gate_closed"):
        m.close()
        if unlocked_here:
            raise GpucrError(f"process {pid} was only locked by the driver, not checkpointed: unlocked, it runs on "
                             "with its data")
        raise GpucrError(f"process {pid} is not checkpointed: nothing to restore")
    machine = gpus.machine_gpus(drv)
    m.gpus = gpus.process_gpus(st, machine)
    if gpu_map and dstate != ProcessState.CHECKPOINTED:
        m.close()
        raise GpucrError(f"process {pid} is not held by the driver (its CUDA context stayed on its GPU, --level data, or "
                         "its driver restore is done): --map applies only to a restore of a --level full checkpoint")
    try:
        m.gpu_moves = gpus.moves_for(pid, m.gpus, gpu_map, machine)
    except GpucrError:
        m.close()
        raise
    # (running with its gate still closed: a restore stopped before its last step; it is finished below)
    if image_dir is not None:
        with imagefs.ImageDir(image_dir, imagefs.owner_for(t.uid, pid)) as idir:
            man = manifest.load(idir)
        m.result["image_id"] = man.get("id")
        m.result["manifest_entry"] = manifest.check_restore(man, pid=pid, start_time=t.start_time,
                                                            generation=st["generation"], gpus=_restored_on(m, machine),
                                                            force=force)
    elif st["state"] == "checkpointed" and not st.get("staged", True) and st.get("checkpoint_phase") != "handed":
        m.close()
        raise GpucrError(f"process {pid}'s data was written to an image and is no longer in host memory: "
                         f"restore it with 'gpucr restore --image DIR {pid}'")
    m.checkpointed = dstate == ProcessState.CHECKPOINTED
    m.locked = dstate == ProcessState.LOCKED
    return m


def _restored_on(m: _Member, machine: list[gpus.Gpu]) -> list[dict[str, Any]]:
    """The GPUs a process will run on after its restore (its own, or the --map targets)."""
    names = {g.uuid: g.name for g in machine}
    out = []
    for d in m.gpus:
        where = m.gpu_moves.get(d["uuid"], d["uuid"])
        out.append({**d, "uuid": where, "name": names.get(where, d["name"])})
    return out


def _check_room(members: list[_Member]) -> None:
    """Refuse, before anything is re-created, a restore that does not fit on its GPUs: what every
    process in it puts back on each GPU, against that GPU's free memory now."""
    need: dict[str, int] = {}
    who: dict[str, list[int]] = {}
    for m in members:
        if not m.checkpointed and m.status.get("state") != "checkpointed":
            continue
        # the driver's own part comes back only from a full checkpoint: its small plain allocations and pools, and
        # its context, which the agent counts nowhere: what the driver's checkpoint freed, where it was measured
        freed = context_share.freed(m.pid, m.t.start_time) if m.checkpointed else {}
        for d in m.gpus:
            where = m.gpu_moves.get(d["uuid"], d["uuid"])
            driver = max(d["driver_bytes"], freed.get(d["uuid"], 0)) if m.checkpointed else 0
            # what is on the GPU still (handed over but not committed: a switch's controller died) is not made again
            need[where] = need.get(where, 0) + d["vmm_bytes"] - d.get("resident_bytes", 0) + driver
            who.setdefault(where, []).append(m.pid)
    if not need:
        return
    drv = members[0].drv
    machine = gpus.machine_gpus(drv)
    for uuid, n in need.items():
        mem = gpus.memory_of(drv, uuid, machine)
        if mem is not None and mem.free < n:
            procs = ", ".join(map(str, who[uuid]))
            raise GpucrError(f"not enough free GPU memory on {uuid} to restore process{'es' if len(who[uuid]) > 1 else ''} "
                             f"{procs}: {n >> 20} MiB are needed, {mem.free >> 20} MiB are free; free GPU memory and "
                             "retry (nothing was restored; the processes stay checkpointed)")


class NoRoomForContext(GpucrError):
    """The driver found too little free memory to restore a process's context; it stays checkpointed, so it can be
    tried again once more is free."""


def _driver_restore(m: _Member) -> None:
    if not m.checkpointed:
        return
    t0 = time.perf_counter()
    try:
        pairs = gpus.restore_pairs(m.gpu_moves, gpus.machine_gpus(m.drv)) if m.gpu_moves else []
        m.drv.restore(m.pid, [(gpus.to_bytes(o), gpus.to_bytes(n)) for o, n in pairs] or None)
    except DriverError as exc:
        if exc.rc == CUDA_ERROR_OUT_OF_MEMORY:
            raise NoRoomForContext("not enough free GPU memory to restore its CUDA context; free GPU memory and retry "
                             "(the process stays checkpointed)") from exc
        raise GpucrError(f"{exc}; it stays checkpointed, retry 'gpucr restore {m.pid}'") from exc
    m.result["phases_s"]["control_in"] = time.perf_counter() - t0
    context_share.forget(m.pid, m.t.start_time)
    _test_kill_point("after-driver-restore")
    m.checkpointed, m.locked = False, m.drv.state(m.pid) == ProcessState.LOCKED


def _driver_unlock(m: _Member, timeout: float) -> None:
    if not m.locked:
        return
    t0 = time.perf_counter()
    m.drv.unlock(m.pid)
    m.locked = False
    m.result["phases_s"]["driver_unlock"] = time.perf_counter() - t0
    _test_kill_point("after-driver-unlock")
    # a checkpoint whose controller died before committing rolls itself back once the driver lets
    # go of the process: look again before asking for the data
    m.status = _settled_status(m.agent, timeout)


def _agent_restored(m: _Member) -> bool:
    return m.agent.call("status", timeout=10.0)["state"] == "running"
