"""Lost wakes (issue 27; the H200 run where a parked app's demand was never answered): on simcuda (the simulated
driver, a test double), real processes, real sockets, a real `gpucr serve` where the service is under test.

- the agent: a connection that watches is never evicted as idle between two watches, and a demand the server
  declined does not lock out the next demand of the same closed period;
- the service: a watch that ends while its app lives is started again, saying why it ended; and a demand that no
  watch acted on (the agent told to lose its wakes) is found in the status the server reads each second, the app
  resumed and the lost wake said loudly."""
from __future__ import annotations

import json
import os
import re
import signal
import socket
import sys
import threading
import time

import pytest

from conftest import RunningServer, gpucr_cli, kill_all
from gpucr import target as targets
from gpucr.workloads.runner import Workload
from test_swap import _apps, _state, _until

MAX_CLIENTS = 8   # native/agent/channel.c: an agent serves this many connections at once
EVICT_GRACE_S = 0.6   # a newcomer younger than channel.c's EVICT_GRACE_MS (0.5 s) is not evicted


class Line:
    """A raw connection to an agent, as a server holds one: request lines out, answer lines in."""

    def __init__(self, path: str) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.connect(path)
        self.buf = b""

    def send(self, line: str) -> None:
        self.sock.sendall(line.encode() + b"\n")

    def answer(self, timeout: float) -> dict | None:
        """The next answer line; None at the agent's end of the connection, TimeoutError past `timeout`."""
        self.sock.settimeout(timeout)
        while b"\n" not in self.buf:
            chunk = self.sock.recv(65536)
            if not chunk:
                return None
            self.buf += chunk
        line, self.buf = self.buf.split(b"\n", 1)
        return json.loads(line)

    def close(self) -> None:
        self.sock.close()


# ---- the agent ----

def test_a_watching_connection_is_never_evicted_as_idle_between_its_watches(sim_app):
    """Between two watches (while the server resumes the app, or parks others for room) the watch's connection sends
    nothing; newcomers filling every slot must evict another idle connection, never it."""
    app = sim_app("--sizes", "4M")
    path = str(targets.resolve(app.pid).socket)
    watch = Line(path)
    watch.send("watch")
    time.sleep(0.3)   # the watch waits on the connection
    watch.send("status")   # ends that watch (the server "hung up"); the connection then waits, idle, between watches
    assert watch.answer(10)["woke"] == "hung up"
    assert watch.answer(10)["ok"]
    time.sleep(EVICT_GRACE_S)
    idle = [Line(path) for _ in range(MAX_CLIENTS - 1)]   # every slot taken: the watch's and these
    time.sleep(EVICT_GRACE_S)
    late = Line(path)   # needs a slot: the oldest idle connection's, which the watch's is
    late.send("hello")
    assert late.answer(10)["ok"], "the newcomer got no slot"
    watch.send("status")
    got = watch.answer(10)
    assert got is not None and got["ok"], "the watching connection was evicted as idle"
    assert idle[0].answer(10) is None, "the oldest idle connection that never watched is the one evicted"
    for c in (watch, late, *idle):
        c.close()


@pytest.mark.parametrize("new_demand", ["after the decline", "before the decline"])
def test_a_demand_the_server_declined_does_not_lock_out_the_next_one(sim_app, new_demand):
    """seen=NS (the server did not resume on that demand: not its park, or its resume failed) re-arms the gate: the
    next demanding call of the same closed period wakes the watch again. Also one that came to the closed gate after
    the watch said `demand` but before the server's `seen=NS` reached the agent: a demand the server has not seen. It
    used to wait for ever: the thread found a demand noted already and noted none, then the decline cleared the
    first (CI saw this as 'the later demand never woke the watch', when the thread ran before the agent read it)."""
    app = sim_app("--sizes", "4M")
    app.ask("loop start")   # a thread launching in a loop: its next launch after the checkpoint is the first demand
    r = gpucr_cli("checkpoint", "--no-server", str(app.pid))
    assert r.returncode == 0, r.stderr
    watch = Line(str(targets.resolve(app.pid).socket))
    done: dict = {}
    t = threading.Thread(target=lambda: done.update(app.ask("work 1", timeout=60)), daemon=True)
    try:
        watch.send("watch")
        first = watch.answer(10)
        assert first["woke"] == "demand" and first["demand_ns"] > 0, first
        if new_demand == "after the decline":
            watch.send(f"watch seen={first['demand_ns']}")   # declined, as the server says it
        t.start()   # another demanding call, waiting at the same closed gate
        if new_demand == "before the decline":
            _until("the new demand counted", lambda: _gate(app.pid)["demands"] > first["demands"], timeout=10)
            watch.send(f"watch seen={first['demand_ns']}")
        try:
            second = watch.answer(10)
        except TimeoutError:
            second = None
        assert second is not None and second["woke"] == "demand", f"the demand made {new_demand} never woke the watch"
        assert second["demand_ns"] > first["demand_ns"], (first, second)
    finally:
        r = gpucr_cli("restore", "--no-server", str(app.pid))
        watch.close()
    assert r.returncode == 0, r.stderr
    t.join(30)
    assert done == {"done": True}
    assert app.ask("loop stop")["error"] is None


def _gate(pid: int) -> dict:
    """The agent's swap gate as its status says it."""
    with targets.resolve(pid).connect() as agent:
        return agent.call("status", timeout=10.0)["swap"]


def test_a_room_request_between_two_watches_waits_for_the_next_and_a_server_gone_refuses_it_at_once(sim_app):
    """A server watches from its first watch until its connection ends, between its watches too: an allocation that
    fails while the server is busy with the last one (its verdict, a park, a resume) waits for the next watch, where
    it used to fail without asking (CI saw 15 of 16 requests of a loop asked). And once the server hangs up, such a
    request is refused at once, not at its 60 s deadline."""
    app = sim_app("--sizes", "4M")
    watch = Line(str(targets.resolve(app.pid).socket))
    too_big = 8 << 30   # more than simcuda's 4 GiB: out of memory, so it asks for room
    errors: list[str] = []

    def allocate() -> threading.Thread:
        def run() -> None:
            try:
                app.ask(f"alloc {too_big}", timeout=90)
                errors.append("allocated")
            except RuntimeError as exc:
                errors.append(str(exc))
        t = threading.Thread(target=run, daemon=True)
        t.start()
        return t

    try:
        watch.send("watch")
        time.sleep(0.3)
        watch.send("status")   # ends that watch: the server is now between two watches
        assert watch.answer(10)["woke"] == "hung up"
        assert watch.answer(10)["ok"]
        asker = allocate()
        asker.join(1.0)
        assert asker.is_alive(), f"the allocation did not wait for the server's next watch: {errors}"
        watch.send("watch")
        woke = watch.answer(10)
        assert woke["woke"] == "room" and woke["bytes"] == too_big, woke
        watch.send("watch room=2")   # no room: the allocation fails as it would have
        asker.join(10)
        assert not asker.is_alive() and "CUDA error 2" in errors[0], errors
        watch.send("status")
        assert watch.answer(10)["woke"] == "hung up" and watch.answer(10)["ok"]

        asker = allocate()   # between watches again; then the server goes
        asker.join(0.5)
        assert asker.is_alive()
        t0 = time.monotonic()
        watch.close()
        asker.join(10)
        assert not asker.is_alive() and "CUDA error 2" in errors[1], errors
        assert time.monotonic() - t0 < 5, "a request whose server hung up waited for its deadline"
    finally:
        watch.close()
    assert app.ask("digest")   # the app goes on


# ---- the service ----

@pytest.fixture
def serve(request):
    """A `gpucr serve` on simcuda with these flags, and apps under `gpucr run --swap` (driver_app, 8M and 3M) with
    extra environment; all ended at the end."""
    servers: list[RunningServer] = []
    apps: list[Workload] = []

    def server(*flags: str) -> RunningServer:
        servers.append(RunningServer(True, *flags))
        return servers[-1]

    def app(name: str, *flags: str, env: dict[str, str] | None = None) -> Workload:
        argv = [sys.executable, "-m", "gpucr.cli", "run", "--simulate", "--swap", "--name", name, *flags, "--",
                sys.executable, "-m", "gpucr.workloads.driver_app", "--sizes", "8M,3M"]
        apps.append(Workload("driver_app", simulate=True, argv=argv, env={**os.environ, **(env or {})}))
        return apps[-1]

    yield server, app
    kill_all(apps)
    for s in servers:
        s.stop()


def _parked(srv: RunningServer, name: str, parks: int = 1) -> None:
    _until(f"{name} parked", lambda: _apps(srv)[name]["parks"] >= parks and _state(srv, name) == "parked", timeout=30)


def test_a_watch_that_ends_while_its_app_lives_is_started_again_and_its_next_demand_resumes_it(serve):
    """The app stopped (SIGSTOP) under its watch: the server gives the watch up; it is started again once the app
    runs, saying why it ended, and the next demand after an idle park wakes the app through it."""
    server, start = serve
    srv = server()
    app = start("stopped", "--idle-park", "2")
    before = app.ask("digest")["digest"]
    _until("its watch started", lambda: re.search(rf"pid {app.pid}", srv.log.read_text()) and
           _apps(srv)["stopped"]["held_bytes"], timeout=20)
    time.sleep(0.6)   # the next swap tick starts the watch
    os.kill(app.pid, signal.SIGSTOP)
    try:
        _until("the watch ended", lambda: "the watch on swap app stopped" in srv.log.read_text(), timeout=20)
    finally:
        os.kill(app.pid, signal.SIGCONT)
    log = srv.log.read_text()
    assert re.search(rf"the watch on swap app stopped \(pid {app.pid}\) ended: .*stopped \(SIGSTOP\).*watching it "
                     r"again", log), log
    assert "no longer woken on demand" not in log
    _until("watched again", lambda: _apps(srv)["stopped"]["watch_restarts"] >= 1, timeout=20)
    _parked(srv, "stopped")
    time.sleep(1.0)   # any restart's backoff over: the watch waits on the parked app's gate
    assert app.ask("work 1", timeout=30) == {"done": True}   # a launch at the closed gate: demand
    row = _until("resumed", lambda: (r := _apps(srv)["stopped"])["resumes"] >= 1 and r, timeout=20)
    assert row["missed_wakes"] == 0, srv.log.read_text()   # its watch woke it, not the net
    assert re.search(rf"resuming swap app stopped \(pid {app.pid}\) on demand: [\d.]+ ms", srv.log.read_text())
    app.ask("work -1")
    assert app.ask("digest")["digest"] == before


@pytest.mark.parametrize("reads", ["pin-ahead", "swap-tick"])
def test_a_demand_no_watch_acted_on_is_found_in_the_status_and_resumes_the_app_loudly(serve, reads):
    """The agent told to lose its wakes (GPUCR_TEST_LOSE_WAKES: the demand noted, its watch not woken): the status the
    server reads each second (its pinning-ahead round, or without one the swap tick's own read) shows the demand,
    and within about a second more the app is resumed, the lost wake said and counted."""
    server, start = serve
    srv = server(*(["--give-back-context"] if reads == "swap-tick" else []))
    app = start("deaf", "--idle-park", "1", env={"GPUCR_TEST_LOSE_WAKES": "1"})
    before = app.ask("digest")["digest"]
    _parked(srv, "deaf")
    t0 = time.monotonic()
    assert app.ask("work 1", timeout=30) == {"done": True}   # waits at the gate until the net resumes it
    waited = time.monotonic() - t0
    row = _until("resumed", lambda: (r := _apps(srv)["deaf"])["resumes"] >= 1 and r, timeout=10)
    assert row["missed_wakes"] == 1 and waited < 5.0, (row, waited)
    log = srv.log.read_text()
    assert re.search(rf"LOST WAKE: swap app deaf \(pid {app.pid}\) has had a demand waiting at its closed gate for "
                     r"[\d.]+ s that its watch did not act on \(its watch is connected\)", log), log
    assert re.search(rf"resuming swap app deaf \(pid {app.pid}\) on a demand its watch missed: [\d.]+ ms", log), log
    app.ask("work -1")
    assert app.ask("digest")["digest"] == before
