"""The swap service as people and tools reach it (issue 29): an HTTP API, Prometheus metrics at /metrics, a live page
at / (docs/api.md, "The HTTP API"), served by `gpucr serve` on a Unix socket beside its own and, with
`--http 127.0.0.1:PORT`, on loopback TCP behind a token (docs/security.md).

Its own Unix socket, not the server's: the server's socket keeps its one-line JSON protocol, which the CLI and
`gpucr.api` speak with the standard library alone, while HTTP needs aiohttp (the `gpucr[service]` extra) and an
event loop of its own. Every endpoint is a request of that same protocol, asked through the server's own handlers
(daemon.Server.ask): one set of requests, checks and words, two ways to carry them.

aiohttp because it is well kept, serves HTTP/1.1 with streaming (the page's server-sent events) on a socket it is
handed (Unix or TCP), needs no ASGI server beside it, and is on the GPU machine's image already, as
prometheus-client is. Nothing here is imported by gpucr's core: without the extra, `gpucr serve` runs without it.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Callable

from .listen import Loopback, parse_loopback

if TYPE_CHECKING:
    from ..server.daemon import Server

__all__ = ["Loopback", "parse_loopback", "missing", "face"]
EXTRA_HINT = "pip install 'gpucr[service]'"


def missing() -> str | None:
    """Why the HTTP API cannot run here (a module of the extra not installed), or None."""
    for module in ("aiohttp", "prometheus_client"):
        try:
            __import__(module)
        except ImportError:
            return f"the HTTP API needs {module}, of gpucr's 'service' extra: {EXTRA_HINT}"
    return None


def face(http: Loopback | None) -> Callable[[Server], Callable[[], None]]:
    """What `gpucr serve` starts once its socket is bound (foreground.main's face): the HTTP API; it returns its stop."""
    def start(srv: Server) -> Callable[[], None]:
        from .serve import start as start_api
        return start_api(srv, http)
    return start
