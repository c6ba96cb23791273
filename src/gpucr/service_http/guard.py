"""Who may use the HTTP API (docs/security.md, "The HTTP API"), and its errors as JSON.

- On the Unix socket: the caller's SO_PEERCRED, checked as the server checks its own socket's (its uid and
  namespaces), for every request.
- On loopback TCP: the Host header must name this listener (127.0.0.1:PORT, [::1]:PORT or localhost:PORT), against
  DNS rebinding; and every request wants the token in `Authorization: Bearer ...`, reads and /metrics included. A
  header, not a cookie: a page of another site the browser shows cannot send it, and the server sends no CORS
  headers, so no other origin may read an answer either. The page itself (GET /, no data in it) is the one thing
  served without the token: it takes the token from its URL's fragment, which the browser never sends.
"""
from __future__ import annotations

import hmac
import json
import socket
from typing import Awaitable, Callable

from aiohttp import web

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
NO_TOKEN_PATHS = frozenset({"/"})   # the page: static, its token comes from the URL fragment


class ApiError(Exception):
    """An answer of status `status` with `{"error": message}`, the message in the CLI's words."""

    def __init__(self, status: int, message: str, **headers: str) -> None:
        super().__init__(message)
        self.status, self.headers = status, headers


def error_response(status: int, message: str, **headers: str) -> web.Response:
    return web.Response(status=status, text=json.dumps({"error": message}), content_type="application/json",
                        headers=headers or None)


@web.middleware
async def json_errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Every error as JSON with one line; the router's own (no such path, no such method) said the same way."""
    try:
        return await handler(request)
    except ApiError as exc:
        return error_response(exc.status, str(exc), **exc.headers)
    except web.HTTPNotFound:
        return error_response(404, f"no such endpoint: {request.path}; the endpoints are in /openapi.json")
    except web.HTTPMethodNotAllowed as exc:
        return error_response(405, f"{request.method} is not served at {request.path}; it takes "
                                   f"{', '.join(sorted(exc.allowed_methods))}", Allow=", ".join(sorted(exc.allowed_methods)))
    except web.HTTPException as exc:
        return error_response(exc.status, exc.reason)


def peer_guard(peer_problem: Callable[[socket.socket], str | None]) -> Callable[..., Awaitable[web.StreamResponse]]:
    """The Unix socket's: the server's own peer check (daemon.Server.peer_problem) on every request."""
    @web.middleware
    async def guard(request: web.Request, handler: Handler) -> web.StreamResponse:
        sock = request.transport.get_extra_info("socket") if request.transport is not None else None
        why = peer_problem(sock) if sock is not None else "the connection has gone"
        if why is not None:
            raise ApiError(403, why)
        return await handler(request)
    return guard


def token_guard(token: str, hosts: frozenset[str], token_file: str) -> Callable[..., Awaitable[web.StreamResponse]]:
    """Loopback TCP's: the Host header first, then the token (but for the page)."""
    want = token.encode()

    @web.middleware
    async def guard(request: web.Request, handler: Handler) -> web.StreamResponse:
        host = request.headers.get("Host", "")
        if host not in hosts:
            raise ApiError(403, f"the Host header {host!r} is not this server's address ({', '.join(sorted(hosts))}): "
                                "refused, against DNS rebinding; ask the address gpucr serve --http printed")
        if request.path in NO_TOKEN_PATHS and request.method in ("GET", "HEAD"):
            return await handler(request)
        kind, _, given = request.headers.get("Authorization", "").partition(" ")
        if kind != "Bearer" or not hmac.compare_digest(given.strip().encode(), want):
            raise ApiError(401, f"{request.path} wants the server's token: send 'Authorization: Bearer TOKEN', the "
                                f"token being in {token_file}", **{"WWW-Authenticate": "Bearer"})
        return await handler(request)
    return guard
