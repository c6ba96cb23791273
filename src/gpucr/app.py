"""Joining the cut from inside the application (optional).

    import gpucr.app
    gpucr.app.on_checkpoint(prepare=flush_queues, resume=reopen_queues)
    gpucr.app.publish_epoch(step)

`prepare` runs before gpucr closes its gate, under the checkpoint's deadline: if it raises or does
not return in time, the checkpoint is aborted and the application runs on. `resume` runs after a
restore (and after an aborted checkpoint whose prepare had run). The published epoch goes into the
checkpoint's manifest; without it, the manifest says the epoch is unknown.

The controller reaches these through a second socket beside the agent's, <runtime dir>/<pid>.app.sock.
"""
from __future__ import annotations

import json
import os
import socket
import threading
import time
from pathlib import Path
from typing import Callable

from . import paths

# An answer is one small JSON object: the controller (perhaps root) reads no more than this of it,
# so an application cannot fill the controller's memory.
MAX_ANSWER = 64 << 10
MAX_ERROR = 1000   # of a callback's exception text in an answer

_lock = threading.Lock()
_prepare: Callable[[], None] | None = None
_resume: Callable[[], None] | None = None
_epoch: int | None = None
_server: threading.Thread | None = None


def socket_path(pid: int | None = None, environ: dict[str, str] | None = None) -> str:
    return str(paths.runtime_dir(None, environ) / f"{pid or os.getpid()}.app.sock")


def on_checkpoint(prepare: Callable[[], None] | None = None, resume: Callable[[], None] | None = None) -> None:
    """Register the application's prepare and resume callbacks (replacing earlier ones)."""
    global _prepare, _resume
    with _lock:
        _prepare, _resume = prepare, resume
    _serve()


def publish_epoch(epoch: int) -> None:
    """The application's own notion of progress (a step, a request count), recorded in each manifest."""
    global _epoch
    with _lock:
        _epoch = int(epoch)
    _serve()


def _answer(verb: str) -> dict:
    with _lock:
        fn = {"prepare": _prepare, "resume": _resume}.get(verb)
        epoch = _epoch
    if verb == "epoch":
        return {"ok": True, "epoch": epoch}
    if verb not in ("prepare", "resume"):
        return {"ok": False, "error": "unknown request"}
    try:
        if fn is not None:
            fn()
    except Exception as exc:  # the controller reports it and aborts
        return {"ok": False, "error": f"{verb} raised {type(exc).__name__}: {exc}"[:MAX_ERROR]}
    return {"ok": True, "epoch": epoch}


def _handle(conn: socket.socket) -> None:
    with conn:
        creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12)
        uid = int.from_bytes(creds[4:8], "little")
        if uid not in (0, os.getuid()):
            return
        buf = b""
        while True:
            data = conn.recv(4096)
            if not data:
                return
            buf += data
            if len(buf) > 4096:
                return
            while b"\n" in buf:
                line, buf = buf.split(b"\n", 1)
                reply = _answer(line.decode(errors="replace").strip())
                conn.sendall(json.dumps(reply).encode() + b"\n")


def _serve() -> None:
    global _server
    with _lock:
        if _server is not None:
            return
        path = socket_path()
        os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
        srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        old = os.umask(0o177)
        try:
            srv.bind(path)
        finally:
            os.umask(old)
        srv.listen(4)

        def loop() -> None:
            while True:
                conn, _ = srv.accept()
                # each request in its own thread: a hung prepare must not block the next resume
                threading.Thread(target=_handle, args=(conn,), daemon=True).start()

        _server = threading.Thread(target=loop, name="gpucr-app", daemon=True)
        _server.start()
        import atexit
        atexit.register(lambda: os.path.exists(path) and os.unlink(path))


class AppChannel:
    """The controller's side: talk to an application that joined the cut (None if it did not)."""

    def __init__(self, path: str) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.connect(path)

    @classmethod
    def at(cls, path: Path) -> "AppChannel | None":
        """The channel listening at `path`, or None: the application did not join the cut, or has gone."""
        try:
            return cls(str(path)) if path.exists() else None
        except OSError:
            return None

    def ask(self, verb: str, timeout: float) -> dict:
        """Send one request; its answer, a JSON object of at most MAX_ANSWER bytes, within `timeout`
        seconds in all (TimeoutError), else ValueError (too long, not an object) or OSError."""
        deadline = time.monotonic() + timeout
        self.sock.settimeout(timeout)
        self.sock.sendall(verb.encode() + b"\n")
        buf = b""
        while b"\n" not in buf:
            if len(buf) > MAX_ANSWER:
                raise ValueError(f"the application's answer is longer than {MAX_ANSWER} bytes")
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("the application did not answer in time")
            self.sock.settimeout(left)
            data = self.sock.recv(min(4096, MAX_ANSWER + 1 - len(buf)))
            if not data:
                raise OSError("the application closed its gpucr channel")
            buf += data
        line = buf.split(b"\n", 1)[0]
        if len(line) > MAX_ANSWER:
            raise ValueError(f"the application's answer is longer than {MAX_ANSWER} bytes")
        reply = json.loads(line)
        if not isinstance(reply, dict):
            raise ValueError("the application's answer is not a JSON object")
        return reply

    def close(self) -> None:
        self.sock.close()
