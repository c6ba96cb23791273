"""The server: the controller kept running, with its driver initialised, serving this user's requests.

Trust (docs/security.md, "The server"): the socket is in the user's private runtime dir, mode 0600;
every connection's SO_PEERCRED must be this server's own uid (root's server serves root only, a user's
server only that user: root never needs another user's server, since its own acts on any process), and
the peer must share the server's pid and mount namespaces, since a request names pids and image paths.
A request is data: the coordinator's own checks (target.resolve and the rest) apply to every pid in it,
exactly as in-process, and nothing in it is a library to load or a path the server opens for itself.
"""
from __future__ import annotations

import errno
import os
import socket
import sys
import threading
import time
import traceback
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator

from .. import coordinator, gpus, recover
from .. import reading
from .. import target as targets
from ..agent import peer_credentials
from ..driver import controller_driver, controller_simulated
from ..errors import GpucrError
from ..results import to_json
from .. import abandon
from . import swap_ops, wire
from ..dataplane.mover import Mover
from ..swap.gpu_view import DriverGpus
from ..swap.service import SwapService

ACCEPT_TICK_S = 0.5
PIN_AHEAD_EVERY_S = 1.0   # how often staging prepared ahead by the processes is looked for (and pinned here)
SWAP_TICK_S = 0.5         # how often the swap service looks for apps that ended or went idle
SWAP_TIMEOUT_S = 30.0     # a resume's deadline (a park's is the app's own: --park-deadline)
ACCEPT_STARVED = (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM)   # accept waits these out
ACCEPT_BACKOFF_S = 0.5   # the longest pause between tries to accept while out of fds
REFUSED_READ_S = 2.0   # how long a refused peer's request is waited for, to answer it with why


class _EnvGate:
    """A request carrying settings of its client's environment (wire.REQUEST_ENV) runs alone, with them
    set in this process's environment (where the coordinator reads them); the others share it."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._shared = 0
        self._alone = False

    @contextmanager
    def hold(self, env: dict[str, str]) -> Iterator[None]:
        with self._cond:
            if env:
                self._cond.wait_for(lambda: not self._alone and self._shared == 0)
                self._alone = True
            else:
                self._cond.wait_for(lambda: not self._alone)
                self._shared += 1
        saved = {k: os.environ.get(k) for k in wire.REQUEST_ENV}
        try:
            if env:
                for k in wire.REQUEST_ENV:
                    os.environ.pop(k, None)
                os.environ.update(env)
            yield
        finally:
            with self._cond:
                if env:
                    for k, v in saved.items():
                        if v is None:
                            os.environ.pop(k, None)
                        else:
                            os.environ[k] = v
                    self._alone = False
                else:
                    self._shared -= 1
                self._cond.notify_all()


class Server:
    def __init__(self, idle_exit_s: float | None = None, keep_context: bool = True, routes: bool = True,
                 host_budget: int | None = None, park_dir: str | None = None) -> None:
        """The server copies every process's data itself (gpucr.dataplane.mover). keep_context: its context per GPU and pinned staging stay between cycles (fast restores),
        else they are given back after each request (the card holds nothing of the server's between cycles,
        and the next cycle pins the staging again); routes: the copies also go through idle NVLink
        neighbours of the process's GPU (gpucr.dataplane.links); host_budget, park_dir: the swap service's host memory
        for parked apps, and where those past it go as images (gpucr.swap.disk)."""
        self.simulated = controller_simulated()
        self.keep_context, self.routes = keep_context, routes
        self.skip_unchanged = False   # gpucr serve --skip-unchanged (Mover.skip_unchanged)
        self._mover: Mover | None = None
        self._mover_lock = threading.Lock()
        self.idle_exit_s = idle_exit_s
        self.started = time.time()
        self.requests = 0
        self.in_flight = 0
        self.last_activity = time.monotonic()
        self.stopping = threading.Event()
        self.env_gate = _EnvGate()
        self.lock = threading.Lock()
        self.dir = wire.make_dir()
        self.path = self.dir / wire.socket_name(self.simulated)
        self.me = wire.namespaces("self")
        self.sock: socket.socket | None = None
        self.ino = 0
        self._starved_s = 0.0   # the pause between tries to accept while out of fds (0: not out of them)
        self._pin_ahead_said: dict[int, str] = {}   # pid -> why pinning ahead for it last failed, as logged
        self.http: dict[str, Any] = {}   # where its HTTP API listens (gpucr.service_http), once it does
        gpu_view = DriverGpus(controller_driver, lambda: self._mover.context_uuids() if self._mover else [], log)
        two_way = os.environ.get("GPUCR_SWAP_TWO_WAY", "1") != "0"   # 0: every switch a park, then a resume
        self.swap = SwapService(self._swap_park, self._swap_resume, log, gpu_view, lambda pid: self.let_go([pid]),
                                switch=self._swap_switch if two_way else None,
                                machine=self._gpu_names, write_image=self._swap_to_disk, host_budget=host_budget,
                                park_dir=park_dir)

    # ---- the socket ----

    def bind(self) -> None:
        """Bind and listen under a temporary name, then link it to the server's name, which fails if one is
        there: a live server's socket is never replaced (a second server exits), a dead one's is. Listening
        first, a socket under the name refuses a connection only when its server is gone (a client then
        removes it, client.Connection)."""
        tmp = self.dir / f".server-{os.getpid()}.tmp"
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        old = os.umask(0o177)
        try:
            _unlink_quiet(tmp)
            s.bind(str(tmp))
        finally:
            os.umask(old)
        try:
            s.listen(64)
            for _ in range(3):
                try:
                    os.link(tmp, self.path)
                    break
                except FileExistsError:
                    if _answers(self.path):
                        raise GpucrError(f"a gpucr server already listens on {self.path}") from None
                    _unlink_quiet(self.path)   # left by a server that was killed
            else:
                raise GpucrError(f"cannot take {self.path}: another server starts at the same moment")
        except BaseException:
            s.close()
            _unlink_quiet(tmp)
            raise
        _unlink_quiet(tmp)
        s.settimeout(ACCEPT_TICK_S)
        self.sock, self.ino = s, os.lstat(self.path).st_ino

    def close(self) -> None:
        if self.sock is not None:
            self.sock.close()
            self.sock = None
        try:
            if os.lstat(self.path).st_ino == self.ino:   # only the socket this server bound
                self.path.unlink()
        except OSError:
            pass

    # ---- serving ----

    def serve(self) -> None:
        assert self.sock is not None
        while not self.stopping.is_set():
            try:
                conn, _ = self.sock.accept()
            except socket.timeout:
                if self._idle_long_enough():
                    log(f"no process under gpucr and no request for {self.idle_exit_s:.0f} s: exiting")
                    return
                continue
            except OSError as exc:
                if exc.errno in (errno.EINTR, errno.ECONNABORTED):
                    continue
                if exc.errno not in ACCEPT_STARVED:
                    raise
                self._wait_out(exc)
                continue
            if self._starved_s:
                log("accepting connections again")
                self._starved_s = 0.0
            # (activity is a request answered, not a connection: a knock that asks nothing, as a starting
            # server's look for a live one is, does not keep an idle server up)
            threading.Thread(target=self._connection, args=(conn,), daemon=True, name="gpucr-serve").start()

    def _wait_out(self, exc: OSError) -> None:
        """No fd (or memory) to accept a connection with: said once, then waited out with a growing pause,
        up to ACCEPT_BACKOFF_S, while the clients wait in the listen backlog (requests in flight end and
        free theirs)."""
        if not self._starved_s:
            log(f"cannot accept connections: {exc.strerror}; waiting until some are freed")
        self._starved_s = min(max(2 * self._starved_s, 0.01), ACCEPT_BACKOFF_S)
        self.stopping.wait(self._starved_s)

    def _idle_long_enough(self) -> bool:
        if self.idle_exit_s is None:
            return False
        with self.lock:
            if self.in_flight or time.monotonic() - self.last_activity < self.idle_exit_s:
                return False
        if targets.list_sockets():
            with self.lock:
                self.last_activity = time.monotonic()
            return False
        return True

    def _connection(self, conn: socket.socket) -> None:
        try:
            why = self.peer_problem(conn)
            conn.settimeout(REFUSED_READ_S if why else wire.REQUEST_IDLE_S)
            # the request is read even from a peer refused: closing on unread bytes would reset the
            # connection, and the peer would read that instead of why
            req = _receive_quiet(conn) if why else wire.receive(conn, "request")
            if why is not None:   # "mismatch": a client of ours goes on in-process, with a note
                log(f"refused a connection: {why}")
                wire.send(conn, {"ok": False, "mismatch": True, "error": why, "code": 1})
                return
            if req is None:
                return
            conn.settimeout(None)
            with abandon.serving(conn):   # its work stops at its next step if the client goes away
                answer = self._answer(req)
            wire.send(conn, answer)
        except Exception as exc:   # a bug must not look like the server dying: say it, keep serving
            if not isinstance(exc, (OSError, GpucrError)):
                log("internal error:\n" + traceback.format_exc())
            try:
                wire.send(conn, {"ok": False, "error": f"the gpucr server failed: {exc}", "code": 1})
            except OSError:
                pass
        finally:
            conn.close()

    def peer_problem(self, conn: socket.socket) -> str | None:
        pid, uid, _ = peer_credentials(conn)
        if uid != os.getuid():
            return (f"permission denied: this gpucr server serves uid {os.getuid()} only, not uid {uid}; "
                    "run gpucr as that user, or with --no-server")
        try:
            if pid == 0 or wire.namespaces(pid) != self.me:
                raise OSError
        except OSError:
            return ("the gpucr server runs in another pid or mount namespace than this client, where its pids and "
                    "paths mean other things")
        return None

    def ask(self, op: str, args: dict[str, Any]) -> dict[str, Any]:
        """A request made inside the server's process (its HTTP API): the same handlers, checks and answer."""
        return self._answer({"op": op, "args": args, "protocol": wire.PROTOCOL, "code": wire.code_identity()})

    def _answer(self, req: dict[str, Any]) -> dict[str, Any]:
        op = req.get("op")
        handler = _HANDLERS.get(op) if isinstance(op, str) else None
        if handler is None:
            return {"ok": False, "error": f"unknown request {op!r}", "code": 2}
        if op not in ("hello", "stop") and (req.get("protocol"), req.get("code")) != (wire.PROTOCOL, wire.code_identity()):
            return {"ok": False, "mismatch": True,
                    "error": f"the gpucr server running (pid {os.getpid()}) is of another gpucr ({wire.code_identity()}); "
                             "stop it with 'gpucr serve --stop'"}
        env = req.get("env") or {}
        if not isinstance(env, dict) or any(k not in wire.REQUEST_ENV or not isinstance(v, str) for k, v in env.items()):
            return {"ok": False, "error": f"a request may carry only {', '.join(wire.REQUEST_ENV)}", "code": 2}
        args = req.get("args") or {}
        if not isinstance(args, dict):
            return {"ok": False, "error": "the request's args are not an object", "code": 2}
        try:
            run = handler(self, args)   # the args checked before anything is done
        except (TypeError, ValueError, KeyError, AttributeError) as exc:
            return {"ok": False, "error": f"malformed '{op}' request ({exc})", "code": 2}
        counted = op not in _LOOKS
        with self.lock:   # a hello (a look at the server itself) is not counted
            self.in_flight += counted
            self.requests += counted
        t0, said = time.perf_counter(), "failed"   # (an unexpected error is said by _connection)
        try:
            with self.env_gate.hold(env):
                result = run()
            said = "done"
            return {"ok": True, "result": result}
        except GpucrError as exc:
            said = f"refused: {exc}"
            return {"ok": False, "error": str(exc), "code": exc.code}
        finally:
            if op in ("checkpoint", "restore"):
                # one line per request, for whoever reads the log beside a slow cycle (the bench keeps it)
                log(f"{op} of process {', '.join(map(str, args.get('pids') or []))}: {said} in "
                    f"{time.perf_counter() - t0:.3f} s")
                self.after_request()
            with self.lock:
                self.in_flight -= counted
                self.last_activity = time.monotonic()

    def data_plane(self) -> Mover:
        """The data plane, made at first use (its contexts only when it first copies)."""
        with self._mover_lock:
            if self._mover is None:
                self._mover = Mover(controller_driver(), routes=self.routes, keep_context=self.keep_context)
                self._mover.said = log
                self._mover.skip_unchanged = self.skip_unchanged
            self._mover.forget_ended()
            return self._mover

    def pin_ahead_loop(self) -> None:
        """While the server keeps its context: every PIN_AHEAD_EVERY_S, pin the staging that processes under
        gpucr hold from earlier cycles (this server started after them), so their next checkpoint through it is as
        fast as the later ones. A process that is busy, not under CUDA yet, or checkpointed is left for next time.
        A round that fails is logged once per reason (one runs every second), and the loop goes on."""
        said = ""
        while not self.stopping.wait(PIN_AHEAD_EVERY_S):
            try:
                if not self._pin_ahead_round():
                    return
                said = ""
            except Exception as exc:   # noqa: BLE001 - ending the loop would end pinning ahead for good (F22)
                if _reason(exc) != said:
                    said = _reason(exc)
                    log(f"pinning ahead failed: {said}; trying again")

    def _pin_ahead_round(self) -> bool:
        """Each listed process's staging pinned ahead, once; False when the server pins nothing ahead."""
        if not self.keep_context:
            return False
        mover = self.data_plane()
        for uuid in mover.let_go_busy_neighbours():
            log(f"gave back the context on GPU {uuid}, whose link it lent: a process now uses that GPU")
        listed = [pid for pid, _sock in targets.list_sockets()]
        for pid in listed:
            self._pin_ahead_guarded(mover, pid)
        self._pin_ahead_said = {p: w for p, w in self._pin_ahead_said.items() if p in listed}
        return True

    def _pin_ahead_guarded(self, mover: Mover, pid: int) -> None:
        """Pin one process's staging ahead; whatever it sends or does, the loop goes on for the others. Why
        it failed is logged once per process and reason (the loop asks again every second)."""
        try:
            self._pin_ahead_one(mover, pid)
            self._pin_ahead_said.pop(pid, None)
        except Exception as exc:   # noqa: BLE001 - a target is untrusted: nothing it answers ends the loop
            why = _reason(exc)
            if self._pin_ahead_said.get(pid) != why:
                self._pin_ahead_said[pid] = why
                log(f"pinning ahead for process {pid} failed: {why}")

    def _pin_ahead_one(self, mover: Mover, pid: int) -> None:
        t = targets.resolve(pid)
        with t.connect() as agent:
            st = agent.call("status", timeout=5.0)
            self.swap.observe(pid, st)   # the swap service learns from every status read, asking none of its own
            devices = st.get("devices") or []
            if st.get("state") == "running" and not st.get("staging_segments"):
                mover.forget(pid)   # it gave its staging back (drop policy): our mapping would keep it
                return
            if st.get("state") != "running" or st.get("busy") or not st.get("cuda") or not devices:
                return
            layout, fds = agent.call_with_fds("layout", timeout=10.0)
        try:
            got = mover.pin_ahead(pid, layout, fds, str(devices[0].get("uuid", "")))
        finally:
            for fd in fds:
                os.close(fd)
        if got:
            log(f"pinned {got >> 20} MiB of process {pid}'s staging ahead of its checkpoint")

    def pins_ahead(self) -> bool:
        return self.keep_context

    def swap_loop(self) -> None:
        """Every SWAP_TICK_S: the swap apps that ended are dropped and the idle ones parked. Their status comes from
        the pinning-ahead round, which reads every agent anyway; without it, this loop reads the resident apps'."""
        while not self.stopping.wait(SWAP_TICK_S):
            try:
                if not self.pins_ahead():
                    self.swap.observe_resident()
                self.swap.tick()
            except Exception as exc:   # noqa: BLE001 - ending the loop would end the swap service for good
                log(f"the swap service's tick failed: {_reason(exc)}; going on")

    def _swap_park(self, pid: int, deadline_s: float, level: str = "full") -> Any:
        """The swap service's park: the server's own checkpoint of the process (at the app's --park-level), its data
        plane copying; its calls in flight must drain within deadline_s, or the park is given up (it stays resident)."""
        return self._swap_request("checkpoint", pid, lambda mover: coordinator.checkpoint_many(
            [pid], level=level, timeout=deadline_s, mover=mover))

    def _swap_resume(self, pid: int, image: str | None = None, gpu_map: dict[str, str] | None = None,
                     drop_staging: bool = False) -> Any:
        """The swap service's resume: the server's restore, from host memory or from the image the app went to on
        disk, onto its own GPUs or those gpu_map names; drop_staging: its staging given back (a host budget counts it)."""
        result = self._swap_request("restore", pid, lambda mover: coordinator.restore_many(
            [pid], timeout=SWAP_TIMEOUT_S, mover=mover, images={pid: image} if image else None,
            gpu_map=gpu_map or None, drop_staging=drop_staging))
        self.let_go([pid] if drop_staging else [])   # given back: our mapping would keep it
        return result

    def _swap_switch(self, out_pid: int, in_pid: int, deadline_s: float, level: str = "full",
                     drop_staging: bool = False) -> Any:
        """The swap service's two-way switch: out_pid parked while in_pid resumes, both through the data plane at once
        (coordinator.switch); out_pid's calls in flight must drain within deadline_s."""
        result = self._swap_request("two-way switch", in_pid, lambda mover: coordinator.switch(
            out_pid, in_pid, mover, timeout=deadline_s, level=level, drop_staging=drop_staging))
        self.let_go([in_pid] if drop_staging else [])   # given back: our mapping would keep it
        return result

    def _swap_to_disk(self, pid: int, image: Path) -> None:
        """The swap service's move of a parked app to disk: its image written from its staging, which is then freed."""
        self._swap_request("image write", pid, lambda mover: coordinator.write_image_of_checkpointed(
            pid, image, mover, timeout=SWAP_TIMEOUT_S))

    @staticmethod
    def _gpu_names() -> list[tuple[str, str]]:
        return [(g.uuid, g.name) for g in gpus.machine_gpus(controller_driver())]

    def _swap_request(self, op: str, pid: int, run: Callable[[Mover | None], Any]) -> Any:
        """A park or resume counted and logged as a request, in the environment requests share; run's result."""
        with self.lock:
            self.in_flight += 1
            self.requests += 1
        t0, said = time.perf_counter(), "failed"
        try:
            with self.env_gate.hold({}), _copying(self) as mover:
                result = run(mover)
            said = "done"
            return result
        finally:
            log(f"{op} of process {pid} (swap): {said} in {time.perf_counter() - t0:.3f} s")
            self.after_request()
            with self.lock:
                self.in_flight -= 1
                self.last_activity = time.monotonic()

    def let_go(self, pids: list[int]) -> None:
        """Unpin and unmap these processes' staging (they gave it back: a mapping here would keep it)."""
        if self._mover is not None:
            for pid in pids:
                self._mover.forget(pid)

    def after_request(self) -> None:
        if self._mover is not None:
            self._mover.settle()

    def info(self) -> dict[str, Any]:
        """What `gpucr serve --status`, `gpucr ps` and `status` show of the server."""
        drv = controller_driver()
        machine = gpus.machine_gpus(drv)
        # measured, not assumed: its contexts (the data plane's, one per GPU it copied on) and nothing else
        held = gpus.usage(drv, os.getpid(), [g.uuid for g in machine], machine)
        with self.lock:
            busy, served = self.in_flight, self.requests
        mover = self._mover
        if mover is not None:
            mover.forget_ended_if_free()   # what it says it holds is of live processes, unless a copy is under way
        return {"server": "gpucr", "protocol": wire.PROTOCOL, "code": wire.code_identity(), "pid": os.getpid(),
                "keep_context": self.keep_context, "routes": self.routes,
                "contexts": mover.context_uuids() if mover else [],
                "pinned_staging_bytes": mover.pinned_bytes() if mover else 0,
                "staging_pool": mover.pool.info() if mover and mover.pool else None,
                "staging": mover.held.holdings() if mover else [],
                "simulated": self.simulated, "socket": str(self.path),
                "log": str(self.dir / wire.log_name(self.simulated)), "up_s": round(time.time() - self.started, 1),
                "requests": served, "in_flight": busy, "swap": self.swap.apps.rows(),
                "swap_host": self.swap.disk.info(), "http": self.http, "driver_version": drv.version(), "idle_exit_s": self.idle_exit_s,
                "gpus": [{"uuid": u.uuid, "process_bytes": u.process} for u in held.values()],
                "gpu_bytes": None if any(u.process is None for u in held.values()) else sum(u.process for u in held.values())}


# ---- requests: each handler checks its args and returns what runs the request; results travel as
# their JSON (gpucr.results.to_json), read back strictly by the client (from_json) ----

Run = Callable[[], Any]


def _images(args: dict[str, Any]) -> dict[int, str] | None:
    imgs = args.get("images")
    if imgs is None:
        return None
    out = {int(k): str(v) for k, v in imgs.items()}
    if any(not os.path.isabs(v) for v in out.values()):
        raise ValueError("an image dir sent to the server must be an absolute path")
    return out


def _pid(v: Any) -> int:
    if not isinstance(v, int) or isinstance(v, bool):
        raise ValueError(f"{v!r} is not a pid")
    return v


def _pids(args: dict[str, Any]) -> list[int]:
    if not isinstance(args["pids"], list):
        raise ValueError("pids must be a list")
    return [_pid(p) for p in args["pids"]]


@contextmanager
def _copying(s: Server) -> Iterator[Mover]:
    """The data plane for a checkpoint or restore, wanted from the request's first step (its checks and the
    handover come before the copy): pinning ahead stops at its next piece, not to slow the driver's calls."""
    mover = s.data_plane()
    with mover.wanted():
        yield mover


def _checkpoint(s: Server, a: dict[str, Any]) -> Run:
    pids, level, timeout, images = _pids(a), str(a["level"]), float(a["timeout"]), _images(a)
    scan = bool(a.get("scan", True))   # a client from before it could ask for none

    def run() -> Any:
        try:
            with _copying(s) as mover:
                return to_json(coordinator.checkpoint_many(pids, level=level, timeout=timeout, images=images,
                                                           mover=mover, scan=scan))
        finally:
            s.let_go(list(images or {}))   # an image's staging is given back: our mapping would keep it
    return run


def _restore(s: Server, a: dict[str, Any]) -> Run:
    pids, timeout, images = _pids(a), float(a["timeout"]), _images(a)
    drop, force = bool(a["drop_staging"]), bool(a["force"])
    accept = bool(a.get("accept_mismatch", False))   # a client from before it asked for none
    gpu_map = {str(k): str(v) for k, v in (a.get("gpu_map") or {}).items()}

    def run() -> Any:
        try:
            with _copying(s) as mover:
                return to_json(coordinator.restore_many(pids, timeout=timeout, drop_staging=drop, images=images,
                                                        force=force, gpu_map=gpu_map, mover=mover,
                                                        accept_mismatch=accept))
        finally:
            s.let_go(pids if drop else [])   # --drop-staging gives the host memory back: ours too
    return run


def _status(_s: Server, a: dict[str, Any]) -> Run:
    pid = _pid(a["pid"])
    return lambda: to_json(reading.status(pid))


def _recover(_s: Server, a: dict[str, Any]) -> Run:
    only_list, timeout = bool(a.get("list")), float(a["timeout"])
    return lambda: [to_json(x) for x in (recover.find() if only_list else recover.recover(timeout=timeout))]


def _swap_register(s: Server, a: dict[str, Any]) -> Run:
    app = s.swap.registration(a)
    return lambda: s.swap.register(app)


def _stop(s: Server, _a: dict[str, Any]) -> Run:
    def run() -> Any:
        s.stopping.set()
        return {"pid": os.getpid()}
    return run


_HANDLERS: dict[str, Callable[[Server, dict[str, Any]], Run]] = {
    "hello": lambda s, a: s.info,
    "checkpoint": _checkpoint,
    "restore": _restore,
    "status": _status,
    "ps": lambda s, a: lambda: to_json(reading.ps()),
    "recover": _recover,
    "swap_register": _swap_register,
    "stop": _stop,
    **swap_ops.HANDLERS,
}
_LOOKS = ("hello", *swap_ops.LOOKS)   # looks at the server: not counted as requests served


def _reason(exc: Exception) -> str:
    """An error as one log line: ours as said, anything else with its type (a bug, or a target's doing)."""
    return str(exc) if isinstance(exc, GpucrError) else f"{type(exc).__name__}: {exc}"


def _receive_quiet(conn: socket.socket) -> None:
    try:
        wire.receive(conn, "request")
    except (OSError, GpucrError):
        pass


def _answers(path: Path) -> bool:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(1.0)
    try:
        s.connect(str(path))
        return True
    except OSError:
        return False
    finally:
        s.close()


def _unlink_quiet(path: Path) -> None:
    try:
        path.unlink()
    except FileNotFoundError:
        pass


def log(line: str) -> None:
    now = time.time()   # milliseconds: lines are read beside cycles of about a second
    stamp = time.strftime('%Y-%m-%dT%H:%M:%S', time.localtime(now)) + f".{int(now * 1000) % 1000:03d}"
    print(f"{stamp} gpucr serve [{os.getpid()}]: {line}", file=sys.stderr, flush=True)
