"""The live page fed from a recording (`gpucr bench --scenario swap --watch`'s NAME-watch.jsonl.gz) instead of a
server: the page itself (page.html, with its own headers), its event stream playing the recorded states in their
order and pace (sped up by --speed), and its data endpoint answering the state the stream has reached. So a run
recorded where no browser is (the GPU machine) is rendered, and its screenshot taken, elsewhere:

    python3 -m gpucr.service_http.replay swap-watch.jsonl.gz --speed 10     # prints the page's address

The replay ends on the last recorded state that shows the most apps (a run's end, with its servers gone, shows none)
and holds it. Parks and resumes are refused: nothing runs behind a recording. Loopback only, no token (it serves a
file's contents, nothing to steer)."""
from __future__ import annotations

import argparse
import asyncio
import gzip
import json
import sys
import time
from pathlib import Path
from typing import Any

from aiohttp import web

from . import page
from .guard import error_response
from .listen import Loopback, bind_tcp
from .routes import EVENT_EVERY_S


def frames(path: Path) -> list[dict[str, Any]]:
    """The recorded states to play, each {"t": when read, "state": the page's data}: those of the event stream (the
    page's own source) and of the data endpoint (the same view; the watch's last read is one), in the order read;
    up to the last one that shows the most apps."""
    with gzip.open(path, "rt", encoding="utf-8") as f:
        lines = [json.loads(line) for line in f if line.strip()]
    got = sorted((x for x in lines if x["via"] in ("events", "state")), key=lambda x: x["t"])
    if not got:
        raise ValueError(f"{path}: no recorded state (neither the event stream's nor the data endpoint's)")
    most = max(len(x["state"]["apps"]) for x in got)
    end = max(i for i, x in enumerate(got) if len(x["state"]["apps"]) == most)
    return got[:end + 1]


class Replay:
    def __init__(self, played: list[dict[str, Any]], speed: float) -> None:
        self.frames, self.speed = played, speed
        self.started = time.monotonic()

    def now(self) -> int:
        """The frame the replay has reached: the recording's time since its first frame, times speed."""
        t = self.frames[0]["t"] + (time.monotonic() - self.started) * self.speed
        return max(i for i, f in enumerate(self.frames) if f["t"] <= t)

    async def page(self, _r: web.Request) -> web.Response:
        return web.Response(body=page.HTML, content_type="text/html", charset="utf-8", headers=page.HEADERS)

    async def state(self, _r: web.Request) -> web.Response:
        return web.json_response(self.frames[self.now()]["state"])

    async def events(self, r: web.Request) -> web.StreamResponse:
        """From the frame reached, each recorded state at its recorded pace; the last one again every second."""
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-store"})
        await resp.prepare(r)
        i = self.now()
        try:
            while True:
                data = json.dumps(self.frames[i]["state"], separators=(",", ":"))
                await resp.write(f"event: state\ndata: {data}\n\n".encode())
                if i + 1 < len(self.frames):
                    gap = (self.frames[i + 1]["t"] - self.frames[i]["t"]) / self.speed
                    i += 1
                else:
                    gap = EVENT_EVERY_S
                await asyncio.sleep(max(0.0, gap))
        except ConnectionResetError:   # the page went away
            return resp

    async def refuse(self, r: web.Request) -> web.Response:
        return error_response(409, f"this is a replay of a recorded run: {r.match_info['name']} cannot be parked or "
                                   "resumed here")

    def app(self) -> web.Application:
        app = web.Application()
        app.add_routes([web.get("/", self.page), web.get("/api/v1/state", self.state),
                        web.get("/api/v1/events", self.events),
                        web.post("/api/v1/apps/{name}/{action:park|resume}", self.refuse)])
        return app


async def _serve(replay: Replay, port: int) -> None:
    sock = bind_tcp(Loopback("127.0.0.1", port))
    runner = web.AppRunner(replay.app(), access_log=None)
    await runner.setup()
    await web.SockSite(runner, sock).start()
    print(f"{Loopback('127.0.0.1', port).url(sock.getsockname()[1])}/", flush=True)
    replay.started = time.monotonic()   # the replay starts when it can be seen
    await asyncio.Event().wait()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python3 -m gpucr.service_http.replay", description=__doc__.split("\n\n")[0])
    p.add_argument("recording", type=Path, help="a NAME-watch.jsonl.gz of gpucr bench --scenario swap --watch")
    p.add_argument("--port", type=int, default=0, help="loopback port (default 0: any free one, printed)")
    p.add_argument("--speed", type=float, default=1.0, help="how much faster than recorded (default 1)")
    a = p.parse_args(argv)
    try:
        played = frames(a.recording)
    except (OSError, ValueError, KeyError) as exc:
        print(f"replay: {exc}", file=sys.stderr)
        return 1
    try:
        asyncio.run(_serve(Replay(played, max(a.speed, 1e-3)), a.port))
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
