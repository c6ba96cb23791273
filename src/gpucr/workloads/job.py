"""A parallel workload (tp_app, pp_app, two_gpu_app) as one job, however it was started:

- torchrun: `torchrun --nproc-per-node N -m gpucr.workloads.MODULE`, optionally under
  `gpucr run --group NAME`; rank 0 speaks for every rank (it broadcasts each command and answers
  with all ranks' answers), so one pipe drives the job;
- ranks: one process per rank (`--rank R --world N --port P`), each with its own pipe, asked at once;
- copies: N independent processes of one module and its arguments (a group of servers on one GPU),
  each with its own pipe, asked at once;
- single: one process (two_gpu_app).

Every answer is the same shape whichever the launch: rank 0's fields, plus "ranks" with each rank's.
Every question has a deadline, and close() leaves no process behind, whatever state the job is in.
"""
from __future__ import annotations

import os
import socket
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any, Callable

from ..proc import process_ended
from .ranks import merge
from .runner import Workload, kill_tree

LAUNCHES = ("torchrun", "ranks", "copies", "single")
ASK_TIMEOUT_S = 300.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun_argv(module: str, args: list[str], world: int, group: str | None = None) -> list[str]:
    """torchrun (as `python -m torch.distributed.run`, the same interpreter) on one host; under
    `gpucr run --group NAME` when a group is named, so every worker is a member."""
    run = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", str(world),
           "--master-addr", "127.0.0.1", "--master-port", str(free_port()), "-m", f"gpucr.workloads.{module}", *args]
    if group:
        return [sys.executable, "-m", "gpucr.cli", "run", "--group", group, "--", *run]
    return run


class Job:
    def __init__(self, module: str, args: list[str], launch: str = "torchrun", world: int = 2,
                 env: dict[str, str] | None = None, agent: bool = True, group: str | None = None,
                 ready_timeout: float = 600.0, simulate: bool = False) -> None:
        if launch not in LAUNCHES:
            raise ValueError(f"unknown launch '{launch}': use one of {', '.join(LAUNCHES)}")
        self.launch, self.world = launch, world
        env = dict(os.environ if env is None else env)
        if launch == "torchrun":
            # `gpucr run` adds the agent itself; without a group, the launcher gets it from here
            self.procs = [Workload("", argv=torchrun_argv(module, args, world, group), env=env,
                                   agent=agent and not group, ready_timeout=ready_timeout, simulate=simulate)]
            self.pids: list[int] = list(self.procs[0].info["pids"])
            self.launcher: int | None = self.procs[0].pid
        elif launch in ("ranks", "copies"):
            if group:
                env["GPUCR_GROUP"] = group
            port = str(free_port())
            self.procs, failed = _start_each(
                [lambda r=r: Workload(module, *args, *_rank_args(launch, r, world, port), env=env, agent=agent,
                                      ready_timeout=ready_timeout, simulate=simulate) for r in range(world)],
                at_once=launch == "ranks")
            self.pids, self.launcher = [w.pid for w in self.procs], None
            if failed:
                self.close(graceful=False)
                raise RuntimeError(f"a {'rank' if launch == 'ranks' else 'process'} of {module} did not start: {failed}")
        else:
            self.procs = [Workload(module, *args, env=env, agent=agent, ready_timeout=ready_timeout, simulate=simulate)]
            self.pids, self.launcher = [self.procs[0].pid], None
        self.info = self._merge([w.info for w in self.procs])
        self._pool = ThreadPoolExecutor(len(self.procs))

    @staticmethod
    def _merge(answers: list[dict[str, Any]]) -> dict[str, Any]:
        if len(answers) == 1 and "ranks" in answers[0]:
            return answers[0]                                   # rank 0 of torchrun merged them already
        return merge(answers)

    def ask(self, command: str, timeout: float = ASK_TIMEOUT_S) -> dict[str, Any]:
        """Every rank's answer to `command`; RuntimeError naming the rank on an error, TimeoutError
        naming the command when an answer does not come within `timeout`."""
        futures = [self._pool.submit(w.ask, command, timeout) for w in self.procs]
        answers = []
        for w, f in zip(self.procs, futures):
            try:
                answers.append(f.result(timeout + 5))
            except (TimeoutError, FutureTimeout):
                raise TimeoutError(f"no answer to '{command}' from process {w.pid} within {timeout:.0f} s") from None
        return self._merge(answers)

    def alive(self) -> dict[int, bool]:
        """Which of the ranks' processes still exist (a dead rank of a torchrun job is not our child)."""
        return {pid: not process_ended(pid) for pid in self.pids}

    def close(self, graceful: bool = True, timeout: float = 60.0) -> list[int | None]:
        """Ask every process to quit (graceful), then kill whatever is left: the ranks, the launcher
        and anything below them. Returns the exit codes of the processes started here."""
        if graceful:
            with ThreadPoolExecutor(max(1, len(self.procs))) as pool:
                list(pool.map(lambda w: _quit(w, timeout), self.procs))
        for w in self.procs:
            if w.proc.poll() is None:
                kill_tree(w.pid, also=[p for p in self.pids if _ours(p)])
        for pid in self.pids:
            if _ours(pid):
                try:
                    os.kill(pid, 9)
                except ProcessLookupError:
                    pass
        codes = []
        for w in self.procs:
            try:
                codes.append(w.proc.wait(timeout=30))
            except Exception:
                codes.append(None)
        if hasattr(self, "_pool"):
            self._pool.shutdown(wait=False, cancel_futures=True)
        return codes

    def __enter__(self) -> "Job":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _start_each(starts: list[Callable[[], Workload]], at_once: bool) -> tuple[list[Workload], BaseException | None]:
    """Every process started (ranks at once: their init waits for all; copies one after another: each
    sizes itself, as an LLM server its KV cache, on what the GPU holds when it starts, which a neighbour
    starting beside it would change), and the first failure, if any (the ones after it are not started)."""
    if at_once:
        with ThreadPoolExecutor(len(starts)) as pool:
            futures = [pool.submit(start) for start in starts]
        failed = [f.exception() for f in futures if f.exception() is not None]
        return [f.result() for f in futures if f.exception() is None], (failed[0] if failed else None)
    procs: list[Workload] = []
    for start in starts:
        try:
            procs.append(start())
        except (RuntimeError, OSError, ValueError) as exc:
            return procs, exc
    return procs, None


def _rank_args(launch: str, rank: int, world: int, port: str) -> list[str]:
    """What tells a process of a job its rank (one process per rank); copies are told nothing: each is a
    whole application of its own, the job only a group of them."""
    return ["--rank", str(rank), "--world", str(world), "--port", port] if launch == "ranks" else []


def _quit(w: Workload, timeout: float) -> None:
    """Write quit and wait up to `timeout` for the process to end; never raises."""
    if w.proc.poll() is not None:
        return
    try:
        assert w.proc.stdin is not None
        w.proc.stdin.write("quit\n")
        w.proc.stdin.flush()
    except OSError:
        return
    end = time.monotonic() + timeout
    while w.proc.poll() is None and time.monotonic() < end:
        time.sleep(0.1)


def _ours(pid: int) -> bool:
    """Still a workload process (not a pid the kernel has given to someone else since)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return b"gpucr.workloads" in f.read()
    except OSError:
        return False
