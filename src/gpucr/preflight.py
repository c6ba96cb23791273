"""What the gpucr command checks of its targets before a request: that each one is up (waiting a little
for one still starting under gpucr), and which driver they run on, so that the controller takes the
same kind: its own simcuda (from its own installation, never a library a target names) for targets on
simcuda, the system's driver otherwise. One process never loads both: a request that mixes them is
refused, naming which is which."""
from __future__ import annotations

import os
import time
from pathlib import Path

from . import target as targets
from .driver import SIMULATE_ENV
from .errors import GpucrError

STARTING_S = 10.0     # a process this young under gpucr may still be loading its agent or CUDA
POLL_S = 0.05


def _age_s(pid: int) -> float:
    ticks = os.sysconf("SC_CLK_TCK")
    uptime = float(Path("/proc/uptime").read_text().split()[0])
    return uptime - targets.process_start_time(pid) / ticks


def _not_ready(pid: int, need_cuda: bool = True) -> tuple[targets.Target | None, str]:
    """The process's target and '' once its agent answers (with CUDA loaded, when `need_cuda`); else what it
    still lacks. A refusal that waiting cannot mend (no such process, stopped, not under gpucr, or under
    gpucr long enough to have started) is raised at once."""
    try:
        t = targets.resolve(pid)
    except GpucrError:
        targets.check_not_stopped(pid)
        if not targets.starting_under_gpucr(pid) or _age_s(pid) >= STARTING_S:
            raise
        return None, "its agent does not answer yet"
    return t, "" if t.hello.get("cuda") or not need_cuda else "it has not loaded the CUDA driver yet"


def wait_ready(pid: int, timeout: float) -> targets.Target:
    """Wait up to `timeout` for a process under gpucr to be ready for a checkpoint (`gpucr wait`)."""
    deadline = time.monotonic() + timeout
    while True:
        t, lack = _not_ready(pid)
        if t is not None and not lack:
            return t
        if time.monotonic() >= deadline:
            raise GpucrError(f"process {pid} is not ready after {timeout:g} s: {lack}")
        time.sleep(POLL_S)


def settle(pid: int, timeout: float, need_cuda: bool = True) -> targets.Target:
    """A target as a request finds it, after waiting (up to `timeout`) while it is still starting: its agent
    not up yet, or CUDA not loaded yet while it is younger than STARTING_S. An older process is taken as it
    is: the request's own checks say what it lacks."""
    deadline = time.monotonic() + timeout
    while True:
        t, lack = _not_ready(pid, need_cuda)
        if t is not None and (not lack or _age_s(pid) >= STARTING_S):
            return t
        if time.monotonic() >= deadline:
            raise GpucrError(f"process {pid} is still starting under gpucr after {timeout:g} s ({lack}); wait for "
                             f"it with 'gpucr wait {pid}', then retry")
        time.sleep(POLL_S)


def take_kind(found: list[targets.Target]) -> None:
    """Make this controller act through the driver its targets run on, when it was not told which."""
    sim = [t.pid for t in found if t.simulated]
    real = [t.pid for t in found if not t.simulated]
    if sim and real:
        raise GpucrError(f"process {_pids(sim)} runs on simcuda, the simulated driver, and process {_pids(real)} on "
                         "the system's CUDA driver; one request cannot act on both (a process never loads both "
                         "drivers): name the processes of each kind in a request of their own")
    if sim and os.environ.get(SIMULATE_ENV, "") == "":
        os.environ[SIMULATE_ENV] = "1"


def _pids(pids: list[int]) -> str:
    return ", ".join(map(str, pids))
