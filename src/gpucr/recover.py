"""`gpucr recover`: find every process left stuck with no controller at work on it, and bring it back.

Stuck means: the driver holds it (LOCKED or CHECKPOINTED: a controller killed between its steps, or
a peer tool that stopped half-way), or gpucr's agent has it checkpointed or parked with its gate
closed. A process whose agent is busy has a controller at work right now and is left alone.
Processes of this user are looked at (every user's, for root): those under gpucr, and any other
that has the CUDA driver loaded, since the driver can hold a process that gpucr never saw.
Processes that share memory are restored together, as a restore needs them to be.
"""
from __future__ import annotations

import os

from . import coordinator
from . import target as targets
from .driver import DriverError, ProcessState, controller_driver
from .errors import GpucrError
from .results import Stuck


def _has_cuda_loaded(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/maps") as f:
            return any("libcuda.so" in line for line in f)
    except OSError:
        return False   # gone, or another user's and we are not root


def _mine(pid: int) -> bool:
    try:
        return os.getuid() == 0 or os.stat(f"/proc/{pid}").st_uid == os.getuid()
    except OSError:
        return False


def find() -> list[Stuck]:
    """Every stuck process this user may act on."""
    drv = controller_driver()
    under = {pid for pid, _ in targets.list_sockets()}
    pids = sorted(under | {int(e) for e in os.listdir("/proc") if e.isdigit() and int(e) != os.getpid()
                           and _mine(int(e)) and _has_cuda_loaded(int(e))})
    out = []
    for pid in pids:
        how = None
        try:
            state = drv.state(pid)
            if state == ProcessState.LOCKED:
                how = "driver locked"
            elif state in (ProcessState.CHECKPOINTED, ProcessState.FAILED):
                how = f"driver {state.name.lower()}"
        except DriverError:
            pass   # no CUDA state of its own: nothing the driver holds
        if pid in under and how is None:
            try:
                st = coordinator.status(pid)
            except GpucrError:
                continue
            if st.busy and not st.rolling_back:
                continue   # a controller is at work on it (an agent rolling back by itself waits for one)
            if st.state == "checkpointed":
                how = "checkpointed by gpucr (level data)"
            elif st.gate_closed:
                how = "parked (a restore stopped before its last step)"
        if how:
            out.append(Stuck(pid, targets.command_line(pid), how, pid in under))
    return out


def _bring_back_plain(s: Stuck) -> None:
    """A process gpucr never saw, held by the driver: restore and unlock it."""
    drv = controller_driver()
    if drv.state(s.pid) == ProcessState.CHECKPOINTED:
        drv.restore(s.pid)
    if drv.state(s.pid) == ProcessState.LOCKED:
        drv.unlock(s.pid)


def recover(timeout: float = 60.0) -> list[Stuck]:
    """Bring back every stuck process; each says what became of it."""
    stuck = find()
    for s in (s for s in stuck if not s.under_gpucr):
        try:
            _bring_back_plain(s)
            s.ok, s.outcome = True, "restored and unlocked by the driver; running"
        except GpucrError as exc:
            s.outcome = f"cannot be brought back: {exc}"
    ours = [s for s in stuck if s.under_gpucr]
    errors: dict[int, str] = {}
    if ours:
        # together first, so memory shared between them is relinked; then one by one what is still stuck
        try:
            coordinator.restore_many([s.pid for s in ours], timeout=timeout)
        except GpucrError:
            for s in ours:
                try:
                    if _still_stuck(s.pid):
                        coordinator.restore_many([s.pid], timeout=timeout)
                except GpucrError as exc:
                    errors[s.pid] = str(exc)
        for s in ours:
            try:
                st = coordinator.status(s.pid)
            except GpucrError as exc:
                s.outcome = f"cannot be asked after the restore: {exc}"
                continue
            s.ok = st.state == "running" and not st.gate_closed and st.driver_state in (None, "running")
            if s.ok:
                s.outcome = "restored; running"
            elif not st.staged and st.state == "checkpointed":
                s.outcome = f"its data is in an image: restore it with 'gpucr restore --image DIR {s.pid}'"
            else:
                s.outcome = f"still {st.state}: {errors.get(s.pid) or 'see gpucr status ' + str(s.pid)}"
    return stuck


def _still_stuck(pid: int) -> bool:
    st = coordinator.status(pid)
    return st.state != "running" or st.gate_closed or st.driver_state not in (None, "running")
