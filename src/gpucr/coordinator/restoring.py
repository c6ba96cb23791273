"""The restore of one or many processes: the driver's steps beside the mover's fill, then data in, relink, resume."""
from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

from .. import gpus, shape
from .. import target as targets
from ..app import AppChannel
from ..errors import GpucrError
from ..results import SCHEMA_VERSION, ProcessRestore, RestoreResult
from ..plane import DataPlane
from .members import (PhaseError, STALL_GRACE_S, _Member, _app_resume, _check_request, _each, _lap, _phase_failures,
                      _settled_status, _usage, _usage_at_end, _watched_call)
from .steps import _agent_restored, _check_room, _driver_restore, _driver_unlock, _vet_for_restore
from .through_plane import _restore_with_server, _server_restorable
from .image_steps import _data_in_from_image
from .relink import _ends_soon, _orphans, _relink


def _data_in(m: _Member, timeout: float, drop_staging: bool) -> None:
    if m.status.get("checkpoint_phase") == "handed":
        # the server died before its copy was in staging, and the driver held the process, so the agent
        # could not take its memory back then (on the driver, its calls fail while checkpointed): now it can
        m.status = m.agent.call("abort", timeout=120.0)
        return
    if m.status["state"] != "checkpointed":
        return
    entry = m.result.pop("manifest_entry", None)
    if entry is not None and not _data_in_from_image(m, entry, timeout, drop_staging):
        return
    pause = os.environ.get("GPUCR_TEST_PAUSE_BEFORE_DATA_IN")
    if pause:   # the test suite's: lets an agent's own roll-back get there first (see _rolled_back_meanwhile)
        time.sleep(float(pause))
    t0 = time.perf_counter()
    try:
        out = _watched_call(m, "restore", timeout + STALL_GRACE_S, timeout_ms=int(timeout * 1000),
                            drop_staging=int(drop_staging), open_gate=0)
    except GpucrError:
        out = _rolled_back_meanwhile(m, timeout)
        if out is None:
            raise
    # after the server's restore, the agent only finishes (and brings back what was not adopted)
    m.result["phases_s"]["finish" if m.server_bytes_in else "data_in"] = time.perf_counter() - t0
    cyc = out["last_cycle_ms"]
    m.result["bytes_moved"] = m.server_bytes_in + cyc.get("bytes_in", 0)
    if cyc.get("bytes_in"):   # the agent put (some of) the data back itself
        m.result["data_plane"] = "agent"
    if "image" in m.result:   # zero chunks the agent set, where the server's fill did not (_read_then_fill)
        m.result["image"]["bytes_zeroed"] += cyc.get("bytes_zeroed", 0)
    m.result["agent_ms"] = {"data_in": cyc.get("data_in", 0.0), "pin_wait": cyc.get("pin_wait", 0.0)}


def _rolled_back_meanwhile(m: _Member, timeout: float) -> dict[str, Any] | None:
    """A checkpoint's controller (or server) died after its data out while the driver held the process: the
    agent's own roll-back waited for the driver's restore, just done here, and may have brought the data back
    before this restore asked (then the agent says it is not checkpointed; seen under load in
    test_server_killed_while_copying_through_a_neighbour). Its last cycle when so, else None."""
    try:
        st = _settled_status(m.agent, timeout)
    except GpucrError:
        return None
    if st["state"] != "running" or st.get("gate_closed"):
        return None
    m.status = st
    return {"last_cycle_ms": st.get("last_cycle_ms") or {}}


def _data_in_all(members: list[_Member], timeout: float, drop_staging: bool, phase: str,
                 sources: list[_Member] | None = None, drop_ended: bool = False) -> None:
    """Data in for every process with its gate still closed, then memory shared between them relinked
    (each exporter re-exports, each importer maps the new memory at its old addresses), then every
    gate opened. An exporter may be any of `sources` (default: `members`), restored or never released,
    or a live process outside them that the importer was bound to (see _relink). `drop_ended` (a
    roll-back): one that dies meanwhile is left out, and the others go on without it."""
    restoring = [m for m in members if m.status.get("state") == "checkpointed"]
    failures = _phase_failures(phase, restoring, lambda m: _data_in(m, timeout, drop_staging))
    live = [f for f in failures if not (drop_ended and _ends_soon(f.pid))]
    if live:
        raise live[0] from live[0].cause
    # one that died meanwhile (a rank killed mid-checkpoint) is no more: the others go on, and what they
    # imported from it is replaced (_orphans)
    if drop_ended:
        restoring = [m for m in restoring if not targets.process_ended(m.pid)]
    shared_before = {m.pid: list(m.status.get("shared", [])) for m in restoring}
    _relink(restoring, shared_before, sources if sources is not None else members)
    _orphans(restoring, shared_before)
    parked = [m for m in members if m.status.get("state") == "running" and m.status.get("gate_closed")]
    _each("resume", [m for m in restoring if _agent_restored(m)] + parked, lambda m: m.agent.call("resume", timeout=60.0))


def restore_many(pids: list[int], timeout: float = 30.0, drop_staging: bool = False,
                 images: dict[int, str | Path] | None = None, force: bool = False,
                 gpu_map: dict[str, str] | None = None, mover: DataPlane | None = None) -> RestoreResult:
    """Restore several processes together; each that can be is brought back (see the module's doc).
    `gpu_map` {old UUID: new UUID}, as --map takes them, moves them to other GPUs of this machine.
    `mover`: the gpucr server's data plane, which fills the processes' memory while the driver restores them."""
    _check_request(pids, timeout)
    images = images or {}
    gpu_map = gpus.check_map(gpu_map or {})
    members: list[_Member] = []
    t0 = time.perf_counter()
    try:
        for pid in pids:   # every check before anything is re-created
            img = images.get(pid)
            members.append(_vet_for_restore(pid, Path(img) if img is not None else None, force, gpu_map or {}))
        _check_room(members)
        for m in members:
            m.gpu_before = _usage(m, m.status, mover)
        _lap(members, "vet", t0)
        failed: dict[int, PhaseError] = {}

        def phase(name: str, fn) -> None:
            for f in _phase_failures(name, [m for m in members if m.pid not in failed], fn):
                failed[f.pid] = f

        def driver_steps() -> None:
            phase("driver restore", _driver_restore)
            phase("driver unlock", lambda m: _driver_unlock(m, timeout))
        for m in members if mover is not None else []:
            m.plane = mover if _server_restorable(m) else None
            if m.plane is not None:   # unless the agent puts (some of) the data back itself (_data_in)
                m.result["data_plane"] = mover.plane
        # from host memory the server fills beside the driver's steps; from an image once the driver has let
        # the process go (_data_in: making staging may pin it, which waits or fails while the driver holds it)
        by_server = [m for m in members if m.plane is not None and m.image_dir is None]
        if by_server:
            _restore_with_server(by_server, timeout, mover, driver_steps, failed)
        else:
            driver_steps()
        live = [m for m in members if m.pid not in failed]
        try:
            _data_in_all(live, timeout, drop_staging, "data in")
        except PhaseError as exc:
            failed[exc.pid] = exc
        if failed:
            ok = [m.pid for m in members if m.pid not in failed]
            first = next(iter(failed.values()))
            rest = f"; processes {', '.join(map(str, ok))} were restored and run" if ok and len(members) > 1 else ""
            raise GpucrError(f"{first}{rest}") from first
        t0 = time.perf_counter()
        for m in members:
            _app_resume(AppChannel.at(m.t.app_socket()))
            m.result["state"] = "running"
        if mover is not None:
            mover.settle()
        changes = [shape.gpu_changes(m.gpu_before, _usage_at_end(m, mover)) for m in members]
        _lap(members, "settle", t0)
        return RestoreResult(SCHEMA_VERSION, "restore", [
            shape.restore(m.result, c, m.gpu_moves, str(m.image_dir) if m.image_dir is not None else None)
            for m, c in zip(members, changes)])
    finally:
        for m in members:
            m.close()


def restore(pid: int, timeout: float = 30.0, drop_staging: bool = False, image: str | Path | None = None,
            force: bool = False, gpu_map: dict[str, str] | None = None) -> ProcessRestore:
    """Put every byte back at the same address and let the process carry on.

    `image` restores the data from a checkpoint image (verified against its manifest first);
    `drop_staging` gives the host staging back afterwards (else it is kept for the next cycle);
    `gpu_map` {old UUID: new UUID} moves it onto other GPUs of this machine, as `gpucr restore --map`.
    """
    return restore_many([pid], timeout, drop_staging, {pid: image} if image is not None else None, force,
                        gpu_map).processes[0]
