"""Client of the in-process agent's control channel (one Unix socket per process)."""
from __future__ import annotations

import json
import os
import socket
import struct
import threading
import time
from pathlib import Path
from typing import Any, Callable, Iterable, Protocol, TypeVar

from .errors import GpucrError

MAX_REPLY = 64 << 20
PROTOCOL = 3            # what the agent says in hello's "protocol"; native/agent/channel.c sends the same
WATCH_EVERY_S = 0.25    # how often a watched call looks at the process while it waits


class HoldsFd(Protocol):
    fd: int | None      # a file descriptor received from an agent, ours to close (None: none or closed)


T = TypeVar("T", bound=HoldsFd)


def peer_credentials(sock: socket.socket) -> tuple[int, int, int]:
    """(pid, uid, gid) of the process at the other end, as the kernel translates them into our namespaces
    (pid 0: a process in a pid namespace we cannot see)."""
    raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    pid, uid, gid = struct.unpack("3i", raw)
    return pid, uid, gid


class AgentClient:
    """One connection to one process's agent; requests are lines, answers JSON lines."""

    def __init__(self, path: Path, pid: int, connect_timeout: float = 5.0, uid: int | None = None) -> None:
        """Connect to `path`; with `uid`, refuse (before a byte is sent) unless the listener is process `pid` of `uid`."""
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
        if uid is not None:
            self._check_peer(uid)

    def _check_peer(self, uid: int) -> None:
        pid, peer_uid, _ = peer_credentials(self._sock)
        if pid == self.pid and peer_uid == uid:
            return
        self._sock.close()
        if pid == 0:
            who = "a process in a pid namespace this controller cannot see"
        else:
            who = f"process {pid} of uid {peer_uid}"
        raise GpucrError(f"the agent socket {self.path} of process {self.pid} is served by {who}, not by process "
                         f"{self.pid} of uid {uid}; refusing to talk to it")

    def close(self) -> None:
        self._sock.close()

    def __enter__(self) -> "AgentClient":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def call(self, verb: str, timeout: float = 30.0, *, watch: Callable[[], None] | None = None,
             **args: int) -> dict[str, Any]:
        """Send one request and return the agent's answer; raise GpucrError when it says no. With `watch`, it is
        called every WATCH_EVERY_S while the answer is awaited: it raises to give up (a stopped or stalled process)."""
        reply, fds = self._call(verb, timeout, False, args, watch=watch)
        return reply

    def call_with_fds(self, verb: str, timeout: float = 30.0, **args: int) -> tuple[dict[str, Any], list[int]]:
        """Like call, for answers that carry file descriptors (the staging segments); the caller closes them."""
        return self._call(verb, timeout, True, args)

    def call_paged_with_fds(self, verb: str, key: str, entry: Callable[[Any, list[int]], T], what: str,
                            timeout: float = 10.0) -> list[T]:
        """A listing the agent sends in pages (`from=N`; `next` is -1 after the last page), each page with
        the fds of its entries; `entry` makes one entry of an answer's `key` list, taking its fd from the
        page's. fds no entry took are closed here, and on a malformed answer every one received so far;
        the entries keep theirs (the caller closes them: close_held)."""
        out: list[T] = []
        start = 0
        while start >= 0:
            reply, fds = self.call_with_fds(verb, timeout=timeout, **{"from": start})
            try:
                got = [entry(e, fds) for e in reply[key]]
                start = int(reply.get("next", -1))
            except (KeyError, TypeError, ValueError) as exc:
                close_held(out)
                _close_all(fds)
                raise GpucrError(f"process {self.pid} sent a malformed {what}") from exc
            out.extend(got)
            used = {o.fd for o in got}
            _close_all([fd for fd in fds if fd not in used])
        return out

    def call_sending_fds(self, verb: str, send: list[int], timeout: float = 30.0, **args: int) -> dict[str, Any]:
        """Like call, with file descriptors attached to the request (shared memory to relink)."""
        return self._call(verb, timeout, False, args, send)[0]

    def _call(self, verb: str, timeout: float, want_fds: bool, args: dict,
              send: list[int] | None = None, watch: Callable[[], None] | None = None) -> tuple[dict[str, Any], list[int]]:
        with self._lock:
            return self._call_locked(verb, timeout, want_fds, args, send, watch)

    def _recv(self, want_fds: bool, fds: list[int], deadline: float, watch: Callable[[], None] | None) -> bytes:
        """One read of the answer; while it waits, `watch` looks at the process every WATCH_EVERY_S."""
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise socket.timeout()
            self._sock.settimeout(min(left, WATCH_EVERY_S) if watch else left)
            try:
                if want_fds and not fds:
                    chunk, got, _, _ = socket.recv_fds(self._sock, 65536, 253)
                    fds.extend(got)
                    return chunk
                return self._sock.recv(65536)
            except socket.timeout:
                if watch is None:
                    raise
                watch()

    def _call_locked(self, verb: str, timeout: float, want_fds: bool, args: dict,
                     send: list[int] | None, watch: Callable[[], None] | None = None) -> tuple[dict[str, Any], list[int]]:
        line = " ".join([verb, *(f"{k}={int(v)}" for k, v in args.items())]) + "\n"
        self._sock.settimeout(timeout)
        deadline = time.monotonic() + timeout
        fds: list[int] = []
        try:
            if send:
                socket.send_fds(self._sock, [line.encode()], send)
            else:
                self._sock.sendall(line.encode())
            while b"\n" not in self._buf:
                try:
                    chunk = self._recv(want_fds, fds, deadline, watch)
                except GpucrError:   # the watch gave up: an answer may still come, so this connection is done
                    _close_all(fds)
                    self._sock.close()
                    raise
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


def close_held(objs: Iterable[HoldsFd]) -> None:
    """Close the fds these entries hold (while open, an fd of GPU memory keeps that memory on the GPU)."""
    for o in objs:
        if o.fd is not None:
            os.close(o.fd)
            o.fd = None
