"""A client of the swap service's HTTP API for the tests: over the server's HTTP Unix socket or its loopback TCP (with
its token), with the standard library's http.client, as any client would."""
from __future__ import annotations

import http.client
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from conftest import RunningServer
from gpucr.bench.swap_watch import UnixHTTP


@dataclass
class Reply:
    status: int
    headers: dict[str, str]
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body)


class Api:
    """The HTTP API of a running server: `tcp` with its token (`gpucr serve --http`), else its Unix socket."""

    def __init__(self, srv: RunningServer, tcp: bool = True) -> None:
        info = srv.info()
        assert info is not None and info["http"], f"the server serves no HTTP API: {info}"
        self.http = info["http"]
        self.tcp = tcp
        self.url = self.http.get("url", "")
        self.token = Path(self.http["token_file"]).read_text().strip() if tcp else ""
        self.hostport = self.url.split("//", 1)[1] if tcp else ""

    def _conn(self, timeout: float) -> http.client.HTTPConnection:
        if self.tcp:
            host, port = self.hostport.rsplit(":", 1)
            return http.client.HTTPConnection(host, int(port), timeout=timeout)
        return UnixHTTP(self.http["socket"], timeout)

    def request(self, method: str, path: str, body: Any = None, token: str | None = None,
                headers: dict[str, str] | None = None, timeout: float = 60.0) -> Reply:
        """One request; the token sent unless token="" (or another given); headers added or replaced."""
        conn = self._conn(timeout)
        h = {"Authorization": f"Bearer {self.token if token is None else token}"} if self.tcp and token != "" else {}
        h.update(headers or {})
        data = json.dumps(body).encode() if body is not None else None
        if data is not None:
            h["Content-Type"] = "application/json"
        try:
            conn.request(method, path, body=data, headers=h)
            r = conn.getresponse()
            return Reply(r.status, {k.lower(): v for k, v in r.getheaders()}, r.read())
        finally:
            conn.close()

    def get(self, path: str, **kw: Any) -> Any:
        r = self.request("GET", path, **kw)
        assert r.status == 200, (path, r.status, r.body)
        return r.json() if r.headers.get("content-type", "").startswith("application/json") else r.body.decode()

    def post(self, path: str, **kw: Any) -> Reply:
        return self.request("POST", path, **kw)

    def app(self, name: str) -> dict[str, Any]:
        return self.get(f"/api/v1/apps/{name}")
