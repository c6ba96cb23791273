"""Data through the mover (gpucr.dataplane: the server's, or the CLI's own with no server): every agent hands its
memory over keeping an fd of each allocation, the mover copies it beside the driver's steps, then each agent lets go;
at restore the mover makes and fills new memory beside the driver's restore, and each agent adopts it."""
from __future__ import annotations

import dataclasses
import os
import threading
import time
from contextlib import ExitStack, contextmanager
from typing import Any, Callable, Iterator

from ..errors import GpucrError
from ..vmm import NoRoomForServerContext
from .. import imagefs, proc
from .. import memory as server_memory
from ..memory import Managed
from ..plane import DataPlane, Made, Stats
from .members import (ADOPT_BATCH, PhaseError, STALL_GRACE_S, _Member, _beside, _each, _test_kill_point,
                      _test_kill_target, _watched_call)
from .staging_steps import provide_staging, refused_for_room
from .steps import _data_out_done, _driver_checkpoint, _driver_lock, _quiesce

HANDOVER_TRIES = 4   # a handover refused because the app allocated since its staging was made: more staging, again


def _data_out_by_server(members: list[_Member], timeout: float, level: str, mover: DataPlane, scan: bool = True) -> None:
    """The server's checkpoint (docs/server.md), of one process or several: every agent releases its memory
    but keeps an fd of each allocation, which keeps it on the GPU (several are quiesced first, so nothing is
    copied while a peer still writes to memory they share); the server copies each process into its staging,
    one after another (the link is the bound), while the driver locks and checkpoints every one (level full);
    then every agent lets go of its fds. Until then "abort" maps the memory again from those fds, with no
    copy: no process gives memory back before every one is copied."""
    for m in members:
        m.plane = mover
    if len(members) > 1:
        _each("quiesce", members, lambda m: _quiesce(m, timeout))
    _each("data out", members, lambda m: _handover(m, timeout))
    _test_kill_point("after-handover")
    stop = threading.Event()   # a driver step failed: the copies not begun yet are not needed
    driver_done = threading.Event()   # the driver's steps ended: the processes' contexts are off the GPU (level full)

    def driver_steps() -> None:
        try:
            _test_kill_point("during-server-copy")
            if level != "full":
                return
            try:   # the control state, at the same time
                _each("driver lock", members, lambda m: _driver_lock(m, timeout))
                _each("driver checkpoint", members, _driver_checkpoint)
            except BaseException:
                stop.set()
                raise
        finally:
            driver_done.set()
    with ExitStack() as held:
        # listed now, after the handover (it trims pools first, so the list and its numbering are the
        # layout's), and before the driver holds any process (its agent may not answer then)
        inputs = {m.pid: _held_inputs(held, m, timeout, "data out") for m in members}
        copied = _beside(lambda: _copy_all_out(members, inputs, mover, stop, scan, driver_done, timeout),
                         "gpucr-server-copy-out", driver_steps)
    if isinstance(copied, GpucrError):
        raise copied
    _each("release", members, lambda m: _handed_done(m, copied[m.pid]))


def _handover(m: _Member, timeout: float) -> None:
    """The agent quiesces (unless it is already) and releases its memory, keeping its own fd of each allocation."""
    _test_kill_target(m.pid, "data-out")
    if not m.held:
        m.data_out_t0 = time.perf_counter()
    # lease=1: should this controller die before it commits, the agent takes its memory back itself. The
    # agent refuses, touching nothing, memory the plane cannot take (not plain device memory, or no fd of it)
    for attempt in range(1, HANDOVER_TRIES + 1):
        try:
            _watched_call(m, "handover", timeout + STALL_GRACE_S, timeout_ms=int(timeout * 1000), lease=1,
                          image=int(m.image_dir is not None))   # an image's: no place in staging
            break
        except GpucrError as exc:
            if not refused_for_room(exc) or m.plane is None or attempt == HANDOVER_TRIES:
                raise
            # it allocated since its staging was made (nothing was released): more staging, then again (threads
            # that allocate all the time can do it again between the status and the next handover: seen in CI)
            provide_staging(m, m.plane, m.agent.call("status", timeout=10.0))
    m.held = True   # "abort" maps the memory again from the agent's fds: nothing left the GPU
    m.result["phases_s"]["handover"] = time.perf_counter() - m.data_out_t0


def _held_inputs(held: ExitStack, m: _Member, timeout: float, phase: str) -> tuple[dict[str, Any], list[int], list[Managed]]:
    """m's _server_inputs, kept open until `held` closes; a failure is m's, at `phase` (a process stopped meanwhile,
    SIGSTOP, is said so, not as the listing it could not finish)."""
    try:
        return held.enter_context(_server_inputs(m, timeout))
    except GpucrError as exc:
        try:
            proc.check_not_stopped(m.pid)
        except GpucrError as stopped:
            raise PhaseError(m.pid, phase, stopped) from exc
        raise PhaseError(m.pid, phase, exc) from exc


def _copy_all_out(members: list[_Member], inputs: dict[int, tuple[dict[str, Any], list[int], list[Managed]]],
                  mover: DataPlane, stop: threading.Event, scan: bool = True,
                  driver_done: threading.Event | None = None, timeout: float = 30.0) -> dict[int, Stats]:
    """Each process's memory copied into its staging by the server, or into its image (checkpoint --image), one
    after another (scan: DataPlane.copy_out's). One that finds no room for the server's context on its GPU (a GPU
    filled to the last MiB, the server's first copy there) is tried again once the driver's steps took the
    processes' own contexts off it (driver_done), within `timeout`."""
    done: dict[int, Stats] = {}
    for m in members:
        if stop.is_set():
            break
        try:
            try:
                done[m.pid] = _copy_out(m, inputs, mover, scan)
            except GpucrError as exc:
                if driver_done is None or m.image_dir is not None or not _caused_by(exc, NoRoomForServerContext):
                    raise
                if not driver_done.wait(timeout) or stop.is_set():
                    raise
                done[m.pid] = _copy_out(m, inputs, mover, scan)
        except GpucrError as exc:
            raise PhaseError(m.pid, "data out", exc) from exc
    return done


def _caused_by(exc: BaseException, kind: type[BaseException]) -> bool:
    while exc is not None:
        if isinstance(exc, kind):
            return True
        exc = exc.__cause__
    return False


def _copy_out(m: _Member, inputs: dict[int, tuple[dict[str, Any], list[int], list[Managed]]], mover: DataPlane,
              scan: bool) -> Stats:
    if m.image_dir is None:
        return mover.copy_out(m.pid, *inputs[m.pid], scan=scan)
    layout, _no_staging, memory = inputs[m.pid]
    m.sink = _image_sink(m, layout)
    return mover.copy_out(m.pid, m.sink.layout, [], memory, scan=scan, image=m.sink)


def _image_sink(m: _Member, layout: dict[str, Any]) -> Any:
    """The image m's data out writes, in its directory (empty, as the vet found it; made 0700 if new), under a
    temporary name until the commit finishes it (gpucr.image.ImageSink); m.close() removes it should the checkpoint
    fail. The plane's ring threads write through its fd: only creating and naming files takes the user's identity."""
    from .. import image as images   # needs xxhash: only image work pays for importing it
    idir = imagefs.ImageDir(m.image_dir, imagefs.owner_for(m.t.uid, m.pid), create=True)
    try:
        if idir.names():
            raise GpucrError(f"the image directory {m.image_dir} is no longer empty (someone else writes there); the "
                             "checkpoint is undone, the process runs on")
        return images.ImageSink(idir, layout["allocations"])
    except BaseException:
        idir.close()
        raise


def _handed_done(m: _Member, st: Stats) -> None:
    """The plane's copy of m is in staging. Its agent keeps its fds until the commit: until then an abort maps
    the memory again (m.held)."""
    _data_out_done(m, m.agent.call("handed_done", timeout=60.0))
    m.held = True
    m.result["phases_s"]["data_out"] = st.seconds   # the server's copy (the handover has its own phase)
    m.result["data_plane"] = m.plane.plane
    m.result["bytes_zero_skipped"] = st.zero_skipped   # in chunks all zero on the GPU: not copied out
    m.result["bytes_unchanged_skipped"] = st.unchanged_skipped   # the staging held them already: not copied out
    m.result["scanned"], m.result["bytes_scanned"] = st.scan, st.scanned   # off with --no-scan: neither part then
    _server_phases(m, st)


def _server_phases(m: _Member, st: Stats) -> None:
    """What the server's copy cost besides the copy itself, when it did: pinning staging it had not pinned
    yet, and waiting for the data plane (another process's copy, or pinning ahead)."""
    if st.pin_s:
        m.result["phases_s"]["server_pin"] = st.pin_s
    if st.wait_s >= 0.001:
        m.result["phases_s"]["server_wait"] = st.wait_s
    if st.scan_s:
        m.result["phases_s"]["server_scan"] = st.scan_s     # a copy out's waits for its zero scan and digests
    if st.checked:
        m.result["phases_s"]["server_check"] = st.check_s   # a fill's check after its copies, before the fds went back
    # where the copy's own seconds went on the server's thread (the copy engines ran meanwhile): a copy
    # slower than the link shows whether the server made, queued, waited or exported
    m.result["phases_s"].update(server_stage=st.stage_s, server_make=st.make_s, server_queue=st.queue_s,
                                server_drain=st.drain_s, server_export=st.export_s)
    if st.routes:
        m.result["routes"] = dict(st.routes)
        # which of the two ways set the pace, and what watching the neighbours cost
        m.result["phases_s"].update(server_straight=st.straight_s, server_route=st.route_s, route_looks=st.looks_s)
    for uuid in st.dropped:
        m.result.setdefault("warnings", []).append(f"the route through GPU {uuid} was given up mid-copy: a process "
                                                   "started on it (the rest went straight)")


@contextmanager
def _server_inputs(m: _Member, timeout: float) -> Iterator[tuple[dict[str, Any], list[int], list[Managed]]]:
    """The process's staging layout with its files, and its memory with our fds of it, for the server's
    data plane; every fd closed afterwards (ours of the memory keep it on the GPU while open)."""
    memory = server_memory.gather(m.agent, timeout)
    try:
        layout, seg_fds = m.agent.call_with_fds("layout", timeout=60.0)
        try:
            yield layout, seg_fds, memory
        finally:
            for fd in seg_fds:
                os.close(fd)
    finally:
        server_memory.close_all(memory)


def _server_restorable(m: _Member) -> bool:
    """Whether the mover may put the data back: from staging in host memory or from an image, onto the process's
    GPUs or those --map names (memory imported from other processes is relinked by the agents next). Not while its agent
    rolls back a checkpoint whose controller died (it answers no layout meanwhile), nor one never committed (the
    memory never left the GPU: _data_in takes it back)."""
    st = m.status
    return (st.get("state") == "checkpointed" and not st.get("rolling_back") and st.get("checkpoint_phase") != "handed"
            and (bool(st.get("staged")) or m.image_dir is not None))


def _moved(memory: list[Managed], moves: dict[str, str]) -> list[Managed]:
    """The process's memory as the server makes it again: on the GPU --map moves it to (the driver's restore moves
    the process's context there, keeping its ordinal; the agent learns the new UUID only at its own restore)."""
    return [dataclasses.replace(e, uuid=moves.get(e.uuid, e.uuid)) for e in memory]


def _restore_with_server(members: list[_Member], timeout: float, mover: DataPlane, driver_steps: Callable[[], None],
                         failed: dict[int, PhaseError], check: bool = True) -> None:
    """The server makes new memory for each of `members` and fills it from its staging, one process after
    another, while `driver_steps` restore every process of the request (those that fail land in `failed`);
    then each agent the driver let go maps that memory at its old addresses (adopt). One the plane could not
    put back lands in `failed` and stays checkpointed, its data still in staging: also one whose new memory differs
    from its checkpoint's digests, unless not `check` (restore --accept-mismatch).

    Adopt runs after the fill, not beside it: on the H200 the driver serialises the server's making and the agent's
    mapping of ~1,500 allocations (torch's expandable segments), and side by side both slowed (make and export
    0.8 s against 0.35-0.55 s, adopt 0.25 s against 0.14-0.16 s), so the restore was slower (1.22-1.25 s against
    1.05-1.11 s)."""
    with ExitStack() as held:
        inputs = {}
        for m in members:
            try:
                inputs[m.pid] = held.enter_context(_server_inputs(m, timeout))
            except GpucrError as exc:
                failed.setdefault(m.pid, PhaseError(m.pid, "data in", exc))
        # the new memory's fds keep it on the GPU: closed whatever becomes of the driver's steps
        made = _beside(lambda: _fill_all([m for m in members if m.pid in inputs], inputs, mover, check), "gpucr-server-fill",
                       driver_steps, undo=_close_made)
    try:
        for m in members:
            filled = made.get(m.pid)
            try:
                if isinstance(filled, GpucrError):
                    raise filled
                if filled is not None and m.pid not in failed:
                    _adopt(m, inputs[m.pid][0], *filled)
            except GpucrError as exc:
                failed.setdefault(m.pid, PhaseError(m.pid, "data in", exc))
    finally:
        _close_made(made)


def _fill_all(members: list[_Member], inputs: dict[int, tuple[dict[str, Any], list[int], list[Managed]]],
              mover: DataPlane, check: bool = True) -> dict[int, Made | GpucrError]:
    """Each process's new memory made and filled by the server, one after another: [(index, fd)] of it, or
    what went wrong (that process then stays checkpointed)."""
    made: dict[int, Made | GpucrError] = {}
    for m in members:
        try:
            layout, seg_fds, memory = inputs[m.pid]
            made[m.pid] = mover.fill(m.pid, layout, seg_fds, _moved(memory, m.gpu_moves), check=check)
        except GpucrError as exc:
            made[m.pid] = exc
    return made


def _close_made(made: dict[int, Any]) -> None:
    """Our fds of the memory the server made, closed (the agents that adopted it hold their own): once
    closed, memory nobody adopted leaves the GPU."""
    for filled in made.values():
        if not isinstance(filled, GpucrError):
            for _i, fd in filled[1]:
                os.close(fd)
            filled[1].clear()


def _adopt(m: _Member, layout: dict[str, Any], st: Stats, fds: list[tuple[int, int]]) -> None:
    """The agent maps the server's new memory at the old addresses, ADOPT_BATCH fds a request. One that fails
    part way has what was adopted given back (unadopt), so the process stays checkpointed whole, its data in staging."""
    t0 = time.perf_counter()
    if m.status.get("state") == "checkpointed":
        sizes = {int(a["index"]): int(a["bytes"]) for a in layout["allocations"]}
        for k in range(0, len(fds), ADOPT_BATCH):
            batch = fds[k:k + ADOPT_BATCH]
            try:
                m.agent.call_sending_fds("adopt", [fd for _, fd in batch], timeout=60.0, **{"from": batch[0][0]})
            except GpucrError:
                if k:
                    _unadopt(m)
                raise
            m.server_bytes_in += sum(sizes[i] for i, _ in batch)
    m.result["phases_s"]["data_in"] = st.seconds
    m.result["checked"], m.result["chunks_checked"] = st.checked, st.digests_compared
    m.result["bytes_zeroed"] = st.zeroed   # zero chunks set by a memset on the GPU, not copied over the link
    _server_phases(m, st)
    m.result["phases_s"]["adopt"] = time.perf_counter() - t0


def _unadopt(m: _Member) -> None:
    """What the agent adopted of a restore that then failed, given back: the process is parked as before it."""
    try:
        m.agent.call("unadopt", timeout=60.0)
    except GpucrError as exc:
        m.result.setdefault("warnings", []).append(f"the memory adopted before the restore failed was not all given "
                                                   f"back ({exc}); 'gpucr restore' again")


def _fillable_memory(m: _Member, timeout: float) -> list[Managed]:
    """The process's memory (no fd held: the plane makes it anew); refused when the plane cannot make again every
    allocation the image holds (plain device memory)."""
    memory = server_memory.gather(m.agent, timeout)
    server_memory.close_all(memory)
    if not all(e.handable for e in memory if e.released and e.movable):
        raise GpucrError(f"process {m.pid} holds memory that gpucr's data plane cannot make again (not plain device "
                         "memory); it stays checkpointed")
    return memory
