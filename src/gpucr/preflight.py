"""What the gpucr command checks of its targets before a request: that each one is up (waiting a little
for one still starting under gpucr), and which driver they run on, so that the controller takes the
same kind: its own simcuda (from its own installation, never a library a target names) for targets on
simcuda, the system's driver otherwise. One process never loads both: a request that mixes them is
refused, naming which is which."""
from __future__ import annotations

import math
import os
import time
from pathlib import Path
from typing import Callable, TypeVar

from . import proc
from . import target as targets
from .driver import SIMULATE_ENV
from .errors import GpucrError

T = TypeVar("T")
STARTING_S = 10.0     # a process this young under gpucr may still be loading its agent or CUDA
POLL_S = 0.05


class StillStarting(GpucrError):
    """A process still starting under gpucr when the request's time ran out."""


def _age_s(pid: int) -> float:
    """How long the process has run; a process gone meanwhile reads as old (nothing is left to wait for)."""
    try:
        ticks = os.sysconf("SC_CLK_TCK")
        uptime = float(Path("/proc/uptime").read_text().split()[0])
        return uptime - proc.process_start_time(pid) / ticks
    except OSError:
        return math.inf


def _not_ready(pid: int, need_cuda: bool = True) -> tuple[targets.Target | None, str]:
    """The process's target and '' once its agent answers (with CUDA loaded, when `need_cuda`); else what it
    still lacks. A refusal that waiting cannot mend (no such process, stopped, not under gpucr, or under
    gpucr long enough to have started) is raised at once."""
    try:
        t = targets.resolve(pid)
    except GpucrError:
        proc.check_not_stopped(pid)
        # `gpucr run` before its exec is waited for however long its start takes (over 10 s on a loaded CI machine)
        if not targets.launching(pid) and (not targets.starting_under_gpucr(pid) or _age_s(pid) >= STARTING_S):
            raise
        return None, "its agent does not answer yet"
    return t, "" if t.hello.get("cuda") or not need_cuda else "it has not loaded the CUDA driver yet"


def _still_starting(t: targets.Target | None, lack: str, pid: int) -> bool:
    """Whether waiting may mend what the process lacks: a process older than STARTING_S is taken as it is."""
    return t is None or (lack != "" and _age_s(pid) < STARTING_S)


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


def _settle(pid: int, deadline: float, timeout: float, need_cuda: bool) -> tuple[targets.Target, bool]:
    """The process's target once it is no longer starting, waiting up to `deadline` (`timeout` is what the
    user gave, for the message); and whether it was still starting when first looked at."""
    waited = False
    while True:
        t, lack = _not_ready(pid, need_cuda)
        if t is not None and not _still_starting(t, lack, pid):
            return t, waited
        if time.monotonic() >= deadline:
            raise StillStarting(f"process {pid} is still starting under gpucr after {timeout:g} s ({lack}); "
                                f"wait for it with 'gpucr wait {pid}', then retry")
        waited = True
        time.sleep(POLL_S)


def request(pids: list[int], timeout: float, ask: Callable[[], T], need_cuda: bool = True) -> T:
    """The answer to a request on these processes. It is asked at once: its own vetting says hello to each
    process, so nothing is spent on checks when all is well. Only when it fails are the processes looked at:
    while one is still starting under gpucr (its agent not up yet, or CUDA not loaded yet while younger than
    STARTING_S), it waits (up to `timeout` in all) and asks again; when they run on the driver kind this
    controller was not told of, it asks again through theirs. Any other failure is the request's own."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return ask()
        except GpucrError as failed:
            looked, bad = [], None
            for pid in pids:
                try:
                    looked.append(_settle(pid, deadline, timeout, need_cuda))
                except StillStarting:
                    raise
                except GpucrError as exc:   # gone, stopped, or never under gpucr
                    bad = bad or exc
            # through the driver the others run on, the request names the one it cannot act on itself (it said the
            # system's driver could not load, where a simcuda process was asked beside a pid that is no process)
            if take_kind([t for t, _ in looked]):
                continue
            if bad is not None or not any(w for _, w in looked):
                raise failed from None


def take_kind(found: list[targets.Target]) -> bool:
    """Make this controller act through the driver its targets run on, when it was not told which; whether
    that changed its kind."""
    sim = [t.pid for t in found if t.simulated]
    real = [t.pid for t in found if not t.simulated]
    if sim and real:
        raise GpucrError(f"process {_pids(sim)} runs on simcuda, the simulated driver, and process {_pids(real)} on "
                         "the system's CUDA driver; one request cannot act on both (a process never loads both "
                         "drivers): name the processes of each kind in a request of their own")
    if sim and os.environ.get(SIMULATE_ENV, "") == "":
        os.environ[SIMULATE_ENV] = "1"
        return True
    return False


def _pids(pids: list[int]) -> str:
    return ", ".join(map(str, pids))
