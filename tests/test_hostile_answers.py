"""A target that answers its controller with hostile listings and fds (docs/security.md: a target is untrusted;
issue 24, F20, F21, F23). Each test plays the attacker as tests/apps/hostile_app.py does: an application that
sits between its own agent and the controller and rewrites the agent's answers. What is checked is the
controller's side: it ends within the request's timeout, its memory and fds stay where they were, and the
application is left running with its data intact."""
from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from gpucr import coordinator, paths
from gpucr.dataplane.cli_plane import cli_plane
from gpucr import reading
from gpucr import target as targets
from gpucr.agent import MAX_LISTING_ENTRIES
from gpucr.errors import GpucrError
from gpucr import memory as server_memory
from gpucr.workloads.runner import Workload

from conftest import ROOT, RunningServer, gpucr_cli
from test_security import SYS_PY, as_user, one_line, root_only, user_dir, user_env, users, wait_for  # noqa: F401


def checkpoint_here(pid: int, timeout: float) -> None:
    """A checkpoint at level data by a controller in this process, with its own mover (no server)."""
    with cli_plane() as mover:
        coordinator.checkpoint_many([pid], mover, level="data", timeout=timeout)

HOSTILE = ROOT / "tests" / "apps" / "hostile_app.py"
MiB = 1 << 20
# a listing that never ends, one page at a time, each page as an honest agent's (it advances by its entries)
# under a count that allows the most: only the deadline ends it
SLOW_ENDLESS = {"HOSTILE_MODE": "endless", "HOSTILE_COPIES": "1", "HOSTILE_DELAY_S": "0.005",
                "HOSTILE_TOTAL": str(MAX_LISTING_ENTRIES)}


def nfds(pid: int | str = "self") -> int:
    if pid == "self":
        gc.collect()   # an earlier test's unreferenced connections close now, not between two counts
    return len(os.listdir(f"/proc/{pid}/fd"))


def fds_but_the_device(pid: int) -> int:
    """The fds a process holds other than the driver's device files: a server opens those once, for its own
    context, when its pin-ahead round first finds a process (up to a second after one appears), not per request."""
    held = 0
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            held += "/nvidia" not in os.readlink(f"/proc/{pid}/fd/{fd}")
        except FileNotFoundError:   # closed since the listing
            pass
    return held


def fd_floor(pid: int, over_s: float = 1.2) -> int:
    """The fewest fds the process held over a short window, leaving out the device's: a server opens an fd for
    each connection (and for a retry every second) and closes it a moment later, so only a leak raises the floor."""
    deadline, floor = time.monotonic() + over_s, fds_but_the_device(pid)
    while time.monotonic() < deadline:
        time.sleep(0.05)
        floor = min(floor, fds_but_the_device(pid))
    return floor


def rss(pid: int | str = "self") -> int:
    status = Path(f"/proc/{pid}/status").read_text()
    return int(next(l for l in status.splitlines() if l.startswith("VmRSS")).split()[1]) << 10


class Hostile:
    """hostile_app.py under the agent, as this user or (with `uid`) as another one, whose simcuda is then
    linked into ours as one machine-wide driver would be on a GPU host."""

    def __init__(self, verb: str, uid: int | None = None, **mode: str) -> None:
        self.dirs: list[Path] = []
        knobs = {"HOSTILE_VERB": verb, **mode}
        if uid is None:
            self.w = Workload("", argv=[sys.executable, str(HOSTILE)], simulate=True, env={**os.environ, **knobs})
            self.proc, self.pid = self.w.proc, self.w.pid
            return
        rt, sim = user_dir(uid), user_dir(uid)
        self.dirs = [rt, sim]
        env = paths.run_env(simulate=True, base=user_env(uid, GPUCR_RUNTIME_DIR=str(rt), SIMCUDA_DIR=str(sim), **knobs))
        self.proc = as_user(uid, [SYS_PY, str(HOSTILE)], env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.pid = json.loads(self.proc.stdout.readline())["pid"]
        ctl = sim / f"{self.pid}.ctl"
        wait_for(ctl.exists, what="the process's simcuda control socket")
        (Path(os.environ["SIMCUDA_DIR"]) / ctl.name).symlink_to(ctl)

    def digest(self) -> str:
        self.proc.stdin.write("digest\n")
        self.proc.stdin.flush()
        return json.loads(self.proc.stdout.readline())["digest"]

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        for d in self.dirs:
            subprocess.run(["rm", "-rf", str(d)], check=False)


@pytest.fixture
def hostile():
    apps: list[Hostile] = []

    def start(verb: str, uid: int | None = None, **mode: str) -> Hostile:
        apps.append(Hostile(verb, uid, **mode))
        return apps[-1]
    yield start
    for a in apps:
        a.close()


def warm(app: Hostile) -> str:
    """The app's digest, once this controller has loaded what it keeps open (the driver) by a first status."""
    reading.status(app.pid)
    return app.digest()


def left_running(app: Hostile, before: str) -> None:
    assert reading.status(app.pid).state == "running"
    assert app.digest() == before


# ---- F20: a listing that never ends ----

@root_only
def test_an_endless_listing_ends_at_the_requests_deadline_in_process(users, hostile):
    app = hostile("shared", users["attacker"], **SLOW_ENDLESS)
    before, fds0, rss0 = warm(app), nfds(), rss()
    t0 = time.monotonic()
    with pytest.raises(GpucrError, match=rf"process {app.pid} did not send its whole list of shared memory within 3 s"):
        checkpoint_here(app.pid, timeout=3.0)
    assert time.monotonic() - t0 < 3.0 + 2.0
    assert nfds() == fds0
    assert rss() - rss0 < 32 * MiB
    left_running(app, before)


@root_only
def test_an_endless_listing_ends_at_the_deadline_through_roots_server(users, hostile):
    srv = RunningServer(True)
    try:
        app = hostile("shared", users["attacker"], **SLOW_ENDLESS)
        before = app.digest()
        one_line(gpucr_cli("checkpoint", "--level", "data", "--timeout", "3", str(app.pid)), str(app.pid))
        fds0, rss0 = nfds(srv.pid), rss(srv.pid)
        t0 = time.monotonic()
        r = gpucr_cli("checkpoint", "--level", "data", "--timeout", "3", str(app.pid))
        assert time.monotonic() - t0 < 3.0 + 3.0
        one_line(r, str(app.pid), "within 3 s")
        assert nfds(srv.pid) == fds0
        assert rss(srv.pid) - rss0 < 32 * MiB
        left_running(app, before)
    finally:
        srv.stop()


@pytest.mark.parametrize("mode, refusal", [
    ({}, "sent more entries than the 0 it announced"),
    ({"HOSTILE_STEP": "0", "HOSTILE_TOTAL": "5000"}, "asked to go on from entry 0 after entries 0 to 999"),
    ({"HOSTILE_TOTAL": str(MAX_LISTING_ENTRIES + 1)}, f"announced {MAX_LISTING_ENTRIES + 1} entries"),
    ({"HOSTILE_TOTAL": str(MAX_LISTING_ENTRIES), "HOSTILE_COPIES": "20000"},
     f"sent more entries than the {MAX_LISTING_ENTRIES} it announced"),
], ids=["past-its-count", "not-advancing", "count-too-large", "past-the-largest-count"])
def test_a_listing_out_of_bounds_is_refused_naming_the_process(hostile, mode, refusal):
    app = hostile("shared", HOSTILE_MODE="endless", **mode)
    before, fds0, rss0 = warm(app), nfds(), rss()
    with pytest.raises(GpucrError, match=rf"process {app.pid} {refusal}"):
        checkpoint_here(app.pid, timeout=30.0)
    assert nfds() == fds0
    assert rss() - rss0 < 256 * MiB   # the bounds, not the attacker, say where it stops
    left_running(app, before)


# ---- F21: fds that come with an answer that then fails ----

@pytest.mark.parametrize("verb", ["memory", "layout"])
@pytest.mark.parametrize("mode", ["half_line", "nondict", "stall"])
def test_fds_of_an_answer_that_fails_are_closed(hostile, verb, mode):
    # a layout comes with staging only once a checkpoint made it: a cycle first, whose two layouts are honest
    app = hostile(verb, HOSTILE_MODE=mode, HOSTILE_HONEST="2" if verb == "layout" else "0")
    if verb == "layout":
        checkpoint_here(app.pid, timeout=30.0)
        with cli_plane() as mover:
            coordinator.restore_many([app.pid], mover, timeout=30.0)
    fds0 = nfds()
    with targets.resolve(app.pid).connect() as agent:
        with pytest.raises(GpucrError, match=f"process {app.pid}"):
            if verb == "memory":
                server_memory.gather(agent, 1.0)
            else:
                agent.call_with_fds("layout", timeout=1.0)
    assert nfds() == fds0


def test_an_answer_that_comes_after_its_deadline_is_never_taken_for_the_next_one(hostile):
    """A request that timed out ends its connection: the late answer cannot be read as the next request's."""
    app = hostile("status", HOSTILE_MODE="late", HOSTILE_DELAY_S="1.5")
    with targets.resolve(app.pid).connect() as agent:
        with pytest.raises(GpucrError, match="did not answer 'status'"):
            agent.call("status", timeout=0.5)
        time.sleep(1.5)   # the late status answer has arrived by now
        with pytest.raises(GpucrError, match=f"process {app.pid}"):
            agent.call("hello", timeout=5.0)


@root_only
def test_roots_server_keeps_no_fd_of_another_users_failed_answer(users, hostile):
    srv = RunningServer(True)
    try:
        app = hostile("memory", users["attacker"], HOSTILE_MODE="half_line")
        one_line(gpucr_cli("checkpoint", "--level", "data", str(app.pid)), str(app.pid))   # the server is warm now
        fds0 = nfds(srv.pid)
        for _ in range(3):
            one_line(gpucr_cli("checkpoint", "--level", "data", str(app.pid)), str(app.pid), "closed the control channel")
        assert nfds(srv.pid) == fds0
    finally:
        srv.stop()


def test_pinning_ahead_keeps_no_fd_of_a_failed_layout(hostile):
    srv = RunningServer(True)
    try:
        app = hostile("layout", HOSTILE_MODE="half_line", HOSTILE_MIB="32", HOSTILE_HONEST="2")
        checkpoint_here(app.pid, timeout=30.0)   # staging made (and kept) by a cycle whose two layouts are honest
        with cli_plane() as mover:
            coordinator.restore_many([app.pid], mover, timeout=30.0)
        asked = f"pinning ahead for process {app.pid} failed: process {app.pid} closed the control channel during 'layout'"
        wait_for(lambda: asked in srv.log.read_text(), what="the server asking for the layout to pin ahead")
        fds0 = fd_floor(srv.pid)
        time.sleep(2.0)   # the server asks again every second (logged once per reason)
        assert fd_floor(srv.pid) <= fds0
    finally:
        srv.stop()


# ---- F23: one fd named by two entries ----

def test_two_entries_naming_one_fd_are_refused_in_process(hostile):
    app = hostile("memory", HOSTILE_MODE="dup_fd")
    fds0 = nfds()
    with targets.resolve(app.pid).connect() as agent:
        with pytest.raises(GpucrError, match=f"process {app.pid} named one fd in two entries"):
            server_memory.gather(agent, 10.0)
    assert nfds() == fds0


def test_two_entries_naming_one_fd_are_refused_by_the_server(hostile, server):
    app = hostile("memory", HOSTILE_MODE="dup_fd")
    before = app.digest()
    one_line(gpucr_cli("checkpoint", str(app.pid)), str(app.pid))   # the server is warm now
    fds0 = fd_floor(server.pid)
    one_line(gpucr_cli("checkpoint", str(app.pid)), f"process {app.pid} named one fd in two entries")
    assert fd_floor(server.pid) <= fds0
    left_running(app, before)


def test_an_honest_listing_of_several_pages_passes_the_bounds(sim_app):
    """More allocations than one page carries fds for (200): every one listed once, each with its own fd."""
    app = sim_app("--sizes", ",".join(["2M"] * 230))
    fds0 = nfds()
    with targets.resolve(app.pid).connect() as agent:
        got = server_memory.gather(agent, 30.0)
    try:
        with_fd = [m.fd for m in got if m.fd is not None]
        assert len(got) >= 230 and len(with_fd) >= 230 and len(set(with_fd)) == len(with_fd)
        assert sorted(m.index for m in got) == list(range(len(got)))
    finally:
        server_memory.close_all(got)
    assert nfds() == fds0


def test_a_listing_at_the_entry_bound_of_honest_entries_passes_the_byte_bound(sim_app):
    """The byte bound leaves room for the entry bound: as many entries as a listing may have, each as long as
    an honest agent's `memory` entry (measured on one here), pass."""
    from gpucr.agent import _Answer, _Listing
    app = sim_app("--sizes", "2M,2M,2M,2M")
    with targets.resolve(app.pid).connect() as agent:
        reply, fds = agent.call_with_fds("memory", 10.0, **{"from": 0})
    for fd in fds:
        os.close(fd)
    page = reply["memory"]
    per_entry = len(json.dumps(reply)) / len(page)
    listing, start, per_page = _Listing(app.pid, "memory", "list of its GPU memory"), 0, 256
    entries = [dict(page[0], fd_index=-1)] * per_page   # the size is the real page's; no fds travel here
    while start >= 0:
        nxt = start + per_page if start + per_page < MAX_LISTING_ENTRIES else -1
        answer = _Answer({"total": MAX_LISTING_ENTRIES, "memory": entries, "next": nxt}, [], int(per_entry * per_page))
        _, start = listing.page(answer, start)
    assert listing.entries == MAX_LISTING_ENTRIES
