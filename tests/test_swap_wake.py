"""Lost wakes (issue 27; the H200 run where a parked app's demand was never answered): on simcuda (the simulated
driver, a test double), real processes, real sockets, a real `gpucr serve` where the service is under test.

- the agent: a connection that watches is never evicted as idle between two watches, and a demand the server
  declined does not lock out the next demand of the same closed period."""
from __future__ import annotations

import json
import socket
import threading
import time

from conftest import gpucr_cli
from gpucr import target as targets

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


def test_a_demand_the_server_declined_does_not_lock_out_the_next_one(sim_app):
    """seen=NS (the server did not resume on that demand: not its park, or its resume failed) re-arms the gate: the
    next demanding call of the same closed period wakes the watch again."""
    app = sim_app("--sizes", "4M")
    app.ask("loop start")   # a thread launching in a loop: its next launch after the checkpoint is the first demand
    r = gpucr_cli("checkpoint", "--no-server", str(app.pid))
    assert r.returncode == 0, r.stderr
    watch = Line(str(targets.resolve(app.pid).socket))
    try:
        watch.send("watch")
        first = watch.answer(10)
        assert first["woke"] == "demand" and first["demand_ns"] > 0, first
        watch.send(f"watch seen={first['demand_ns']}")   # declined, as the server says it
        done: dict = {}
        t = threading.Thread(target=lambda: done.update(app.ask("work 1", timeout=60)), daemon=True)
        t.start()   # another demanding call, waiting at the same closed gate
        try:
            second = watch.answer(10)
        except TimeoutError:
            second = None
        assert second is not None and second["woke"] == "demand", "the later demand never woke the watch"
        assert second["demand_ns"] > first["demand_ns"], (first, second)
    finally:
        r = gpucr_cli("restore", "--no-server", str(app.pid))
        watch.close()
    assert r.returncode == 0, r.stderr
    t.join(30)
    assert done == {"done": True}
    assert app.ask("loop stop")["error"] is None
