"""What every phase of a request shares: the process as a member of it (_Member), running a phase over all
members and naming who failed (PhaseError), the watched agent call, deadlines, and the test suite's kill points."""
from __future__ import annotations

import os
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, TypeVar

from .. import gpus
from .. import proc
from .. import target as targets
from ..app import AppChannel
from ..driver import CUDA_ERROR_NOT_INITIALIZED, Driver, DriverError, ProcessState
from ..errors import GpucrError
from ..abandon import why_abandoned as abandoned
from ..plane import DataPlane
from ..timeouts import timeout_problem


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
        if proc.process_ended(pid, self.t.start_time):
            raise GpucrError(f"process {pid} exited during '{self.verb}'")
        proc.check_not_stopped(pid)
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


def _usage(m: _Member, status: dict[str, Any], mover: DataPlane | None) -> dict[str, gpus.Usage]:
    """m's GPUs' memory now, with, through the server (`mover`), the server's own part: this process runs it."""
    return gpus.process_usage(m.pid, m.uuids(), status, os.getpid() if mover is not None else None)


def _usage_at_end(m: _Member, mover: DataPlane | None) -> dict[str, gpus.Usage]:
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
    held: bool = False            # quiesced or copied (gate closed), nothing released: "abort" undoes it
    data_out_t0: float = 0.0
    asked_driver: bool = False    # a driver step was asked: it may hold the process though no answer came (stopped)
    locked: bool = False
    checkpointed: bool = False
    left_held: str = ""           # the driver's steps could not be undone: when they can ("once it runs again")
    gpus: list[dict[str, Any]] = field(default_factory=list)    # the GPUs it uses (gpus.process_gpus)
    gpu_moves: dict[str, str] = field(default_factory=dict)   # restore: {old UUID: new UUID} for the driver
    gpu_before: dict[str, gpus.Usage] = field(default_factory=dict)   # its GPUs' memory before it all began
    server_bytes_in: int = 0      # restore: bytes the gpucr server put back itself (its data plane)
    plane: DataPlane | None = None    # the gpucr server's data plane, when it moves this process's data
    sink: Any = None              # checkpoint --image: the image its data out writes (gpucr.image.ImageSink)

    def uuids(self) -> list[str]:
        """The GPUs it is on, and those a restore moves it to."""
        own = [d["uuid"] for d in (self.gpus or self.status.get("devices", []))]
        return own + [u for u in self.gpu_moves.values() if u not in own]

    @property
    def pid(self) -> int:
        return self.t.pid

    def close(self) -> None:
        if self.sink is not None:   # an image not finished (the checkpoint failed): nothing of it is left
            self.sink.discard()
            self.sink.idir.close()
            self.sink = None
        if self.app is not None:
            self.app.close()
            self.app = None
        if self.agent is not None:
            self.agent.close()
            self.agent = None


def _check_request(pids: list[int], timeout: float) -> None:
    if not pids:
        raise GpucrError("no process named")
    why = timeout_problem(timeout)
    if why:
        raise GpucrError(why)
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


def _settled_status(agent, timeout: float) -> dict[str, Any]:
    """The agent's status once no checkpoint or restore is running in it (e.g. its own roll-back); given up
    when the process is stopped, or when what runs makes no progress for the deadline."""
    seen, since = None, time.monotonic()
    while True:
        st = agent.call("status", timeout=10.0)
        if not st.get("busy"):
            return st
        proc.check_not_stopped(agent.pid)
        progress = st.get("progress")
        if progress != seen:
            seen, since = progress, time.monotonic()
        elif time.monotonic() - since > timeout + STALL_GRACE_S:
            raise GpucrError(f"process {agent.pid} stayed busy with another checkpoint or restore, making no progress "
                             f"for {timeout + STALL_GRACE_S:.0f} s; retry later")
        time.sleep(0.05)


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
    process (SIGKILL) just before its <phase>, as a worker that dies mid-checkpoint would;
    <phase>:<pid>:SIGSTOP stops it there instead, as a user's Ctrl-Z or a debugger would."""
    spec = os.environ.get("GPUCR_TEST_KILL_TARGET", "")
    if spec in (f"{phase}:{pid}", f"{phase}:{pid}:SIGSTOP"):
        os.kill(pid, signal.SIGSTOP if spec.endswith(":SIGSTOP") else signal.SIGKILL)
