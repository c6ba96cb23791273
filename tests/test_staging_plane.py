"""Staging made by the data plane and held by the agent (issue 25 item 1, "Who owns staging"): the plane makes,
faults in and budgets it; the agent checks and holds its fds (`hold`), so a parked app's data outlives a server;
the application runs no thread of gpucr's to prepare it."""
from __future__ import annotations

import os
import signal
import subprocess
import threading
from pathlib import Path

import pytest

import gpucr
from gpucr import paths
from gpucr.agent import AgentClient
from gpucr.dataplane import budget
from gpucr.dataplane.staging_make import sealed_memfd, unlinked_file
from gpucr.errors import GpucrError
from gpucr.server.route import NO_SERVER_ENV
from gpucr.target import agent_socket_name

from conftest import RunningServer, gpucr_cli

MiB = 1 << 20


def _agent(pid: int) -> AgentClient:
    return AgentClient(paths.runtime_dir() / agent_socket_name(pid), pid)


def _thread_names(pid: int) -> set[str]:
    names = set()
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            names.add((task / "comm").read_text().strip())
        except OSError:
            pass
    return names



def fd_links(pid: int) -> list[str]:
    """What each open fd of the process names; an fd closed between the listing and its readlink (the app's
    threads run on meanwhile) is left out."""
    links = []
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            links.append(os.readlink(f"/proc/{pid}/fd/{fd}"))
        except FileNotFoundError:
            pass
    return links

def test_the_app_runs_no_thread_to_prepare_its_staging(sim_app):
    """Its first checkpoint makes 192 MiB of staging: faulted in by the plane, never by threads in the app."""
    app = sim_app("--sizes", "128M,64M", env={**os.environ, "GPUCR_STAGING": "shm"})
    seen: set[str] = set()
    stop = threading.Event()

    def watch() -> None:
        while not stop.is_set():
            seen.update(_thread_names(app.pid))
    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        result = gpucr.checkpoint(app.pid)
    finally:
        stop.set()
        watcher.join()
    assert "staging" in result.phases_s, "the plane made staging before the handover"
    assert not any(n.startswith("gpucr-touch") for n in seen), seen
    assert b"gpucr-touch" not in paths.agent_lib().read_bytes(), "the agent makes no staging any more"
    held = fd_links(app.pid)
    assert any(link.startswith("/memfd:gpucr-staging") for link in held), "the agent holds the plane's memfds"
    gpucr.restore(app.pid)


def test_a_cycle_that_reuses_its_staging_asks_for_none(sim_app):
    app = sim_app("--sizes", "16M", env={**os.environ, "GPUCR_STAGING": "shm"})
    gpucr.checkpoint(app.pid)
    gpucr.restore(app.pid)
    again = gpucr.checkpoint(app.pid)
    assert "staging" not in again.phases_s, "kept staging fits: nothing made, no hold"
    gpucr.restore(app.pid)


@pytest.mark.parametrize("bad", ["unsealed memfd", "named file", "pipe"])
def test_hold_refuses_a_file_the_plane_would_not_make(sim_app, tmp_path, bad):
    app = sim_app("--sizes", "4M", env={**os.environ, "GPUCR_STAGING": "shm"})
    if bad == "unsealed memfd":
        fd = os.memfd_create("not-gpucr", os.MFD_CLOEXEC)
        os.ftruncate(fd, 4 * MiB)
    elif bad == "named file":
        fd = os.open(tmp_path / "named", os.O_RDWR | os.O_CREAT, 0o600)
        os.ftruncate(fd, 4 * MiB)
    else:
        fd = os.pipe()[0]
    try:
        with _agent(app.pid) as agent:
            with pytest.raises(GpucrError, match="staging segment 0"):
                agent.call_sending_fds("hold", [fd], replace=0, entry=0)
            assert agent.call("status")["staging_segments"] == 0
    finally:
        os.close(fd)


def test_hold_is_refused_while_staging_holds_the_data(sim_app):
    app = sim_app("--sizes", "4M", env={**os.environ, "GPUCR_STAGING": "shm"})
    gpucr.checkpoint(app.pid)
    fd = sealed_memfd(4 * MiB, huge=False)
    try:
        with _agent(app.pid) as agent:
            with pytest.raises(GpucrError, match="hold refused: the process is parked"):
                agent.call_sending_fds("hold", [fd], replace=1, entry=0)
    finally:
        os.close(fd)
    gpucr.restore(app.pid)


def test_file_staging_is_an_unlinked_file_in_the_dir(sim_app, tmp_path):
    app = sim_app("--sizes", "8M", env={**os.environ, "GPUCR_STAGING": f"file:{tmp_path}"})
    before = app.ask("digest")
    gpucr.checkpoint(app.pid)
    assert list(tmp_path.iterdir()) == [], "no name left behind"
    held = fd_links(app.pid)
    assert any(link.startswith(str(tmp_path)) and link.endswith("(deleted)") for link in held), held
    gpucr.restore(app.pid)
    assert app.ask("digest") == before
    fd = unlinked_file(str(tmp_path), MiB)
    assert os.fstat(fd).st_nlink == 0 and os.fstat(fd).st_size == MiB
    os.close(fd)


@pytest.mark.parametrize("restorer", ["new server", "no server"])
def test_a_parked_apps_staging_outlives_its_server(sim_app, restorer):
    """The server that made and filled the staging is SIGKILLed while the app is parked: the app's agent holds the
    staging (and its ledger entry), so a new server, or the CLI's own mover, restores it intact."""
    app = sim_app("--sizes", "24M,8M", env={**os.environ, "GPUCR_STAGING": "shm"})
    before = app.ask("digest")
    first = RunningServer(True)
    try:
        assert gpucr.checkpoint(app.pid).data_plane == "server"
    finally:
        first.proc.send_signal(signal.SIGKILL)
        first.stop()
    st = gpucr_cli("status", "--no-server", str(app.pid))
    assert st.returncode == 0 and "32 MiB" in st.stdout, st.stdout + st.stderr
    assert budget.used_bytes(paths.runtime_dir()) >= 32 * MiB, "the entry lives with the app, not the server"
    if restorer == "new server":
        second = RunningServer(True)
        try:
            assert gpucr.restore(app.pid).data_plane == "server"
        finally:
            second.stop()
    else:
        r = gpucr_cli("restore", "--no-server", str(app.pid))
        assert r.returncode == 0, r.stderr
    assert app.ask("digest") == before


def test_the_ledger_counts_an_entry_while_its_holder_lives(tmp_path):
    """budget.py's ledger, alone: an entry counts while some process holds its flock; a stale one is reaped."""
    d = tmp_path / "rt"
    d.mkdir(mode=0o700)
    with budget.locked(d) as dirfd:
        held = budget.write_entry(dirfd, "1-2.staging", 5 * MiB)
    child = subprocess.Popen(["sleep", "60"], pass_fds=[held])   # holds the entry, as an agent would
    os.close(held)
    try:
        assert budget.used_bytes(d) == 5 * MiB
    finally:
        child.kill()
        child.wait()
    assert budget.used_bytes(d) == 0
    with budget.locked(d) as dirfd:
        assert budget.others(dirfd, "", reap=True) == 0
    assert list(d.iterdir()) == [], "the stale entry is removed under the lock"


def test_a_refusal_leaves_no_entry_behind(sim_app, monkeypatch):
    monkeypatch.setenv(NO_SERVER_ENV, "1")
    app = sim_app("--sizes", "64M", env={**os.environ, "GPUCR_STAGING": "shm", "GPUCR_HOST_BUDGET": "16M"})
    with pytest.raises(GpucrError, match="host-memory budget"):
        gpucr.checkpoint(app.pid)
    assert [p for p in paths.runtime_dir().iterdir() if p.name.endswith(budget.SUFFIX)] == []


def test_staging_more_than_twice_the_data_is_made_anew(sim_app):
    """The app freed most of its memory: its next checkpoint gives its staging back and has the plane make it at
    the size needed (the agent plans `replace`), the budget's entry saying the new size."""
    # segments of 32 MiB: staging is given back only when more than a segment is idle (a pool segment lent to a
    # smaller app is kept)
    app = sim_app("--sizes", "64M,4M", env={**os.environ, "GPUCR_STAGING": "shm", "GPUCR_STAGING_SEGMENT_MIB": "32"})
    gpucr.checkpoint(app.pid)
    gpucr.restore(app.pid)
    assert gpucr.status(app.pid).staging_bytes >= 68 * MiB
    app.ask("free 0")
    before = app.ask("digest")
    gpucr.checkpoint(app.pid)
    st = gpucr.status(app.pid)
    assert 4 * MiB <= st.staging_bytes < 8 * MiB and st.host_budget_used_bytes == st.staging_bytes, st
    gpucr.restore(app.pid)
    assert app.ask("digest") == before
