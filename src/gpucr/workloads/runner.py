"""Starting a workload under gpucr and talking to it."""
from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

from .. import paths


class Workload:
    """A workload process under the agent; `ask` sends one command and returns its JSON answer."""

    def __init__(self, module: str, *args: str, simulate: bool = False, env: dict[str, str] | None = None,
                 ready_timeout: float = 600.0, argv: list[str] | None = None) -> None:
        """Run gpucr.workloads.<module> with args, or `argv` (a program of any kind speaking the same
        one-JSON-line-per-command protocol) when given."""
        full_env = paths.run_env(simulate=simulate, base=env)
        cmd = argv if argv is not None else [sys.executable, "-m", f"gpucr.workloads.{module}", *args]
        self.proc = subprocess.Popen(cmd, env=full_env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1)
        self.pid = self.proc.pid
        self.info = self._read()
        if not self.info.get("ready"):
            raise RuntimeError(f"workload {module} did not start: {self.info}")

    def _read(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            code = self.proc.wait(timeout=30)
            raise RuntimeError(f"workload exited with code {code}")
        return json.loads(line)

    def ask(self, command: str) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(command + "\n")
        self.proc.stdin.flush()
        reply = self._read()
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
