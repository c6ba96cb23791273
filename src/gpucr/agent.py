"""Client of the in-process agent's control channel (one Unix socket per process)."""
from __future__ import annotations

import json
import os
import socket
import threading
from pathlib import Path
from typing import Any

from .errors import GpucrError

MAX_REPLY = 64 << 20


class AgentClient:
    """One connection to one process's agent; requests are lines, answers JSON lines."""

    def __init__(self, path: Path, pid: int, connect_timeout: float = 5.0) -> None:
        self.path, self.pid = path, pid
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock.settimeout(connect_timeout)
        try:
            self._sock.connect(str(path))
        except OSError as exc:
            self._sock.close()
            raise GpucrError(f"process {pid} is not reachable through gpucr's agent ({exc.strerror}); "
                             "was it started with 'gpucr run'?") from exc
        self._buf = b""
        self._lock = threading.Lock()   # one request at a time on this connection, whichever thread asks

    def close(self) -> None:
        self._sock.close()

    def __enter__(self) -> "AgentClient":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def call(self, verb: str, timeout: float = 30.0, **args: int) -> dict[str, Any]:
        """Send one request and return the agent's answer; raise GpucrError when it says no."""
        reply, fds = self._call(verb, timeout, False, args)
        return reply

    def call_with_fds(self, verb: str, timeout: float = 30.0, **args: int) -> tuple[dict[str, Any], list[int]]:
        """Like call, for answers that carry file descriptors (the staging segments); the caller closes them."""
        return self._call(verb, timeout, True, args)

    def call_sending_fds(self, verb: str, send: list[int], timeout: float = 30.0, **args: int) -> dict[str, Any]:
        """Like call, with file descriptors attached to the request (shared memory to relink)."""
        return self._call(verb, timeout, False, args, send)[0]

    def _call(self, verb: str, timeout: float, want_fds: bool, args: dict,
              send: list[int] | None = None) -> tuple[dict[str, Any], list[int]]:
        with self._lock:
            return self._call_locked(verb, timeout, want_fds, args, send)

    def _call_locked(self, verb: str, timeout: float, want_fds: bool, args: dict,
                     send: list[int] | None) -> tuple[dict[str, Any], list[int]]:
        line = " ".join([verb, *(f"{k}={int(v)}" for k, v in args.items())]) + "\n"
        self._sock.settimeout(timeout)
        fds: list[int] = []
        try:
            if send:
                socket.send_fds(self._sock, [line.encode()], send)
            else:
                self._sock.sendall(line.encode())
            while b"\n" not in self._buf:
                if want_fds and not fds:
                    chunk, got, _, _ = socket.recv_fds(self._sock, 65536, 253)
                    fds.extend(got)
                else:
                    chunk = self._sock.recv(65536)
                if not chunk:
                    raise GpucrError(f"process {self.pid} closed the control channel during '{verb}' (did it exit?)")
                self._buf += chunk
                if len(self._buf) > MAX_REPLY:
                    raise GpucrError(f"process {self.pid} sent an oversized answer to '{verb}'")
        except socket.timeout as exc:
            raise GpucrError(f"process {self.pid} did not answer '{verb}' within {timeout:.0f} s") from exc
        except OSError as exc:
            raise GpucrError(f"talking to process {self.pid} failed during '{verb}': {exc}") from exc
        raw, self._buf = self._buf.split(b"\n", 1)
        try:
            reply = json.loads(raw)
        except ValueError as exc:
            _close_all(fds)
            raise GpucrError(f"process {self.pid} sent a malformed answer to '{verb}'") from exc
        if not reply.get("ok"):
            _close_all(fds)
            raise GpucrError(f"process {self.pid}: {reply.get('error', 'request failed')}")
        return reply, fds


def _close_all(fds: list[int]) -> None:
    for fd in fds:
        os.close(fd)
