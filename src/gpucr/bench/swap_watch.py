"""`gpucr bench --scenario swap --watch` (issue 29): while the scenario runs, a client of the serve's HTTP API on its
Unix socket reads the page's data endpoint (/api/v1/state) and /metrics every second and follows the event stream
(/api/v1/events), as a person's page and a Prometheus scrape would. Each thing read is a line of a gzipped JSON-lines
recording beside the results (its states replay into the page: gpucr.service_http.replay). At the end, the metrics'
per-app counters (parks, resumes, bytes moved) are set against the bench's own counts of the run.

Every read is a request of the API, answered from the server's state: none reaches an agent (issue 29 item 2). The
standard library's http.client carries them, so the watch needs nothing beyond prometheus_client's text parser."""
from __future__ import annotations

import gzip
import http.client
import json
import socket
import threading
import time
from pathlib import Path
from typing import IO, Any

READ_EVERY_S = 1.0
READ_TIMEOUT_S = 10.0
DIRECTIONS = ("park", "resume")
COUNTERS = {"gpucr_app_switches_total": "{}s", "gpucr_app_moved_bytes_total": "bytes_{}"}   # -> parks, bytes_park


class UnixHTTP(http.client.HTTPConnection):
    """HTTP over the serve's Unix socket (no TCP listener, no token: the socket's peer check lets its user in)."""

    def __init__(self, path: str, timeout: float | None) -> None:
        super().__init__("localhost", timeout=timeout)
        self.unix_path = path

    def connect(self) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(self.timeout)
        self.sock.connect(self.unix_path)


def app_counters(metrics_text: str) -> dict[str, dict[str, float]]:
    """Each app's parks, resumes and bytes moved each way, from a /metrics text (prometheus_client's parser)."""
    from prometheus_client.parser import text_string_to_metric_families
    out: dict[str, dict[str, float]] = {}
    for family in text_string_to_metric_families(metrics_text):
        for s in family.samples:
            key = COUNTERS.get(s.name)
            if key is not None:
                row = out.setdefault(s.labels["app"], {})
                name = key.format(s.labels["direction"])
                row[name] = row.get(name, 0.0) + s.value
    return out


def bench_counters(requests: list[dict[str, Any]], starts: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """The same counts from the bench's own records: each switch it saw in a request's window (swap_ways._moved's
    `switched`) and in a server's start (the parks it made room with: Fleet.starts). A switch outside them (none
    is asked then) would make the two differ, and be said so."""
    out: dict[str, dict[str, float]] = {}
    for rec in [*requests, *starts]:
        for app, direction, moved in rec.get("switched", ()):
            row = out.setdefault(app, dict.fromkeys([f"{d}s" for d in DIRECTIONS] +
                                                    [f"bytes_{d}" for d in DIRECTIONS], 0.0))
            row[f"{direction}s"] += 1
            row[f"bytes_{direction}"] += moved
    return out


def compare(metrics: dict[str, dict[str, float]], bench: dict[str, dict[str, float]]) -> dict[str, Any]:
    """Both numbers of every count of every app either side saw, and whether all are equal."""
    apps: dict[str, Any] = {}
    for app in sorted(set(metrics) | set(bench)):
        m, b = metrics.get(app, {}), bench.get(app, {})
        apps[app] = {k: {"metrics": m.get(k), "bench": b.get(k, 0.0), "equal": m.get(k) == b.get(k, 0.0)}
                     for k in sorted(set(m) | set(b))}
    return {"equal": bool(apps) and all(c["equal"] for row in apps.values() for c in row.values()), "apps": apps}


class Watch:
    """Two threads: one reads the state and /metrics every READ_EVERY_S, one follows the event stream. Both write
    lines {"t": wall clock, "via": "state" | "metrics" | "events", ...} to `out` (gzip)."""

    def __init__(self, sock_path: str, out: Path) -> None:
        self.sock_path, self.out = sock_path, out
        self._file: IO[str] = gzip.open(out, "wt", encoding="utf-8")
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._stream: UnixHTTP | None = None
        self.reads = {"state": 0, "metrics": 0, "events": 0}
        self.errors: list[str] = []
        self.last_metrics = ""
        self._threads = [threading.Thread(target=self._poll, daemon=True, name="gpucr-watch-poll"),
                         threading.Thread(target=self._follow, daemon=True, name="gpucr-watch-events")]

    def start(self) -> Watch:
        for t in self._threads:
            t.start()
        return self

    def _get(self, path: str) -> str:
        conn = UnixHTTP(self.sock_path, READ_TIMEOUT_S)
        try:
            conn.request("GET", path)
            r = conn.getresponse()
            body = r.read().decode()
            if r.status != 200:
                raise OSError(f"GET {path}: {r.status} {body[:200]}")
            return body
        finally:
            conn.close()

    def _write(self, via: str, **what: Any) -> None:
        with self._lock:
            if not self._file.closed:
                self._file.write(json.dumps({"t": round(time.time(), 3), "via": via, **what},
                                            separators=(",", ":")) + "\n")
                self.reads[via] += 1

    def _error(self, what: str) -> None:
        if len(self.errors) < 20:   # a server gone says the same each second: the first ones tell
            self.errors.append(what)

    def read_once(self) -> None:
        """One read of the page's data endpoint and of /metrics, recorded."""
        try:
            self._write("state", state=json.loads(self._get("/api/v1/state")))
            text = self._get("/metrics")
            self.last_metrics = text
            self._write("metrics", apps=app_counters(text), bytes=len(text))
        except (OSError, ValueError, http.client.HTTPException) as exc:
            self._error(f"{time.strftime('%H:%M:%S')} {type(exc).__name__}: {exc}")

    def _poll(self) -> None:
        while not self._stop.is_set():
            began = time.monotonic()
            self.read_once()
            self._stop.wait(max(0.0, READ_EVERY_S - (time.monotonic() - began)))

    def _follow(self) -> None:
        """The event stream, each `event: state` recorded; followed again if it breaks, until stop()."""
        while not self._stop.is_set():
            conn = self._stream = UnixHTTP(self.sock_path, None)
            try:
                conn.request("GET", "/api/v1/events")
                r = conn.getresponse()
                name, data = "", ""
                while not self._stop.is_set():
                    line = r.readline().decode()
                    if not line:
                        break
                    if line.startswith("event: "):
                        name = line[7:].strip()
                    elif line.startswith("data: "):
                        data += line[6:].strip()
                    elif line == "\n" and data:
                        if name == "state":
                            self._write("events", state=json.loads(data))
                        else:
                            self._error(f"event {name}: {data[:200]}")
                        name, data = "", ""
            except (OSError, ValueError, http.client.HTTPException) as exc:
                if not self._stop.is_set():
                    self._error(f"events: {type(exc).__name__}: {exc}")
            finally:
                conn.close()
            self._stop.wait(READ_EVERY_S)

    def finish(self) -> dict[str, dict[str, float]]:
        """Stop both threads after one last read (the counts the run ended with, its apps still registered: a gone
        app's series are dropped); the recording closed. Returns that last read's per-app counters."""
        self._stop.set()
        if self._stream is not None and self._stream.sock is not None:
            try:   # the event stream's read returns at once
                self._stream.sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        for t in self._threads:
            t.join(READ_TIMEOUT_S)
        self.read_once()
        with self._lock:
            self._file.close()
        return app_counters(self.last_metrics) if self.last_metrics else {}


def read_recording(path: Path) -> list[dict[str, Any]]:
    """The lines of a recording, in order."""
    with gzip.open(path, "rt", encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]
