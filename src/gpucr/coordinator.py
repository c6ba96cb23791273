"""Checkpoint and restore of one or many processes: the gpucr server's data plane (a mover, when the
request runs in the server) or each agent moves the data, the driver the control state. Many processes go
through each phase together, like a two-phase commit:

checkpoint: prepare all -> data out all -> driver lock all -> driver checkpoint all -> commit all
  through the server: prepare all -> quiesce all -> hand over all -> the server copies each, beside the
              driver's lock and checkpoint of all -> handed_done all -> commit all
restore:    driver restore all -> driver unlock all -> data in all -> resume all
  through the server: the server fills each, beside the driver's restore and unlock of all -> adopt each
              -> data in all (relink) -> resume all

A checkpoint is all or nothing: if any process fails at any phase, every process is rolled back to
running with its data intact, and the error names the process and the phase. A restore brings back
every process it can; one that fails stays checkpointed and restorable, and the error names it.
"""
from __future__ import annotations

import dataclasses
import math
import os
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator, TypeVar

from . import gpus, manifest, sharing, shape
from . import imagefs
from . import target as targets
from .app import AppChannel
from .driver import CUDA_ERROR_NOT_INITIALIZED, CUDA_ERROR_OUT_OF_MEMORY, Driver, DriverError, ProcessState
from .errors import GpucrError, note
from .results import SCHEMA_VERSION, CheckpointResult, ProcessCheckpoint, ProcessRestore, RestoreResult

from .levels import LEVELS   # noqa: E402,F401 (coordinator.LEVELS, as before)
from .dataplane import memory as server_memory
from .dataplane.memory import Managed
from .abandon import why_abandoned as abandoned

if TYPE_CHECKING:
    from .dataplane.mover import Mover, Stats as ServerStats

T = TypeVar("T")
ADOPT_BATCH = 64            # fds per adopt request (the agent takes at most 64 with one request)


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


def _test_kill_point(point: str) -> None:
    """Fault injection for the test suite: GPUCR_TEST_KILL_AT=<point> makes this controller die
    (SIGKILL, no clean-up) at that point, as a crashed or killed controller would."""
    if os.environ.get("GPUCR_TEST_KILL_AT") == point:
        os.kill(os.getpid(), signal.SIGKILL)


STALL_GRACE_S = 10.0        # beyond the user's deadline, which bounds staging, drain and sync together
IMAGE_STALL_MIN_S = 30.0    # an image chunk (64 MiB) may take this long to read on a slow disk
IMAGE_STAGE_MIN_S = 300.0   # making staging for an image (pinned, with the bounce ring off) reports no progress
HARD_LIMIT_S = 24 * 3600.0  # no wait is longer: progress deadlines end them long before


def _reply_timeout(timeout: float) -> float:
    """How long the controller waits for a data-moving answer while the process moves: the copy takes
    what it takes. Stalls are caught by _Watch (no progress for the stall limit), not by this."""
    return HARD_LIMIT_S


class _Watch:
    """Watches a process while the controller waits for its agent's answer: gives up at once when the
    process is stopped or gone, and when its progress (bytes moved, steps taken, read on a second
    connection) has not changed for `limit` seconds. Called every agent.WATCH_EVERY_S."""

    def __init__(self, t: targets.Target, verb: str, limit: float) -> None:
        self.t, self.verb, self.limit = t, verb, limit
        self.seen: Any = None
        self.since = time.monotonic()
        self.next_look = 0.0
        self.probe = None

    def __call__(self) -> None:
        pid = self.t.pid
        if not os.path.exists(f"/proc/{pid}"):
            raise GpucrError(f"process {pid} exited during '{self.verb}'")
        targets.check_not_stopped(pid)
        now = time.monotonic()
        if now < self.next_look:
            return
        self.next_look = now + 1.0
        seen = self._progress()
        if seen is not None and seen != self.seen:
            self.seen, self.since = seen, now
        elif now - self.since > self.limit:
            raise GpucrError(f"process {pid} made no progress for {self.limit:.0f} s during '{self.verb}' "
                             f"(last: {self.seen[0] if self.seen else 0} bytes moved); gave up")

    def _progress(self) -> tuple[int, int] | None:
        try:
            if self.probe is None:
                self.probe = self.t.connect()
            p = self.probe.call("status", timeout=5.0).get("progress") or {}
            return int(p.get("bytes", 0)), int(p.get("steps", 0))
        except (GpucrError, TypeError, ValueError):
            self.close()
            return None   # cannot tell: it counts as no progress

    def close(self) -> None:
        if self.probe is not None:
            self.probe.close()
            self.probe = None


def _watched_call(m: "_Member", verb: str, limit: float, **args: int) -> dict[str, Any]:
    """A data-moving request, with its wait watched (see _Watch)."""
    watch = _Watch(m.t, verb, limit)
    try:
        return m.agent.call(verb, timeout=_reply_timeout(limit), watch=watch, **args)
    finally:
        watch.close()


def _usage(m: _Member, status: dict[str, Any], mover: Mover | None) -> dict[str, gpus.Usage]:
    """m's GPUs' memory now, with, through the server (`mover`), the server's own part: this process runs it."""
    return gpus.process_usage(m.pid, m.uuids(), status, os.getpid() if mover is not None else None)


def _usage_at_end(m: _Member, mover: Mover | None) -> dict[str, gpus.Usage]:
    """m's GPUs' memory once its checkpoint or restore is done: its agent says again what the server made."""
    try:
        st = m.agent.call("status", timeout=10.0)
    except GpucrError:
        st = {}   # it ended meanwhile, holding nothing; the request is done and is not failed for a figure
    return _usage(m, st, mover)


class PhaseError(GpucrError):
    def __init__(self, pid: int, phase: str, cause: Exception) -> None:
        text = str(cause)
        if text.startswith(f"process {pid}: "):   # the agent's answers already name the process
            text = text[len(f"process {pid}: "):]
        super().__init__(f"process {pid} failed at {phase}: {text}")
        self.pid, self.phase, self.cause = pid, phase, cause


@dataclass
class _Member:
    """One process in a checkpoint or restore, and how far it has got (what a roll-back must undo)."""
    t: targets.Target
    drv: Driver
    agent: Any = None
    app: AppChannel | None = None
    status: dict[str, Any] = field(default_factory=dict)
    result: dict[str, Any] = field(default_factory=dict)
    image_dir: Path | None = None
    data_out: bool = False
    held: bool = False            # quiesced or copied (gate closed), nothing released: "abort" undoes it
    data_out_t0: float = 0.0
    locked: bool = False
    checkpointed: bool = False
    gpus: list[dict[str, Any]] = field(default_factory=list)    # the GPUs it uses (gpus.process_gpus)
    gpu_moves: dict[str, str] = field(default_factory=dict)   # restore: {old UUID: new UUID} for the driver
    gpu_before: dict[str, gpus.Usage] = field(default_factory=dict)   # its GPUs' memory before it all began
    server_bytes_in: int = 0      # restore: bytes the gpucr server put back itself (its data plane)
    plane: Mover | None = None    # the gpucr server's data plane, when it moves this process's data

    def uuids(self) -> list[str]:
        """The GPUs it is on, and those a restore moves it to."""
        own = [d["uuid"] for d in (self.gpus or self.status.get("devices", []))]
        return own + [u for u in self.gpu_moves.values() if u not in own]

    @property
    def pid(self) -> int:
        return self.t.pid

    def close(self) -> None:
        if self.app is not None:
            self.app.close()
            self.app = None
        if self.agent is not None:
            self.agent.close()
            self.agent = None


def _check_request(pids: list[int], timeout: float) -> None:
    if not pids:
        raise GpucrError("no process named")
    if not (math.isfinite(timeout) and timeout > 0):
        raise GpucrError("the timeout must be a positive number of seconds")
    twice = sorted({p for p in pids if pids.count(p) > 1})
    if twice:
        raise GpucrError(f"process {', '.join(map(str, twice))} is named twice: name each process once")


def _run_all(members: list[_Member], fn) -> list[tuple[_Member, BaseException]]:
    """Run fn for every process at once (inline for one); return the failures once all have finished."""
    if len(members) <= 1:
        out = []
        for m in members:
            try:
                fn(m)
            except GpucrError as exc:
                out.append((m, exc))
        return out
    with ThreadPoolExecutor(len(members)) as pool:
        futures = [(m, pool.submit(fn, m)) for m in members]
    return [(m, f.exception()) for m, f in futures if f.exception() is not None]


# The phases a request served by the gpucr server stops before once its client has gone away: those whose
# failure is undone (a checkpoint rolled back, a restore not begun); never a commit or a restore half done.
ABANDONABLE = frozenset({"prepare", "quiesce", "data out", "release", "driver lock", "driver checkpoint",
                         "restore", "driver restore"})


def _phase_failures(phase: str, members: list[_Member], fn) -> list[PhaseError]:
    """One phase across all processes: its failures as PhaseErrors (anything but a GpucrError is a bug: raised)."""
    why = abandoned() if phase in ABANDONABLE else None
    if why is not None:   # the server's client went away: this phase fails, and is undone as any failure here
        return [PhaseError(m.pid, phase, GpucrError(why)) for m in members]
    failures = []
    for m, exc in _run_all(members, fn):
        if not isinstance(exc, GpucrError):
            raise exc
        failures.append(PhaseError(m.pid, phase, exc))
    return failures


def _lap(members: list[_Member], phase: str, t0: float) -> float:
    """Record the seconds since t0 as `phase` of every member (a step they went through together: the
    checks before anything is touched, the commit, the settling after) and return now. A result's
    phases then cover its whole time, so a slow cycle shows where it went."""
    now = time.perf_counter()
    for m in members:
        m.result["phases_s"][phase] = now - t0
    return now


def _each(phase: str, members: list[_Member], fn) -> None:
    """Run one phase for every process at once; raise (after all have finished) naming the first failure."""
    failures = _phase_failures(phase, members, fn)
    if failures:
        raise failures[0] from failures[0].cause


# ---- checkpoint ----

def _vetting_status(m: _Member, timeout: float) -> dict[str, Any]:
    """The agent's status before anything is touched, within the request's own deadline: a process busy
    starting up (loading gigabytes) may answer late."""
    try:
        return m.agent.call("status", timeout=timeout)
    except GpucrError as exc:
        m.close()
        raise GpucrError(f"{exc} (--timeout); nothing was touched. Is it still starting up? Wait until it is up "
                         f"('gpucr wait {m.pid}' and its own output), or give a longer --timeout, then retry") from exc


def _vet_for_checkpoint(pid: int, image_dir: Path | None, timeout: float) -> _Member:
    t = targets.resolve(pid)
    _need_cuda(t)
    drv = t.driver()
    dstate = _driver_state(drv, pid)
    if dstate != ProcessState.RUNNING:
        raise GpucrError(f"process {pid} is already checkpointed (driver state {dstate.name.lower()}); "
                         f"restore it with 'gpucr restore {pid}'")
    if image_dir is not None:
        _check_image_dir(image_dir, imagefs.owner_for(t.uid, pid))
    m = _Member(t, drv, image_dir=image_dir, result={"pid": pid, "phases_s": {}})
    m.agent = t.connect()
    m.status = _vetting_status(m, timeout)
    if m.status["state"] != "running":
        m.close()
        raise GpucrError(f"process {pid} is already checkpointed (level data); restore it with 'gpucr restore {pid}'")
    return m


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


def _unpin_for_driver() -> bool:
    """GPUCR_UNPIN_FOR_DRIVER=1: unpin the staging before the driver's checkpoint and pin it again
    during the restore's copies (pin-ahead threads), instead of leaving it pinned through the
    driver's checkpoint. Off by default: on the H200 (Llama-3-8B shape, 69 GiB) it moved the pinning
    cost rather than removing it (unregistering does not overlap the copies; re-pinning runs at
    about 16-21 GB/s against the driver's own re-pin at about 25 GB/s): checkpoint 2.98 s vs 2.95 s,
    restore 4.73 s vs 4.24 s (bench/results/2026-11-29-h200-bench-llama-huge.json)."""
    return os.environ.get("GPUCR_UNPIN_FOR_DRIVER", "0") not in ("", "0")


def _quiesce(m: _Member, timeout: float) -> None:
    """First phase of a checkpoint of several processes: staging ready, gate closed, device still;
    nothing copied or released (an "abort" undoes it). lease=1 as for _data_out."""
    m.data_out_t0 = time.perf_counter()
    _watched_call(m, "quiesce", timeout + STALL_GRACE_S, timeout_ms=int(timeout * 1000), lease=1)
    m.held = True


def _data_out(m: _Member, timeout: float, level: str, hold: bool = False) -> None:
    """The agent's own copy out, then (unless `hold`: several processes release only once all are copied)
    the memory given back."""
    _test_kill_target(m.pid, "data-out")
    if not hold:
        m.data_out_t0 = time.perf_counter()
    # lease=1: should this controller die before it commits, the agent rolls the process back itself.
    # unpin=1: staging is unpinned segment by segment behind the copies, for an image (its memory goes
    # away once on disk, and the driver must not be needed then) or for the driver's checkpoint.
    unpin = m.image_dir is not None or (level == "full" and _unpin_for_driver())
    out = _watched_call(m, "checkpoint", timeout + STALL_GRACE_S, timeout_ms=int(timeout * 1000), lease=1,
                        unpin=int(unpin), hold=int(hold))
    if hold:
        m.held = True
        return
    _data_out_done(m, out)


def _handable(m: _Member, memory: list[Managed]) -> bool:
    """Whether the server can take all of the process's data: device memory with an fd of the agent's for every
    allocation it moves (an exporter's too: copied once, from it), and an fd of every import it unlinks (which
    keeps that memory on the GPU until every copy is confirmed). (At a restore, a released allocation is
    handable when the server can make it again.)"""
    return (all(e.handable for e in memory if e.movable)
            and all(e.fd is not None for e in memory if e.kind == "imported" and e.maps)
            # an image of memory shared between processes: its importer's staging at the image's restore does not
            # match the image yet (issue 25 notes), so that one still goes the agents' way
            and not (m.image_dir is not None and m.status.get("shared")))


def _server_takes(members: list[_Member], timeout: float) -> bool:
    """Whether the server's data plane can take every process's data; nothing is touched to find out."""
    takes: dict[int, bool] = {}

    def look(m: _Member) -> None:
        memory = server_memory.gather(m.agent, timeout)
        takes[m.pid] = _handable(m, memory)   # (before our fds are closed: an import needs the agent's)
        server_memory.close_all(memory)
    _each("data out", members, look)
    return all(takes.values())


def _data_out_by_server(members: list[_Member], timeout: float, level: str, mover: Mover) -> None:
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

    def driver_steps() -> None:
        _test_kill_point("during-server-copy")
        if level != "full":
            return
        try:   # the control state, at the same time
            _each("driver lock", members, lambda m: _driver_lock(m, timeout))
            _each("driver checkpoint", members, _driver_checkpoint)
        except BaseException:
            stop.set()
            raise
    with ExitStack() as held:
        # listed now, after the handover (it trims pools first, so the list and its numbering are the
        # layout's), and before the driver holds any process (its agent may not answer then)
        inputs = {m.pid: _held_inputs(held, m, timeout, "data out") for m in members}
        copied = _beside(lambda: _copy_all_out(members, inputs, mover, stop), "gpucr-server-copy-out", driver_steps)
    if isinstance(copied, GpucrError):
        raise copied
    _each("release", members, lambda m: _handed_done(m, copied[m.pid]))


def _handover(m: _Member, timeout: float) -> None:
    """The agent quiesces (unless it is already) and releases its memory, keeping its own fd of each allocation."""
    _test_kill_target(m.pid, "data-out")
    if not m.held:
        m.data_out_t0 = time.perf_counter()
    # lease=1: should this controller die before handed_done, the agent takes its memory back itself.
    # unpin=1 for an image: the process's staging goes once on disk, when the driver may hold the process
    _watched_call(m, "handover", timeout + STALL_GRACE_S, timeout_ms=int(timeout * 1000), lease=1,
                  unpin=int(m.image_dir is not None))
    m.held = True   # "abort" maps the memory again from the agent's fds: nothing left the GPU
    m.result["phases_s"]["handover"] = time.perf_counter() - m.data_out_t0


def _held_inputs(held: ExitStack, m: _Member, timeout: float, phase: str) -> tuple[dict[str, Any], list[int], list[Managed]]:
    """m's _server_inputs, kept open until `held` closes; a failure is m's, at `phase`."""
    try:
        return held.enter_context(_server_inputs(m, timeout))
    except GpucrError as exc:
        raise PhaseError(m.pid, phase, exc) from exc


def _copy_all_out(members: list[_Member], inputs: dict[int, tuple[dict[str, Any], list[int], list[Managed]]],
                  mover: Mover, stop: threading.Event) -> dict[int, ServerStats]:
    """Each process's memory copied into its staging by the server, one after another."""
    done: dict[int, ServerStats] = {}
    for m in members:
        if stop.is_set():
            break
        try:
            done[m.pid] = mover.copy_out(m.pid, *inputs[m.pid])
        except GpucrError as exc:
            raise PhaseError(m.pid, "data out", exc) from exc
    return done


def _handed_done(m: _Member, st: ServerStats) -> None:
    """The server's copy of m is in staging: its agent lets go of its fds, and the memory leaves the GPU."""
    _data_out_done(m, m.agent.call("handed_done", timeout=60.0))
    m.result["phases_s"]["data_out"] = st.seconds   # the server's copy (the handover has its own phase)
    m.result["data_plane"] = m.plane.plane if m.plane is not None else "server"
    _server_phases(m, st)


def _server_phases(m: _Member, st: ServerStats) -> None:
    """What the server's copy cost besides the copy itself, when it did: pinning staging it had not pinned
    yet, and waiting for the data plane (another process's copy, or pinning ahead)."""
    if st.pin_s:
        m.result["phases_s"]["server_pin"] = st.pin_s
    if st.wait_s >= 0.001:
        m.result["phases_s"]["server_wait"] = st.wait_s
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


def _beside(work: Callable[[], T], name: str, here: Callable[[], None],
            undo: Callable[[T], None] = lambda _r: None) -> T | GpucrError:
    """`work` (the server's copies) in a thread of its own while `here` (the driver's steps) runs in this
    one: work's result, or the GpucrError it raised, once it has ended. What `here` raises goes up then,
    after `undo` of work's result (what it made would otherwise be left behind)."""
    out: list[Any] = []

    def run() -> None:
        try:
            out.append(work())
        except GpucrError as exc:
            out.append(exc)
    worker = threading.Thread(target=run, name=name)
    worker.start()
    try:
        here()
    except BaseException:
        worker.join()
        if out and not isinstance(out[0], GpucrError):
            undo(out[0])
        raise
    worker.join()
    return out[0]


def _release(m: _Member) -> None:
    """Last phase of a checkpoint of several processes: every one is copied, so memory may go."""
    _data_out_done(m, m.agent.call("release", timeout=120.0))


def _data_out_done(m: _Member, out: dict[str, Any]) -> None:
    m.data_out, m.held = True, False
    r = m.result
    r["phases_s"]["data_out"] = time.perf_counter() - m.data_out_t0
    cyc = out["last_cycle_ms"]
    r["agent_ms"] = {k: cyc[k] for k in ("staging", "gate", "sync", "copy_out", "release")}
    r["bytes_moved"] = cyc["bytes_out"]
    r["bytes_left_to_driver"] = out["bytes_left_to_driver"]
    r["coverage"] = out.get("coverage")
    r["generation"] = out["generation"]
    m.status = out
    _test_kill_point("after-data-out")


def _driver_lock(m: _Member, timeout: float) -> None:
    _test_kill_target(m.pid, "driver-lock")
    t0 = time.perf_counter()
    m.drv.lock(m.pid, int(timeout * 1000))
    m.locked = True
    m.result["phases_s"]["driver_lock"] = time.perf_counter() - t0
    _test_kill_point("after-driver-lock")


def _driver_checkpoint(m: _Member) -> None:
    t0 = time.perf_counter()
    m.drv.checkpoint(m.pid)
    m.checkpointed = True
    m.result["phases_s"]["control_out"] = time.perf_counter() - t0
    _test_kill_point("after-driver-checkpoint")
    final = m.drv.state(m.pid)
    if final != ProcessState.CHECKPOINTED:
        raise GpucrError(f"the driver left it in state {final.name.lower()} instead of checkpointed")


def _commit(m: _Member, level: str) -> None:
    m.agent.call("commit", timeout=10.0, full=int(level == "full"))
    epoch = None
    if m.app is not None:
        try:
            epoch = m.app.ask("epoch", 5.0).get("epoch")
        except (OSError, ValueError):
            epoch = None
        m.app.close()
        m.app = None
    m.result["state"] = "checkpointed"
    m.result["level"] = level
    m.result["warnings"] = m.result.get("warnings", []) + _warnings(m)
    if m.image_dir is not None:
        m.result["image"] = _write_image(m, level, epoch)


def _warnings(m: _Member) -> list[str]:
    """What the checkpoint did less well than it claims by default: shared memory whose POSIX fd is
    still open in the process stays allocated in the driver (the fd holds it), so it is not given back
    while checkpointed; and copies that went through pageable memory because no ring could be pinned."""
    try:
        st = m.agent.call("status", timeout=10.0)
    except GpucrError:
        return []
    out = [f"{s['bytes'] >> 20} MiB of memory it {'exported' if s['role'] == 'exporter' else 'imported'} stays on "
           f"the GPU while checkpointed: process {m.pid} still holds {s['open_fds']} open file descriptor(s) of it; "
           "close them once the memory is imported (as NCCL does)" for s in st.get("shared", []) if s.get("open_fds")]
    if st.get("bounce_problem"):
        out.append(f"process {m.pid}: {st['bounce_problem']}, so its data went through pageable memory (slower); "
                   "check pinned-memory limits with 'gpucr doctor'")
    return out


def _roll_back_driver(m: _Member) -> None:
    """Undo the driver's steps for this process; never raises (the process may be gone)."""
    try:
        if not os.path.exists(f"/proc/{m.pid}"):
            m.data_out = False
            return
        targets.check_not_stopped(m.pid)   # a stopped process cannot answer the driver: left restorable
        s = m.drv.state(m.pid)
        if s == ProcessState.CHECKPOINTED:
            m.drv.restore(m.pid)
            s = m.drv.state(m.pid)
        if s == ProcessState.LOCKED:
            m.drv.unlock(m.pid)
    except GpucrError:
        pass


def _abort_held(m: _Member) -> None:
    """A process quiesced or copied but not released: reopening its gate undoes it."""
    if m.held and os.path.exists(f"/proc/{m.pid}"):
        try:
            m.agent.call("abort", timeout=60.0)
        except GpucrError:
            pass   # its lease ends with this connection and the agent aborts by itself
        m.held = False


def _roll_back(members: list[_Member]) -> None:
    """Undo a partial checkpoint of these processes, last step first; never raises."""
    _run_all(members, _roll_back_driver)   # it never raises
    _run_all(members, _abort_held)   # it never raises
    back = [m for m in members if m.data_out and not targets.process_ended(m.pid)]
    for m in back:
        m.status = {**m.status, "state": "checkpointed"}
    try:
        _data_in_all(back, 600.0, False, "roll-back", sources=members, drop_ended=True)
    except GpucrError:
        pass
    for m in members:
        _app_resume(m.app)
        m.app = None


def checkpoint_many(pids: list[int], level: str = "full", timeout: float = 30.0,
                    images: dict[int, str | Path] | None = None, mover: Mover | None = None) -> CheckpointResult:
    """Checkpoint several processes together, all or nothing (see the module's doc). `mover`: the gpucr
    server's data plane, which copies the data while the driver takes the control state, when it can take
    every process's data (else the agents copy it, each in its process)."""
    if level not in LEVELS:
        raise GpucrError(f"unknown level '{level}': use one of {', '.join(LEVELS)}")
    _check_request(pids, timeout)
    images = images or {}
    members: list[_Member] = []
    t0 = time.perf_counter()
    try:
        for pid in pids:   # vet everyone before touching anyone
            img = images.get(pid)
            members.append(_vet_for_checkpoint(pid, Path(img) if img is not None else None, timeout))
        _check_sharing(members, timeout)
        for m in members:
            m.gpu_before = _usage(m, m.status, mover)
        t0 = _lap(members, "vet", t0)
        try:
            _each("prepare", members, lambda m: _prepare(m, timeout))
            t0 = _lap(members, "prepare", t0)
            if mover is not None and _server_takes(members, timeout):
                _data_out_by_server(members, timeout, level, mover)
            elif len(members) > 1:
                # no process gives memory back before every one is still and copied: memory they share
                # stays whole if any of them fails, and nothing is copied while a peer still writes to it
                _each("quiesce", members, lambda m: _quiesce(m, timeout))
                _each("data out", members, lambda m: _data_out(m, timeout, level, hold=True))
                _each("release", members, _release)
            else:
                _each("data out", members, lambda m: _data_out(m, timeout, level))
            if level == "full":   # (the server's data out took the control state already, side by side)
                _each("driver lock", [m for m in members if not m.checkpointed], lambda m: _driver_lock(m, timeout))
                _each("driver checkpoint", [m for m in members if not m.checkpointed], _driver_checkpoint)
        except PhaseError as exc:
            _roll_back(members)
            if len(members) > 1:
                alive = [m for m in members if not targets.process_ended(m.pid)]
                lost = "".join(f"; process {m.pid}: {w}" for m in alive for w in m.result.get("warnings", []))
                ended = [str(m.pid) for m in members if m not in alive]
                who = (f"all {len(members)} processes run on" if not ended else
                       f"{len(alive)} of {len(members)} processes run on (process {', '.join(ended)} ended)")
                raise GpucrError(f"{exc}; rolled back: {who} with their data intact{lost}") from exc
            if exc.phase in ("prepare", "data out"):
                raise GpucrError(str(exc)) from exc   # nothing was released: its own words say it runs on
            raise GpucrError(f"{exc}; rolled back, process {exc.pid} runs on with its data intact") from exc
        t0 = time.perf_counter()
        _each("commit", members, lambda m: _commit(m, level))
        t0 = _lap(members, "commit", t0)
        if mover is not None:
            mover.settle()   # the server's context given back first, when it does not keep it
        changes = [shape.gpu_changes(m.gpu_before, _usage_at_end(m, mover)) for m in members]
        _lap(members, "settle", t0)
        return CheckpointResult(SCHEMA_VERSION, "checkpoint", [shape.checkpoint(m.result, c) for m, c in zip(members, changes)])
    finally:
        for m in members:
            m.close()


def checkpoint(pid: int, level: str = "full", timeout: float = 30.0, image: str | Path | None = None) -> ProcessCheckpoint:
    """Save the process's GPU memory and give it back; the process stays alive, parked.

    With `image`, the data is also written to that directory (with its manifest) and the host
    staging is released, so host memory is freed too.
    """
    return checkpoint_many([pid], level, timeout, {pid: image} if image is not None else None).processes[0]


def _write_image(m: _Member, level: str, epoch) -> dict:
    """Write the staged data and its manifest, then let the process give its staging back."""
    from . import image as images   # needs xxhash: only image work pays for importing it
    layout, fds = m.agent.call_with_fds("layout", timeout=60.0)
    try:
        with imagefs.ImageDir(m.image_dir, imagefs.owner_for(m.t.uid, m.pid), create=True) as idir:
            if idir.names():
                raise GpucrError(f"the image directory {m.image_dir} is no longer empty (someone else writes there); "
                                 "the process stays checkpointed with its data in host memory")
            allocs, stats = images.write(idir, layout, fds)
            man = manifest.build(pid=m.pid, start_time=m.t.start_time, generation=layout["generation"], level=level,
                                 gpus=gpus.process_gpus(m.status, gpus.machine_gpus(m.drv)),
                                 driver_version=m.drv.version(), status=m.status, allocations=allocs,
                                 epoch=epoch, simulated=m.drv.simulated)
            man["image"] = stats
            manifest.save(idir, man)
    finally:
        for fd in fds:
            os.close(fd)
    m.agent.call("drop", timeout=60.0)   # the data is safe on disk: free the host memory too
    if m.plane is not None:
        m.plane.forget(m.pid)   # its mapping and pins of the staging would keep that memory alive
    return {"dir": str(m.image_dir), "id": man["id"], **stats}


# ---- restore ----

def _vet_for_restore(pid: int, image_dir: Path | None, force: bool, gpu_map: dict[str, str]) -> _Member:
    t = targets.resolve(pid)
    _need_cuda(t)
    drv = t.driver()
    dstate = _driver_state(drv, pid)
    m = _Member(t, drv, image_dir=image_dir, result={"pid": pid, "phases_s": {}})
    m.agent = t.connect()
    m.status = m.agent.call("status", timeout=10.0)
    if m.status.get("rolling_back") and dstate == ProcessState.RUNNING:
        # its checkpoint's controller died after data out: the agent is undoing it alone, wait for that
        # (with the driver holding the process, the roll-back waits for this restore instead)
        m.status = _settled_status(m.agent, 60.0)
    st = m.status
    if dstate == ProcessState.RUNNING and st["state"] == "running" and not st.get("gate_closed"):
        m.close()
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
        for d in m.gpus:
            where = m.gpu_moves.get(d["uuid"], d["uuid"])
            # the driver's own part (small plain allocations, pools) comes back only from a full checkpoint
            need[where] = need.get(where, 0) + d["vmm_bytes"] + (d["driver_bytes"] if m.checkpointed else 0)
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


def _driver_restore(m: _Member) -> None:
    if not m.checkpointed:
        return
    t0 = time.perf_counter()
    try:
        pairs = gpus.restore_pairs(m.gpu_moves, gpus.machine_gpus(m.drv)) if m.gpu_moves else []
        m.drv.restore(m.pid, [(gpus.to_bytes(o), gpus.to_bytes(n)) for o, n in pairs] or None)
    except DriverError as exc:
        if exc.rc == CUDA_ERROR_OUT_OF_MEMORY:
            raise GpucrError("not enough free GPU memory to restore its CUDA context; free GPU memory and retry "
                             "(the process stays checkpointed)") from exc
        raise GpucrError(f"{exc}; it stays checkpointed, retry 'gpucr restore {m.pid}'") from exc
    m.result["phases_s"]["control_in"] = time.perf_counter() - t0
    _test_kill_point("after-driver-restore")
    m.checkpointed, m.locked = False, m.drv.state(m.pid) == ProcessState.LOCKED


def _server_restorable(m: _Member) -> bool:
    """Whether the mover may put the data back: from staging in host memory or from an image, onto the process's
    GPUs or those --map names (memory imported from other processes is relinked by the agents next). Not while its agent
    rolls back a checkpoint whose controller died: it restores from staging itself once the driver lets go, and
    answers no layout meanwhile."""
    st = m.status
    return (st.get("state") == "checkpointed" and not st.get("rolling_back")
            and (bool(st.get("staged")) or (m.image_dir is not None and not st.get("shared"))))


def _moved(memory: list[Managed], moves: dict[str, str]) -> list[Managed]:
    """The process's memory as the server makes it again: on the GPU --map moves it to (the driver's restore moves
    the process's context there, keeping its ordinal; the agent learns the new UUID only at its own restore)."""
    return [dataclasses.replace(e, uuid=moves.get(e.uuid, e.uuid)) for e in memory]


def _restore_with_server(members: list[_Member], timeout: float, mover: Mover, driver_steps: Callable[[], None],
                         failed: dict[int, PhaseError]) -> None:
    """The server makes new memory for each of `members` and fills it from its staging, one process after
    another, while `driver_steps` restore every process of the request (those that fail land in `failed`);
    then each agent the driver let go maps that memory at its old addresses (adopt). Whatever the server
    could not put back, the agent's own restore from staging brings back next (_data_in)."""
    with ExitStack() as held:
        inputs = {}
        for m in members:
            try:
                inputs[m.pid] = held.enter_context(_server_inputs(m, timeout))
            except GpucrError as exc:
                note(f"process {m.pid}: {exc}; its agent's own restore from staging brings it back")
        # the new memory's fds keep it on the GPU: closed whatever becomes of the driver's steps
        made = _beside(lambda: _fill_all([m for m in members if m.pid in inputs], inputs, mover), "gpucr-server-fill",
                       driver_steps, undo=_close_made)
    try:
        for m in members:
            filled = made.get(m.pid)
            if isinstance(filled, GpucrError):
                note(f"process {m.pid}: {filled}; its agent's own restore from staging brings it back")
            elif filled is not None and m.pid not in failed:
                _adopt(m, inputs[m.pid][0], *filled)
    finally:
        _close_made(made)


def _fill_all(members: list[_Member], inputs: dict[int, tuple[dict[str, Any], list[int], list[Managed]]],
              mover: Mover) -> dict[int, tuple[ServerStats, list[tuple[int, int]]] | GpucrError]:
    """Each process's new memory made and filled by the server, one after another: [(index, fd)] of it, or
    what went wrong (that process's agent then restores it itself)."""
    made: dict[int, tuple[ServerStats, list[tuple[int, int]]] | GpucrError] = {}
    for m in members:
        try:
            layout, seg_fds, memory = inputs[m.pid]
            made[m.pid] = mover.fill(m.pid, layout, seg_fds, _moved(memory, m.gpu_moves))
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


def _adopt(m: _Member, layout: dict[str, Any], st: ServerStats, fds: list[tuple[int, int]]) -> None:
    """The agent maps the server's new memory at the old addresses, ADOPT_BATCH fds a request."""
    t0 = time.perf_counter()
    try:
        if m.status.get("state") == "checkpointed":
            for k in range(0, len(fds), ADOPT_BATCH):
                batch = fds[k:k + ADOPT_BATCH]
                m.agent.call_sending_fds("adopt", [fd for _, fd in batch], timeout=60.0, **{"from": batch[0][0]})
                taken = {i for i, _ in batch}
                m.server_bytes_in += sum(int(a["bytes"]) for a in layout["allocations"] if int(a["index"]) in taken)
            m.result["data_plane"] = m.plane.plane if m.plane is not None else "server"
    except GpucrError as exc:   # the agent's own restore brings back what was not adopted
        note(f"process {m.pid}: {exc}; its agent's own restore from staging brings the rest back")
    m.result["phases_s"]["data_in"] = st.seconds
    _server_phases(m, st)
    m.result["phases_s"]["adopt"] = time.perf_counter() - t0


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


def _data_in_from_image(m: _Member, entry: dict, timeout: float, drop_staging: bool) -> bool:
    """The image read into new staging; through the server's plane (m.plane), which then fills new memory from
    it, True: the agent's own restore is still to finish (_data_in). Else the agent restores while the image is
    read (the in-process plane), False. A read that fails leaves the process checkpointed, the image its source."""
    if m.status.get("staged"):
        m.agent.call("drop", timeout=60.0)   # the image is the source now
    t0 = time.perf_counter()
    # staging is made before any data arrives; it reports no progress of its own, so its limit is wide.
    # lease=1: should this controller die before the staging is used, the agent drops what was read of it
    _watched_call(m, "stage", max(timeout, IMAGE_STAGE_MIN_S) + STALL_GRACE_S, lease=int(m.plane is not None))
    layout, fds = m.agent.call_with_fds("layout", timeout=60.0)
    m.result["phases_s"]["stage"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    limit = max(timeout, IMAGE_STALL_MIN_S) + STALL_GRACE_S
    try:
        with imagefs.ImageDir(m.image_dir, imagefs.owner_for(m.t.uid, m.pid)) as idir:
            memory = _fillable_memory(m, timeout) if m.plane is not None else None
            if memory is not None:
                _read_then_fill(m, idir, entry, layout, fds, memory)
                return True
            m.plane = None
            out = _restore_reading(m, idir, entry, layout, fds, limit, drop_staging)
    finally:
        for fd in fds:
            os.close(fd)
    m.result["phases_s"]["image_read_and_data_in"] = time.perf_counter() - t0
    m.result["bytes_moved"] = out["last_cycle_ms"]["bytes_in"]
    if "image" in m.result:   # (an importer's read can fail while its restore, which waits for nothing, succeeds)
        m.result["image"]["bytes_zeroed"] = out["last_cycle_ms"].get("bytes_zeroed", 0)
    return False


def _fillable_memory(m: _Member, timeout: float) -> list[Managed] | None:
    """The process's memory (no fd held: the server makes it anew), or None when the server cannot make again
    every allocation the image holds (plain device memory)."""
    memory = server_memory.gather(m.agent, timeout)
    server_memory.close_all(memory)
    return memory if all(e.handable for e in memory if e.released and e.movable) else None


def _read_then_fill(m: _Member, idir: imagefs.ImageDir, entry: dict, layout: dict[str, Any], seg_fds: list[int],
                    memory: list[Managed]) -> None:
    """The image read into staging, every chunk verified (the disk is the bound: the server's fill, at the
    link's speed, comes after); then the server makes new memory from it, zero chunks set on the GPU, and
    the agent adopts it. Should the read fail, the staging goes and the process stays checkpointed."""
    from . import image as images
    t0 = time.perf_counter()
    try:
        # each zero chunk is also told to the agent: should the fill fail, its own restore sets them
        m.result["image"] = images.read(idir, entry["data"], layout, seg_fds,
                                        on_zero=lambda va, off: m.agent.call("zero", timeout=60.0, va=va, offset=off),
                                        on_chunk=lambda: _test_kill_point("during-image-read"))
    except GpucrError as exc:
        try:
            m.agent.call("drop", timeout=60.0)
        except GpucrError:
            pass   # its lease on the staging drops it once this connection ends
        raise GpucrError(f"{exc}; it stays checkpointed: restore it from an intact image") from exc
    m.result["phases_s"]["image_read"] = time.perf_counter() - t0
    try:
        made: tuple[ServerStats, list[tuple[int, int]]] | GpucrError = m.plane.fill(
            m.pid, layout, seg_fds, _moved(memory, m.gpu_moves), image=_zero_chunks(entry["data"], layout))
    except GpucrError as exc:
        made = exc
    if isinstance(made, GpucrError):
        m.result["image"]["bytes_zeroed"] = 0
        note(f"process {m.pid}: {made}; its agent's own restore from the staging read brings it back")
        return
    m.result["image"]["bytes_zeroed"] = made[0].zeroed
    try:
        _adopt(m, layout, *made)
    finally:
        _close_made({m.pid: made})


def _zero_chunks(allocs: list[dict[str, Any]], layout: dict[str, Any]) -> dict[int, list[tuple[int, int]]]:
    """{allocation index in the layout: [(offset, bytes)]} of the image's zero chunks (images.read matched the two)."""
    index = {int(a["va"]): int(a["index"]) for a in layout["allocations"]}
    return {index[int(a["va"])]: [(int(c["offset"]), int(c["bytes"])) for c in a["chunks"] if c.get("zero")]
            for a in allocs}


def _restore_reading(m: _Member, idir: imagefs.ImageDir, entry: dict, layout: dict, fds: list[int], limit: float,
                     drop_staging: bool) -> dict[str, Any]:
    """The restore, waiting on this connection, while a reader thread fills staging from the image and
    announces each allocation on a second connection as soon as its chunks are verified. Either side
    failing stops the other; the agent then drops what was read and stays checkpointed (the image is
    still the source)."""
    from . import image as images
    read_error: list[GpucrError] = []
    stop = threading.Event()

    def chunk_read() -> None:
        if stop.is_set():
            raise GpucrError("the restore ended")
        notify.call("progress", timeout=60.0)
        if os.environ.get("GPUCR_TEST_KILL_AT") == "during-image-read":
            while not notify.call("status", timeout=10.0)["busy"]:   # the agent waits for the data now
                time.sleep(0.01)
            _test_kill_point("during-image-read")

    with m.t.connect() as notify:
        def read_all() -> None:
            try:
                m.result["image"] = images.read(
                    idir, entry["data"], layout, fds,
                    on_ready=lambda va: notify.call("ready", timeout=60.0, va=va),
                    on_zero=lambda va, off: notify.call("zero", timeout=60.0, va=va, offset=off),
                    on_chunk=chunk_read)
            except GpucrError as exc:
                read_error.append(exc)
                try:
                    notify.call("ready_abort", timeout=60.0)
                except GpucrError:
                    pass
        reader = threading.Thread(target=read_all, name="gpucr-image-read")
        reader.start()
        try:
            return _watched_call(m, "restore", limit, timeout_ms=int(limit * 1000), drop_staging=int(drop_staging),
                                 wait_ready=1, open_gate=0)
        except GpucrError as exc:
            stop.set()
            reader.join()
            cause = read_error[0] if read_error else exc
            raise GpucrError(f"{cause}; it stays checkpointed: restore it from an intact image") from exc
        finally:
            stop.set()
            reader.join()


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


def _relink(restoring: list[_Member], shared_before: dict[int, list[dict[str, Any]]], sources: list[_Member]) -> None:
    """Every importer's unlinked memory mapped again from its exporter, named by key."""
    wanted: dict[int, list[_Member]] = {}   # key -> importers waiting for it
    owners: dict[int, int] = {}
    for m in restoring:
        for o in shared_before[m.pid]:
            if o["role"] == "importer" and o.get("unlinked", True) and o.get("key"):
                wanted.setdefault(o["key"], []).append(m)
                owners[o["key"]] = o.get("owner", 0)
    if not wanted:
        return
    by_key = {o["key"]: m for m in sources if not targets.process_ended(m.pid)
              for o in m.status.get("shared", []) if o["role"] == "exporter"}
    outside: dict[int, Any] = {}
    try:
        for key, importers in wanted.items():
            exp_pid, exp = (by_key[key].pid, by_key[key].agent) if key in by_key else (owners[key], None)
            if exp is None:   # an exporter running outside this restore (it never stopped): ask it directly
                if not exp_pid or targets.process_ended(exp_pid):
                    continue  # gone: _orphans deals with it
                try:
                    if exp_pid not in outside:
                        outside[exp_pid] = targets.resolve(exp_pid).connect()
                    exp = outside[exp_pid]
                except GpucrError as exc:
                    raise PhaseError(importers[0].pid, f"relink of memory shared by process {exp_pid}", exc) from exc
            try:
                _reply, fds = exp.call_with_fds("export", timeout=60.0, key=key)
            except GpucrError as exc:
                raise PhaseError(exp_pid, "re-export of shared memory", exc) from exc
            try:
                for imp in {m.pid: m for m in importers}.values():   # once each: a relink maps every import of the key
                    try:
                        imp.agent.call_sending_fds("relink", fds[:1], timeout=60.0, key=key)
                    except GpucrError as exc:
                        raise PhaseError(imp.pid, "relink of shared memory", exc) from exc
            finally:
                for fd in fds:
                    os.close(fd)
    finally:
        for agent in outside.values():
            agent.close()


def _ends_soon(pid: int, within_s: float = 1.0) -> bool:
    """Whether a process whose agent just failed has ended or ends within a moment: a SIGKILLed
    process closes its sockets a little before it becomes a zombie."""
    deadline = time.monotonic() + within_s
    while not targets.process_ended(pid):
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.02)
    return True


def _owner_gone(o: dict[str, Any]) -> bool:
    """Whether the exporter an importer was bound to has ended (pid and start time name it)."""
    return bool(o.get("owner")) and targets.process_ended(o["owner"], o.get("owner_start"))


def _orphans(restoring: list[_Member], shared_before: dict[int, list[dict[str, Any]]]) -> None:
    """Memory a process imported from an exporter that has died (a rank killed mid-checkpoint) can
    never be relinked: the agent puts zeroed memory at those addresses, so the process runs on with
    its own data intact instead of waiting for ever with its gate closed; the result says so."""
    exported = {o["key"] for m in restoring for o in shared_before[m.pid] if o["role"] == "exporter"}
    for m in restoring:
        gone = {o["key"]: o for o in shared_before[m.pid] if o["role"] == "importer" and o.get("unlinked", True)
                and o["key"] not in exported and _owner_gone(o)}
        for key, o in gone.items():
            try:
                out = m.agent.call("orphan", timeout=60.0, key=key)
            except GpucrError as exc:
                raise PhaseError(m.pid, "replacing memory shared by a process that ended", exc) from exc
            m.result.setdefault("warnings", []).append(
                f"{out['bytes'] >> 20} MiB it shared with process {o['owner']}, which ended, were replaced by zeroed memory "
                "at the same addresses (a communicator with that process cannot work again)")


def _agent_restored(m: _Member) -> bool:
    return m.agent.call("status", timeout=10.0)["state"] == "running"


def _check_sharing(members: list[_Member], timeout: float) -> None:
    """Memory shared between processes is checkpointed only with every process that shares it
    (sharing.py says how that is found); importers are given their exporters' keys for the relink."""
    uuids = {d["uuid"] for m in members for d in m.status.get("devices", [])}
    sharing.check_and_bind({m.pid: m.agent for m in members}, members[0].drv, uuids, timeout)


def restore_many(pids: list[int], timeout: float = 30.0, drop_staging: bool = False,
                 images: dict[int, str | Path] | None = None, force: bool = False,
                 gpu_map: dict[str, str] | None = None, mover: Mover | None = None) -> RestoreResult:
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


def _settled_status(agent, timeout: float) -> dict[str, Any]:
    """The agent's status once no checkpoint or restore is running in it (e.g. its own roll-back); given up
    when the process is stopped, or when what runs makes no progress for the deadline."""
    seen, since = None, time.monotonic()
    while True:
        st = agent.call("status", timeout=10.0)
        if not st.get("busy"):
            return st
        targets.check_not_stopped(agent.pid)
        progress = st.get("progress")
        if progress != seen:
            seen, since = progress, time.monotonic()
        elif time.monotonic() - since > timeout + STALL_GRACE_S:
            raise GpucrError(f"process {agent.pid} stayed busy with another checkpoint or restore, making no progress "
                             f"for {timeout + STALL_GRACE_S:.0f} s; retry later")
        time.sleep(0.05)


# ---- an application that joined the cut (gpucr.app) ----

def _app_prepare(t: targets.Target, timeout: float) -> AppChannel | None:
    """Let an application that joined the cut prepare; abort (it runs on) if it fails or hangs."""
    app = AppChannel.at(t.app_socket())
    if app is None:
        return None
    try:
        reply = app.ask("prepare", timeout)
    except (OSError, ValueError) as exc:
        app.close()
        what = "did not finish within the deadline" if isinstance(exc, TimeoutError) else f"failed ({exc})"
        raise GpucrError(f"the application's prepare callback {what}; checkpoint aborted, the application runs on") from exc
    if not reply.get("ok"):
        _app_resume(app)
        raise GpucrError(f"the application refused to prepare: {reply.get('error')}; checkpoint aborted, the application runs on")
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


def _test_kill_target(pid: int, phase: str) -> None:
    """Fault injection for the test suite: GPUCR_TEST_KILL_TARGET=<phase>:<pid> kills that target
    process (SIGKILL) just before its <phase>, as a worker that dies mid-checkpoint would."""
    if os.environ.get("GPUCR_TEST_KILL_TARGET") == f"{phase}:{pid}":
        os.kill(pid, signal.SIGKILL)
