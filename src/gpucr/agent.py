"""Client of the in-process agent's control channel (one Unix socket per process)."""
from __future__ import annotations

import json
import os
import socket
import struct
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Protocol, TypeVar

from .errors import GpucrError

MAX_REPLY = 64 << 20
PROTOCOL = 4            # what the agent says in hello's "protocol"; native/agent/report.c sends the same
WATCH_EVERY_S = 0.25    # how often a watched call looks at the process while it waits
# A paged listing (`shared`, `memory`) comes from an untrusted process: besides one deadline, it is bounded
# by the count its agent announces first (at most this many entries: far more allocations than a process
# makes) and by the bytes of all its pages together: room for that many entries of MAX_ENTRY_BYTES (an
# honest `memory` entry is about 300 bytes).
MAX_LISTING_ENTRIES = 1 << 18
MAX_ENTRY_BYTES = 512
MAX_LISTING_BYTES = MAX_LISTING_ENTRIES * MAX_ENTRY_BYTES


class HoldsFd(Protocol):
    fd: int | None      # a file descriptor received from an agent, ours to close (None: none or closed)


T = TypeVar("T", bound=HoldsFd)


class Received:
    """The fds that came with one answer, ours until handed on: whatever was not taken is closed on leaving,
    on every path (an answer that then fails must not leave its fds open in a long-lived controller)."""

    def __init__(self, fds: list[int] | None = None) -> None:
        self.fds = fds if fds is not None else []

    def take(self) -> list[int]:
        out, self.fds = self.fds, []
        return out

    def hand_on(self, taken: Iterable[int | None]) -> None:
        """These fds are someone else's to close now."""
        gone = set(taken)
        self.fds = [fd for fd in self.fds if fd not in gone]

    def __enter__(self) -> "Received":
        return self

    def __exit__(self, *exc: object) -> None:
        _close_all(self.take())


@dataclass
class _Answer:
    reply: dict[str, Any]
    fds: list[int]
    size: int           # bytes of its line


class _Listing:
    """The checks of one paged listing, page after page: the count the agent announced on its first page
    bounds the entries, each `next` must advance by exactly the page's entries, the pages together stay
    under MAX_LISTING_BYTES, and each fd sent is named by at most one entry."""

    def __init__(self, pid: int, key: str, what: str) -> None:
        self.pid, self.key, self.what = pid, key, what
        self.total: int | None = None
        self.entries = self.pages = self.bytes = 0

    def refuse(self, did: str) -> GpucrError:
        return GpucrError(f"process {self.pid} {did} in its {self.what} (page {self.pages}); refused, nothing "
                          "of it used (its agent is faulty, or the process hostile)")

    def time_left(self, deadline: float, timeout: float) -> float:
        """What is left of the listing's one deadline; past it, the listing is refused."""
        left = deadline - time.monotonic()
        if left <= 0:
            raise GpucrError(f"process {self.pid} did not send its whole {self.what} within {timeout:.0f} s "
                             f"({self.pages} pages, {self.entries} entries so far); refused")
        return left

    def page(self, ans: _Answer, start: int) -> tuple[list[dict[str, Any]], int]:
        """This page's entries and where the next page starts (-1: none), or a refusal naming the process."""
        self.pages += 1
        self.bytes += ans.size
        if self.bytes > MAX_LISTING_BYTES:
            raise self.refuse(f"sent more than {MAX_LISTING_BYTES >> 20} MiB")
        if self.total is None:
            self.total = ans.reply.get("total")
            if type(self.total) is not int or not 0 <= self.total <= MAX_LISTING_ENTRIES:
                raise self.refuse(f"announced {self.total!r} entries (at most {MAX_LISTING_ENTRIES})")
        entries, nxt = ans.reply.get(self.key), ans.reply.get("next", -1)
        if type(entries) is not list or not all(isinstance(e, dict) for e in entries) or type(nxt) is not int:
            raise self.refuse("sent a malformed page")
        self.entries += len(entries)
        if self.entries > self.total:
            raise self.refuse(f"sent more entries than the {self.total} it announced")
        if nxt != -1 and (not entries or nxt != start + len(entries)):
            raise self.refuse(f"asked to go on from entry {nxt} after entries {start} to {start + len(entries) - 1}")
        self._check_fd_indexes(entries, len(ans.fds))
        return entries, nxt

    def _check_fd_indexes(self, entries: list[dict[str, Any]], nfds: int) -> None:
        named = [e.get("fd_index", -1) for e in entries]
        if any(type(i) is not int or not -1 <= i < nfds for i in named):
            raise self.refuse(f"named an fd it did not send ({nfds} sent)")
        taken = [i for i in named if i >= 0]
        if len(set(taken)) != len(taken):
            raise self.refuse("named one fd in two entries")


def peer_credentials(sock: socket.socket) -> tuple[int, int, int]:
    """(pid, uid, gid) of the process at the other end, as the kernel translates them into our namespaces
    (pid 0: a process in a pid namespace we cannot see)."""
    raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    pid, uid, gid = struct.unpack("3i", raw)
    return pid, uid, gid


class AgentClient:
    """One connection to one process's agent; requests are lines, answers JSON lines."""

    def __init__(self, path: Path, pid: int, connect_timeout: float = 5.0, uid: int | None = None,
                 always_watch: Callable[[], None] | None = None) -> None:
        """Connect to `path`; with `uid`, refuse (before a byte is sent) unless the listener is process `pid` of `uid`.
        `always_watch` watches every call that has no watch of its own (a process stopped while its agent was
        asked is then named at once, not after the call's whole timeout)."""
        self.path, self.pid, self._always_watch = path, pid, always_watch
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

    def hang_up(self) -> None:
        """End the connection from another thread: a call waiting on it returns at once (a close alone would not
        wake it), and the agent sees the end too."""
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass   # already ended

    def __enter__(self) -> "AgentClient":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def call(self, verb: str, timeout: float = 30.0, *, watch: Callable[[], None] | None = None,
             **args: int) -> dict[str, Any]:
        """Send one request and return the agent's answer; raise GpucrError when it says no. With `watch`, it is
        called every WATCH_EVERY_S while the answer is awaited: it raises to give up (a stopped or stalled process)."""
        return self._call(verb, timeout, False, args, watch=watch).reply

    def call_with_fds(self, verb: str, timeout: float = 30.0, **args: int) -> tuple[dict[str, Any], list[int]]:
        """Like call, for answers that carry file descriptors (the staging segments); the caller closes them."""
        ans = self._call(verb, timeout, True, args)
        return ans.reply, ans.fds

    def call_paged_with_fds(self, verb: str, key: str, entry: Callable[[Any, list[int]], T], what: str,
                            timeout: float) -> list[T]:
        """A listing the agent sends in pages (`from=N`; `next` is -1 after the last page), each page with
        the fds of its entries; `entry` makes one entry of an answer's `key` list, taking its fd from the
        page's. The whole listing has one deadline, `timeout`, and the bounds of _Listing. fds no entry
        took are closed here, and on any failure every one received so far; the entries keep theirs (the
        caller closes them: close_held)."""
        deadline = time.monotonic() + timeout
        listing = _Listing(self.pid, key, what)
        out: list[T] = []
        start = 0
        try:
            while start >= 0:
                try:
                    ans = self._call(verb, listing.time_left(deadline, timeout), True, {"from": start})
                except GpucrError:
                    listing.time_left(deadline, timeout)   # a page cut short by the deadline: say so
                    raise
                with Received(ans.fds) as got:
                    entries, start = listing.page(ans, start)
                    try:
                        page = [entry(e, got.fds) for e in entries]
                    except (KeyError, TypeError, ValueError) as exc:
                        raise listing.refuse("sent a malformed entry") from exc
                    got.hand_on(o.fd for o in page)   # the rest are closed on leaving
                    out.extend(page)
            return out
        except BaseException:
            close_held(out)
            raise

    def call_sending_fds(self, verb: str, send: list[int], timeout: float = 30.0, **args: int) -> dict[str, Any]:
        """Like call, with file descriptors attached to the request (shared memory to relink)."""
        return self._call(verb, timeout, False, args, send).reply

    def _call(self, verb: str, timeout: float, want_fds: bool, args: dict,
              send: list[int] | None = None, watch: Callable[[], None] | None = None) -> _Answer:
        with self._lock, Received() as got:
            ans = self._call_locked(verb, timeout, want_fds, args, send, watch, got.fds)
            ans.fds = got.take()   # only a whole answer that says yes hands its fds on
            return ans

    def _recv(self, want_fds: bool, fds: list[int], deadline: float, watch: Callable[[], None] | None) -> bytes:
        """One read of the answer; while it waits, `watch` looks at the process every WATCH_EVERY_S."""
        watch = watch or self._always_watch
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

    def _call_locked(self, verb: str, timeout: float, want_fds: bool, args: dict, send: list[int] | None,
                     watch: Callable[[], None] | None, fds: list[int]) -> _Answer:
        """One request and its answer; the fds that come with it land in `fds` (the caller's to close)."""
        if self._sock.fileno() < 0:
            raise GpucrError(f"the connection to process {self.pid} was ended when an earlier request failed; "
                             f"'{verb}' needs a new one")
        line = " ".join([verb, *(f"{k}={int(v)}" for k, v in args.items())]) + "\n"
        self._sock.settimeout(timeout)
        deadline = time.monotonic() + timeout
        try:
            if send:
                socket.send_fds(self._sock, [line.encode()], send)
            else:
                self._sock.sendall(line.encode())
            # only the newest piece is searched for the end of line, the pieces joined once: a growing buffer
            # searched whole on every read is quadratic in a large (or hostile) answer
            parts, size, done = [self._buf], len(self._buf), b"\n" in self._buf
            while not done:
                try:
                    chunk = self._recv(want_fds, fds, deadline, watch)
                except GpucrError:   # the watch gave up: an answer may still come, so this connection is done
                    self._sock.close()
                    raise
                if not chunk:
                    raise GpucrError(f"process {self.pid} closed the control channel during '{verb}' (did it exit?)")
                parts.append(chunk)
                size += len(chunk)
                if size > MAX_REPLY:
                    self._sock.close()   # the rest of that answer must not be read as the next one's
                    raise GpucrError(f"process {self.pid} sent an oversized answer to '{verb}'")
                done = b"\n" in chunk
            self._buf = b"".join(parts)
        except socket.timeout as exc:
            self._sock.close()   # a late answer must not be read as the next request's
            raise GpucrError(f"process {self.pid} did not answer '{verb}' within {timeout:.0f} s") from exc
        except OSError as exc:
            self._sock.close()
            raise GpucrError(f"talking to process {self.pid} failed during '{verb}': {exc}") from exc
        raw, self._buf = self._buf.split(b"\n", 1)
        try:
            reply = json.loads(raw)
        except ValueError as exc:
            raise GpucrError(f"process {self.pid} sent a malformed answer to '{verb}'") from exc
        if not isinstance(reply, dict):
            raise GpucrError(f"process {self.pid} sent an answer to '{verb}' that is not a JSON object")
        if not reply.get("ok"):
            raise GpucrError(f"process {self.pid}: {reply.get('error', 'request failed')}")
        return _Answer(reply, [], len(raw))


def _close_all(fds: list[int]) -> None:
    for fd in fds:
        os.close(fd)


def close_held(objs: Iterable[HoldsFd]) -> None:
    """Close the fds these entries hold (while open, an fd of GPU memory keeps that memory on the GPU)."""
    for o in objs:
        if o.fd is not None:
            os.close(o.fd)
            o.fd = None
