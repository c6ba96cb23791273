"""The agent's control channel: private, validated, and still serving after bad requests."""
from __future__ import annotations

import json
import os
import shutil
import socket
import stat
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from hypothesis import given, settings, strategies as st

from gpucr import paths
from gpucr.target import agent_socket_name


def talk(sock_path, data: bytes) -> list[dict]:
    """data sent whole, then every answer line until the agent hangs up."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(10)
        s.connect(str(sock_path))
        s.sendall(data)
        s.shutdown(socket.SHUT_WR)
        out = b"".join(iter(lambda: s.recv(65536), b""))
    return [json.loads(l) for l in out.splitlines() if l]


def test_runtime_dir_and_socket_are_private(sim_app):
    app = sim_app("--sizes", "4M")
    d = paths.runtime_dir()
    sock = d / agent_socket_name(app.pid)
    assert stat.S_IMODE(os.stat(d).st_mode) == 0o700
    assert stat.S_IMODE(os.stat(sock).st_mode) == 0o600


def test_malformed_requests_get_errors_and_agent_keeps_serving(sim_app):
    app = sim_app("--sizes", "4M")
    sock = paths.runtime_dir() / agent_socket_name(app.pid)
    replies = talk(sock, b"\n" + b"bogus\n" + b"handover timeout_ms=-5\n" + b"handover timeout_ms=abc\n" + b"hel\x00lo\n" +
                   b"checkpoint\n" + b"hello\n")
    assert [r["ok"] for r in replies] == [False, False, False, False, False, False, True]
    assert "unknown request verb" in replies[1]["error"]
    assert "timeout_ms must be a positive number" in replies[2]["error"]
    assert "unknown request verb" in replies[5]["error"], "the agent copies nothing itself any more (issue 25)"
    too_long = talk(sock, b"x" * 5000)
    assert too_long and not too_long[0]["ok"] and "too long" in too_long[0]["error"]
    assert talk(sock, b"status\n")[0]["state"] == "running"


@settings(max_examples=150, deadline=None)
@given(st.binary(max_size=600))
def test_fuzz_channel_never_breaks_the_agent(sim_agent_socket, data):
    replies = talk(sim_agent_socket, data + b"\n")
    for r in replies:
        assert isinstance(r["ok"], bool)
    # nothing random may start a checkpoint that leaves the app parked
    assert talk(sim_agent_socket, b"status\n")[0]["state"] == "running"


@pytest.mark.skipif(os.getuid() != 0, reason="needs root to act as another user")
def test_peer_of_another_user_is_refused_by_the_agent_itself(sim_app):
    """Defence in depth: even with the directory and socket opened up, SO_PEERCRED keeps strangers out."""
    d = Path(tempfile.mkdtemp(dir="/tmp"))   # reachable by another user once opened up (pytest's own dirs are not)
    try:
        app = sim_app("--sizes", "4M", env=dict(os.environ, GPUCR_RUNTIME_DIR=str(d)))
        _probe_as_stranger(d, d / agent_socket_name(app.pid))
    finally:
        shutil.rmtree(d, ignore_errors=True)


def _probe_as_stranger(d: Path, sock: Path) -> None:
    os.chmod(d, 0o711)
    os.chmod(sock, 0o666)
    probe = ("import socket,sys; s=socket.socket(socket.AF_UNIX); s.connect(sys.argv[1]); s.sendall(b'status\\n');"
             "print(s.recv(4096).decode())")
    r = subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", sys.executable, "-c", probe,
                        str(sock)], capture_output=True, text=True, timeout=30)
    reply = json.loads(r.stdout)
    assert reply["ok"] is False and "permission denied" in reply["error"]
    assert talk(sock, b"status\n")[0]["state"] == "running"   # its own user still gets through


def test_readers_asking_without_pause_never_make_a_checkpoint_or_restore_busy(sim_app):
    """A monitor's `status` and a gpucr server's pin-ahead `layout` only read: asked back to back on their own
    connections, they must never make a controller's checkpoint or restore fail as "busy" (the layout read held the
    lock of changes, and status probed it)."""
    import threading
    import gpucr
    from gpucr import target as targets
    app = sim_app("--sizes", "16M")
    before = app.ask("digest")
    stop = threading.Event()

    def read(verb: str) -> None:
        with targets.resolve(app.pid).connect() as agent:
            while not stop.is_set():
                try:
                    for fd in agent.call_with_fds(verb, timeout=10.0)[1]:
                        os.close(fd)
                except gpucr.GpucrError:
                    pass   # a layout refused while a change runs: a reader may be told busy, never a change

    readers = [threading.Thread(target=read, args=(v,), daemon=True) for v in ("status", "status", "layout", "layout")]
    for t in readers:
        t.start()
    try:
        for _ in range(30):
            gpucr.checkpoint(app.pid)
            gpucr.restore(app.pid)
    finally:
        stop.set()
        for t in readers:
            t.join(10)
    assert app.ask("digest") == before


def test_a_controllers_connection_outlives_readers_that_take_the_slots(sim_agent_socket):
    """A restore's controller asks the agent at its vet (`status controller=1`) and then not until its fill is done,
    however long that takes. The agent keeps that connection when readers take every slot; a reader's own idle
    connection is the one given up for a newcomer (eight slots; one idle for 0.5 s goes, the oldest first: here the
    controller's, were it not a controller's)."""
    def line(s: socket.socket, req: bytes) -> dict:
        s.sendall(req)
        got = b""
        while not got.endswith(b"\n"):
            chunk = s.recv(65536)
            if not chunk:
                raise ConnectionError("the agent hung up")
            got += chunk
        return json.loads(got)
    socks = []
    try:
        for _ in range(2):
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.settimeout(10)
            s.connect(str(sim_agent_socket))
            socks.append(s)
        controller, reader = socks
        assert "state" in line(controller, b"status controller=1\n")
        assert "state" in line(reader, b"status\n")
        time.sleep(0.7)   # both idle past the grace
        for _ in range(7):   # the slots full at the sixth: the seventh is given the oldest idle one that never acted
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.settimeout(10)
            s.connect(str(sim_agent_socket))
            socks.append(s)
            assert "state" in line(s, b"status\n")
        assert "state" in line(controller, b"status\n"), "the controller's connection was kept"
        with pytest.raises((ConnectionError, OSError)):
            line(reader, b"status\n")
    finally:
        for s in socks:
            s.close()
