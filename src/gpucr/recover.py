"""`gpucr recover`: find every process left stuck with no controller at work on it, and bring it back.

Stuck means: the driver holds it (LOCKED or CHECKPOINTED: a controller killed between its steps, or
a peer tool that stopped half-way), or gpucr's agent has it checkpointed or parked with its gate
closed. A process whose agent is busy has a controller at work right now and is left alone.
Processes of this user are looked at (every user's, for root): those under gpucr, each asked through
its agent wherever that listens (its own verified runtime dirs), and any other that has the CUDA driver
loaded, since the driver can hold a process that gpucr never saw. A process checkpointed on purpose (its
controller committed) is not stuck: it is left alone unless asked (`--all`).
Processes that share memory are restored together, as a restore needs them to be.
"""
from __future__ import annotations

import os
from typing import Collection

from . import coordinator
from . import reading
from . import target as targets
from .dataplane.cli_plane import cli_plane
from .driver import Driver, DriverError, ProcessState, controller_driver
from .errors import GpucrError
from .results import ProcessStatus, Stuck

AGENT_LIB = "libgpucr.so"   # gpucr's agent, loaded in every process under gpucr


def _loaded(pid: int) -> set[str]:
    """Which of the CUDA driver and gpucr's agent process `pid` has mapped (one read of its maps)."""
    try:
        with open(f"/proc/{pid}/maps") as f:
            return {lib for line in f for lib in ("libcuda.so", AGENT_LIB) if lib in line}
    except OSError:
        return set()   # gone, or another user's and we are not root


def _mine(pid: int) -> bool:
    try:
        return os.getuid() == 0 or os.stat(f"/proc/{pid}").st_uid == os.getuid()
    except OSError:
        return False


def _driver_holds(drv: Driver, pid: int) -> str | None:
    """How the driver holds `pid`, if it does."""
    try:
        state = drv.state(pid)
    except DriverError:
        return None   # no CUDA state of its own: nothing the driver holds
    except GpucrError as exc:   # stopped, or the driver did not answer: it may hold it
        return f"the driver cannot say ({exc})"
    if state == ProcessState.LOCKED:
        return "driver locked"
    if state in (ProcessState.CHECKPOINTED, ProcessState.FAILED):
        return f"driver {state.name.lower()}"
    return None


def _on_purpose(st: ProcessStatus) -> bool:
    """A checkpoint its controller committed (`gpucr checkpoint` done), still as that left it: parked on purpose, not
    stuck. `committed` (reading.status) holds only while the driver holds the process as the committed level left
    it (checkpointed at level full, running at level data) and no restore or abort was tried since; the agent is
    checkpointed with its gate closed, between no phases, and no controller or roll-back is at work. A controller that
    died before committing, or during a restore (after the driver's steps too), leaves it stuck."""
    return st.committed and st.state == "checkpointed" and st.gate_closed and not st.checkpoint_phase and \
        not st.busy and not st.rolling_back


def _agent_sees(pid: int, held: str | None, committed_too: bool) -> str | None:
    """How process `pid`, under gpucr, is stuck as its agent says (found in the process's own verified runtime
    dirs, target.resolve), or None when it is not, or a controller is at work on it, or it is parked on purpose
    (unless `committed_too`)."""
    try:
        st = reading.status(pid)
    except GpucrError as exc:   # stuck only if the driver holds it: an agent of another gpucr may be fine
        return f"{held}; its agent does not answer: {exc}" if held else None
    if (st.busy and not st.rolling_back) or (_on_purpose(st) and not committed_too):
        return None   # a controller is at work on it (an agent rolling back by itself waits for one)
    if held:
        return held
    if st.state == "checkpointed":
        return f"checkpointed by gpucr (level {st.level or 'data'})"
    if st.gate_closed:
        return "parked (a restore stopped before its last step)"
    return None


def find(committed_too: bool = False, only: Collection[int] | None = None) -> list[Stuck]:
    """Every stuck process this user may act on (every user's, for root), or of those in `only`; with
    `committed_too`, also those checkpointed on purpose. A process with gpucr's agent loaded is always taken as
    under gpucr, wherever its agent listens: the driver alone would leave its agent's gate closed."""
    drv = controller_driver()
    listed = {pid for pid, _ in targets.list_sockets()}   # this user's dirs, other pid namespaces included
    seen = (int(e) for e in os.listdir("/proc") if e.isdigit())
    loaded = {pid: _loaded(pid) for pid in seen if (only is None or pid in only) and pid != os.getpid() and _mine(pid)}
    pids = sorted({p for p in listed if only is None or p in only} | {p for p, libs in loaded.items() if libs})
    out = []
    for pid in pids:
        under = pid in listed or AGENT_LIB in loaded.get(pid, set())
        held = _driver_holds(drv, pid)
        how = _agent_sees(pid, held, committed_too) if under else held
        if how:
            out.append(Stuck(pid, targets.command_line(pid), how, under))
    return out


def _bring_back_plain(s: Stuck) -> None:
    """A process gpucr never saw, held by the driver: restore and unlock it."""
    drv = controller_driver()
    if drv.state(s.pid) == ProcessState.CHECKPOINTED:
        drv.restore(s.pid)
    if drv.state(s.pid) == ProcessState.LOCKED:
        drv.unlock(s.pid)


def recover(timeout: float = 60.0, committed_too: bool = False, only: Collection[int] | None = None) -> list[Stuck]:
    """Bring back every stuck process, or those of `only` (with `committed_too`, also those checkpointed on
    purpose); each says what became of it."""
    stuck = find(committed_too, only)
    for s in (s for s in stuck if not s.under_gpucr):
        try:
            _bring_back_plain(s)
            s.ok, s.outcome = True, "restored and unlocked by the driver; running"
        except GpucrError as exc:
            s.outcome = f"cannot be brought back: {exc}"
    ours = [s for s in stuck if s.under_gpucr]
    errors: dict[int, str] = {}
    if ours:
        # together first, so memory shared between them is relinked; then one by one what is still stuck. The
        # data goes back through this process's own mover (no server need run: it may be what died)
        with cli_plane() as mover:
            try:
                coordinator.restore_many([s.pid for s in ours], mover, timeout=timeout)
            except GpucrError:
                for s in ours:
                    try:
                        if _still_stuck(s.pid):
                            coordinator.restore_many([s.pid], mover, timeout=timeout)
                    except GpucrError as exc:
                        errors[s.pid] = str(exc)
        for s in ours:
            try:
                st = reading.status(s.pid)
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
    st = reading.status(pid)
    return st.state != "running" or st.gate_closed or st.driver_state not in (None, "running")
