"""The restore of one or many processes: the driver's steps beside the mover's fill, then data in, relink, resume."""
from __future__ import annotations

import time
from pathlib import Path

from .. import gpus, shape
from .. import proc
from ..app import AppChannel
from ..errors import GpucrError
from ..results import SCHEMA_VERSION, RestoreResult
from ..plane import DataPlane
from .members import (PhaseError, STALL_GRACE_S, _Member, _app_resume, _check_request, _each, _lap, _phase_failures,
                      _settled_status, _usage, _usage_at_end, _watched_call)
from .steps import _agent_restored, _check_room, _driver_restore, _driver_unlock, _vet_for_restore
from .through_plane import _restore_with_server, _server_restorable
from .image_steps import _data_in_from_image
from .given_back import refill_given
from .relink import _ends_soon, _orphans, _relink


def _data_in(m: _Member, timeout: float, drop_staging: bool) -> None:
    if m.status.get("checkpoint_phase") == "handed":
        # its checkpoint was never committed (its controller or server died): the agent's fds kept the memory on
        # the GPU, and with the driver holding the process it could not map it again then; now it can, no copy,
        # except what a two-way switch gave back before its commit: made again from staging first, with one
        if m.plane is not None:
            refill_given(m, m.plane, timeout)
        try:
            m.status = m.agent.call("abort", timeout=120.0)
        except GpucrError:
            # its own roll-back may have got there first, once the driver let go (seen under load)
            m.status = _settled_status(m.agent, timeout)
            if m.status["state"] != "running":
                raise
        return
    if m.status["state"] != "checkpointed":
        return
    entry = m.result.pop("manifest_entry", None)
    if entry is not None:
        _data_in_from_image(m, entry, timeout)
    t0 = time.perf_counter()
    # the plane filled new memory and the agent adopted it: the agent only checks every allocation is back
    # (else it stays checkpointed, its data still in staging) and keeps its gate closed for the relink
    _watched_call(m, "restore", timeout + STALL_GRACE_S, drop_staging=int(drop_staging), open_gate=0)
    m.result["phases_s"]["finish"] = time.perf_counter() - t0
    m.result["bytes_moved"] = m.server_bytes_in


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
        restoring = [m for m in restoring if not proc.process_ended(m.pid)]
    shared_before = {m.pid: list(m.status.get("shared", [])) for m in restoring}
    _relink(restoring, shared_before, sources if sources is not None else members)
    _orphans(restoring, shared_before)
    parked = [m for m in members if m.status.get("state") == "running" and m.status.get("gate_closed")]
    _each("resume", [m for m in restoring if _agent_restored(m)] + parked, lambda m: m.agent.call("resume", timeout=60.0))


def _restored_by_another(members: list[_Member], failed: dict[int, GpucrError]) -> None:
    """A restore that lost a race with another controller's (two `gpucr restore P` at once) failed at a driver step
    or the adopt, while the process runs, restored: said so, not as a failure to retry."""
    for m in members:
        exc = failed.get(m.pid)
        if exc is None or m.agent is None:
            continue
        try:
            st = m.agent.call("status", timeout=5.0)
        except (GpucrError, OSError):
            continue
        if st.get("state") == "running" and not st.get("busy") and not st.get("gate_closed"):
            raise GpucrError(f"process {m.pid} was restored by another controller meanwhile and runs (this restore "
                             f"stopped at {getattr(exc, 'phase', 'a step')}); nothing is left to do") from exc


def restore_many(pids: list[int], mover: DataPlane, timeout: float = 30.0, drop_staging: bool = False,
                 images: dict[int, str | Path] | None = None, force: bool = False,
                 gpu_map: dict[str, str] | None = None, accept_mismatch: bool = False) -> RestoreResult:
    """Restore several processes together; each that can be is brought back (see the module's doc).
    `gpu_map` {old UUID: new UUID}, as --map takes them, moves them to other GPUs of this machine.
    `mover`: gpucr's data plane, which fills the processes' memory while the driver restores them.

    `images` {pid: DIR} restore the data from checkpoint images (verified against its manifest first);
    `drop_staging` gives the host staging back afterwards (else it is kept for the next cycle).
    `accept_mismatch` restores memory whose digests differ from the checkpoint's (else refused: it stays checkpointed)."""
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
        for m in members:
            m.plane = mover
            m.result["data_plane"] = mover.plane
        # from host memory the server fills beside the driver's steps; from an image once the driver has let
        # the process go (_data_in: making staging may pin it, which waits or fails while the driver holds it)
        by_server = [m for m in members if _server_restorable(m) and m.image_dir is None]
        if by_server:
            _restore_with_server(by_server, timeout, mover, driver_steps, failed, check=not accept_mismatch)
        else:
            driver_steps()
        live = [m for m in members if m.pid not in failed]
        try:
            _data_in_all(live, timeout, drop_staging, "data in")
        except PhaseError as exc:
            failed[exc.pid] = exc
        if failed:
            _restored_by_another(members, failed)
            ok = [m.pid for m in members if m.pid not in failed]
            first = next(iter(failed.values()))
            rest = f"; processes {', '.join(map(str, ok))} were restored and run" if ok and len(members) > 1 else ""
            raise GpucrError(f"{first}{rest}") from first
        t0 = time.perf_counter()
        for m in members:
            _app_resume(AppChannel.at(m.t.app_socket()))
            m.result["state"] = "running"
        mover.settle()
        changes = [shape.gpu_changes(m.gpu_before, _usage_at_end(m, mover)) for m in members]
        _lap(members, "settle", t0)
        return RestoreResult(SCHEMA_VERSION, "restore", [
            shape.restore(m.result, c, m.gpu_moves, str(m.image_dir) if m.image_dir is not None else None)
            for m, c in zip(members, changes)])
    finally:
        for m in members:
            m.close()
