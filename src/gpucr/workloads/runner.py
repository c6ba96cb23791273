"""Starting a workload under gpucr and talking to it."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from typing import Any

from .. import paths
from ..jobs import children_of


def plain_env(simulate: bool = False, base: dict[str, str] | None = None) -> dict[str, str]:
    """run_env without the agent: the same driver (simcuda or the GPU's), no LD_PRELOAD of gpucr."""
    env = paths.run_env(simulate=simulate, base=base)
    agent = str(paths.agent_lib())
    keep = [p for p in env.get("LD_PRELOAD", "").split(":") if p and p != agent]
    if keep:
        env["LD_PRELOAD"] = ":".join(keep)
    else:
        env.pop("LD_PRELOAD", None)
    return env


class Workload:
    """A workload process under the agent; `ask` sends one command and returns its JSON answer."""

    def __init__(self, module: str, *args: str, simulate: bool = False, env: dict[str, str] | None = None,
                 ready_timeout: float = 600.0, argv: list[str] | None = None, agent: bool = True) -> None:
        """Run gpucr.workloads.<module> with args, or `argv` (a program of any kind speaking the same
        one-JSON-line-per-command protocol) when given; agent=False: without gpucr's agent (as the
        driver's own checkpoint must see it)."""
        full_env = paths.run_env(simulate=simulate, base=env) if agent else plain_env(simulate, env)
        cmd = argv if argv is not None else [sys.executable, "-m", f"gpucr.workloads.{module}", *args]
        self.proc = subprocess.Popen(cmd, env=full_env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1)
        self.pid = self.proc.pid
        try:
            self.info = self._read(ready_timeout)
        except TimeoutError:
            kill_tree(self.pid)
            self.proc.wait()
            raise RuntimeError(f"workload {module or cmd[0]} did not start within {ready_timeout:.0f} s (killed)") from None
        if not self.info.get("ready"):
            raise RuntimeError(f"workload {module} did not start: {self.info}")

    def _read(self, timeout: float | None = None) -> dict[str, Any]:
        """The next JSON line; with a timeout, TimeoutError when none comes (the process is then
        to be killed: a reader thread stays behind until its pipe closes)."""
        assert self.proc.stdout is not None
        if timeout is None:
            line = self.proc.stdout.readline()
        else:
            box: list[str] = []
            reader = threading.Thread(target=lambda: box.append(self.proc.stdout.readline()), daemon=True)
            reader.start()
            reader.join(timeout)
            if reader.is_alive():
                raise TimeoutError(f"process {self.pid} gave no answer within {timeout:.0f} s")
            line = box[0]
        if not line:
            code = self.proc.wait(timeout=30)
            raise RuntimeError(f"workload exited with code {code}")
        return json.loads(line)

    def ask(self, command: str, timeout: float | None = None) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(command + "\n")
        self.proc.stdin.flush()
        reply = self._read(timeout)
        if "error" in reply and reply["error"] and command.split()[0] not in ("loop", "graph"):
            raise RuntimeError(f"workload answered '{command}' with: {reply['error']}")
        return reply

    def close(self) -> int:
        if self.proc.poll() is None:
            try:
                assert self.proc.stdin is not None
                self.proc.stdin.write("quit\n")
                self.proc.stdin.flush()
                return self.proc.wait(timeout=60)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
        return self.proc.wait()

    def __enter__(self) -> "Workload":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def kill_tree(pid: int, also: list[int] | None = None) -> None:
    """SIGKILL a process, everything below it and `also` (workers a launcher started in sessions of
    their own, which no process-group kill reaches); the ones below first, so none is orphaned."""
    for p in [*children_of(pid), *(also or []), pid]:
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass
