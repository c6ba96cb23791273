"""Finding, asking, starting and stopping this user's gpucr server.

The client trusts a server as it trusts an agent's socket, and no more: the socket must be in the user's
verified private runtime dir, be a socket of the user's, and the listener's SO_PEERCRED uid must be the
user's (checked before a byte is sent).
"""
from __future__ import annotations

import errno
import os
import select
import socket
import stat
import sys
import time
from pathlib import Path
from typing import Any

from .. import paths
from ..agent import peer_credentials
from ..errors import GpucrError
from ..proc import check_not_stopped, process_ended
from . import wire

AUTO_IDLE_EXIT_S = 60.0   # a server `gpucr run` started goes away this long after the last process under gpucr
STOPPED_CHECK_S = 1.0     # how often a client waiting for an answer checks that the server is not stopped
ANSWER_READ_S = 30.0      # once an answer has begun, the rest of it must come within this
START_WAIT_S = 20.0       # how long `gpucr run` waits for the server it started (python and cuInit: ~0.3-1.5 s)


class Unavailable(GpucrError):
    """A server's socket is there but no usable server behind it (stale, of another install, not ours)."""


class ServerDied(GpucrError):
    """The server's connection closed before its answer: it died during the request."""

    def __init__(self, message: str, pid: int | None) -> None:
        super().__init__(message)
        self.server_pid = pid


def socket_path(simulated: bool) -> Path | None:
    d = wire.existing_dir()
    return d / wire.socket_name(simulated) if d is not None else None


class Connection:
    """One connection to the server, for one request."""

    def __init__(self, path: Path) -> None:
        why = paths.socket_problem(path, os.getuid())
        if why is not None:
            raise Unavailable(f"refusing the gpucr server socket: {why}")
        self.path = path
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(5.0)
        ino = 0
        try:
            ino = os.lstat(path).st_ino   # the very socket that refuses, if it does
            self.sock.connect(str(path))
        except OSError as exc:
            self.sock.close()
            if exc.errno == errno.ECONNREFUSED:
                _remove_dead(path, ino)
            raise Unavailable(f"the gpucr server is not running ({path.name}: {exc.strerror})") from exc
        self.pid, uid, _ = peer_credentials(self.sock)
        why = None
        if uid != os.getuid():
            why = f"the gpucr server socket {path} is served by uid {uid}, not {os.getuid()}; not used"
        elif not _same_namespaces(self.pid):
            why = ("the gpucr server runs in another pid or mount namespace than this client, where its pids and "
                   "paths mean other things")
        if why is not None:
            self.sock.close()
            raise Unavailable(why)

    def _wait_for_answer(self, op: str, timeout: float | None) -> None:
        """Until the answer begins: checking every second that the server is not stopped."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            wait = STOPPED_CHECK_S if deadline is None else min(STOPPED_CHECK_S, max(0.0, deadline - time.monotonic()))
            if select.select([self.sock], [], [], wait)[0]:
                return
            if deadline is not None and time.monotonic() >= deadline:
                raise socket.timeout()
            if self.pid:
                try:
                    check_not_stopped(self.pid)
                except GpucrError as exc:
                    raise GpucrError(f"gpucr server: {exc}, or run with --no-server ('{op}' waits for it)") from exc

    def ask(self, op: str, args: dict[str, Any] | None = None, env: dict[str, str] | None = None,
            timeout: float | None = None) -> Any:
        """Send one request and return its result; GpucrError with the server's words when it says no,
        ServerDied when the connection ends before an answer. No deadline by default: the server puts
        its own on every wait (the coordinator's progress watches), and its death ends the wait; a
        server that is stopped (SIGSTOP, a debugger) can do neither, so it is named at once."""
        try:
            self.sock.settimeout(5.0)
            wire.send(self.sock, {"op": op, "args": args or {}, "env": env or {}, "protocol": wire.PROTOCOL,
                                  "code": wire.code_identity()})
            self._wait_for_answer(op, timeout)
            self.sock.settimeout(ANSWER_READ_S)   # the answer has begun: the server writes it whole
            reply = wire.receive(self.sock, "server's answer")
        except socket.timeout as exc:
            raise GpucrError(f"the gpucr server (pid {self.pid}) did not answer '{op}' within {timeout} s") from exc
        except OSError as exc:
            reply = None
            if not isinstance(exc, (ConnectionResetError, BrokenPipeError)):
                raise GpucrError(f"talking to the gpucr server failed during '{op}': {exc}") from exc
        finally:
            self.sock.close()
        if reply is None:
            raise ServerDied(f"the gpucr server (pid {self.pid}) died during '{op}'", self.pid)
        if reply.get("mismatch"):
            raise Unavailable(str(reply.get("error")))
        if not reply.get("ok"):
            raise GpucrError(str(reply.get("error", "the gpucr server refused the request")), code=int(reply.get("code", 1)))
        return reply.get("result")


def _remove_dead(path: Path, ino: int) -> None:
    """Remove the socket a killed server left, so that the next request goes in-process without a note.
    Only this very socket: nothing listens on it (a server listens before it takes its name), and one that
    a new server put in its place meanwhile is left alone."""
    try:
        if os.lstat(path).st_ino == ino:
            path.unlink()
    except OSError:
        pass


def _same_namespaces(pid: int) -> bool:
    """Whether the server (pid as the kernel shows it here; 0: in a pid namespace we cannot see) shares
    this process's pid and mount namespaces (the server checks the same of its clients)."""
    try:
        return pid != 0 and wire.namespaces(pid) == wire.namespaces("self")
    except OSError:
        return False


def connect(simulated: bool) -> Connection | None:
    """A connection to the user's server, None when none was started; Unavailable when one is named
    but cannot be used (the caller goes on in-process, with a note)."""
    path = socket_path(simulated)
    if path is None or not os.path.lexists(path):
        return None
    return Connection(path)


def info(simulated: bool) -> dict[str, Any] | None:
    """The server's own description (its hello), or None when none answers."""
    try:
        conn = connect(simulated)
        return conn.ask("hello", timeout=10.0) if conn is not None else None
    except GpucrError:
        return None


def start(simulated: bool, idle_exit_s: float | None = AUTO_IDLE_EXIT_S, wait_s: float = START_WAIT_S) -> None:
    """Start a server in the background, detached (its own session, reparented to init: never the
    caller's child), logging to its log in the runtime dir (wire.log_name), and wait until it answers, so the
    first checkpoint goes through it; GpucrError when it dies first (its log's last line says why) or
    does not answer within `wait_s`. A second server started at the same time exits, leaving the first."""
    d = wire.make_dir()
    log_path = d / wire.log_name(simulated)
    log_fd = _open_log(log_path)
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPUCR_TEST_") and k != "GPUCR_NO_SERVER"}
    env["GPUCR_SIMULATE"] = "1" if simulated else "0"
    argv = [sys.executable, "-m", "gpucr.cli", "serve"] + (["--idle-exit", str(idle_exit_s)] if idle_exit_s else [])
    rfd, wfd = os.pipe()
    try:
        child = os.fork()
        if child == 0:   # the first child only makes a session, forks the server and says its pid
            code = 127
            try:
                os.close(rfd)
                os.setsid()
                server = os.fork()
                if server == 0:
                    null = os.open(os.devnull, os.O_RDONLY)
                    os.dup2(null, 0)
                    os.dup2(log_fd, 1)
                    os.dup2(log_fd, 2)
                    os.execve(sys.executable, argv, env)
                os.write(wfd, str(server).encode())
                code = 0
            finally:
                os._exit(code)
        os.close(wfd)
        wfd = -1
        os.waitpid(child, 0)
        pid = int(os.read(rfd, 32) or b"0")
    finally:
        os.close(log_fd)
        os.close(rfd)
        if wfd >= 0:
            os.close(wfd)
    deadline = time.monotonic() + wait_s
    while info(simulated) is None:
        if not pid or not _alive(pid):
            if info(simulated) is not None:   # another server won the name: it serves
                return
            raise GpucrError(f"it exited: {_last_line(log_path)}")
        if time.monotonic() > deadline:
            raise GpucrError(f"it did not answer within {wait_s:.0f} s (pid {pid}, log {log_path})")
        time.sleep(0.02)


def _last_line(path: Path) -> str:
    try:
        lines = path.read_text(errors="replace").strip().splitlines()
    except OSError as exc:
        return f"(its log {path}: {exc.strerror})"
    return lines[-1] if lines else f"(nothing in {path})"


def _open_log(path: Path) -> int:
    """The server's log, appended to: a regular file of the user's, never through a link."""
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid() or st.st_nlink != 1:
        os.close(fd)
        raise GpucrError(f"{path} is not a regular file of yours; remove it")
    return fd


def ensure_running(simulated: bool) -> str | None:
    """Start the server unless one answers; a note to show when it cannot be started, else None."""
    try:
        conn = connect(simulated)
        if conn is not None:
            conn.ask("hello", timeout=10.0)
            return None
    except Unavailable:
        pass   # stale (a killed server's socket): the new server replaces it
    except GpucrError as exc:
        return f"the gpucr server does not answer ({exc}); checkpoints run in-process"
    try:
        start(simulated)
    except (OSError, GpucrError) as exc:
        return f"cannot start the gpucr server ({exc}); checkpoints run in-process"
    return None


def stop(simulated: bool, wait_s: float = 30.0) -> int | None:
    """Ask the server to stop and wait until it has; its pid, or None when none ran."""
    conn = connect(simulated)
    if conn is None:
        return None
    pid = conn.pid
    conn.ask("stop", timeout=10.0)
    deadline = time.monotonic() + wait_s
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    if _alive(pid):
        raise GpucrError(f"the gpucr server (pid {pid}) did not stop within {wait_s:.0f} s; kill it with kill {pid}")
    return pid


def _alive(pid: int) -> bool:
    return not process_ended(pid)   # a zombie (a server this very process started, not reaped) has stopped


__all__ = ["Connection", "ServerDied", "Unavailable", "connect", "ensure_running", "info", "start", "stop",
           "socket_path"]
