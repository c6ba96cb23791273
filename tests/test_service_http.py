"""The swap service's HTTP API (issue 29) through a real `gpucr serve --http 127.0.0.1:0` on simcuda with real swap
apps: what it shows, what it changes, its errors, who may use it, and that no read of it asks an agent anything."""
from __future__ import annotations

import json
import os
import re
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from conftest import RunningServer, gpucr_cli
import test_swap
from service_api import Api
from test_swap import _state, _until

swap_server, swap_app = test_swap.swap_server, test_swap.swap_app
HTTP = ["--http", "127.0.0.1:0"]
ENDPOINTS = ["/api/v1/health", "/api/v1/state", "/api/v1/apps", "/api/v1/gpus", "/api/v1/switches", "/metrics",
             "/openapi.json", "/api/v1/apps/a", "/api/v1/events"]


@pytest.fixture
def server_args() -> list[str]:
    return HTTP


def _two_apps(swap_server, swap_app):
    a, b = swap_app("alpha", "--priority", "2"), swap_app("beta")
    a.ask("work 1")
    b.ask("work 1")
    _until("both apps hold their memory", lambda: all(
        x["resident_bytes"] >= 11 << 20 for x in Api(swap_server).get("/api/v1/apps")["apps"]) and
        len(Api(swap_server).get("/api/v1/apps")["apps"]) == 2)
    return a, b


@pytest.mark.parametrize("tcp", [True, False], ids=["tcp", "unix"])
def test_apps_and_gpus_shown_parked_resumed_and_changed_by_name(swap_server, swap_app, tcp):
    a, _b = _two_apps(swap_server, swap_app)
    api = Api(swap_server, tcp)
    before = a.ask("digest")["digest"]
    apps = {x["name"]: x for x in api.get("/api/v1/apps")["apps"]}
    assert apps["alpha"]["pid"] == a.pid and apps["alpha"]["priority"] == 2 and apps["alpha"]["state"] == "resident"
    gpu = api.get("/api/v1/gpus")["gpus"][0]
    assert gpu["apps"]["alpha"] == apps["alpha"]["resident_bytes"] and gpu["total_bytes"] == 4 << 30
    assert gpu["apps_bytes"] + gpu["server_bytes"] + gpu["others_bytes"] == gpu["used_bytes"], gpu

    r = api.post("/api/v1/apps/alpha/park")
    assert r.status == 200 and r.json()["state"] == "parked" and r.json()["parked_host_bytes"] >= 8 << 20, r.body
    assert "alpha" not in api.get("/api/v1/gpus")["gpus"][0]["apps"]
    r = api.post("/api/v1/apps/alpha/resume")
    assert r.status == 200 and r.json()["state"] == "resident", r.body
    assert a.ask("digest")["digest"] == before
    switches = api.get("/api/v1/switches")["switches"]
    assert [(s["app"], s["direction"]) for s in switches] == [("alpha", "park"), ("alpha", "resume")]
    assert all(s["bytes_moved"] >= 8 << 20 and s["seconds"] > 0 and s["at"] <= time.time() for s in switches)
    assert all(0 < s["control_s"] < s["seconds"] for s in switches), "the driver's part of each, as its result said"

    r = api.request("PATCH", "/api/v1/apps/beta", body={"priority": 5, "idle_park_s": 1})
    assert r.status == 200 and r.json()["priority"] == 5 and r.json()["idle_park_s"] == 1, r.body
    _until("beta, now idle-parked after 1 s, is parked", lambda: _state(swap_server, "beta") == "parked")
    log = swap_server.log.read_text()
    assert re.search(r"parked swap app alpha \(pid \d+\): asked by the HTTP API", log), log
    assert re.search(r"resuming swap app alpha \(pid \d+\) asked by the HTTP API", log), log
    assert "swap app beta (pid" in log and "priority 5, idle_park_s 1.0 (set by the HTTP API)" in log


def test_errors_are_json_with_the_servers_words(swap_server, swap_app):
    _two_apps(swap_server, swap_app)
    api = Api(swap_server)
    cases = [("POST", "/api/v1/apps/nobody/park", None, 404, "no swap app named 'nobody' runs under this gpucr server"),
             ("GET", "/api/v1/apps/nobody", None, 404, "'gpucr ps' lists them"),
             ("POST", "/api/v1/apps/alpha/resume", None, 409, "swap app alpha is resident, not parked"),
             ("PATCH", "/api/v1/apps/alpha", {"priority": 5000}, 400, "priority must be a whole number from -1000"),
             ("PATCH", "/api/v1/apps/alpha", {"colour": 1}, 400, "not colour"),
             ("PATCH", "/api/v1/apps/alpha", [1], 400, "the body must be a JSON object"),
             ("GET", "/api/v1/switches?limit=x", None, 400, "limit must be a whole number"),
             ("GET", "/nowhere", None, 404, "no such endpoint: /nowhere"),
             ("DELETE", "/api/v1/apps/alpha", None, 405, "DELETE is not served at /api/v1/apps/alpha")]
    for method, path, body, status, words in cases:
        r = api.request(method, path, body=body)
        assert r.status == status and r.headers["content-type"].startswith("application/json"), (path, r)
        assert words in r.json()["error"] and "\n" not in r.json()["error"], (path, r.json())
    assert api.post("/api/v1/apps/alpha/park").status == 200
    r = api.post("/api/v1/apps/alpha/park")
    assert r.status == 409 and "swap app alpha is parked, not resident" in r.json()["error"]


def test_tcp_wants_the_token_everywhere_checks_host_and_sends_no_cors(swap_server):
    api = Api(swap_server)
    for path in ENDPOINTS:
        for token in ("", "not-the-token", api.token[:-1]):
            r = api.request("GET", path, token=token, timeout=10)
            assert r.status == 401 and r.headers["www-authenticate"] == "Bearer", (path, token, r)
            assert "wants the server's token" in r.json()["error"]
        r = api.request("GET", path, headers={"Host": f"rebound.example:{api.hostport.rsplit(':', 1)[1]}"}, timeout=10)
        assert r.status == 403 and "against DNS rebinding" in r.json()["error"], (path, r)
    page = api.request("GET", "/", token="")
    assert page.status == 200 and b"gpucr swap service" in page.body
    assert "default-src 'none'" in page.headers["content-security-policy"] and page.headers["x-frame-options"] == "DENY"
    assert not re.search(rb"<(script|link|img)[^>]+(src|href)=", page.body), "the page loads nothing from elsewhere"
    for method, path in (("GET", "/api/v1/state"), ("OPTIONS", "/api/v1/apps/a/park"), ("GET", "/")):
        r = api.request(method, path, headers={"Origin": "http://attacker.example",
                                              "Access-Control-Request-Method": "POST"})
        assert not [h for h in r.headers if h.startswith("access-control-")], (method, path, r.headers)
    assert api.get("/api/v1/health")["status"] == "ok"
    token_file = Path(api.http["token_file"])
    assert stat.S_IMODE(token_file.stat().st_mode) == 0o600 and token_file.parent == swap_server.socket.parent
    assert stat.S_IMODE(os.lstat(api.http["socket"]).st_mode) == 0o600


def _tcp_listeners(pid: int) -> list[str]:
    """The TCP ports process pid listens on."""
    mine = {os.readlink(f"/proc/{pid}/fd/{fd}") for fd in os.listdir(f"/proc/{pid}/fd")}
    ports = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            f = line.split()
            if f[3] == "0A" and f"socket:[{f[9]}]" in mine:
                ports.append(f[1])
    return ports


@pytest.mark.parametrize("server_args", [[]])
def test_no_tcp_listener_unless_asked_and_the_unix_socket_serves_its_uid_only(swap_server):
    assert _tcp_listeners(swap_server.pid) == []
    api = Api(swap_server, tcp=False)
    assert "url" not in api.http and api.get("/api/v1/health")["pid"] == swap_server.pid
    assert not list(swap_server.socket.parent.glob("*-http.token"))


@pytest.mark.skipif(os.getuid() != 0, reason="needs root, to run a client as another uid (setpriv)")
def test_another_uid_is_refused_on_the_http_socket(monkeypatch):
    d = Path(tempfile.mkdtemp(dir="/tmp"))   # reachable by another user once opened up (pytest's own dirs are not)
    monkeypatch.setenv("GPUCR_RUNTIME_DIR", str(d))
    srv = RunningServer(True)
    try:
        sock = srv.info()["http"]["socket"]
        os.chmod(d, 0o711)
        os.chmod(sock, 0o666)
        probe = ("import socket,sys; s=socket.socket(socket.AF_UNIX); s.connect(sys.argv[1]);"
                 "s.sendall(b'GET /api/v1/state HTTP/1.0\\r\\nHost: x\\r\\n\\r\\n'); print(s.recv(65536).decode())")
        r = subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", sys.executable, "-c", probe,
                            sock], capture_output=True, text=True, timeout=30)
        assert r.stdout.startswith("HTTP/1.0 403") and "serves uid 0 only, not uid 65534" in r.stdout, r
    finally:
        srv.stop()
        os.chmod(d, 0o700)
        subprocess.run(["rm", "-rf", str(d)])


def test_no_read_asks_an_agent_even_of_a_stopped_app(swap_server, swap_app):
    """An agent asked anything while its process is stopped (SIGSTOP) answers nothing: each read below would hang
    its deadline (5 s) if it asked one. They read what the server holds."""
    a, _b = _two_apps(swap_server, swap_app)
    api = Api(swap_server)
    os.kill(a.pid, signal.SIGSTOP)
    try:
        for _ in range(3):
            for path in ("/api/v1/state", "/metrics", "/api/v1/apps/alpha", "/api/v1/health"):
                t0 = time.monotonic()
                api.get(path, timeout=4)
                assert time.monotonic() - t0 < 2.0, path
    finally:
        os.kill(a.pid, signal.SIGCONT)


def test_the_event_stream_sends_the_state_every_second(swap_server, swap_app):
    _two_apps(swap_server, swap_app)
    api = Api(swap_server)
    conn = api._conn(10)
    conn.request("GET", "/api/v1/events", headers={"Authorization": f"Bearer {api.token}"})
    r = conn.getresponse()
    assert r.status == 200 and r.getheader("content-type") == "text/event-stream"
    events, t0 = [], time.monotonic()
    while len(events) < 3:
        line = r.fp.readline().decode()
        if line.startswith("data: "):
            events.append(json.loads(line[6:]))
    conn.close()
    assert time.monotonic() - t0 >= 1.5 and {a["name"] for a in events[-1]["apps"]} == {"alpha", "beta"}


def test_http_takes_loopback_only_and_a_port_taken_is_one_line():
    r = gpucr_cli("serve", "--simulate", "--http", "0.0.0.0:8321")
    assert r.returncode == 2 and "'0.0.0.0' is not a loopback address: the HTTP API listens on this host only" in r.stderr
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    try:
        port = taken.getsockname()[1]
        r = gpucr_cli("serve", "--simulate", "--http", f"localhost:{port}", timeout=60)
        assert r.returncode == 1 and r.stderr.strip().splitlines()[-1] == (
            f"gpucr: error: cannot listen on http://127.0.0.1:{port} for --http: Address already in use; give another "
            "port (0: any free one)"), r.stderr
        assert not list(Path(os.environ["GPUCR_RUNTIME_DIR"]).glob("*-http.*")), "nothing of it is left behind"
    finally:
        taken.close()

