"""The server's socket and its wire format.

One connection carries one request: a JSON line from the client, a JSON line back. The socket lives in
the user's private runtime dir (paths.runtime_rule: owned by the user, 0700, not a link), one per
driver kind, so a simulated controller never talks to a server on the GPU's driver or the reverse, and
one per pid and mount namespace, since a request's pids and paths mean what they mean in its client's
namespaces only.
"""
from __future__ import annotations

import json
import os
import socket
import tempfile
from pathlib import Path
from typing import Any

from .. import paths
from ..version import __version__
from ..errors import GpucrError

PROTOCOL = 1
MAX_MESSAGE = 64 << 20       # a request or an answer (ps of many processes with their certificates)
REQUEST_IDLE_S = 30.0        # a connection that sends no whole request within this is closed
# Settings of the client's own environment that change what a request does: each travels with the request
# (the server's environment is the one it started with). Nothing else of the client's environment does.
REQUEST_ENV = ("GPUCR_TEST_KILL_AT", "GPUCR_TEST_KILL_TARGET", "GPUCR_TEST_DRIVER_LIMIT_S")


def _stem(simulated: bool) -> str:
    """The server's name in the runtime dir: its driver kind and the namespaces it serves (the pid and mount
    namespaces a client must share with it, daemon.Server.peer_problem): each pair of namespaces that
    shares a runtime dir has a server, and a client never finds another pair's."""
    pidns, mntns = namespaces("self")
    return f"server{'-sim' if simulated else ''}-{pidns}-{mntns}"


def socket_name(simulated: bool) -> str:
    return _stem(simulated) + ".sock"


def log_name(simulated: bool) -> str:
    return _stem(simulated) + ".log"


def http_socket_name(simulated: bool) -> str:
    """The HTTP API's Unix socket, beside the server's own (gpucr.service_http). Its name is no longer than the
    server's: a socket's path has 107 bytes at most, and a runtime dir that fits one fits both."""
    return _stem(simulated) + ".http"


def token_name(simulated: bool) -> str:
    """The HTTP API's token for loopback TCP (`gpucr serve --http`), 0600 beside the server's socket."""
    return _stem(simulated) + "-http.token"


def code_identity() -> str:
    """What a client and a server must share to work together: gpucr's version and where its code is
    (a server left running from another checkout or install is not used)."""
    return f"{__version__}:{Path(__file__).resolve().parent.parent}"


def existing_dir() -> Path | None:
    """The user's verified runtime dir (the rules' dir, else a private fallback of theirs), or None."""
    dirs = paths.agent_dirs(os.getuid())
    return dirs[0] if dirs else None


def make_dir() -> Path:
    """The user's runtime dir, made 0700 when missing; under the default rule a name someone else holds is
    left alone and a private dir of our own is made instead, as the agent does."""
    found = existing_dir()
    if found is not None:
        return found
    named, fallback = paths.runtime_rule()
    try:
        os.mkdir(named, 0o700)
        if paths.dir_problem(named, os.getuid()) is None:
            return named
    except FileExistsError:
        pass
    except OSError as exc:
        if not fallback:
            raise GpucrError(f"cannot make the runtime dir {named}: {exc.strerror}") from exc
    if not fallback:
        raise GpucrError(f"the runtime dir {named} is not private: {paths.dir_problem(named, os.getuid())}; "
                         "make it a directory of yours with mode 0700")
    prefix = paths.fallback_prefix(os.getuid())
    return Path(tempfile.mkdtemp(prefix=prefix.name, dir=prefix.parent))


def send(sock: socket.socket, obj: dict[str, Any]) -> None:
    sock.sendall(json.dumps(obj, separators=(",", ":")).encode() + b"\n")


def receive(sock: socket.socket, what: str) -> dict[str, Any] | None:
    """One JSON object line, or None when the other side closed before sending one."""
    # chunks kept apart and only the newest searched for the end of line: a growing bytes object searched whole on
    # every read made a 64 MiB request cost 25 s of the server's time (quadratic)
    chunks: list[bytes] = []
    size = 0
    while True:
        chunk = sock.recv(1 << 16)
        if not chunk:
            return None
        chunks.append(chunk)
        size += len(chunk)
        if size > MAX_MESSAGE:
            raise GpucrError(f"the {what} is larger than {MAX_MESSAGE >> 20} MiB")
        if b"\n" in chunk:
            break
    try:
        obj = json.loads(b"".join(chunks).split(b"\n", 1)[0])
    except ValueError as exc:
        raise GpucrError(f"the {what} is not JSON") from exc
    if not isinstance(obj, dict):
        raise GpucrError(f"the {what} is not a JSON object")
    return obj


def namespaces(pid: int | str) -> tuple[int, int]:
    """(pid namespace inode, mount namespace inode) of a process: a request names pids and paths, which
    mean the same to the server only when both are the same as the client's."""
    return os.stat(f"/proc/{pid}/ns/pid").st_ino, os.stat(f"/proc/{pid}/ns/mnt").st_ino
