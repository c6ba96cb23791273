"""The HTTP API running inside `gpucr serve`: an asyncio loop (aiohttp) on a thread of its own, beside the server's
socket loop, serving its Unix socket and, when asked, loopback TCP. Its requests go to the server's handlers
(daemon.Server.ask) on worker threads, so a park that takes seconds holds no other request up."""
from __future__ import annotations

import asyncio
import socket
import threading
from typing import TYPE_CHECKING, Callable

from aiohttp import web

from ..errors import GpucrError
from ..server import wire
from ..server.daemon import log
from .guard import json_errors, peer_guard, token_guard
from .listen import Loopback, bind_tcp, bind_unix, remove_quietly, write_token
from .routes import Routes, known_queries

if TYPE_CHECKING:
    from ..server.daemon import Server

START_WAIT_S = 10.0
STOP_WAIT_S = 5.0


class ApiThread:
    def __init__(self, srv: Server, http: Loopback | None) -> None:
        self.srv, self.http = srv, http
        self.sock_path = srv.dir / wire.http_socket_name(srv.simulated)
        self.token_path = srv.dir / wire.token_name(srv.simulated)
        self._loop = asyncio.new_event_loop()
        self._runners: list[web.AppRunner] = []
        self._ino = 0
        self._ready = threading.Event()
        self._failed: BaseException | None = None
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Bound and serving, or GpucrError saying why not (a port taken), before the server says it serves."""
        unix, self._ino = bind_unix(self.sock_path)
        tcp: socket.socket | None = None
        try:
            tcp = self._bind_tcp()
            token = write_token(self.token_path) if tcp is not None else ""
            self._thread = threading.Thread(target=self._run, args=(unix, tcp, token), daemon=True, name="gpucr-http")
            self._thread.start()
            if not self._ready.wait(START_WAIT_S) or self._failed is not None:
                raise GpucrError(f"the HTTP API did not start: {self._failed or f'not ready within {START_WAIT_S:g} s'}")
        except BaseException:
            for sock in (unix, tcp):
                if sock is not None:
                    sock.close()
            self.stop()
            raise
        self._say(tcp, token)

    def _bind_tcp(self) -> socket.socket | None:
        if self.http is None:
            return None
        try:
            return bind_tcp(self.http)
        except OSError as exc:
            raise GpucrError(f"cannot listen on {self.http.url(self.http.port)} for --http: {exc.strerror}; give "
                             "another port (0: any free one)") from None

    def _say(self, tcp: socket.socket | None, token: str) -> None:
        """Where it listens: in the server's description (`gpucr serve --show-http`) and its log."""
        self.srv.http = {"socket": str(self.sock_path)}
        log(f"the HTTP API listens on {self.sock_path}")
        if tcp is not None and self.http is not None:
            url = self.http.url(tcp.getsockname()[1])
            self.srv.http.update({"url": url, "token_file": str(self.token_path)})
            log(f"the HTTP API listens on {url} (loopback only; its token is in {self.token_path}); the page: "
                f"{url}/#token={token}")

    def _run(self, unix: socket.socket, tcp: socket.socket | None, token: str) -> None:
        asyncio.set_event_loop(self._loop)
        try:
            self._loop.run_until_complete(self._sites(unix, tcp, token))
        except BaseException as exc:   # noqa: BLE001 - said by start(), in the server's thread
            self._failed = exc
            self._ready.set()
            return
        self._ready.set()
        self._loop.run_forever()
        self._loop.run_until_complete(self._cleanup())
        self._loop.close()

    async def _sites(self, unix: socket.socket, tcp: socket.socket | None, token: str) -> None:
        routes = Routes(self.srv.ask).table()
        await self._site(unix, routes, peer_guard(self.srv.peer_problem))
        if tcp is not None and self.http is not None:
            hosts = self.http.hosts(tcp.getsockname()[1])
            await self._site(tcp, routes, token_guard(token, hosts, str(self.token_path)))

    async def _site(self, sock: socket.socket, routes: list[web.RouteDef], guard: Callable) -> None:
        app = web.Application(middlewares=[json_errors, guard, known_queries])
        app.add_routes(routes)
        runner = web.AppRunner(app, access_log=None, handle_signals=False, shutdown_timeout=1.0)
        await runner.setup()
        await web.SockSite(runner, sock).start()
        self._runners.append(runner)

    async def _cleanup(self) -> None:
        for runner in self._runners:
            await runner.cleanup()

    def stop(self) -> None:
        if self._thread is not None and self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(STOP_WAIT_S)
        remove_quietly(self.sock_path, self._ino)
        if self.http is not None:
            remove_quietly(self.token_path)


def start(srv: Server, http: Loopback | None) -> Callable[[], None]:
    api = ApiThread(srv, http)
    api.start()
    return api.stop
