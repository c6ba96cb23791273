"""The HTTP API's endpoints (docs/api.md, "The HTTP API"; their schema: openapi.py). Each is a request of the server's
own socket protocol, asked through the same handlers (daemon.Server.ask): `swap_view`, `swap_app`, `swap_park`,
`swap_resume`, `swap_set` and `hello`. So an answer, its checks and its error's words are those of every other
client; this module only maps them onto paths, status codes and JSON."""
from __future__ import annotations

import asyncio
import json
from typing import Any, Callable

from aiohttp import web

from ..server.swap_ops import NO_SUCH_APP
from . import metrics, openapi, page
from .guard import ApiError

Ask = Callable[[str, dict[str, Any]], dict[str, Any]]
BY = "the HTTP API"          # who asked, as the server's log says it
EVENT_EVERY_S = 1.0          # the event stream's period: each event is the page's whole state
EVENT_SWITCHES = 50          # the recent switches an event carries (the page's timeline)
MAX_SWITCHES = 200


def _status(answer: dict[str, Any]) -> int:
    """The HTTP status of a request the server refused: its code says which kind of refusal."""
    return {2: 400, NO_SUCH_APP: 404}.get(answer.get("code"), 409)


QUERIES = {"/api/v1/switches": ("limit",)}   # the query parameters an endpoint takes; the others take none


@web.middleware
async def known_queries(request: web.Request, handler: Callable) -> web.StreamResponse:
    """A query parameter an endpoint does not take is refused, not ignored: a misspelt one would do nothing, silently."""
    takes = QUERIES.get(request.path, ())
    unknown = sorted(set(request.query) - set(takes))
    if unknown:
        raise ApiError(400, f"{request.path} takes {'the query parameter ' + ', '.join(takes) if takes else 'no query'}"
                            f", not {unknown[0]!r}")
    return await handler(request)


class Routes:
    def __init__(self, ask: Ask) -> None:
        self._ask = ask

    async def ask(self, op: str, args: dict[str, Any]) -> Any:
        """The server's answer to op (in a worker thread: a park takes seconds); ApiError when it refuses."""
        answer = await asyncio.get_running_loop().run_in_executor(None, self._ask, op, args)
        if not answer.get("ok"):
            raise ApiError(_status(answer), str(answer.get("error")))
        return answer["result"]

    def table(self) -> list[web.RouteDef]:
        return [web.get("/", self.page), web.get("/openapi.json", self.schema), web.get("/metrics", self.metrics),
                web.get("/api/v1/health", self.health), web.get("/api/v1/state", self.state),
                web.get("/api/v1/events", self.events), web.get("/api/v1/gpus", self.gpus),
                web.get("/api/v1/switches", self.switches), web.get("/api/v1/apps", self.apps),
                web.get("/api/v1/apps/{name}", self.app), web.patch("/api/v1/apps/{name}", self.set_policy),
                web.post("/api/v1/apps/{name}/park", self.park), web.post("/api/v1/apps/{name}/resume", self.resume)]

    # ---- reads ----

    async def health(self, _r: web.Request) -> web.Response:
        info = await self.ask("hello", {})
        return web.json_response({"status": "ok", "pid": info["pid"], "simulated": info["simulated"],
                                  "up_s": info["up_s"], "requests": info["requests"], "in_flight": info["in_flight"],
                                  "protocol": info["protocol"], "apps": len(info.get("swap") or [])})

    async def state(self, _r: web.Request) -> web.Response:
        return web.json_response(await self.ask("swap_view", {"switches": EVENT_SWITCHES}))

    async def gpus(self, _r: web.Request) -> web.Response:
        return web.json_response({"gpus": (await self.ask("swap_view", {"switches": 0}))["gpus"]})

    async def apps(self, _r: web.Request) -> web.Response:
        return web.json_response({"apps": (await self.ask("swap_view", {"switches": 0}))["apps"]})

    async def app(self, r: web.Request) -> web.Response:
        return web.json_response(await self.ask("swap_app", {"name": r.match_info["name"]}))

    async def switches(self, r: web.Request) -> web.Response:
        raw = r.query.get("limit", str(MAX_SWITCHES))
        if not raw.isdigit() or int(raw) > MAX_SWITCHES:
            raise ApiError(400, f"limit must be a whole number from 0 to {MAX_SWITCHES}, not {raw!r}")
        return web.json_response({"switches": (await self.ask("swap_view", {"switches": int(raw)}))["switches"]})

    async def events(self, r: web.Request) -> web.StreamResponse:
        """Server-sent events: the page's state (`event: state`) every EVENT_EVERY_S, until the client goes."""
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-store"})
        await resp.prepare(r)
        while True:
            try:
                state = await self.ask("swap_view", {"switches": EVENT_SWITCHES})
                await resp.write(f"event: state\ndata: {json.dumps(state, separators=(',', ':'))}\n\n".encode())
            except ApiError as exc:
                await resp.write(f"event: error\ndata: {json.dumps({'error': str(exc)})}\n\n".encode())
            except ConnectionResetError:   # the client went away
                return resp
            await asyncio.sleep(EVENT_EVERY_S)

    async def metrics(self, _r: web.Request) -> web.Response:
        state = await self.ask("swap_view", {"switches": 0})
        return web.Response(body=metrics.render(state), headers={"Content-Type": metrics.CONTENT_TYPE})

    async def schema(self, _r: web.Request) -> web.Response:
        return web.json_response(openapi.SCHEMA)

    async def page(self, _r: web.Request) -> web.Response:
        return web.Response(body=page.HTML, content_type="text/html", charset="utf-8", headers=page.HEADERS)

    # ---- changes ----

    async def park(self, r: web.Request) -> web.Response:
        return web.json_response(await self.ask("swap_park", {"name": r.match_info["name"], "by": BY}))

    async def resume(self, r: web.Request) -> web.Response:
        return web.json_response(await self.ask("swap_resume", {"name": r.match_info["name"], "by": BY}))

    async def set_policy(self, r: web.Request) -> web.Response:
        try:
            body = await r.json()
        except ValueError:
            body = None
        if not isinstance(body, dict):
            raise ApiError(400, 'the body must be a JSON object of the policy to change, e.g. {"priority": 3}')
        args = {**body, "name": r.match_info["name"], "by": BY}
        return web.json_response(await self.ask("swap_set", args))
