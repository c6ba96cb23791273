"""The two-way switch (docs/swap.md): on one GPU, process A is checkpointed (parked) while process B is restored
(resumed), at the same time, through the plane's one link. A hands its memory over as for any checkpoint; the plane
copies it out and, beside it, makes and fills B's (DataPlane.two_way), each of A's allocations given back as soon as
its copy lands in staging, each of B's made once the GPU holds it (gpucr.switch_schedule). The driver's steps run
beside the copies, A's and B's at once: A's lock and checkpoint (its context freed), and B's restore (once its
context fits) and unlock.
Then A commits and B adopts its new memory and runs.

Roll-back: a switch that fails leaves each app as it was before it, where it can: B's new memory let go (its
driver restore undone by a checkpoint again), A's driver steps undone, what A gave back made again from staging
with a copy (given_back.py), the rest taken back from the agent's fds. A controller that dies instead leaves A
handed over (its agent cannot take back what it gave away: gate closed, data in staging) and B parked: each
restorable by `gpucr restore`, never lost."""
from __future__ import annotations

import os
import threading
import time
from contextlib import ExitStack
from typing import Any, Callable

from .. import gpus, shape
from ..app import AppChannel
from ..errors import GpucrError
from ..plane import DataPlane, Made, Stats
from ..results import SCHEMA_VERSION, CheckpointResult, RestoreResult
from ..switch_schedule import Room, plan
from . import context_share
from .checkpointing import _commit
from .given_back import refill_given
from .members import (PhaseError, _Member, _app_resume, _beside, _lap, _test_kill_point, _usage, _usage_at_end)
from .restoring import _data_in_all
from .staging_steps import provide_staging
from .steps import (NoRoomForContext, _abort_held, _driver_checkpoint, _driver_lock, _driver_restore, _driver_unlock,
                    _prepare, _roll_back_driver, _vet_for_checkpoint, _vet_for_restore)
from .through_plane import (_adopt, _close_made, _handed_done, _handover, _held_inputs, _server_inputs,
                            _server_restorable, _unadopt)

SLACK = 2 << 20   # beyond each piece: the driver's granule, as the swap service's room asks


class NotTwoWay(GpucrError):
    """The pair cannot switch both ways at once; nothing was touched (the caller parks, then resumes)."""


def _one_gpu(a: _Member, b: _Member) -> str:
    ua = {d["uuid"] for d in a.status.get("devices") or []}
    ub = {d["uuid"] for d in b.gpus}
    if len(ua) != 1 or ua != ub:
        raise NotTwoWay(f"a two-way switch is of two processes on one same GPU (here {sorted(ua)} and {sorted(ub)})")
    return next(iter(ua))


def _vet(out_pid: int, in_pid: int, timeout: float) -> tuple[_Member, _Member]:
    """Both asked, each its own lap 'vet' (the H100's two-way switch took 59 ms here, against 3-5 ms for each alone)."""
    t0 = time.perf_counter()
    a = _vet_for_checkpoint(out_pid, None, timeout)
    t = _lap([a], "vet", t0)
    try:
        b = _vet_for_restore(in_pid, None, False, {})
    except GpucrError:
        a.close()
        raise
    _lap([b], "vet", t)
    why = ("" if _server_restorable(b) else f"process {in_pid} is not parked in host memory")
    why = why or ("" if not a.status.get("shared") else f"process {out_pid} shares GPU memory with another process")
    if why:
        a.close()
        b.close()
        raise NotTwoWay(f"no two-way switch: {why}")
    return a, b


def _fits(a: _Member, b: _Member, uuid: str, free: int) -> tuple[int, int]:
    """B's context's bytes (what its checkpoint freed beside its data) and A's beside its data (what A holds beyond
    its allocations: freed at its driver checkpoint); NotTwoWay when B does not fit even once all of A is gone, its
    context too (what the driver counts it holds: plan, the rule the switch runs by, on the sums)."""
    ctx_b = context_share.freed(b.pid, b.t.start_time).get(uuid, 0)
    held = a.gpu_before.get(uuid)
    vmm_a = sum(int(d["vmm_bytes"]) for d in a.status.get("devices") or [])
    out = [max(held.process or 0, vmm_a) if held is not None else vmm_a]
    into = [ctx_b] + [int(d["vmm_bytes"]) for d in b.gpus]
    try:
        plan(free, out, into, SLACK)
    except GpucrError as exc:
        raise NotTwoWay(f"no two-way switch: {exc}") from exc
    return ctx_b, out[0] - vmm_a


def switch(out_pid: int, in_pid: int, mover: DataPlane, timeout: float = 30.0, level: str = "full",
           drop_staging: bool = False) -> tuple[CheckpointResult, RestoreResult, dict[str, Any]]:
    """Park process out_pid and resume process in_pid at once (the module's doc): the checkpoint's result, the
    restore's, and the switch's own ({"two_way": True, bytes each way, seconds, the wait for room}). NotTwoWay,
    touching nothing, when the pair cannot (other GPUs, shared memory, B not in host memory, not enough room even
    once A is out); GpucrError after a roll-back (the module's doc) when it fails."""
    t0 = time.perf_counter()
    a, b = _vet(out_pid, in_pid, timeout)
    t = time.perf_counter()   # from here each result's phases cover the switch's, where a slow one went
    try:
        uuid = _one_gpu(a, b)
        machine = gpus.machine_gpus(a.drv)

        def free() -> int:
            mem = gpus.memory_of(a.drv, uuid, machine)
            return mem.free if mem is not None else 0
        a.gpu_before, b.gpu_before = _usage(a, a.status, mover), _usage(b, b.status, mover)
        ctx_b, ctx_a = _fits(a, b, uuid, free())
        t = _lap([a, b], "room", t)   # the GPUs' memory read, B's fit checked (the H100's two-way vet took 50 ms)
        provide_staging(a, mover)
        t = _lap([a], "staging", t)
        a.plane = b.plane = mover
        b.result["data_plane"] = mover.plane
        room = Room(free, SLACK, f"GPU {uuid}", ahead=ctx_b, behind=ctx_a)
        held_b = b.checkpointed   # the driver holds B (a full park): a failed switch puts it back so
        _prepare(a, timeout)
        t = _lap([a], "prepare", t)
        try:
            st_out, made = _both_ways(a, b, mover, room, ctx_b, level, timeout)
        except GpucrError as exc:
            _roll_back(a, b, mover, timeout, held_b)
            raise GpucrError(f"the two-way switch of processes {out_pid} (out) and {in_pid} (in) failed: {exc}; "
                             f"rolled back: {_said(a)}, {_said(b)}") from exc
        t = _lap([a, b], "both_ways", t)
        _handed_done(a, st_out)
        _commit(a, level)
        t = _lap([a], "commit", t)
        _test_kill_point("switch-after-commit")
        try:
            _adopt(b, made[0], *made[1])
        finally:
            _close_made({b.pid: made[1]})
        _data_in_all([b], timeout, drop_staging, "data in")
        t = time.perf_counter()   # adopt and finish are phases of their own
        _app_resume(_app_of(b))
        b.result["state"] = "running"
        t = _lap([b], "resume", t)
        mover.settle()
        _lap([a, b], "settle", t)
        out = CheckpointResult(SCHEMA_VERSION, "checkpoint",
                               [shape.checkpoint(a.result, shape.gpu_changes(a.gpu_before, _usage_at_end(a, mover)))])
        into = RestoreResult(SCHEMA_VERSION, "restore", [shape.restore(
            b.result, shape.gpu_changes(b.gpu_before, _usage_at_end(b, mover)), {}, None)])
        return out, into, {"two_way": True, "bytes_out": int(a.result.get("bytes_moved") or 0),
                           "bytes_in": int(b.server_bytes_in), "seconds": time.perf_counter() - t0,
                           "waited_for_room_s": room.waited_s, "made_while_out": room.made_while_out,
                           "taken_over": made[1][0].taken_over}
    finally:
        a.close()
        b.close()


def _app_of(m: _Member) -> AppChannel:
    """The restored app's own channel (as restore_many wakes it)."""
    return AppChannel.at(m.t.app_socket())


def _both_ways(a: _Member, b: _Member, mover: DataPlane, room: Room, ctx_b: int, level: str,
               timeout: float) -> tuple[Stats, tuple[dict[str, Any], Made]]:
    """A handed over, then its copy out and B's fill at once beside the driver's steps of both. Returns A's copy's
    stats and B's (layout, made)."""
    _handover(a, timeout)
    _test_kill_point("switch-after-handover")

    def give_back(upto: int) -> None:
        a.agent.call("give_back", timeout=30.0, upto=upto)
        _test_kill_point("switch-after-give-back")
        if os.environ.get("GPUCR_TEST_FAIL_AT") == "switch-after-give-back":   # the test suite's failed switch
            raise GpucrError("failed on purpose after a give-back (GPUCR_TEST_FAIL_AT)")

    def out_steps() -> None:
        if level == "full":
            _driver_lock(a, timeout)
            _driver_checkpoint(a)
            room.given()   # its context left the GPU

    def in_steps() -> None:
        # refused for memory, it is tried again once more of A is gone, as B's pieces are
        room.make(ctx_b, f"process {b.pid}'s CUDA context", lambda: _driver_restore(b),
                  lambda exc: isinstance(exc, NoRoomForContext), piece=False)
        _driver_unlock(b, timeout)

    def driver_steps() -> None:
        _at_once(_failing(out_steps, room), _failing(in_steps, room))
        _test_kill_point("switch-after-driver-steps")
    with ExitStack() as held:
        a_in = _held_inputs(held, a, timeout, "data out")
        b_in = held.enter_context(_server_inputs(b, timeout))
        done = _beside(lambda: mover.two_way(a.pid, a_in, b.pid, b_in, give_back, room), "gpucr-switch",
                       driver_steps, undo=_let_go_of_fill(b.pid))
    if isinstance(done, GpucrError):
        raise done
    st_out, made = done
    return st_out, (b_in[0], made)


def _let_go_of_fill(pid: int) -> Callable[[tuple[Stats, Made]], None]:
    """The undo of a two-way copy that finished while the driver's steps failed: the memory made for process pid
    (the in-direction's Made) let go, our fds of it closed. (It once passed the fd list for the Made: an IndexError
    that skipped the roll-back and left the app coming in waiting at its gate.)"""
    return lambda done: _close_made({pid: done[1]})


def _at_once(first: Callable[[], None], second: Callable[[], None]) -> None:
    """Both at once, first in a thread of its own: A's checkpoint and B's restore are each the driver's work in its
    own process, so the switch's control time is the longer one, not their sum (B's restore still waits in
    room.taking until its context fits). Raises first's error before second's: A's is the cause where both fail."""
    errors: list[BaseException] = []

    def run() -> None:
        try:
            first()
        except BaseException as exc:
            errors.append(exc)
    worker = threading.Thread(target=run, name="gpucr-switch-out-driver")
    worker.start()
    try:
        second()
    except BaseException as exc:
        worker.join()
        raise (errors[0] if errors else exc)
    worker.join()
    if errors:
        raise errors[0]


def _failing(steps: Callable[[], None], room: Room) -> Callable[[], None]:
    """steps(), whose failure also ends the copies' waits for room (nothing more will be freed)."""
    def run() -> None:
        try:
            steps()
        except BaseException as exc:
            room.fail(exc)
            raise
    return run


def _roll_back(a: _Member, b: _Member, mover: DataPlane, timeout: float, held_b: bool) -> None:
    """B back to parked (its new memory let go by the plane already; what it adopted given back; its driver restore
    undone by a checkpoint), then A back to running: its driver's steps undone, what it gave back made again from
    staging, the rest taken back from its agent's fds. What cannot be undone stays restorable (the module's doc)."""
    if b.status.get("state") == "checkpointed" and b.server_bytes_in:
        _unadopt(b)
    if held_b and not b.checkpointed:   # its driver restore ran: undone by a checkpoint again
        try:
            _driver_lock(b, timeout)
            _driver_checkpoint(b)
        except (GpucrError, PhaseError) as exc:
            b.result.setdefault("warnings", []).append(f"its driver restore was not undone: {exc}")
    _roll_back_driver(a)
    try:
        refill_given(a, mover, timeout)
    except GpucrError as exc:
        a.result.setdefault("warnings", []).append(f"what it gave back was not made again: {exc}")
        a.held = False   # left handed over: restorable, not taken back half
    _abort_held(a)
    _app_resume(a.app)
    a.app = None


def _said(m: _Member) -> str:
    try:
        st = m.agent.call("status", timeout=10.0)
    except GpucrError:
        return f"process {m.pid}: unknown"
    running = st.get("state") == "running" and not st.get("gate_closed")
    return f"process {m.pid} {'runs' if running else 'is parked (restorable)'}"
