"""Threads that watch the GPU through a checkpoint (issue 24, item 0). On the driver, a stream or event
query or a synchronize is not held by the checkpoint lock: one that overlaps the driver's checkpoint fails
it (304) and one made while the process is checkpointed kills it (SIGSEGV). simcuda does the same, so
these tests fail unless the agent's gate holds every such call, and the context switches before them,
from gate close to gate open, or (the queries, once the checkpoint settled) answers it without the driver."""
from __future__ import annotations

import time

import pytest

from conftest import gpucr_cli

PARK_S = 0.2     # long enough for pollers every 2 ms to call a hundred times, were they not held
CYCLES = 3


# answered "complete" by the agent, without the driver, once the checkpoint has settled (entrypoints.def)
QUERIES = ("stream-query", "event-query")


def _cycle(app, pid: int, level: str, via: list[str]) -> None:
    """One checkpoint and restore by the CLI; while parked, the queries are answered by the agent (at level
    full a query that reached simcuda would kill the process) and no other poller gets through the gate."""
    r = gpucr_cli("checkpoint", *via, "--level", level, str(pid))
    assert r.returncode == 0, r.stderr
    time.sleep(PARK_S / 4)   # a call drained at gate close has long returned; its count is in
    parked = app.ask("poll counts")
    time.sleep(PARK_S)
    now = app.ask("poll counts")
    assert now["errors"] == parked["errors"] == [], now
    waiting = [f for f in now["counts"] if f not in QUERIES]
    assert {f: now["counts"][f] for f in waiting} == {f: parked["counts"][f] for f in waiting}, \
        "a poller's call got past the closed gate"
    assert all(now["counts"][f] > parked["counts"][f] for f in QUERIES), f"a query was not answered while parked: {now}"
    r = gpucr_cli("restore", *via, str(pid))
    assert r.returncode == 0, r.stderr


def _running_again(app, since: dict) -> None:
    """Every poller calls again after the restore."""
    deadline = time.time() + 10
    while time.time() < deadline:
        now = app.ask("poll counts")["counts"]
        if all(now[f] > since[f] for f in now):
            return
        time.sleep(0.02)
    raise AssertionError(f"pollers stalled after the restore: {since} -> {now}")


@pytest.mark.parametrize("level", ["full", "data"])
@pytest.mark.parametrize("path", ["server", "no-server"])
def test_threads_polling_the_gpu_live_through_cycles(request, sim_app, path, level):
    via = ["--no-server"] if path == "no-server" else []
    if path == "server":
        request.getfixturevalue("server")
    app = sim_app("--sizes", "8M,3M,64K", "--vmm-mib", "4")
    app.ask("poll start 2")
    for i in range(CYCLES):
        app.ask(f"work {i + 1}")
        before = app.ask("digest")
        counts = app.ask("poll counts")["counts"]
        _cycle(app, app.pid, level, via)
        assert app.proc.poll() is None, f"cycle {i}: the application died ({app.proc.returncode})"
        assert app.ask("digest") == before, f"cycle {i}"
        _running_again(app, counts)
    out = app.ask("poll stop")
    assert out["errors"] == [] and min(out["counts"].values()) > 0, out


@pytest.mark.parametrize("level", ["full", "data"])
def test_a_thread_started_while_parked_waits_at_its_context_switch_until_the_restore(sim_app, level):
    """A thread the application starts while it is parked: its first call, cuCtxSetCurrent, is held at the gate
    (on the driver, a new thread's context switch and query on a checkpointed process killed it) and returns only
    after the restore; then its query runs, and the application lives with its data intact."""
    app = sim_app("--sizes", "8M")
    before = app.ask("digest")
    r = gpucr_cli("checkpoint", "--no-server", "--level", level, str(app.pid))
    assert r.returncode == 0, r.stderr
    app.ask("enter start")
    time.sleep(PARK_S)
    assert app.ask("enter state")["returned"] == {}, "the new thread's cuCtxSetCurrent got past the closed gate"
    r = gpucr_cli("restore", "--no-server", str(app.pid))
    assert r.returncode == 0, r.stderr
    deadline = time.time() + 10
    while len(returned := app.ask("enter state")["returned"]) < 2 and time.time() < deadline:
        time.sleep(0.02)
    assert returned == {"set_current": 0, "stream_query": 0}, returned
    assert app.proc.poll() is None and app.ask("digest") == before
