"""A request whose client has gone away is not worked on to its end (issue 24, F20): the server notes the
connection that each request's thread serves, and the coordinator asks, before each step it can undo, whether
that client is still there; when it is not, the step fails as any failure there would, and is undone."""
from __future__ import annotations

import select
import socket
import threading
from contextlib import contextmanager
from typing import Iterator

_serving = threading.local()   # .conn: the client connection this thread answers (None outside a request)


def client_gone(conn: socket.socket) -> bool:
    """The client closed or reset its end: nobody will read the answer. (A client sends one request line and
    then only waits, so a readable connection with nothing to read is one that ended.) poll, not select:
    select cannot look at an fd past 1023, and a busy server has its connections there."""
    ready = select.poll()
    try:
        ready.register(conn, select.POLLIN)
        if not ready.poll(0):
            return False
        return conn.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
    except BlockingIOError:
        return False
    except (OSError, ValueError):   # reset, or closed under us
        return True


@contextmanager
def serving(conn: socket.socket) -> Iterator[None]:
    """This thread answers `conn` meanwhile."""
    _serving.conn = conn
    try:
        yield
    finally:
        _serving.conn = None


def why_abandoned() -> str | None:
    """Why the request this thread works on is to stop (its client went away), or None: go on. Outside the
    server (an in-process controller) always None."""
    conn = getattr(_serving, "conn", None)
    if conn is None or not client_gone(conn):
        return None
    return "the request's client went away (the gpucr command that asked for it ended); stopped there"
